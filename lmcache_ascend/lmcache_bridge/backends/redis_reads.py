"""Staged lookups read a ``redis://`` pool on redis-py's synchronous client.

Why. LMCache's ``RedisConnector`` reads through ``redis.asyncio`` on the
storage manager's event loop: per chunk a GET of ``<key>metadata``, a GET of
``<key>kv_bytes`` and a copy into an LMCache buffer. With hiredis installed
(a dependency of this package), redis-py's synchronous client reads the same
values about 2.3x faster (bench/bench_redis_reads.py: 1.82 against 0.78
GB/s, 2 MiB values). The staged lookup already waits for its reads on its own
threads, beside vLLM's step, so it reads the entries there itself,
synchronously: one MGET for a window's metadata keys, then one GET per value
into a buffer that LMCache's CPU backend allocates exactly as its connector
does. On plain TCP each value is received straight into that buffer
(``DirectGets``); over TLS redis-py parses it and it is copied. Without
hiredis the synchronous client is the slower one (redis-py's pure-Python
parser), so LMCache's reads stay, and the log says so.

The entries are LMCache's (``RedisConnector._get``'s format, LMCache 0.5.6 and
0.5.7rc2): ``RemoteMetadata`` under ``<key>metadata``, the chunk's first
``metadata.length`` bytes under ``<key>kv_bytes``. LMCache's ``contains``
of this backend is answered here too, one pipeline of EXISTS of the same
metadata keys instead of a round trip per chunk (``install_contains``);
writes and every other operation (puts, the reconnect) stay LMCache's. A value
missing while its metadata exists is what LMCache's reader treats as an
eviction: a miss, the metadata deleted. A value of another length than its
metadata says, or metadata that does not decode, is a miss (LMCache's reader
raises there, and the staged lookup sees a miss too). A read cut short by the
server (down, stalled past ``blocking_timeout_secs``) is a miss from there on.

Only a plain ``RedisConnector`` (``redis://`` or ``rediss://``, one server),
with hiredis, is read this way; Sentinel and Cluster pools, and every other
scheme, read through LMCache's backend as before. ``ascend_redis_sync_reads: false`` (an
LMCache config key, ``LMCACHE_ASCEND_REDIS_SYNC_READS``) turns it off. Which
reader and parser a pool uses is logged once.

Imports LMCache and redis-py only when a reader is built.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

SWITCH = "ascend_redis_sync_reads"
_SCHEMES = ("redis://", "rediss://")
_lock = threading.Lock()
_logged: set[str] = set()


def _log_once(tag: str, level: int, msg: str, *args: Any) -> None:
    with _lock:
        if tag in _logged:
            return
        _logged.add(tag)
    logger.log(level, msg, *args)


def _wrapped(connection: Any) -> Any:
    """LMCache's connector behind its instrumentation wrapper, if any."""
    unwrap = getattr(connection, "getWrappedConnector", None)
    return unwrap() if callable(unwrap) else connection


def _switched_off(config: Any) -> bool:
    from lmcache_ascend.planning.settings import AscendConfig

    return not AscendConfig.from_lmcache(config).redis_sync_reads


class DirectGets:
    """``GET`` of values straight into their destination buffers.

    Why: redis-py with hiredis receives a 2 MiB value in about 65 ``recv``
    calls of 32 KiB, copies it into hiredis's buffer, then into a bytes
    object, and the reader copies it a third time into LMCache's buffer
    (about 13% of the reads' time in a profile). Here each reply is one
    peek at its header line, then one ``recvmsg_into(..., MSG_WAITALL)``
    of the header, the value (straight into that buffer) and its CRLF, the
    GIL released for the whole value: two system calls and two GIL
    acquisitions per value, where the staged lookup's threads share the
    GIL with vLLM's worker loop. A throwaway script read 2.84 GB/s receiving
    into the buffer against 2.17 for ``GET`` plus a copy (2 cores).

    ``DEPTH`` GETs are in flight per connection (``Replies``): the server
    copies value k+1 into its reply buffer and starts sending it while value
    k is still being received, instead of waiting for the next GET. A
    throwaway script (256 values of 2 MiB, 2 cores, six rounds) read
    1.87-2.97 GB/s with two in flight against 1.60-2.34 with one; four were
    no better than two.

    redis-py makes each connection (AUTH, SELECT, CLIENT SETNAME: whatever
    the URL asks for) and packs each command; only the replies to those
    ``GET``s are read here: ``$<n>\\r\\n<n bytes>\\r\\n`` or ``$-1\\r\\n`` (RESP2
    and RESP3 alike). Plain TCP only: a TLS socket cannot take MSG_WAITALL
    (``rediss://`` reads through redis-py). Any fault, and any read that
    stops with replies still in flight, closes that connection; the read is
    then a miss, as one through redis-py would be. The socket runs in
    blocking mode with the kernel's receive and send timeouts set to the
    pool's timeout, so a stalled server costs at most that per call."""

    DEPTH = 2

    def __init__(self, pool: Any, timeout: float) -> None:
        self._pool = pool
        self._idle: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._timeval = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))

    def _take(self) -> Any:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        conn = self._pool.connection_class(**self._pool.connection_kwargs)
        conn.connect()
        sock = conn._sock
        sock.settimeout(None)  # blocking: MSG_WAITALL waits for the whole value
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._timeval)
        return conn

    def check(self) -> None:
        """Opens one connection now, so a redis-py that does not expose its
        socket is found at startup, not on every read."""
        self._idle.put(self._take())

    def replies(self) -> "Replies":
        """One connection's GETs and their replies, for a ``with`` block."""
        return Replies(self, self._take())

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().disconnect()
            except queue.Empty:
                return


class Replies:
    """GETs sent ahead on one connection; their replies received in order.

    Leaving the ``with`` block gives the connection back where every reply
    sent for was received whole; otherwise (an exception, a value that did
    not fit, a read stopped early) the connection is closed, so no stale
    reply is ever read as the answer to a later GET."""

    def __init__(self, owner: DirectGets, conn: Any) -> None:
        self._owner = owner
        self._conn = conn
        self._sock = conn._sock
        self.sent = 0
        self._received = 0
        self._clean = True

    def send(self, key: str) -> None:
        self._sock.sendall(b"".join(self._conn.pack_command("GET", key)))
        self.sent += 1

    def receive_into(self, dest: memoryview) -> Optional[int]:
        """The next reply: the value's length, its bytes written to ``dest``
        where they fit (else nothing is read and the connection will go), or
        None where the key holds nothing."""
        sock = self._sock
        head, size = _peek_line(sock)
        if head == b"$-1" or head == b"_":  # nil (RESP2, RESP3)
            _recv_exactly(sock, memoryview(bytearray(size)))
            self._received += 1
            return None
        if head[:1] != b"$":  # an error reply (-ERR ...) or not Redis
            raise ConnectionError(f"reply to GET: {head[:64]!r}")
        # Redis sends a length >= 0 (nil is matched above); anything else is
        # not a GET reply, and a negative one would fill all but its last
        # bytes of ``dest`` and read the stream out of step.
        if not head[1:].isdigit():
            raise ConnectionError(f"reply to GET with a bad length: {head[:64]!r}")
        n = int(head[1:])
        if n > len(dest):
            self._clean = False  # not drained
            return n
        # The header line, the value and its CRLF in one receive: the value
        # lands in ``dest``, the rest in two small buffers.
        crlf = bytearray(2)
        _recv_scatter(sock, [memoryview(bytearray(size)), dest[:n], memoryview(crlf)])
        if crlf != b"\r\n":
            raise ConnectionError("GET reply without its CRLF")
        self._received += 1
        return n

    def __enter__(self) -> "Replies":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and self._clean and self._received == self.sent:
            self._owner._idle.put(self._conn)
        else:
            self._conn.disconnect()


def _peek_line(sock: socket.socket) -> tuple[bytes, int]:
    """The next reply line without its CRLF, and how many of its bytes are
    still unread in the socket: one peek (blocking until the server answers)
    where the line has arrived whole, the usual case; else it is read a byte
    at a time (nothing after it is read)."""
    peeked = sock.recv(64, socket.MSG_PEEK)
    if not peeked:
        raise ConnectionError("the server closed the connection")
    end = peeked.find(b"\r\n")
    if end >= 0:
        return peeked[:end], end + 2
    return _line(sock), 0


def _line(sock: socket.socket) -> bytes:
    """One reply line without its CRLF, a byte at a time: nothing after it
    is read."""
    out = bytearray()
    while not out.endswith(b"\r\n"):
        if len(out) > 512:
            raise ConnectionError(f"reply line too long: {bytes(out[:64])!r}")
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("the server closed the connection")
        out += byte
    return bytes(out[:-2])


def _recv_scatter(sock: socket.socket, views: list[memoryview]) -> None:
    """Fills ``views`` in order from the socket: one ``recvmsg_into`` with
    MSG_WAITALL, then the rest (a receive cut short by a signal) view by view."""
    got = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
    for view in views:
        if got >= len(view):
            got -= len(view)
            continue
        _recv_exactly(sock, view[got:])
        got = 0


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("the server closed the connection")
        got += n


class SyncRedisReader:
    """Reads LMCache's Redis entries for one ``RemoteBackend``."""

    def __init__(self, backend: Any) -> None:
        import redis
        from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

        self._backend = backend
        # Resolved here, so a release that moved it fails the build (LMCache's
        # reads, logged), not every read.
        self._metadata = lmcache_modules.load(lmcache_modules.PROTOCOL).RemoteMetadata
        timeout = float(getattr(backend.config, "blocking_timeout_secs", 10) or 10)
        # Its own small pool: the fetch thread and the lookup thread read, one
        # at a time per lookup; LMCache's asyncio pool cannot be used off its loop.
        self._client = redis.Redis.from_url(
            str(backend.remote_url), socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=4)
        self._direct: Optional[DirectGets] = None
        if not issubclass(self._client.connection_pool.connection_class, redis.SSLConnection):
            try:
                direct = DirectGets(self._client.connection_pool, timeout)
                direct.check()
                self._direct = direct
            except Exception as e:  # noqa: BLE001 - redis-py's GETs then, as before
                _log_once("direct", logging.WARNING, "lmcache-ascend: values of %s are read through redis-py's "
                          "GET (the direct reader could not start: %s: %s)", _redact(backend.remote_url),
                          type(e).__name__, e)
        self._errors = (redis.exceptions.RedisError, OSError)
        self._contains: Optional[Any] = None  # what install_contains replaced

    def install_contains(self) -> None:
        """Answer LMCache's ``batched_contains`` for this backend with one
        pipeline of EXISTS (``close`` puts LMCache's back)."""
        from lmcache_ascend.lmcache_bridge.patching import overrides

        self._contains = overrides.apply(
            overrides.REDIS_SYNC_CONTAINS, self._backend, "batched_contains", self.batched_contains)

    def batched_contains(self, keys: Sequence[Any], pin: bool = False) -> int:
        """How many of ``keys``, from the first, have their metadata key in
        Redis: LMCache's ``RemoteBackend.batched_contains`` answer (it asks
        EXISTS of ``<key>metadata`` per key; Redis cannot pin)."""
        backend = self._backend
        if backend.connection is None:  # LMCache's answer while the store is down
            return 0
        if getattr(backend, "_mla_worker_id_as0_mode", False):
            keys = [key.with_new_worker_id(0) for key in keys]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key.to_string() + "metadata")
            found = pipe.execute()
        except self._errors as e:
            _log_once("contains", logging.WARNING, "lmcache-ascend: asking %s which chunks it holds failed "
                      "(%s: %s); counted as none (logged once)", _redact(backend.remote_url), type(e).__name__, e)
            return 0
        count = 0
        for hit in found:
            if not hit:
                break
            count += 1
        return count

    def read(self, keys: Sequence[Any]) -> list[Optional[Any]]:
        """LMCache MemoryObjs for the longest readable prefix of ``keys``
        (each with one reference), then ``None`` if it stopped early; the
        shape of ``RemoteBackend.batched_get_blocking``'s answer, cut."""
        RemoteMetadata = self._metadata
        backend = self._backend
        if getattr(backend, "_mla_worker_id_as0_mode", False):
            keys = [key.with_new_worker_id(0) for key in keys]  # as batched_get_blocking does
        names = [key.to_string() for key in keys]
        out: list[Optional[Any]] = []
        t0 = time.perf_counter()
        try:
            metas = self._decoded(names, self._client.mget([name + "metadata" for name in names]), RemoteMetadata)
            if self._direct is not None:
                self._read_direct(metas, out)
            else:
                for name, meta in metas:
                    obj = self._read_one(name, meta)
                    out.append(obj)
                    if obj is None:
                        break
            if len(out) < len(names) and (not out or out[-1] is not None):
                out.append(None)  # every value read, then a chunk without usable metadata
        except BaseException as e:
            if not isinstance(e, self._errors):
                for obj in out:  # nothing read stays referenced when the caller falls back
                    if obj is not None:
                        obj.ref_count_down()
                raise
            _log_once("error", logging.WARNING,
                      "lmcache-ascend: a staged read from %s failed (%s: %s); the lookup reports the chunks "
                      "read before it (logged once)", _redact(backend.remote_url), type(e).__name__, e)
            out.append(None)
        monitor = getattr(backend, "stats_monitor", None)
        if monitor is not None:
            monitor.update_interval_remote_time_to_get_sync((time.perf_counter() - t0) * 1000)
        return [backend.deserializer.deserialize(o) if o is not None else None for o in out]

    @staticmethod
    def _decoded(names: list[str], raws: list[Optional[bytes]], remote_metadata: Any) -> list[tuple[str, Any]]:
        """(name, metadata) of the longest prefix whose metadata is there and
        decodes."""
        out = []
        for name, raw in zip(names, raws):
            if raw is None:
                break
            try:
                out.append((name, remote_metadata.deserialize(memoryview(raw))))
            except Exception as e:  # noqa: BLE001 - any undecodable metadata is a miss
                logger.debug("lmcache-ascend: metadata of %s does not decode: %s", name, e)
                break
        return out

    def _read_direct(self, metas: list[tuple[str, Any]], out: list[Optional[Any]]) -> None:
        """Values of ``metas`` into ``out`` on one connection, ``DEPTH`` GETs
        ahead of the one being received; stops after the first miss."""
        assert self._direct is not None
        with self._direct.replies() as replies:
            for i, (name, meta) in enumerate(metas):
                while replies.sent < min(len(metas), i + DirectGets.DEPTH):
                    replies.send(metas[replies.sent][0] + "kv_bytes")
                obj, view = self._allocate(meta)
                if obj is None:
                    out.append(None)
                    return
                try:
                    n = replies.receive_into(view[: meta.length])
                except BaseException:
                    obj.ref_count_down()
                    raise
                obj = self._judged(name, meta, obj, view, n)
                out.append(obj)
                if obj is None:
                    return

    def _read_one(self, name: str, meta: Any) -> Optional[Any]:
        """One value through redis-py's GET (TLS), copied into its buffer."""
        obj, view = self._allocate(meta)
        if obj is None:
            return None
        try:
            value = self._client.get(name + "kv_bytes")
        except BaseException:
            obj.ref_count_down()
            raise
        n = None if value is None else len(value)
        if n is not None and n <= min(meta.length, len(view)):
            view[:n] = value
        return self._judged(name, meta, obj, view, n)

    def _allocate(self, meta: Any) -> tuple[Optional[Any], memoryview]:
        """A buffer of LMCache's CPU backend for ``meta``'s chunk (as its
        connector allocates it) and a byte view of it."""
        obj = self._backend.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            _log_once("alloc", logging.WARNING,
                      "lmcache-ascend: LMCache's CPU buffer is full; a staged read stops there (logged once)")
            return None, memoryview(b"")
        view = obj.byte_array
        view = view.cast("B") if isinstance(view, memoryview) and view.format != "B" else memoryview(view)
        return obj, view

    def _judged(self, name: str, meta: Any, obj: Any, view: memoryview, n: Optional[int]) -> Optional[Any]:
        """``obj`` where its value (``n`` bytes read into ``view``) is whole,
        else None with the buffer released."""
        if n is None:
            # LMCache's reader reads this as an eviction and deletes the
            # metadata, so no later lookup counts the chunk as present.
            obj.ref_count_down()
            self._client.delete(name + "metadata")
            return None
        if n != meta.length or meta.length > len(view):
            logger.debug("lmcache-ascend: %s holds %d bytes, its metadata says %d (buffer %d)", name, n,
                         meta.length, len(view))
            obj.ref_count_down()
            return None
        return obj

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._contains is not None:
            from lmcache_ascend.lmcache_bridge.patching import overrides

            overrides.undo(self._contains)
            self._contains = None
        try:
            self._client.close()
        except self._errors:
            pass


def reader_failed(error: BaseException) -> None:
    """The reader raised where it should have answered (a defect, or an
    LMCache release whose entries it does not know): the read goes through
    LMCache's reader instead; said once, loudly."""
    _log_once("defect", logging.ERROR, "lmcache-ascend: the synchronous Redis reader failed (%s: %s); this "
              "and any later failing read go through LMCache's reader (set ascend_redis_sync_reads: false "
              "to stop trying it)", type(error).__name__, error)


def _redact(url: Any) -> str:
    from lmcache_ascend.lmcache_bridge.backends.credentials import redact_url

    return redact_url(str(url))


def reader_for(backend: Any) -> Optional[SyncRedisReader]:
    """A synchronous reader for ``backend`` where it is LMCache's plain Redis
    connector and not switched off; None otherwise (LMCache's own reads)."""
    if type(backend).__name__ != "RemoteBackend" or backend.connection is None:
        return None
    url = str(getattr(backend, "remote_url", "") or "")
    if not url.startswith(_SCHEMES) or type(_wrapped(backend.connection)).__name__ != "RedisConnector":
        return None
    if _switched_off(backend.config):
        _log_once("off", logging.INFO, "lmcache-ascend: %s=false: staged lookups read %s through LMCache's "
                  "asyncio Redis connector", SWITCH, _redact(url))
        return None
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        # Measured (bench/bench_redis_reads.py): with redis-py's pure-Python
        # parser the synchronous client reads large values several times
        # slower than LMCache's asyncio reader, so LMCache's reads stay.
        _log_once("parser", logging.INFO, "lmcache-ascend: staged lookups read %s through LMCache's asyncio "
                  "connector: hiredis is not installed (pip install hiredis: the connector then reads on "
                  "redis-py's synchronous client, about 2x faster per hit in docs/benchmarks.md)", _redact(url))
        return None
    try:
        reader = SyncRedisReader(backend)
        reader.install_contains()
    except Exception as e:  # noqa: BLE001 - never worse than LMCache's own reads
        _log_once("build", logging.WARNING, "lmcache-ascend: staged lookups read %s through LMCache's asyncio "
                  "connector: the synchronous reader could not be built (%s: %s)", _redact(url), type(e).__name__, e)
        return None
    _log_once("on", logging.INFO, "lmcache-ascend: staged lookups read %s on redis-py's synchronous client with "
              "hiredis%s; LMCache's connector does everything else", _redact(url),
              ", each value received straight into LMCache's buffer" if reader._direct is not None else
              " (values parsed by redis-py and copied: TLS, or the direct reader did not start)")
    return reader


def read_prefix(backend: Any, keys: list, reader: Optional["SyncRedisReader"] = None) -> list:
    """Objects for ``keys`` from ``backend`` (or ``reader``, which reads the
    same entries), cut at the first one that could not be read (a list
    shorter than ``keys`` or ending in None). A batched read that fails as a
    whole is retried key by key, so one bad entry does not cost the good ones
    before it; ``reader`` reads key by key already."""
    objs: Optional[list] = None
    if reader is not None:
        try:
            objs = list(reader.read(keys))
        except Exception as e:  # noqa: BLE001 - a defect of ours must not cost the hit
            reader_failed(e)
            reader = None
    if objs is None:
        try:
            objs = list(backend.batched_get_blocking(keys))
        except Exception:  # noqa: BLE001 - e.g. metadata that decodes to nonsense
            objs = [None]
    if reader is None and objs and objs[0] is None and len(keys) > 1:
        objs = []
        for key in keys:
            try:
                obj = backend.get_blocking(key)
            except Exception:  # noqa: BLE001
                obj = None
            objs.append(obj)
            if obj is None:
                break
    for i, obj in enumerate(objs):
        if obj is None:
            for extra in objs[i + 1:]:
                if extra is not None:
                    extra.ref_count_down()
            return objs[: i + 1]
    return objs
