# SPDX-License-Identifier: Apache-2.0
"""Mamba/GDN state hits over prompt lengths: the connector against vLLM's own
prefix cache, on the same prompts, per hybrid block size.

For each block size B asked for (vLLM's ``block_size``; vLLM may raise it to
fit the Mamba page, so B is read back from the worker's plan record, never
assumed), prompts of every length from B to ``--max-blocks`` x B in steps of
``--step`` tokens, each a distinct random prompt, run in two engines:

* with the connector: every prompt cold, then vLLM's prefix cache is reset
  and every prompt runs again: its cached tokens are the connector's hit;
* without it: every prompt cold, then again without a reset: vLLM's own
  prefix-cache hit on the same prompt.

Goal (issue 39): every length >= B + 1 hits its last boundary
``((n - 1) // B) * B`` from the connector. Printed per length: the hit of
each, the boundary, and at the end the bytes the connector stored per hit
token (KV chunks and state snapshots, from its per-request summary lines).

  python bench/bench_state_hits.py                       # B 256, 384, 512; step 32; up to 8 B
  python bench/bench_state_hits.py --blocks 384 --step 96 --max-blocks 4   # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402
import e2e_state  # noqa: E402
from lmcache_ascend.cli.plan_file import read_plan  # noqa: E402

# The connector's per-request summary (integration/vllm/worker.py,
# WorkerHalf._log_record): per-group stored bytes, and the state snapshot's
# size and where it was stored.
SUMMARY_RE = re.compile(
    r"lmcache-ascend: request \S+: hit (\d+) tokens .*?, stored (\d+) tokens \[([^\]]*)\].*?"
    r"Mamba state \((\d+) bytes each\): loaded [^,]*, stored at (none|\[[^\]]*\])"
)
GROUP_BYTES_RE = re.compile(r"=(\d+)B")


@dataclass
class Row:
    length: int
    boundary: int  # the last block boundary below the prompt's end
    lmcache: int  # connector hit after vLLM's prefix cache was reset
    vllm: int  # vLLM's own prefix-cache hit, same prompt, same block size


def lengths_for(block: int, step: int, max_blocks: int) -> list[int]:
    return list(range(block, max_blocks * block + 1, step))


def prompt(length: int, block: int) -> list[int]:
    from lmcache_ascend.cli.tiny_models import token_prompt

    return token_prompt(length, seed=10_000 + 7 * block + length)


def scenario(model: str, lengths: list[int], block: int, connector: bool, cpu_gib: int):
    from lmcache_ascend.cli.engine_run import Phase, Scenario

    prompts = [prompt(n, block) for n in lengths]
    phases = [Phase("cold", prompts, max_tokens=1, sequential=True),
              Phase("again", prompts, max_tokens=1, sequential=True, reset_prefix_cache=connector)]
    kwargs = dict(e2e_state.ENGINE_KWARGS, block_size=block)
    # vLLM's own cache must keep every cold prompt (its hit is the reference).
    kv_gib = 1 + math.ceil(2 * sum(lengths) * e2e_state.kv_bytes_per_token(e2e_state.spec()) / 2**30)
    return Scenario(model=model, phases=phases, dtype="bfloat16", connector="ascend" if connector else "none",
                    engine_kwargs=kwargs, max_model_len=max(lengths) + 64, kv_cache_gib=kv_gib,
                    env={"LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gib)})


def stored_bytes(log: str) -> tuple[int, int]:
    """(KV chunk bytes, state snapshot bytes) the connector stored."""
    kv = state = 0
    for m in SUMMARY_RE.finditer(log):
        kv += sum(int(b) for b in GROUP_BYTES_RE.findall(m.group(3)))
        at = m.group(5)
        if at != "none":
            state += int(m.group(4)) * len(json.loads(at))
    return kv, state


def measure(model: str, block: int, args, workdir: Path, log) -> tuple[int, list[Row], tuple[int, int]]:
    from lmcache_ascend.cli.engine_run import Scenario

    sc = Scenario(model=model, phases=[], dtype="bfloat16", max_model_len=4096,
                  engine_kwargs=dict(e2e_state.ENGINE_KWARGS, block_size=block))
    run = bench_e2e.run_engine(sc, workdir, f"plan-{block}", args.timeout)
    record = read_plan(run.plan_file)  # bench_e2e.run_engine asked the worker for it
    state = record.get("state") or {}
    if not state.get("enabled"):
        raise RuntimeError(f"block {block}: Mamba state hits are off: {state}")
    b = int(state["block_size"])
    if b != block:
        log(f"[B={block}] vLLM chose block {b} (the Mamba page needs it); measuring at {b}")
    lengths = lengths_for(b, args.step, args.max_blocks)
    log(f"[B={b}] {len(lengths)} lengths {lengths[0]}..{lengths[-1]}, step {args.step}; "
        f"{e2e_state.describe(state, record['plan'])}")
    hits = {}
    for connector in (True, False):
        t0 = time.time()
        run = bench_e2e.run_engine(scenario(model, lengths, b, connector, args.cpu_gib), workdir,
                                   f"b{b}-{'ascend' if connector else 'none'}", args.timeout)
        cold, again = run.results
        if any(c["num_cached_tokens"] for c in cold["completions"]):
            raise RuntimeError(f"B={b}: a cold prompt found cached tokens")
        hits[connector] = [c["num_cached_tokens"] for c in again["completions"]]
        if connector:
            stored = stored_bytes(run.log)
            if "Evict" in run.log or "evict" in run.log:
                log(f"[B={b}] WARNING: LMCache evicted entries (raise --cpu-gib)")
        log(f"[B={b}] engine {'with' if connector else 'without'} the connector: {time.time() - t0:.0f} s")
    rows = [Row(n, ((n - 1) // b) * b, hits[True][i], hits[False][i]) for i, n in enumerate(lengths)]
    return b, rows, stored


def report(b: int, rows: list[Row], stored: tuple[int, int]) -> bool:
    print(f"\nB = {b} tokens: hit tokens per prompt length (connector after a reset | vLLM's own cache)")
    print(f"{'length':>7} {'boundary':>9} {'connector':>10} {'vLLM':>6}")
    for r in rows:
        flag = "" if r.lmcache == r.boundary else "   <- short of its boundary"
        print(f"{r.length:>7} {r.boundary:>9} {r.lmcache:>10} {r.vllm:>6}{flag}")
    eligible = [r for r in rows if r.length >= b + 1]
    at_boundary = sum(r.lmcache == r.boundary for r in eligible)
    vllm_at = sum(r.vllm == r.boundary for r in eligible)
    hit = sum(r.lmcache for r in rows)
    kv, state = stored
    print(f"lengths >= B+1 hitting their last boundary: connector {at_boundary}/{len(eligible)}, "
          f"vLLM's own cache {vllm_at}/{len(eligible)}")
    print(f"hit tokens: connector {hit}, vLLM {sum(r.vllm for r in rows)}; stored {kv + state} bytes "
          f"(KV {kv}, state snapshots {state}) = {((kv + state) / hit) if hit else float('nan'):.0f} bytes "
          f"per hit token")
    return at_boundary == len(eligible)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="256,384,512", help="vLLM block sizes to ask for, comma-separated")
    ap.add_argument("--step", type=int, default=32, help="tokens between prompt lengths")
    ap.add_argument("--max-blocks", type=int, default=8, help="longest prompt, in blocks")
    ap.add_argument("--cpu-gib", type=int, default=4, help="LMCache's local CPU cache (no eviction wanted)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine process")
    ap.add_argument("--workdir", type=Path, default=None, help="keep scenarios and engine logs here")
    args = ap.parse_args(argv)
    from lmcache_ascend.cli.tiny_models import build_tiny_model, default_cache_dir

    model = str(build_tiny_model(e2e_state.spec(), cache_dir=default_cache_dir() / "bench-e2e"))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_state_hits_"))
    workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ok = True
    for block in (int(x) for x in args.blocks.split(",")):
        b, rows, stored = measure(model, block, args, workdir, log)
        ok &= report(b, rows, stored)
    print(f"\nengine logs: {workdir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
