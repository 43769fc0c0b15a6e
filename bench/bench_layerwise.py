# SPDX-License-Identifier: Apache-2.0
"""Layer-by-layer loads (``ascend_layerwise_load``) against loads before the
forward, on a real vLLM engine (CPU), in one run.

For each prompt length, on one engine per setting (the same model and
prompts; rounds alternate the two settings so drift in the machine's load
hits both alike):

  (c) warm from LMCache: vLLM's prefix cache reset, then a prompt the engine
      computed and stored before: the hit's chunks are copied into vLLM's
      KV cache, before the forward (off) or layer by layer beside it (on);
  (e) a prompt that hits vLLM's own prefix cache up to the same boundary:
      the same forward without any copy.

So (c) - (e) is what the copy adds to the hit's step. Printed per length:
the medians of (c) and (e) for each setting, (c) - (e), and the ratio
on / off of (c) - (e): below 1 the copy overlaps the forward. The first
token of every (c) must equal across settings and equal (e)'s engine-wide
reference, the same prompt's vLLM hit (d) (greedy; logprobs within 1e-4),
or the run fails. Each engine's layer-by-layer steps and stall seconds
(the connector's counters) are printed, so a setting that did not pipeline
cannot pass for one that did.

Reuses bench_e2e.py's model, prompts and engine runner (each engine runs
in a process of its own, bench_e2e.py --engine-run).

Usage:
  python bench/bench_layerwise.py [--lengths 4096,8192] [--rounds 2] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402
from e2e_logs import git_rev, machine, med, ttfts  # noqa: E402

SETTINGS = ("off", "on")
ENV = "LMCACHE_ASCEND_LAYERWISE_LOAD"


def completion(run, name: str) -> dict:
    for r in run.results:
        if r["name"] == name:
            return r["completions"][0]
    raise KeyError(name)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=["llama", "gemma3"])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--model-cache", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from lmcache_ascend.cli.tiny_models import build_tiny_model, default_cache_dir

    lengths = [int(x) for x in args.lengths.split(",")]
    spec = bench_e2e.model_specs()[args.model]
    path = str(build_tiny_model(spec, cache_dir=args.model_cache or default_cache_dir()))
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {msg}", flush=True)

    log(f"machine: {machine()}; code {git_rev()}; model {args.model} ({Path(path).name})")
    samples: dict[tuple[str, int, str], list[float]] = {}
    firsts: dict[tuple[int, int], dict[str, tuple]] = {}
    counters: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench_layerwise_") as tmp:
        work = Path(tmp)
        for rnd in range(args.rounds):
            reps = range(rnd * args.repeats, (rnd + 1) * args.repeats)
            order = SETTINGS if rnd % 2 == 0 else tuple(reversed(SETTINGS))
            for setting in order:
                sc = bench_e2e.scenario(path, spec, lengths, reps, connector=True)
                log(f"round {rnd + 1}/{args.rounds}: engine with ascend_layerwise_load={setting}, "
                    f"{len(sc.phases)} phases")
                run = bench_e2e.run_engine(sc, work, f"r{rnd}-{setting}", args.timeout, {ENV: setting})
                log(f"  done in {run.wall_s:.0f} s")
                t = ttfts(run)
                last = run.results[-1].get("counters", {})
                counters[setting].append({k: last.get(k, 0) for k in ("layerwise_loads", "layerwise_stall_seconds",
                                                                        "loaded_tokens", "load_errors")})
                for n in lengths:
                    for r in reps:
                        for kind, name in (("c", f"lmcache/{n}/{r}/0"), ("e", f"boundary/{n}/{r}/0"),
                                           ("d", f"vllm/{n}/{r}/0")):
                            samples.setdefault((setting, n, kind), []).append(t[name]["ttft"])
                        c, d = completion(run, f"lmcache/{n}/{r}/0"), completion(run, f"vllm/{n}/{r}/0")
                        if c["num_cached_tokens"] == 0:
                            raise RuntimeError(f"{setting}: no LMCache hit at {n} tokens")
                        firsts.setdefault((n, r), {})[setting] = (c["tokens"], c["logprobs"], d["tokens"])
    bad = []
    for (n, r), by in sorted(firsts.items()):
        ref = by["off"][2]
        for setting, (tokens, logprobs, vllm_tokens) in by.items():
            if tokens != ref or vllm_tokens != ref:
                bad.append(f"{n}/{r} {setting}: {tokens} vs vLLM hit {ref}")
        a, b = by["off"][1], by["on"][1]
        if any(abs(x - y) > 1e-4 for x, y in zip(a, b)):
            bad.append(f"{n}/{r}: logprobs {a} (off) vs {b} (on)")
    print()
    print(f"| prompt tokens | (c) off s | (e) off s | (c)-(e) off ms | (c) on s | (e) on s | (c)-(e) on ms | on/off of (c)-(e) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for n in lengths:
        m = {(s, k): med(samples[(s, n, k)]) for s in SETTINGS for k in "ce"}
        off, on = m[("off", "c")] - m[("off", "e")], m[("on", "c")] - m[("on", "e")]
        ratio = on / off if off > 0 else float("nan")
        rows.append({"length": n, **{f"{k}_{s}": m[(s, k)] for s in SETTINGS for k in "ce"}, "ratio": ratio})
        print(f"| {n} | {m[('off', 'c')]:.3f} | {m[('off', 'e')]:.3f} | {off * 1e3:.0f} | {m[('on', 'c')]:.3f} | "
              f"{m[('on', 'e')]:.3f} | {on * 1e3:.0f} | {ratio:.2f} |")
    print()
    for s in SETTINGS:
        print(f"{s}: connector counters at each engine's end: {counters[s]}")
    if any(c["layerwise_loads"] for c in counters["off"]) or not all(c["layerwise_loads"] for c in counters["on"]):
        bad.append(f"layer-by-layer steps: off {counters['off']}, on {counters['on']}")
    print("outputs: " + ("every (c) equals vLLM's own hit in both settings" if not bad else "MISMATCH"))
    for line in bad:
        print("  " + line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "counters": counters, "bad": bad}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
