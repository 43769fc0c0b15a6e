"""``lmcache-ascend demo``: a tiny random-weight hybrid model (built once,
cached) serves a long shared-prefix workload cold, then warm from LMCache
after vLLM's own prefix cache is reset; outputs are compared with an engine
without the connector."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from lmcache_ascend.cli.engine_run import Completion, Phase, Scenario
from lmcache_ascend.cli.plan_file import PlanFileError, read_plan
from lmcache_ascend.cli.spawn import progress, run_scenario

LOGPROB_TOL = 1e-3


def _same(a: Completion, b: Completion) -> tuple[bool, float]:
    if a.tokens != b.tokens or len(a.logprobs) != len(b.logprobs):
        return False, math.inf
    worst = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    return worst <= LOGPROB_TOL, worst


def _stored_bytes(plan_file: Path) -> dict[str, int]:
    """Per-group bytes per chunk from the worker's plan record (none when
    the worker wrote none: the figures are extra, the comparison is not)."""
    try:
        record = read_plan(plan_file)
    except PlanFileError:
        return {}
    return {str(g["group"]): int(g["planned_bytes"]) for g in record["plan"]["groups"] if g["stored"]}


def run(args: argparse.Namespace) -> int:
    from lmcache_ascend.cli.tiny_models import build_tiny_model, token_prompt

    if args.model:
        model = args.model
        progress(f"using your model {model}")
    else:
        progress(f"building a tiny random-weight {args.arch} model (cached after the first run)")
        model = str(build_tiny_model(args.arch))
        progress(f"model at {model}")
    prefix = token_prompt(args.prefix_tokens, seed=7)
    prompts = [prefix + token_prompt(args.suffix_tokens, seed=100 + i) for i in range(args.requests)]
    phases = [
        # An unrelated prompt first, so one-time engine warm-up is not billed
        # to the first cold request.
        Phase("warmup", [token_prompt(256, seed=99)], max_tokens=1, sequential=True),
        Phase("cold", prompts, max_tokens=args.max_tokens, sequential=True),
        Phase("warm", prompts, max_tokens=args.max_tokens, reset_prefix_cache=True, sequential=True),
    ]
    max_len = args.prefix_tokens + args.suffix_tokens + args.max_tokens + 16
    common: dict[str, Any] = dict(model=model, dtype=args.dtype, max_model_len=max_len)
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-demo-") as tmp:
        work = Path(tmp)
        progress("run 1/2: vLLM with LMCacheAscendConnectorV1Dynamic")
        with_conn, _, plan_file = run_scenario(Scenario(phases=phases, **common), "connector", work)
        per_group = _stored_bytes(plan_file)  # read before the folder is removed
        progress("run 2/2: the same workload without a connector (reference outputs)")
        ref = run_scenario(Scenario(phases=phases, connector="none", **common), "reference", work).results
    _, cold, warm = with_conn
    print()
    print("cold: fresh cache (request 0 misses; later requests may already hit the shared")
    print("      prefix request 0 stored); warm: after vLLM's prefix cache was reset.")
    print(f"{'request':>7} | {'TTFT cold':>10} | {'TTFT warm':>10} | {'speedup':>7} | "
          f"{'hit cold':>8} | {'hit warm':>8} | {'identical':>9}")
    print("-" * 78)
    all_ok = True
    for i in range(len(prompts)):
        c, w = cold.completions[i], warm.completions[i]
        # Cold and warm against the reference (the warm-up phase has one prompt).
        ok_ref = all(_same(p.completions[i], r.completions[i])[0] for p, r in zip(with_conn[1:], ref[1:]))
        ok_cw, _ = _same(w, c)
        ok = ok_ref and ok_cw
        all_ok &= ok
        speed = c.ttft / w.ttft if w.ttft and w.ttft > 0 else float("nan")
        print(f"{i:>7} | {c.ttft * 1000:>8.1f}ms | {w.ttft * 1000:>8.1f}ms | {speed:>6.1f}x | "
              f"{c.num_cached_tokens:>8} | {w.num_cached_tokens:>8} | {'yes' if ok else 'NO':>9}")
    print()
    if per_group:
        print("bytes stored per chunk, by KV cache group: "
              + ", ".join(f"group {g}: {b:,}" for g, b in sorted(per_group.items(), key=lambda x: int(x[0]))))
    print(f"prompt: {args.prefix_tokens} shared + {args.suffix_tokens} unique tokens, "
          f"{args.requests} requests, model {model}")
    print("outputs and logprobs identical (warm vs cold vs no-connector): "
          + ("yes" if all_ok else "NO"))
    return 0 if all_ok else 1


