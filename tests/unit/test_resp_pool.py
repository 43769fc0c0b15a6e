"""A Redis pool read through LMCache's native client (``remote_url:
resp://``), on a real ``redis-server`` started here: what one engine stores,
another stages at lookup and loads byte for byte; a value damaged in Redis is
refused at lookup and counted, the chunks before it still hit.

resp:// is the faster way to read Redis here (docs/benchmarks.md); its
blocking calls need the patch in lmcache_bridge/patching/patches.py
(``native_client_sync_on_loop``), which the staged lookup's read-ahead
exercises on every hit."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from lmcache_ascend.integration.vllm import adapter_route

adapter_route.install()  # as the entry points do, before LMCache loads its modules
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine  # noqa: E402
from lmcache_ascend.lmcache_bridge.integrity import staging  # noqa: E402
from pattern_kv import PatternKV, pattern  # noqa: E402
from redis_server import RedisServer, ensure_redis_server  # noqa: E402

CHUNK = 16
CHUNK_BYTES = 64 * 1024
N_CHUNKS = 6
TOKENS = list(range(5000, 5000 + N_CHUNKS * CHUNK))


def _pattern(start: int) -> torch.Tensor:
    return pattern(start, CHUNK_BYTES)


def _KV() -> PatternKV:
    return PatternKV(CHUNK_BYTES)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path_factory.mktemp("resp")) as s:
        yield s


def _engine(url: str, model: str, kv: PatternKV) -> WorkerEngine:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_url=url, remote_serde="naive",
        pre_caching_hash_algorithm="sha256_cbor", save_unfull_chunk=False)
    spec = EngineSpec("resp-test", model, 0, 1, CHUNK, {})
    connector = PagedChunkConnector(CHUNK_BYTES, CHUNK, kv.store, kv.load, checksums=True)
    return WorkerEngine.start(config, spec, connector, CHUNK_BYTES, 1, "fp")


@pytest.mark.parametrize("window", [2, staging.FETCH_WINDOW])
def test_resp_pool_hits_exactly_and_refuses_a_damaged_value(server, window, monkeypatch):
    monkeypatch.setattr(staging, "FETCH_WINDOW", window)
    url = server.url.replace("redis://", "resp://", 1)
    model = f"resp-{uuid.uuid4().hex[:8]}"
    server.client().command("FLUSHALL")  # every key is this test's
    writer_kv, reader_kv = _KV(), _KV()
    writer = _engine(url, model, writer_kv)
    try:
        tokens = torch.tensor(TOKENS)
        mask = torch.ones(len(TOKENS), dtype=torch.bool)
        writer.store(tokens, mask, TransferContext("s", ((0,),)))
        keys = server.client().keys()
        deadline = time.monotonic() + 30
        while len(keys) < N_CHUNKS and time.monotonic() < deadline:  # puts are asynchronous
            time.sleep(0.05)
            keys = server.client().keys()
        assert len(keys) == N_CHUNKS, keys  # resp:// writes one key per chunk (no metadata key)
    finally:
        writer.close()

    reader = _engine(url, model, reader_kv)
    try:
        assert reader.engine.lookup(tokens=TOKENS, lookup_id="a", pin=True) == len(TOKENS)
        claim = reader.claim("a")
        assert reader.load_claim(claim, 0, len(TOKENS), TransferContext("a", ((0,),))) == len(TOKENS)
        reader.release_claim(claim)
        for start in range(0, len(TOKENS), CHUNK):
            assert torch.equal(reader_kv.loaded[start], _pattern(start)), start
        assert reader.take_counts().staged_chunks == N_CHUNKS

        # Damage the fourth chunk's value in Redis: one byte of its payload.
        fourth = next(k for k in keys if _chunk_start(reader, k) == 3 * CHUNK)
        raw = server.client().get(fourth)
        server.client().command("SETRANGE", fourth, 100, bytes([raw[100] ^ 0xFF]))
        assert reader.engine.lookup(tokens=TOKENS, lookup_id="b", pin=True) == 3 * CHUNK
        counts = reader.take_counts()
        assert counts.checksum_failures == 1 and counts.staged_chunks == 3
        reader.unpin("b")
        assert reader.staging.held() == 0
    finally:
        reader.close()


def _chunk_start(engine: WorkerEngine, redis_key: bytes) -> int:
    ids = engine.chunk_ids(torch.tensor(TOKENS), torch.ones(len(TOKENS), dtype=torch.bool))
    for start, ident in ids.items():
        if f"@{ident:x}@" in redis_key.decode() or f"@{ident}@" in redis_key.decode():
            return start
    raise AssertionError(f"no chunk of this prompt has key {redis_key!r}")
