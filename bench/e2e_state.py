# SPDX-License-Identifier: Apache-2.0
"""The Qwen3-Next-style (Gated DeltaNet + full attention) model of
bench_e2e.py, and what differs for it.

* vLLM's align cache mode keeps a model's recurrent state only where a
  prefill step ends on a block boundary, and vLLM picks the hybrid block
  size B per machine and model. The bench reads B from the worker's plan
  record of a first, empty engine, and uses prompts of ``k * B + tail``
  tokens (``--state-tail``, default 200): every supported vLLM ends the
  first prefill step at ``k * B``, so both LMCache and vLLM's own prefix
  cache can hit ``k * B``. (vLLM-CPU's engine core resets the block size
  its align split reads to 128 after startup, so without the connector's
  repair a tail longer than 128 tokens left no state at ``k * B`` and
  nothing hit: docs/architecture.md, "When a Mamba/GDN state exists".)
* The LMCache chunk is B (the connector's default for this model).
* A hit also loads the state snapshot at the hit: its bytes count in
  "bytes loaded" (LMCache hands over ``pieces`` objects of a chunk each).
* vLLM-CPU 0.26 turns prefix caching off for hybrid models by default and
  its GDN kernel needs a float32 SSM state, so both are set explicitly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

STATE_MODEL = "qwen3_next"
# Past the last boundary: longer than the 128 vLLM-CPU resets its block
# size to, shorter than any B vLLM picks here.
TAIL = 200
ENGINE_KWARGS = {"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"}


def spec():
    from lmcache_ascend.cli.tiny_models import TinyModelSpec

    # 12 layers, full attention every 4th (3 attention, 9 GDN layers), MoE
    # MLPs like Qwen3-Next; bf16 (vLLM-CPU's GDN kernels take nothing else).
    return TinyModelSpec(
        "qwen3_next",
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        dtype="bfloat16",
        extra=(
            ("full_attention_interval", 4),
            ("linear_num_key_heads", 4),
            ("linear_num_value_heads", 8),
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("moe_intermediate_size", 512),
            ("shared_expert_intermediate_size", 512),
        ),
    )


def is_state_model(name: str) -> bool:
    return name == STATE_MODEL


def attention_layers(s) -> int:
    return s.num_layers // dict(s.extra).get("full_attention_interval", 4)


def kv_bytes_per_token(s) -> int:
    """Attention KV per token (bf16); GDN state is per request, not per token."""
    return attention_layers(s) * 2 * s.num_kv_heads * s.head_dim * 2


def read_state_plan(model: str, scenario_cls, run_engine: Callable, workdir: Path, timeout: int) -> dict[str, Any]:
    """Start the connector on an empty workload and return the worker's plan
    record (``plan``, ``state``: block size B, snapshot bytes, pieces)."""
    sc = scenario_cls(model=model, phases=[], dtype="bfloat16", engine_kwargs=dict(ENGINE_KWARGS), max_model_len=4096)
    from lmcache_ascend.cli.plan_file import read_plan

    run = run_engine(sc, workdir, "qwen3_next-plan", timeout)
    record = read_plan(run.plan_file)
    state = record.get("state") or {}
    if not state.get("enabled"):
        raise RuntimeError(f"Mamba state hits are off for the bench model: {state}")
    return record


def lengths_for(lengths: list[int], block: int, tail: int = TAIL) -> list[int]:
    """Each requested length rounded to k * B + tail (k >= 1)."""
    if not 0 < tail < block:
        raise ValueError(f"--state-tail {tail}: valid 1 .. {block - 1} (B = {block})")
    return sorted({max(1, round(n / block)) * block + tail for n in lengths})


def bytes_loaded(plan: dict[str, Any], state: dict[str, Any], hit_tokens: int) -> int:
    """LMCache objects handed over by a hit: its KV chunks and the state
    snapshot's pieces (one chunk buffer each)."""
    chunks = hit_tokens // plan["chunk_size"]
    return (chunks + (state["pieces"] if hit_tokens else 0)) * plan["chunk_bytes"]


def describe(state: dict[str, Any], plan: dict[str, Any]) -> str:
    return (
        f"B {state['block_size']} tokens, state snapshot {state['snapshot_bytes']} bytes in "
        f"{state['pieces']} piece(s), chunk {plan['chunk_bytes']} bytes"
    )


def min_kv_gib(s, max_len: int) -> int:
    """vLLM's KV pool also holds the state blocks (a few per request)."""
    return max(2, math.ceil(4 * max_len * kv_bytes_per_token(s) / 2**30))
