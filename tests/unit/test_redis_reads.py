"""Staged lookups read a redis:// pool on redis-py's synchronous client
with hiredis (``lmcache_bridge/backends/redis_reads.py``; hiredis is a
dependency of the package and of every test stack), on a real
``redis-server`` started here. The reference is LMCache's own reader of the same entries
(``RemoteBackend.batched_get_blocking`` through its asyncio
``RedisConnector``): every chunk read equal to it byte for byte, and each
damaged entry a miss in its place, as LMCache's reader makes it."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import torch

from lmcache_ascend.integration.vllm import adapter_route

adapter_route.install()  # as the entry points do, before LMCache loads its modules
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_ascend.lmcache_bridge.backends import redis_reads  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine  # noqa: E402
from pattern_kv import PatternKV, pattern  # noqa: E402
from redis_server import RedisServer, ensure_redis_server  # noqa: E402

CHUNK = 16
CHUNK_BYTES = 64 * 1024
N_CHUNKS = 6
TOKENS = list(range(7000, 7000 + N_CHUNKS * CHUNK))
REMOTE = "RemoteBackend"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path_factory.mktemp("redis-reads")) as s:
        yield s


def _engine(url: str, model: str, kv: PatternKV, **values) -> WorkerEngine:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_url=url, remote_serde="naive",
        pre_caching_hash_algorithm="sha256_cbor", save_unfull_chunk=False, **values)
    spec = EngineSpec("redis-reads-test", model, 0, 1, CHUNK, {})
    connector = PagedChunkConnector(CHUNK_BYTES, CHUNK, kv.store, kv.load, checksums=True)
    return WorkerEngine.start(config, spec, connector, CHUNK_BYTES, 1, "fp")


def _stored(server) -> str:
    """A fresh model's N_CHUNKS chunks, stored in Redis by a writer engine."""
    model = f"reads-{uuid.uuid4().hex[:8]}"
    server.client().command("FLUSHALL")  # every key is this test's
    writer = _engine(server.url, model, PatternKV(CHUNK_BYTES))
    try:
        writer.store(torch.tensor(TOKENS), torch.ones(len(TOKENS), dtype=torch.bool), TransferContext("s", ((0,),)))
        deadline = time.monotonic() + 30
        while len(server.client().keys("*kv_bytes")) < N_CHUNKS and time.monotonic() < deadline:
            time.sleep(0.05)  # LMCache's puts are asynchronous
        assert len(server.client().keys("*kv_bytes")) == N_CHUNKS
    finally:
        writer.close()
    return model


def _keys(engine: WorkerEngine) -> list:
    return [key for start, end, key in engine.engine.token_database.process_tokens(tokens=TOKENS) if end > start]


def _release(objs) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def _bytes(obj) -> bytes:
    return bytes(obj.byte_array)


def test_sync_reads_equal_lmcaches_reads_and_load_exactly(server):
    model = _stored(server)
    kv = PatternKV(CHUNK_BYTES)
    reader = _engine(server.url, model, kv)
    try:
        backend = reader.engine.storage_manager.storage_backends[REMOTE]
        sync = redis_reads.reader_for(backend)
        assert isinstance(sync, redis_reads.SyncRedisReader)
        keys = _keys(reader)
        ours, theirs = sync.read(keys), backend.batched_get_blocking(keys)
        try:
            assert len(ours) == len(theirs) == N_CHUNKS
            for a, b in zip(ours, theirs):
                assert a.get_shapes() == b.get_shapes() and a.get_dtypes() == b.get_dtypes()
                assert a.get_memory_format() == b.get_memory_format()
                assert _bytes(a) == _bytes(b)
        finally:
            _release(ours)
            _release(theirs)
        sync.close()

        # The staged lookup reads through it, and the load copies exactly.
        assert reader.engine.lookup(tokens=TOKENS, lookup_id="a", pin=True) == len(TOKENS)
        assert isinstance(reader.staging._readers[REMOTE], redis_reads.SyncRedisReader)
        claim = reader.claim("a")
        assert reader.load_claim(claim, 0, len(TOKENS), TransferContext("a", ((0,),))) == len(TOKENS)
        reader.release_claim(claim)
        for start in range(0, len(TOKENS), CHUNK):
            assert torch.equal(kv.loaded[start], pattern(start, CHUNK_BYTES)), start
        reader.unpin("a")
        assert reader.staging.held() == 0
    finally:
        reader.close()


def _damage(client, name: bytes, how: str) -> None:
    if how == "value deleted":
        client.delete(name + b"kv_bytes")
    elif how == "value one byte short":
        client.set(name + b"kv_bytes", client.get(name + b"kv_bytes")[:-1])
    elif how == "value one byte long":
        client.set(name + b"kv_bytes", client.get(name + b"kv_bytes") + b"\0")
    elif how == "metadata undecodable":
        client.set(name + b"metadata", b"\x07")
    elif how == "value of another type":  # GET answers -WRONGTYPE
        client.delete(name + b"kv_bytes")
        client.command("RPUSH", name + b"kv_bytes", b"x")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "redis-py-get"])
@pytest.mark.parametrize("how", ["value deleted", "value one byte short", "value one byte long", "metadata undecodable",
                                 "value of another type"])
def test_a_damaged_entry_is_a_miss_in_its_place_as_lmcaches_reader_makes_it(server, how, direct):
    model = _stored(server)
    reader = _engine(server.url, model, PatternKV(CHUNK_BYTES))
    try:
        backend = reader.engine.storage_manager.storage_backends[REMOTE]
        sync = redis_reads.reader_for(backend)
        # Plain TCP: values are received straight into LMCache's buffers;
        # the other way is redis-py's GET (what rediss:// pools use).
        assert isinstance(sync._direct, redis_reads.DirectGets)
        if not direct:
            sync._direct.close()
            sync._direct = None
        allocated = []
        allocate = backend.local_cpu_backend.allocate

        def recorded(*args, **kwargs):
            obj = allocate(*args, **kwargs)
            allocated.append(obj)
            return obj

        backend.local_cpu_backend.allocate = recorded
        keys = _keys(reader)
        name = keys[3].to_string().encode()
        _damage(server.client(), name, how)
        ours = sync.read(keys)
        del backend.local_cpu_backend.allocate
        # Every buffer read for the damaged chunk went back to LMCache.
        assert all(obj.get_ref_count() == 0 for obj in allocated if not any(obj is o for o in ours))
        try:
            assert [o is not None for o in ours] == [True, True, True, False]
            for i in range(3):  # the chunks before it are LMCache's, byte for byte
                theirs = backend.batched_get_blocking([keys[i]])
                assert _bytes(ours[i]) == _bytes(theirs[0])
                _release(theirs)
            theirs = backend.batched_get_blocking([keys[3]])  # LMCache's own reader misses it too
            assert theirs == [None]
        finally:
            _release(ours)
        if how == "value deleted":  # what LMCache's reader does on an evicted value: the metadata goes
            assert server.client().get(name + b"metadata") is None
        # The same reader reads on after the fault (a connection it had to drop is made again).
        again = sync.read(keys[:3])
        try:
            assert len(again) == 3 and all(o is not None for o in again)
            for i, obj in enumerate(again):
                theirs = backend.batched_get_blocking([keys[i]])
                assert _bytes(obj) == _bytes(theirs[0])
                _release(theirs)
        finally:
            _release(again)
        sync.close()
        # Through the staged lookup: the hit ends before the damaged chunk.
        assert reader.engine.lookup(tokens=TOKENS, lookup_id="b", pin=True) == 3 * CHUNK
        reader.unpin("b")
        assert reader.staging.held() == 0
    finally:
        reader.close()


def _clients(server) -> str:
    listing = server.client().command("CLIENT", "LIST")
    return listing.decode() if isinstance(listing, bytes) else listing


def test_values_are_read_ahead_on_one_connection_dropped_when_a_read_stops_early(server, monkeypatch):
    """Direct reads keep ``DEPTH`` GETs in flight on one connection; a read
    that ends clean gives it back (the next read reuses it), a read that
    stops with a GET in flight closes it, so no stale reply ever answers a
    later GET. Reference: LMCache's own reader of the same entries."""
    model = _stored(server)
    reader = _engine(server.url, model, PatternKV(CHUNK_BYTES))
    try:
        backend = reader.engine.storage_manager.storage_backends[REMOTE]
        sync = redis_reads.reader_for(backend)
        direct = sync._direct
        assert isinstance(direct, redis_reads.DirectGets) and direct.DEPTH == 2
        keys = _keys(reader)
        in_flight = []
        receive = redis_reads.Replies.receive_into

        def recorded(self, dest):
            in_flight.append(self.sent - self._received)
            return receive(self, dest)

        monkeypatch.setattr(redis_reads.Replies, "receive_into", recorded)
        taken = []  # each read's connection
        take = redis_reads.DirectGets._take

        def took(self):
            taken.append(take(self))
            return taken[-1]

        monkeypatch.setattr(redis_reads.DirectGets, "_take", took)

        def addr(conn) -> str:
            host, port = conn._sock.getsockname()[:2]
            return f"addr={host}:{port} "

        def check(objs, first):
            try:
                for i, obj in enumerate(objs):
                    theirs = backend.batched_get_blocking([keys[first + i]])
                    assert _bytes(obj) == _bytes(theirs[0]), first + i
                    _release(theirs)
            finally:
                _release(objs)

        for _ in range(2):
            in_flight.clear()
            objs = sync.read(keys)
            assert len(objs) == N_CHUNKS and all(o is not None for o in objs)
            check(objs, 0)
            # Two in flight while each value but the last is received.
            assert in_flight == [2] * (N_CHUNKS - 1) + [1]
            assert direct._idle.qsize() == 1 and addr(taken[-1]) in _clients(server)
        assert taken[0] is taken[1]  # the second read reused the first one's connection
        gone = addr(taken[-1])
        _damage(server.client(), keys[2].to_string().encode(), "value deleted")
        objs = sync.read(keys)
        assert [o is not None for o in objs] == [True, True, False]
        _release(objs)
        assert direct._idle.qsize() == 0  # the GET of keys[3] was in flight: the connection went
        deadline = time.monotonic() + 10
        while gone in _clients(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone not in _clients(server)
        check(sync.read(keys[3:]), 3)  # a new connection, each value its own
        assert taken[-1] is not taken[0] and direct._idle.qsize() == 1
        sync.close()
    finally:
        reader.close()


def test_a_server_gone_is_a_miss_not_an_error(tmp_path):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path) as own:
        model = _stored(own)
        reader = _engine(own.url, model, PatternKV(CHUNK_BYTES), blocking_timeout_secs=2)
        try:
            backend = reader.engine.storage_manager.storage_backends[REMOTE]
            sync = redis_reads.reader_for(backend)
            keys = _keys(reader)
            first = sync.read(keys[:1])
            assert first[0] is not None
            _release(first)
            own.kill()
            t0 = time.monotonic()
            assert sync.read(keys) == [None]
            assert time.monotonic() - t0 < 10
            sync.close()
        finally:
            reader.close()


def test_switched_off_without_hiredis_and_other_schemes_read_through_lmcache(server, monkeypatch):
    import redis.utils

    model = _stored(server)
    reader = _engine(server.url, model, PatternKV(CHUNK_BYTES), **{redis_reads.SWITCH: False})
    try:
        backend = reader.engine.storage_manager.storage_backends[REMOTE]
        assert redis_reads.reader_for(backend) is None
        assert reader.engine.lookup(tokens=TOKENS, lookup_id="c", pin=True) == len(TOKENS)  # LMCache's reads
        assert reader.staging._readers[REMOTE] is None
        reader.unpin("c")
    finally:
        reader.close()
    resp = _engine(server.url.replace("redis://", "resp://", 1), model, PatternKV(CHUNK_BYTES))
    try:
        assert redis_reads.reader_for(resp.engine.storage_manager.storage_backends[REMOTE]) is None
    finally:
        resp.close()
    # Without hiredis the synchronous client is the slower reader
    # (bench/bench_redis_reads.py): LMCache's reads, and the hit still exact.
    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    kv = PatternKV(CHUNK_BYTES)
    plain = _engine(server.url, model, kv)
    try:
        assert redis_reads.reader_for(plain.engine.storage_manager.storage_backends[REMOTE]) is None
        assert plain.engine.lookup(tokens=TOKENS, lookup_id="d", pin=True) == len(TOKENS)
        assert plain.staging._readers[REMOTE] is None
        claim = plain.claim("d")
        assert plain.load_claim(claim, 0, len(TOKENS), TransferContext("d", ((0,),))) == len(TOKENS)
        plain.release_claim(claim)
        assert all(torch.equal(kv.loaded[s], pattern(s, CHUNK_BYTES)) for s in range(0, len(TOKENS), CHUNK))
    finally:
        plain.close()


def test_contains_counts_the_prefix_lmcache_counts(server):
    """The staged lookup's first question (which chunks does Redis hold) is
    answered in one pipeline; LMCache's own answer (its class's method, one
    EXISTS per key on its loop) is the reference."""
    model = _stored(server)
    reader = _engine(server.url, model, PatternKV(CHUNK_BYTES))
    try:
        backend = reader.engine.storage_manager.storage_backends[REMOTE]
        lmcaches = type(backend).batched_contains
        sync = redis_reads.reader_for(backend)
        assert backend.batched_contains == sync.batched_contains  # installed on this backend
        keys = _keys(reader)
        assert sync.batched_contains(keys) == lmcaches(backend, keys) == N_CHUNKS
        server.client().delete(keys[2].to_string().encode() + b"metadata")
        assert sync.batched_contains(keys) == lmcaches(backend, keys) == 2
        assert sync.batched_contains(keys[2:]) == lmcaches(backend, keys[2:]) == 0
        other = [k for a, b, k in reader.engine.token_database.process_tokens(tokens=[t + 1 for t in TOKENS]) if b > a]
        assert sync.batched_contains(other) == lmcaches(backend, other) == 0
        sync.close()
        assert "batched_contains" not in vars(backend) or backend.batched_contains.__func__ is lmcaches
    finally:
        reader.close()



def test_a_reader_defect_costs_nothing_but_its_speed(server, monkeypatch, caplog):
    """The reader raising where it should answer (here: on the third chunk)
    sends that read through LMCache's reader: the hit is whole and exact,
    one ERROR says so, and nothing the failed read took stays referenced."""
    model = _stored(server)
    kv = PatternKV(CHUNK_BYTES)
    reader = _engine(server.url, model, kv)
    calls = []

    taken = []  # what the reader read before its defect

    def broken(self, meta):
        calls.append(meta)
        if len(calls) == 3:
            raise RuntimeError("a defect")
        obj, view = real(self, meta)
        taken.append(obj)
        return obj, view

    real = redis_reads.SyncRedisReader._allocate
    try:
        monkeypatch.setattr(redis_reads.SyncRedisReader, "_allocate", broken)
        with caplog.at_level("ERROR"):
            assert reader.engine.lookup(tokens=TOKENS, lookup_id="e", pin=True) == len(TOKENS)
        assert len(calls) == 3  # the sync reader ran, failed, and LMCache's read the rest
        assert [r.getMessage() for r in caplog.records if "synchronous Redis reader failed" in r.getMessage()]
        claim = reader.claim("e")
        assert reader.load_claim(claim, 0, len(TOKENS), TransferContext("e", ((0,),))) == len(TOKENS)
        reader.release_claim(claim)
        assert all(torch.equal(kv.loaded[s], pattern(s, CHUNK_BYTES)) for s in range(0, len(TOKENS), CHUNK))
        reader.unpin("e")
        assert reader.staging.held() == 0
        # The two chunks read before the defect went back to LMCache.
        assert len(taken) == 2 and all(obj.get_ref_count() == 0 for obj in taken)
    finally:
        reader.close()


class _Conn:
    """A connection's socket end, as Replies uses redis-py's connection."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.closed = False

    def pack_command(self, *args):
        return [b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args)]

    def disconnect(self) -> None:
        self.closed = True
        self._sock.close()


def test_replies_are_parsed_however_the_bytes_arrive():
    """The reply framing on a real socket pair, the server's bytes written
    in pieces (a header cut in two, a nil reply followed by a value in one
    write): every value lands whole in its buffer, nothing of the next reply
    is consumed with a nil one, and a broken reply is an error."""
    a, b = socket.socketpair()
    value = bytes(range(256)) * 40
    pieces = [b"$1", b"0240\r\n" + value[:1000], value[1000:] + b"\r\n$-1\r\n$3\r\nxyz\r\n", b"_\r\n"]

    def serve():
        for piece in pieces:
            time.sleep(0.05)
            b.sendall(piece)

    server = threading.Thread(target=serve)
    server.start()
    try:
        owner = redis_reads.DirectGets(None, 1.0)  # no pool: the connections are made here
        conn = _Conn(a)
        with redis_reads.Replies(owner, conn) as replies:
            for _ in range(4):
                replies.send("k")
            first = bytearray(len(value) + 7)
            assert replies.receive_into(memoryview(first)) == len(value)
            assert bytes(first[: len(value)]) == value and first[len(value):] == bytes(7)
            assert replies.receive_into(memoryview(bytearray(8))) is None
            third = bytearray(3)
            assert replies.receive_into(memoryview(third)) == 3 and third == b"xyz"
            assert replies.receive_into(memoryview(bytearray(8))) is None  # RESP3 nil
        assert not conn.closed and owner._idle.get_nowait() is conn  # every reply read: kept
    finally:
        server.join()
        a.close()
        b.close()
    for broken, error in [(b"x" * 600, "too long"), (b"$12\r\nshort", "closed"), (b"-ERR no\r\n", "reply to GET"),
                          (b"$4", "closed"), (b"$-5\r\n" + b"y" * 20, "bad length"), (b"$1x\r\n", "bad length")]:
        a, b = socket.socketpair()
        b.sendall(broken)
        b.shutdown(socket.SHUT_WR)
        conn = _Conn(a)
        with pytest.raises(ConnectionError, match=error):
            with redis_reads.Replies(owner, conn) as replies:
                replies.send("k")
                replies.receive_into(memoryview(bytearray(16)))
        assert conn.closed  # a broken reply never leaves its connection in use
        b.close()
