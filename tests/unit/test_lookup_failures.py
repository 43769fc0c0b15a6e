"""Lookups LMCache does not answer are misses, counted and logged.

The scheduler half asks LMCache's lookup client (ZMQ to the worker's lookup
server). When the server does not answer within ``lookup_timeout_ms`` the
client returns 0 exactly as for a real miss; ``SchedulerLookup`` tells
the two apart and the scheduler counts and logs the failure. These tests use
LMCache's real lookup client and server; the server's engine is a stand-in
that answers a fixed number of chunks (the storage side is covered by the
engine tests).
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

pytest.importorskip("vllm", reason="the scheduler half reads vLLM's request types")

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import SchedulerLookup
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules
from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.vllm_keys import RequestView
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup

LookupClientFactory = lmcache_modules.load(lmcache_modules.LOOKUP_CLIENT_FACTORY).LookupClientFactory

CHUNK = 256
GROUPS = (SchedulerGroup(index=0, kind=GroupKind.FULL, spec_name="FullAttentionSpec", block_size=128),)


def _view(req_id: str, n: int) -> RequestView:
    tokens = list(range(1, n + 1))
    return RequestView(req_id=req_id, token_ids=tokens, num_tokens=n, num_prompt_tokens=n)


def _config(timeout_ms: int) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        lookup_timeout_ms=timeout_ms,
        pre_caching_hash_algorithm="sha256_cbor",
    )


def _metadata(role: str, engine_id: str) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="lookup-test",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.uint8,
        kv_shape=(1, 1, CHUNK, 1, 1),
        role=role,
        chunk_size=CHUNK,
        engine_id=engine_id,
        kv_connector_extra_config={},
    )


class _ChunksEngine:
    """Answers every lookup with the first ``chunks`` chunks of the prompt."""

    def __init__(self, config: LMCacheEngineConfig, chunks: int) -> None:
        self.config = config
        self.chunks = chunks
        self.lookup_ids: list[str] = []

    def lookup(self, hashes=None, offsets=None, lookup_id=None, pin=False, request_configs=None, tokens=None):
        self.lookup_ids.append(lookup_id)
        return sum(offsets[: self.chunks])


def test_unanswered_lookups_are_misses_counted_and_logged_sparingly(caplog):
    asked: list[str] = []

    def dead_lookup(token_ids, req_id):
        asked.append(req_id)
        return None

    half = SchedulerHalf(GROUPS, CHUNK, dead_lookup)
    with caplog.at_level(logging.WARNING, logger="lmcache_ascend.integration.vllm.scheduler"):
        for i in range(150):
            assert half.get_num_new_matched_tokens(_view(f"r{i}", 600), 0) == (0, False)
            half.update_state_after_alloc(f"r{i}", 0)
    assert len(asked) == 150
    assert half.stats.lookup_failures == 150
    assert half.stats.hit_tokens == 0
    warnings = [r.getMessage() for r in caplog.records if "lookup got no answer" in r.getMessage()]
    # The first failure and the 100th, each naming the request and the count.
    assert len(warnings) == 2, warnings
    assert "request r0:" in warnings[0] and "1 lookup failure(s)" in warnings[0]
    assert "request r99:" in warnings[1] and "100 lookup failure(s)" in warnings[1]


def test_answered_lookup_is_not_a_failure():
    half = SchedulerHalf(GROUPS, CHUNK, lambda toks, rid: 512)
    assert half.get_num_new_matched_tokens(_view("a", 600), 0) == (512, False)
    assert half.stats.lookup_failures == 0


def test_real_client_without_a_server_reports_no_answer():
    client = LookupClientFactory.create_lookup_client(
        _config(timeout_ms=200), _metadata("scheduler", f"no-server-{uuid.uuid4().hex}")
    )
    try:
        lookup = SchedulerLookup(client, CHUNK)
        assert lookup(range(1, 601), "req-1") is None
        # Nothing recorded by the client for it.
        assert client.lookup_cache("req-1") == -1
        # Shorter than a chunk: no key to ask about, an ordinary 0.
        assert lookup(range(1, 101), "req-2") == 0
    finally:
        client.close()


def test_real_client_and_server_answer_and_leave_no_record():
    engine_id = f"answers-{uuid.uuid4().hex}"
    config = _config(timeout_ms=5000)
    engine = _ChunksEngine(config, chunks=2)
    server = LookupClientFactory.create_lookup_server(engine, _metadata("worker", engine_id))
    client = LookupClientFactory.create_lookup_client(config, _metadata("scheduler", engine_id))
    try:
        lookup = SchedulerLookup(client, CHUNK)
        assert lookup(range(1, 601), "req-1") == 2 * CHUNK
        assert engine.lookup_ids == ["req-1"]
        # LMCache's client keeps a per-request record unless cleared; a
        # long-running server would otherwise grow it forever.
        assert client.lookup_cache("req-1") == -1
        engine.chunks = 0
        assert lookup(range(1, 601), "req-2") == 0  # answered miss, not None
    finally:
        client.close()
        server.close()
