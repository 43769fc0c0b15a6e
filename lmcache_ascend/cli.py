"""``lmcache-ascend`` command line: ``demo`` and ``explain``.

demo     builds a small random-weight hybrid model (once, cached), serves a
         long shared-prefix workload cold, resets vLLM's prefix cache, serves
         it warm from LMCache, and checks outputs against a no-cache engine.
explain  prints how the connector plans transfers for a model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lmcache_ascend.testing.engine_run import Phase, PhaseResult, Scenario, Completion

LOGPROB_TOL = 1e-3


def _progress(msg: str) -> None:
    print(f"[lmcache-ascend] {msg}", flush=True)


def _run_scenario(scenario: Scenario, label: str, workdir: Path) -> tuple[list[PhaseResult], str]:
    """Run one engine in a subprocess, echoing its milestones."""
    sc = workdir / f"{label}.json"
    out = workdir / f"{label}.out.json"
    log = workdir / f"{label}.log"
    sc.write_text(json.dumps(asdict(scenario)))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(scenario.kv_cache_gib))
    milestones = (
        ("Loading weights took", "model loaded"),
        ("init engine", "engine ready"),
        ("lmcache-ascend worker plan", "connector planned the KV transfers"),
    )
    start = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_ascend.testing.engine_run", str(sc), str(out)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            env=env,
        )
        seen: set[str] = set()
        while proc.poll() is None:
            time.sleep(1.0)
            text = log.read_text(errors="replace")
            for needle, msg in milestones:
                if needle in text and needle not in seen:
                    seen.add(needle)
                    _progress(f"  {label}: {msg} ({time.time() - start:.0f} s)")
            if not seen and int(time.time() - start) % 10 == 0:
                _progress(f"  {label}: starting vLLM ({time.time() - start:.0f} s)...")
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise SystemExit(f"{label} engine failed (rc={proc.returncode}); log {log}:\n{tail}")
    raw = json.loads(out.read_text())
    results = [
        PhaseResult.from_json(r)
        for r in raw
    ]
    return results, text


def _same(a: Completion, b: Completion) -> tuple[bool, float]:
    if a.tokens != b.tokens or len(a.logprobs) != len(b.logprobs):
        return False, math.inf
    worst = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    return worst <= LOGPROB_TOL, worst


def _stored_bytes(log: str) -> dict[str, int]:
    """Per-group bytes per chunk from the worker's plan line (JSON)."""
    for line in log.splitlines():
        if "LMCACHE_ASCEND_PLAN_JSON " in line:
            # The log format appends " (file:line)" after the JSON object.
            plan, _ = json.JSONDecoder().raw_decode(line.split("LMCACHE_ASCEND_PLAN_JSON ", 1)[1])
            return {str(g["group"]): int(g["planned_bytes"]) for g in plan["groups"] if g["stored"]}
    return {}


def cmd_demo(args: argparse.Namespace) -> int:
    from lmcache_ascend.testing.tiny_models import build_tiny_model, token_prompt

    if args.model:
        model = args.model
        _progress(f"using your model {model}")
    else:
        _progress(f"building a tiny random-weight {args.arch} model (cached after the first run)")
        model = str(build_tiny_model(args.arch))
        _progress(f"model at {model}")
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
        _progress("run 1/2: vLLM with LMCacheAscendConnectorV1Dynamic")
        with_conn, log = _run_scenario(Scenario(phases=phases, **common), "connector", work)
        _progress("run 2/2: the same workload without a connector (reference outputs)")
        ref, _ = _run_scenario(Scenario(phases=phases, connector="none", **common), "reference", work)
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
    per_group = _stored_bytes(log)
    if per_group:
        print("bytes stored per chunk, by KV cache group: "
              + ", ".join(f"group {g}: {b:,}" for g, b in sorted(per_group.items(), key=lambda x: int(x[0]))))
    print(f"prompt: {args.prefix_tokens} shared + {args.suffix_tokens} unique tokens, "
          f"{args.requests} requests, model {model}")
    print("outputs and logprobs identical (warm vs cold vs no-connector): "
          + ("yes" if all_ok else "NO"))
    return 0 if all_ok else 1


def cmd_explain(args: argparse.Namespace) -> int:
    from lmcache_ascend.testing.engine_run import explain_plan

    extra = {}
    for item in args.engine_arg or []:
        if "=" not in item:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            extra[k] = json.loads(v)
        except json.JSONDecodeError:
            extra[k] = v
    plan = explain_plan(args.model, dtype=args.dtype, max_model_len=args.max_model_len, engine_kwargs=extra)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(plan["text"])
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lmcache-ascend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="cold vs warm shared-prefix serving on a local tiny model")
    d.add_argument("--model", help="path of your own model (default: build a tiny hybrid one)")
    d.add_argument("--arch", default="gemma3", choices=["llama", "gemma2", "gemma3"])
    d.add_argument("--prefix-tokens", type=int, default=2048)
    d.add_argument("--suffix-tokens", type=int, default=64)
    d.add_argument("--requests", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=8)
    d.add_argument("--dtype", default="float32")
    d.set_defaults(func=cmd_demo)
    e = sub.add_parser("explain", help="print the transfer plan for a model")
    e.add_argument("--model", required=True)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="extra vLLM engine argument (repeatable), e.g. block_size=64")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_explain)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
