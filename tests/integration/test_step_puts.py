"""One remote hand-off per step (lmcache_bridge/engine/step_puts.py), on a real
LMCache engine with its local CPU cache and a real ``redis-server`` as the
remote backend; no vLLM.

Each chunk's bytes are a pattern derived from its request and token start
(the reference the Redis values are compared with). Three requests store in
one step, two of them with the same prefix: LMCache's remote backend must be
called once, with each distinct chunk once; nothing may reach Redis before
the step's stores are done, everything must after, byte for byte; every
chunk must be in the local cache at once, and no memory object may keep a
reference the hand-off took."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine
from lmcache_ascend.planning.groups import ChunkRequest

from redis_server import RedisServer, ensure_redis_server

CHUNK = 16
CHUNK_BYTES = 4096
SHARED = list(range(1000, 1000 + 4 * CHUNK))  # two requests: four whole chunks each
OTHER = list(range(5000, 5000 + 2 * CHUNK))


def _pattern(first_token: int, start: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(first_token * 1000 + start)
    return torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=gen)


def _start_engine(server: RedisServer, current: dict, name: str, **disk) -> WorkerEngine:
    """A real LMCache engine (CPU cache, Redis, and ``disk`` settings) whose
    chunk connector fills each chunk with its reference pattern."""

    def store(buf: torch.Tensor, req: ChunkRequest) -> None:
        buf[:CHUNK_BYTES].copy_(_pattern(current["first"], req.start))

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_url=server.url,
        remote_serde="naive",
        pre_caching_hash_algorithm="sha256_cbor",
        save_unfull_chunk=False,
        **disk,
    )
    spec = EngineSpec(name, f"{name}-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
    connector = PagedChunkConnector(CHUNK_BYTES, CHUNK, store, lambda buf, req: None, checksums=True)
    return WorkerEngine.start(config, spec, connector, CHUNK_BYTES, 1, "fp")


@pytest.fixture
def redis_engine(tmp_path, monkeypatch):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and cannot be installed here")
    calls: list[int] = []
    fail = {"on": False}
    orig = RemoteBackend.batched_submit_put_task

    def counted(self, keys, memory_objs, transfer_spec=None, on_complete_callback=None):
        # LMCache's own call, counted; patched on the class before the
        # engine starts, so the hand-off wraps this.
        calls.append(len(keys))
        if fail["on"]:
            raise ConnectionError("remote backend unavailable")
        return orig(self, keys, memory_objs, transfer_spec=transfer_spec, on_complete_callback=on_complete_callback)

    monkeypatch.setattr(RemoteBackend, "batched_submit_put_task", counted)
    # Whose tokens is being stored: the chunk connector is told only starts.
    current = {"first": 0}
    with RedisServer(tmp_path / "redis") as server:
        engine = _start_engine(server, current, "step-puts")
        try:
            yield engine, server, calls, fail, current
        finally:
            engine.close()


def _store(engine: WorkerEngine, current: dict, tokens: list[int], req_id: str) -> dict[int, int]:
    current["first"] = tokens[0]
    t = torch.tensor(tokens)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    engine.store(t, mask, TransferContext(req_id, ((0,),)))
    return engine.chunk_ids(t, mask)


def _redis_values(server: RedisServer, want: int, timeout: float = 20.0) -> dict[bytes, bytes]:
    with server.client() as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            keys = [k for k in c.keys() if k.endswith(b"kv_bytes")]
            if len(keys) >= want:
                break
            time.sleep(0.05)
        return {k: c.get(k) for k in keys}


def _local_objs(engine: WorkerEngine) -> dict:
    return dict(engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache)


def test_a_steps_stores_reach_redis_in_one_handoff_each_chunk_once_with_its_bytes(redis_engine):
    engine, server, calls, _fail, current = redis_engine
    with engine.step() as handoff:
        shared = _store(engine, current, SHARED, "a")
        _store(engine, current, SHARED, "b")  # the same prefix, in the same step
        other = _store(engine, current, OTHER, "c")
        # Held: LMCache's remote backend has not been called, Redis is empty,
        # the local cache already has every chunk.
        assert calls == []
        with server.client() as c:
            assert c.dbsize() == 0
        assert len(_local_objs(engine)) == len(shared) + len(other)
    assert handoff.chunks == 6
    assert engine.drain_puts(10)
    assert calls == [len(shared) + len(other)]  # one call, each distinct chunk once

    values = _redis_values(server, 6)
    assert len(values) == 6
    for tokens, ids in ((SHARED, shared), (OTHER, other)):
        for start, ident in ids.items():
            match = [v for k, v in values.items() if f"@{ident:x}@".encode() in k or f"@{ident}@".encode() in k]
            assert len(match) == 1, (start, ident, list(values))
            assert torch.equal(torch.frombuffer(bytearray(match[0][:CHUNK_BYTES]), dtype=torch.uint8),
                               _pattern(tokens[0], start))
    # The hand-off's references are all returned: only the local cache holds
    # each object (a leak would pin it in LMCache's memory for good).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(o.get_ref_count() != 1 for o in _local_objs(engine).values()):
        time.sleep(0.05)
    assert sorted(o.get_ref_count() for o in _local_objs(engine).values()) == [1] * 6


def test_outside_a_step_each_store_hands_off_at_once(redis_engine):
    engine, server, calls, _fail, current = redis_engine
    _store(engine, current, SHARED, "a")
    assert calls == [4]
    _store(engine, current, OTHER, "c")
    assert calls == [4, 2]
    assert len(_redis_values(server, 6)) == 6


def test_a_failed_handoff_costs_the_remote_copies_only(redis_engine, caplog):
    engine, server, calls, fail, current = redis_engine
    fail["on"] = True
    with caplog.at_level(logging.ERROR, logger="lmcache_ascend.lmcache_bridge.engine.step_puts"):
        for req in ("a", "b"):
            with engine.step():
                _store(engine, current, SHARED if req == "a" else OTHER, req)
            assert engine.drain_puts(10)
    assert calls == [4, 2]
    assert engine.backend_failures() == 2  # exported as vllm:lmcache_ascend_backend_failures_total
    # Logged once, naming what was lost.
    lines = [r.getMessage() for r in caplog.records if "handing" in r.getMessage()]
    assert len(lines) == 1 and "4 chunk(s)" in lines[0] and "RemoteBackend" in lines[0]
    # The local cache still serves every chunk, with no reference left over.
    assert sorted(o.get_ref_count() for o in _local_objs(engine).values()) == [1] * 6
    assert engine.engine.lookup(tokens=SHARED, lookup_id="x", pin=False) == len(SHARED)
    with server.client() as c:
        assert c.dbsize() == 0


def test_close_hands_off_what_is_still_held(redis_engine):
    """A worker closing in the middle of a step (engine shutdown) loses no
    chunk it already stored locally: close() hands the held ones off first."""
    engine, server, calls, _fail, current = redis_engine
    step = engine.step()
    step.__enter__()  # a step whose block never ends
    _store(engine, current, SHARED, "a")
    assert calls == []
    engine.close()
    assert calls == [4]
    assert len(_redis_values(server, 4)) == 4


# ---- seals beside the step ---------------------------------------------------
# A chunk's checksum reads its whole payload: inside a step whose puts are
# held it is computed on the hand-off thread, and the chunk reaches the disk
# and remote backends only sealed.


@pytest.fixture
def disk_and_redis_engine(tmp_path, monkeypatch):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and cannot be installed here")
    from lmcache_ascend.lmcache_bridge.engine import chunk_io

    sealed_on: list[str] = []
    crc = chunk_io._crc

    def recorded(payload, ident=None):
        sealed_on.append(threading.current_thread().name)
        return crc(payload, ident)

    monkeypatch.setattr(chunk_io, "_crc", recorded)
    current = {"first": 0}
    with RedisServer(tmp_path / "redis") as server:
        engine = _start_engine(server, current, "step-seals",
                               local_disk=f"file://{tmp_path / 'disk'}/", max_local_disk_size=0.05)
        try:
            yield engine, engine.connector, server, sealed_on, current
        finally:
            engine.close()


def _disk_entries(engine: WorkerEngine, want: int, timeout: float = 20.0) -> dict:
    disk = engine.engine.storage_manager.storage_backends["LocalDiskBackend"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(disk.dict) < want:
        time.sleep(0.05)
    return {key: disk.get_blocking(key) for key in list(disk.dict)}


def test_a_steps_seals_run_beside_it_and_only_sealed_chunks_leave(disk_and_redis_engine):
    engine, connector, server, sealed_on, current = disk_and_redis_engine
    assert engine._step_puts is not None and engine._step_puts.seals_deferred
    with engine.step():
        shared = _store(engine, current, SHARED, "a")
        other = _store(engine, current, OTHER, "c")
        # Copied, not sealed: no checksum was computed on the storing thread,
        # and nothing reached the disk or Redis; the local cache serves them.
        assert sealed_on == []
        assert _disk_entries(engine, 0, timeout=0) == {}
        with server.client() as c:
            assert c.dbsize() == 0
        assert engine.engine.lookup(tokens=SHARED, lookup_id="x", pin=False) == len(SHARED)
    assert engine.drain_puts(10)
    assert sealed_on == ["lmcache-ascend-puts"] * 6
    assert connector.seals.sealed == 6

    # Every copy that left the process verifies under its own key, with the
    # bytes the step stored (the reference pattern).
    ident_start = {ident: (tokens[0], start) for tokens, ids in ((SHARED, shared), (OTHER, other))
                   for start, ident in ids.items()}
    values = _redis_values(server, 6)
    assert len(values) == 6
    for key, value in values.items():
        (ident,) = [i for i in ident_start if f"@{i:x}@".encode() in key or f"@{i}@".encode() in key]
        first, start = ident_start[ident]
        buf = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        connector._verify(buf, start, ident)  # raises ChunkCorrupted on a bad seal
        assert torch.equal(buf[:CHUNK_BYTES], _pattern(first, start))
    disk = _disk_entries(engine, 6)
    assert len(disk) == 6
    for key, obj in disk.items():
        first, start = ident_start[key.chunk_hash]
        connector.verify(obj, start, key.chunk_hash)
        assert torch.equal(obj.tensor.view(torch.uint8).reshape(-1)[:CHUNK_BYTES], _pattern(first, start))
        obj.ref_count_down()
    # The seals' references are returned with the puts'.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(o.get_ref_count() != 1 for o in _local_objs(engine).values()):
        time.sleep(0.05)
    assert sorted(o.get_ref_count() for o in _local_objs(engine).values()) == [1] * 6


def test_outside_a_step_a_chunk_is_sealed_before_its_puts(disk_and_redis_engine):
    engine, connector, server, sealed_on, current = disk_and_redis_engine
    _store(engine, current, SHARED, "a")
    assert sealed_on == [threading.current_thread().name] * 4
    assert len(_redis_values(server, 4)) == 4


def test_a_chunk_that_cannot_be_sealed_never_leaves_the_process(disk_and_redis_engine, monkeypatch, caplog):
    engine, connector, server, sealed_on, current = disk_and_redis_engine
    from lmcache_ascend.lmcache_bridge.engine import chunk_io

    crc = chunk_io._crc
    calls = {"n": 0}

    def second_fails(payload, ident=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("seal failed")
        return crc(payload, ident)

    monkeypatch.setattr(chunk_io, "_crc", second_fails)
    with caplog.at_level(logging.ERROR, logger="lmcache_ascend.lmcache_bridge.engine.step_puts"):
        with engine.step():
            ids = _store(engine, current, SHARED, "a")
        assert engine.drain_puts(10)
    assert sum("sealing a chunk failed" in r.getMessage() for r in caplog.records) == 1
    values = _redis_values(server, 3)
    time.sleep(0.5)  # a fourth value, wrongly handed off, would be there by now
    with server.client() as c:
        assert len([k for k in c.keys() if k.endswith(b"kv_bytes")]) == 3
    second = sorted(ids)[1]
    assert not any(f"@{ids[second]:x}@".encode() in k or f"@{ids[second]}@".encode() in k for k in values)
    assert len(_disk_entries(engine, 3)) == 3
    # The local cache still serves all four (it is never verified).
    assert engine.engine.lookup(tokens=SHARED, lookup_id="y", pin=False) == len(SHARED)
