"""The lookup verifies and holds what it reports (lmcache_bridge/integrity/staging.py),
on a real LMCache engine whose only store is LMCache's local disk backend.

Each chunk's bytes are a pattern derived from its token start (the reference
a load is compared with); the entries on disk are then damaged, truncated,
replaced by another chunk's bytes or deleted, as a failing disk or another
writer would, and the lookup must report only the prefix that is intact,
count and remove what is not, and the load must copy exactly what was
verified even when the store loses everything after the lookup."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache.v1.config import LMCacheEngineConfig

from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine
from lmcache_ascend.lmcache_bridge.integrity import staging
from pattern_kv import PatternKV, pattern

CHUNK = 16
CHUNK_BYTES = 4096
TOKENS = list(range(1000, 1000 + 4 * CHUNK))  # four whole chunks


def _pattern(start: int) -> torch.Tensor:
    return pattern(start, CHUNK_BYTES)


def _KV() -> PatternKV:
    return PatternKV(CHUNK_BYTES)


def _engine(kv: PatternKV, **config: Any) -> WorkerEngine:
    """A real LMCache engine of this connector's shape; ``config``: its storage."""
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, max_local_cpu_size=0.05, pre_caching_hash_algorithm="sha256_cbor",
        save_unfull_chunk=False, **config)
    spec = EngineSpec("staging-test", f"staging-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
    connector = PagedChunkConnector(CHUNK_BYTES, CHUNK, kv.store, kv.load, checksums=True)
    return WorkerEngine.start(config, spec, connector, CHUNK_BYTES, 1, "fp")


@pytest.fixture(params=[1, staging.FETCH_WINDOW], ids=["window1", "window16"])
def disk_engine(tmp_path, request, monkeypatch):
    # Window 1: every chunk is read while the one before it is verified, so
    # a refusal leaves a read-ahead chunk to release; the default window
    # reads these four chunks at once.
    monkeypatch.setattr(staging, "FETCH_WINDOW", request.param)
    disk = tmp_path / "disk"
    disk.mkdir()
    kv = _KV()
    # local_cpu off: every hit comes from the disk backend.
    engine = _engine(kv, local_cpu=False, local_disk=f"file://{disk}/", max_local_disk_size=0.05)
    try:
        yield engine, kv, disk
    finally:
        engine.close()


def _store_all(engine: WorkerEngine, disk: Path) -> list[Path]:
    tokens = torch.tensor(TOKENS)
    engine.store(tokens, torch.ones(len(TOKENS), dtype=torch.bool), TransferContext("s", ((0,),)))
    keys = list(engine.chunk_ids(tokens, torch.ones(len(TOKENS), dtype=torch.bool)).items())
    # Disk writes are asynchronous, and LMCache's disk backend writes the
    # file before it indexes the key: wait for the index, not the files, or a
    # lookup racing the last write reports one chunk short.
    backend = engine.engine.storage_manager.storage_backends["LocalDiskBackend"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(backend.dict) < len(keys):
        time.sleep(0.05)
    assert len(backend.dict) == len(keys), "the disk backend did not index every chunk in 20 s"
    files = sorted(p for p in disk.rglob("*") if p.is_file())
    # File of each chunk, in token order: the file names carry the chunk hash.
    by_start = []
    for start, ident in keys:
        match = [p for p in files if f"@{ident:x}@" in p.name or f"@{ident}@" in p.name]
        assert len(match) == 1, (start, ident, [p.name for p in files])
        by_start.append(match[0])
    return by_start


def _lookup(engine: WorkerEngine, lookup_id: str) -> int:
    return engine.engine.lookup(tokens=TOKENS, lookup_id=lookup_id, pin=True)


def _load(engine: WorkerEngine, lookup_id: str, kv: PatternKV) -> int:
    claim = engine.claim(lookup_id)
    assert claim is not None
    try:
        return engine.load_claim(claim, 0, len(TOKENS), TransferContext(lookup_id, ((0,),)))
    finally:
        engine.release_claim(claim)


def test_intact_chunks_load_exactly_even_when_the_store_loses_them_after_lookup(disk_engine):
    engine, kv, disk = disk_engine
    files = _store_all(engine, disk)
    assert _lookup(engine, "r") == len(TOKENS)
    assert engine.take_counts().staged_chunks == 4
    for f in files:  # the disk dies between lookup and load
        f.unlink()
    assert _load(engine, "r", kv) == len(TOKENS)
    for start in range(0, len(TOKENS), CHUNK):
        assert torch.equal(kv.loaded[start], _pattern(start)), start
    # Released after the load: nothing stays held.
    assert engine.staging.held() == 0


# (A truncated disk file is not a case here: LMCache's disk read fills a
# recycled buffer, so what comes back depends on the allocator, not the
# file. Truncated Redis values are covered by the engine tests.)
@pytest.mark.parametrize("damage", ["flip", "foreign"])
def test_bad_chunk_ends_the_hit_is_counted_removed_and_not_read_again(disk_engine, damage, caplog):
    engine, kv, disk = disk_engine
    files = _store_all(engine, disk)
    data = bytearray(files[2].read_bytes())
    if damage == "flip":
        data[100] ^= 0xFF
    else:  # a well-formed chunk of this layout, stored under another key
        data = bytearray(files[1].read_bytes())
    files[2].write_bytes(bytes(data))

    read = _record_reads(engine)
    assert _lookup(engine, "r") == 2 * CHUNK  # the two chunks before it
    # Each buffer read is held for the hit or was given back, the refused
    # chunk's and (window 1) the one read ahead after it included.
    held = {id(entry.obj) for entry in engine.staging._entries.values()}
    assert len(read) == 4 and len(held) == 2
    assert all(id(obj) in held or obj.get_ref_count() == 0 for obj in read), \
        [obj.get_ref_count() for obj in read]
    counts = engine.take_counts()
    assert counts.checksum_failures + counts.unreadable_chunks == 1
    assert "refused at lookup" in caplog.text
    assert not files[2].exists()  # removed from the disk backend
    assert _load(engine, "r", kv) == 2 * CHUNK
    assert sorted(kv.loaded) == [0, CHUNK]
    assert all(torch.equal(kv.loaded[s], _pattern(s)) for s in kv.loaded)
    # The next lookup neither reads nor counts it again.
    assert _lookup(engine, "r2") == 2 * CHUNK
    again = engine.take_counts()
    assert again.checksum_failures + again.unreadable_chunks == 0
    engine.unpin("r2")
    assert engine.staging.held() == 0


def _record_reads(engine: WorkerEngine) -> list:
    """The buffers the staging's reads return (kept alive here, so LMCache's
    garbage-collection safety net cannot hide one never given back)."""
    read: list = []
    fetch = engine.staging._fetch

    def recording(*args, **kwargs):
        fetched, complete = fetch(*args, **kwargs)
        read.extend(item.obj for item in fetched if item.obj is not None)
        return fetched, complete

    engine.staging._fetch = recording
    return read


def test_repeated_lookups_share_one_staged_copy_and_unpin_releases_it(disk_engine):
    engine, kv, disk = disk_engine
    _store_all(engine, disk)
    assert _lookup(engine, "a") == len(TOKENS)
    assert _lookup(engine, "a") == len(TOKENS)  # the scheduler asks again
    assert _lookup(engine, "b") == len(TOKENS)  # another request, same prefix
    counts = engine.take_counts()
    assert counts.staged_chunks == 4  # read from disk once
    assert engine.staging.held() == 4
    engine.unpin("a")
    assert engine.staging.held() == 4  # "b" still holds them
    engine.unpin("b")
    assert engine.staging.held() == 0
    assert engine.claim("a") is None  # nothing left to load: the worker falls back, counted


def test_close_says_how_many_staged_chunks_were_still_held(disk_engine, caplog):
    """Every staged chunk is released by its load, its request's unpin or
    the TTL; close reports (and releases) any left, so a missed release
    shows in the log: a WARNING with the count, INFO when there is none."""
    engine, kv, disk = disk_engine
    _store_all(engine, disk)
    assert _lookup(engine, "a") == len(TOKENS)
    assert _lookup(engine, "b") == len(TOKENS)
    engine.unpin("b")
    held = engine.staging.held()
    assert held == 4  # "a" was never loaded nor unpinned
    with caplog.at_level(logging.INFO, logger="lmcache_ascend"):
        engine.staging.close()
    line = [r for r in caplog.records if "closing:" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in line] == [
        (logging.WARNING, f"lmcache-ascend: closing: {held} staged chunk(s) still held (1 lookup(s) no load "
                          "claimed); released")]
    assert engine.staging.held() == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmcache_ascend"):
        engine.staging.close()  # nothing left: one INFO line saying so
    assert [(r.levelno, r.getMessage()) for r in caplog.records if "closing:" in r.getMessage()] == [
        (logging.INFO, "lmcache-ascend: closing: 0 staged chunk(s) still held (0 lookup(s) no load claimed); "
                       "released")]


@pytest.mark.parametrize("case", ["released", "staged_left", "reference_left"])
def test_close_says_what_was_still_held(case, caplog):
    """A lookup stages what it reports (a reference on each chunk of
    LMCache's CPU cache) until the load or the request's end releases it.
    Close reports, after the last puts: the staged chunks still held, then
    the chunks of LMCache's CPU cache still pinned or referenced beyond the
    cache's own reference. INFO with 0 when everything was released; a
    WARNING with the count when not, the leak an abort, preemption or
    shutdown path could cause."""
    # Hits come from LMCache's CPU cache.
    engine = _engine(_KV(), local_cpu=True)
    kept = None
    try:
        tokens = torch.tensor(TOKENS)
        engine.store(tokens, torch.ones(len(TOKENS), dtype=torch.bool), TransferContext("s", ((0,),)))
        assert _lookup(engine, "a") == len(TOKENS)
        if case != "staged_left":
            engine.unpin("a")
        if case == "reference_left":  # as a load that never gave its chunk back
            backend = engine.engine.storage_manager.storage_backends["LocalCPUBackend"]
            kept = next(iter(backend.hot_cache.values()))
            kept.ref_count_up()
        with caplog.at_level(logging.INFO, logger="lmcache_ascend"):
            engine.close()
    finally:
        engine.close()
        if kept is not None:
            kept.ref_count_down()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "closing:" in r.getMessage()]
    n = len(TOKENS) // CHUNK
    staged = (f"lmcache-ascend: closing: {n} staged chunk(s) still held (1 lookup(s) no load claimed); released"
              if case == "staged_left" else
              "lmcache-ascend: closing: 0 staged chunk(s) still held (0 lookup(s) no load claimed); released")
    cpu = (f"lmcache-ascend: closing: 1 of {n} chunk(s) in LMCache's CPU cache still pinned or referenced (a pin "
           "or reference that no load, unpin or put released)" if case == "reference_left" else
           f"lmcache-ascend: closing: 0 of {n} chunk(s) in LMCache's CPU cache still pinned or referenced")
    assert lines == [
        (logging.WARNING if case == "staged_left" else logging.INFO, staged),
        (logging.WARNING if case == "reference_left" else logging.INFO, cpu),
    ]


def _held_fetches(engine: WorkerEngine) -> tuple[threading.Event, threading.Event]:
    """Every staging read waits for ``go`` once it has begun (``begun``), as
    a remote fetch still in flight when its request ends would."""
    begun, go = threading.Event(), threading.Event()
    fetch = engine.staging._fetch

    def held(*args, **kwargs):
        begun.set()
        assert go.wait(30), "the test never let the fetch go on"
        return fetch(*args, **kwargs)

    engine.staging._fetch = held
    return begun, go


@pytest.mark.parametrize("lookup_id, ended, released", [
    ("a", "a", True),  # the request's own lookup: a client gone, or its RPC timed out
    ("a#state1", "a", True),  # a Mamba state probe of it
    ("ab", "a", False),  # another request whose id merely starts alike
    ("a", None, False),  # the request lives on (readmitted after a preemption): unpin, not ended
])
def test_a_lookup_that_lands_after_its_request_ended_holds_nothing(disk_engine, lookup_id, ended, released):
    """The worker's lookup server reads a prefix while its request ends:
    the scheduler stopped waiting (LMCache's lookup_timeout_ms) or the client
    left. What that lookup stages is released when it lands, not held until
    STAGE_TTL_S; a lookup of a request that still lives keeps what it staged
    for its load. Measured against the chunks the staging holds and what a
    load can claim."""
    engine, kv, disk = disk_engine
    _store_all(engine, disk)
    begun, go = _held_fetches(engine)
    result: list[int] = []
    reader = threading.Thread(target=lambda: result.append(_lookup(engine, lookup_id)))
    reader.start()
    try:
        assert begun.wait(30)
        if ended is not None:
            engine.request_ended(ended)
        else:
            engine.unpin(lookup_id)  # what the scheduler sends for a lookup it lets go
    finally:
        go.set()
        reader.join(30)
    assert result == [len(TOKENS)]  # the lookup itself read everything
    assert engine.take_counts().staged_chunks == 4
    if released:
        assert engine.staging.held() == 0
        assert engine.claim(lookup_id) is None
    else:
        assert engine.staging.held() == 4
        assert _load(engine, lookup_id, kv) == len(TOKENS)
        assert all(torch.equal(kv.loaded[s], _pattern(s)) for s in range(0, len(TOKENS), CHUNK))
        assert engine.staging.held() == 0
    # Nothing is remembered of the ended lookup: the same id staged again
    # (the bookkeeping of one lookup cannot outlive it) is held for its load.
    del engine.staging._fetch  # the staging's own reads again
    assert _lookup(engine, lookup_id) == len(TOKENS)
    assert engine.staging.held() == 4
    engine.request_ended(lookup_id.split("#")[0])
    assert engine.staging.held() == 0
