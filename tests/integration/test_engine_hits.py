"""Real vLLM engine on the CPU, tiny random-weight models, our connector.

Every test compares a run WITH the connector against the same workload on
an engine WITHOUT it (and the warm phase against the cold one): tokens must
match exactly and logprobs within 1e-3 (fp32). Logprobs matter: random
models repeat tokens, so equal tokens alone would miss corrupted KV.
"""

from __future__ import annotations

import re

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt
from lmcache_ascend.compat import vllm_features

import sched_trace
from engine_checks import CHUNK, assert_same
from faults import ENGINE_CORE_ENV, MULTIPROCESS

from .conftest import run_engine_in, run_reference_in

pytestmark = pytest.mark.engine

A = token_prompt(3 * CHUNK + 100, seed=1)  # 868 tokens: 3 whole chunks are cacheable
B = A[:600] + token_prompt(200, seed=2)  # shares 2 whole chunks with A, then diverges
C = token_prompt(2 * CHUNK + 30, seed=3)
SHORT = token_prompt(100, seed=4)  # shorter than a chunk: never hits


def phases() -> list[Phase]:
    return [
        Phase("cold", [A], sequential=True),
        Phase("warm", [A], reset_prefix_cache=True, sequential=True),
        Phase("shared_prefix", [B], reset_prefix_cache=True, sequential=True),
        Phase("short", [SHORT], reset_prefix_cache=True, sequential=True),
        Phase("batch", [A, B, C, SHORT], reset_prefix_cache=True),
    ]


def run_pair(run_engine, model: str, dtype: str = "float32", env: dict | None = None, **kw):
    env = dict(env or {})
    with_conn, log = run_engine(Scenario(model=model, phases=phases(), dtype=dtype, env=env, **kw))
    without, _ = run_engine(Scenario(model=model, phases=phases(), dtype=dtype, connector="none", env=env))
    return with_conn, without, log


def check_outputs(with_conn, without) -> None:
    for got, ref in zip(with_conn, without):
        assert_same(got, ref, got.name)
    # Warm (hit) against cold (miss) of the same engine.
    assert_same(with_conn[1], with_conn[0], "warm vs cold")


# Gemma-3 (six KV cache groups) runs on every supported vLLM (`compat`), on
# vLLM's multiprocess engine core, as `LLM` and `vllm serve` run it: the
# connector's scheduler and worker halves in two processes, its step
# metadata (all six groups' blocks) pickled between them. The others run
# in-process, as most engine tests do (the same connector code, one process
# start instead of three). Gemma-2 (full and sliding groups interleaved)
# copies its hits layer by layer beside the forward (ascend_layerwise_load,
# off by default): the same outputs, from the same engine runs.
LAYERWISE = {"LMCACHE_ASCEND_LAYERWISE_LOAD": "on"}


@pytest.mark.parametrize("name,env", [("llama", {}), ("gemma2", LAYERWISE),
                                      pytest.param("gemma3", MULTIPROCESS, marks=pytest.mark.compat(
        "torch", "lmcache", "connector_hooks", "kv_layout_source", "hash_block_size", "stats_need_worker_stats"))],
                         ids=["llama", "gemma2", "gemma3"])
def test_attention_models_hit_and_match(run_engine, tiny_model, name, env):
    with_conn, without, log = run_pair(run_engine, tiny_model(name), env=env)
    check_outputs(with_conn, without)
    by_name = {p.name: p for p in with_conn}
    # Cold: nothing cached. Warm: every whole chunk except the last token's.
    assert by_name["cold"].completions[0].num_cached_tokens == 0
    assert by_name["warm"].completions[0].num_cached_tokens >= 3 * CHUNK
    assert by_name["shared_prefix"].completions[0].num_cached_tokens == 2 * CHUNK
    assert by_name["short"].completions[0].num_cached_tokens == 0
    batch = by_name["batch"].completions
    assert batch[0].num_cached_tokens >= 3 * CHUNK  # A was stored in the cold phase
    assert batch[1].num_cached_tokens >= 2 * CHUNK  # B's prefix (and B) stored
    # The connector's per-request lines agree with what vLLM reported.
    lines = re.findall(r"request \S+: hit (\d+) tokens \(vLLM had (\d+)\), loaded (\d+) tokens", log)
    assert any(int(loaded) >= 3 * CHUNK for _, _, loaded in lines), lines
    ids = re.findall(r"lmcache-ascend: request (\S+): hit", log)
    assert len(ids) == len(set(ids)), ids  # each request reported once
    if env.get(ENGINE_CORE_ENV) != "1":
        # The last phase's requests end as the engine goes idle (an offline
        # LLM takes no further step): their lines come when the connector
        # closes. vLLM force-kills its multiprocess engine core at shutdown
        # here ("force killing remaining process EngineCore") before the
        # connector closes, so there the lines never come.
        assert "(logged at shutdown)" in log
    assert re.search(r"stored [1-9]\d* tokens", log)
    # No chunk_size configured: chunks as fine as vLLM-CPU's 128-token blocks.
    assert "chunk_size not set; using 128 tokens" in log
    if env is LAYERWISE:
        # The hits of the warm, shared-prefix and batch phases were copied
        # beside the forward (the first forward taught which layers wait).
        assert "copied layer by layer beside the forward" in log
        assert "layer-by-layer loads on: vLLM waits on 4 layer(s)" in log, log[-3000:]
        assert with_conn[-1].counters.get("layerwise_loads", 0) >= 3, with_conn[-1].counters


@pytest.mark.compat("torch", "lmcache", "connector_hooks", "kv_layout_source", "hash_block_size", "prefix_match_unit",
                    "state_copy", "checkpoint_blocks")
@pytest.mark.skipif(
    vllm_features().series == (0, 23),
    reason="vLLM-CPU 0.23 cannot run Qwen3-Next (its CPU GDN kernels crash in bf16)",
)
def test_state_model_without_align_mode_refuses_hits_and_matches(tmp_path, tiny_model):
    """Qwen3-Next (GDN + full attention) with vLLM's prefix caching off:
    vLLM's Mamba cache mode is then 'none' (only the latest state of each
    request is kept), so no chunk boundary has a state to restore. Hits are
    refused with one line naming why and the setting that enables them,
    and outputs stay exact. (With align mode on, the default with prefix
    caching, hits are served: tests/integration/test_mamba_hits.py.)"""
    model = tiny_model("qwen3_next")
    # float32 SSM state: vLLM-CPU 0.26's GDN kernel rejects a bf16 one.
    # In-process engine core: the batch's requests are all queued before its
    # first step, so its steps do not follow timing (test_mamba_hits.ENV).
    kw = dict(model=model, phases=phases(), dtype="bfloat16", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
              engine_kwargs={"enable_prefix_caching": False, "mamba_ssm_cache_dtype": "float32"})
    # The reference first: it is also the control that tells a failure of
    # vLLM's own CPU kernels on this machine (a skip naming it) from ours.
    ref_steps, steps = [], []
    without, _ = run_reference_in(tmp_path, Scenario(connector="none", **kw), schedule=ref_steps)
    with_conn, log = run_engine_in(tmp_path, Scenario(**kw), schedule=steps)
    # No hit is served, so both engines ran the same forward steps on the
    # same threads: the same computation, compared at tolerance 0 (bf16
    # kernels give other bits for other steps; these are not other steps).
    assert sched_trace.first_difference(steps, ref_steps) is None, sched_trace.first_difference(steps, ref_steps)
    for got, ref in zip(with_conn, without, strict=True):
        assert_same(got, ref, got.name, tol=0.0)
    for phase in with_conn:
        for c in phase.completions:
            assert c.num_cached_tokens == 0
    refusals = [line for line in log.splitlines() if "external cache hits are refused" in line]
    assert len(refusals) == 1, refusals
    assert "Mamba cache mode is 'none'" in refusals[0] and "--mamba-cache-mode align" in refusals[0]
    assert "--enable-prefix-caching" in refusals[0] or "prefix caching on" in refusals[0]
    # Nor is anything stored: chunks without the state behind them could
    # serve no instance of this model (issue 39, item 3).
    assert "Nothing is stored" in refusals[0]
    stored = [line for line in log.splitlines()
              if re.search(r"Stored \d+ out of total|stored [1-9]\d* tokens", line)]
    assert stored == [], stored[:3]
