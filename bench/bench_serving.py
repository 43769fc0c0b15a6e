# SPDX-License-Identifier: Apache-2.0
"""Serving under KV-cache pressure: a multi-round conversation benchmark on
vLLM's OpenAI-compatible server (CPU), with and without the connector.

N simulated users share a long system prompt; each has its own history and a
conversation that grows round after round: the prompt of round r+1 is the
prompt of round r, the token ids the server generated for it (greedy,
``ignore_eos``, exactly ``--answer`` tokens) and a new question. Users take
turns through a FIFO with ``--concurrency`` requests in flight, so between
two rounds of one user every other user's round runs. Prompts are token ids
(the tiny models' WordLevel vocabulary), sent to ``/v1/completions`` with
streaming: TTFT and inter-token latency are measured by the client.

For each model and KV setting, one server per configuration, one after the
other, the same workload:

  none     vLLM alone (its own prefix cache only)
  ascend   LMCacheAscendConnectorV1Dynamic (every KV cache group)
  lmcache  vLLM's LMCacheConnectorV1 through our adapter route
           (single-group models only: it reads one group, vLLM turns HMA off)
  noop     a connector that does nothing (bench/noop_connector.py): the
           cost of vLLM's connector plumbing alone, a control

``--repeats N`` starts N servers of each configuration in ABBA order and
compares the means over them: one pair of servers differs by up to 10 % on
this kind of machine, more than the 3 % the "fit" goal allows.

KV settings: ``pressure`` gives vLLM ``--num-gpu-blocks-override`` blocks,
enough for the requests in flight but far less than the working set (every
user's conversation), so vLLM's prefix cache evicts a user's history before
its next round while LMCache's CPU cache keeps it; ``fit`` gives vLLM the
whole ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB), which holds the working set.
``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB and 1 GiB already holds far more
than a workload that finishes in minutes on 2 cores, hence the block
override. Every server gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM-CPU
otherwise reserves one more core when a connector is configured) and LMCache
chunk ``--chunk-size`` (128 = vLLM-CPU's block; also for the adapter route,
whose own default would be LMCache's 256).

Reported per configuration: mean / p50 / p90 TTFT, mean / p90 ITL, output
tokens/s and requests/s over the workload's wall time, vLLM's prefix-cache
hit rate (``vllm:prefix_cache_hits / queries``) and the tokens the connector
served (``vllm:external_prefix_cache_hits``) from ``/metrics`` (deltas over
the workload), preemptions; per-round mean TTFT; ratios to vLLM alone and
the goals; output equality of every request against vLLM alone with the
same KV setting (greedy: tokens exactly, logprobs within ``--logprob-tol``).
Figures are printed, never asserted; ``--check`` exits non-zero on
correctness failures only (unequal outputs, no hits under pressure, no
pressure, missing figures).

Usage:
  python bench/bench_serving.py --json serving.json --plot docs/img/serving_ttft.png
  python bench/bench_serving.py --quick --check        # tiny models, a few minutes
  python bench/bench_serving.py --report serving.json [--plot PNG]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from e2e_logs import git_rev, machine  # noqa: E402 (bench/ is on sys.path)
from serving_client import Server, ServerSpec, Workload, complete, run_workload, settled_metrics
from serving_report import (CONNECTOR_NAMES, METRICS, check, compare, figures, lookup, plot,
                            print_report, ratios)

BLOCK = 128  # vLLM-CPU's KV block size in tokens
START_TIMEOUT_S = 420


def model_specs(quick: bool) -> dict[str, Any]:
    """The bench_e2e models (12 layers, hidden 768: seconds per 4k-token
    prefill on 2 cores) or, with --quick, the tests' tiny ones."""
    from lmcache_ascend.cli.tiny_models import SPECS

    if quick:
        return {"llama": SPECS["llama"], "gemma3": SPECS["gemma3"]}
    from bench_e2e import model_specs as e2e_specs

    return e2e_specs()


def kv_groups(spec: Any, hma: bool = True) -> tuple[int, int]:
    """(full, sliding) KV cache groups of vLLM's hybrid manager: Gemma-3's
    5:1 sliding/full layers give one full and five sliding groups; Llama one
    full group; with the manager off (the adapter route) one group."""
    return (1, 5) if spec.arch == "gemma3" and hma else (1, 0)


def pressure_blocks(wl: Workload, spec: Any, groups: tuple[int, int], max_model_len: int) -> int:
    """Blocks for the requests in flight, not for the working set.

    Full groups: the shared system prompt once plus ``concurrency``
    conversations at their longest (two blocks of slack each). Sliding
    groups keep a window per request (two blocks of slack) after its
    prefill, but while one is prefilled they hold the window plus the step's
    tokens (vLLM's own bound: window - 1 + max_num_batched_tokens, 2048 for
    the CPU API server, at most the model length), which vLLM also demands at
    startup for one request. Plus vLLM's null block."""
    full, sliding = groups
    blk = lambda n: -(-n // BLOCK)  # noqa: E731
    per_user = blk(wl.max_context() - wl.system_tokens) + 2
    window = getattr(spec, "sliding_window", 0) or 0
    running = (full * (blk(wl.system_tokens) + wl.concurrency * per_user)
               + sliding * wl.concurrency * (blk(window) + 2))
    one_request = (full * (blk(max_model_len) + 1)
                   + sliding * (blk(min(window - 1 + 2048, max_model_len)) + 1))
    return max(running, one_request) + 1


def code_label() -> str:
    import lmcache_ascend

    pkg = Path(lmcache_ascend.__file__).resolve().parent
    code = git_rev()
    if pkg.parent != Path(__file__).resolve().parents[1]:
        code += f"; lmcache_ascend imported from {pkg}"
    return code


def record_dict(rec: Any) -> dict:
    r = rec.reply
    return {"user": rec.user, "round": rec.round, "prompt_tokens": rec.prompt_tokens,
            "start_s": rec.start, "ttft": r.ttft, "e2e_s": r.e2e, "itls": r.itls,
            "output_tokens": len(r.tokens), "cached_tokens": r.cached_tokens,
            "tokens": r.tokens, "logprobs": r.logprobs}


def warm_up(port: int, path: str, wl: Workload, timeout: float) -> None:
    """First-request costs, outside the figures: ``wl.concurrency`` requests
    at once, each as long as a round-1 prompt, on tokens no user sends.
    With a single 144-token warm-up, round 1's first two requests (the same
    cold work in every configuration) took 2.6-4.2 s from one server to the
    next; with this one, 2.4-2.9 s (docs/benchmarks.md)."""
    n = wl.system_tokens + wl.history_tokens + wl.question_tokens
    prompts = [Workload(1, 1, 1, 0, n, 0, 2, seed=wl.seed + 99 + i).history(0)
               for i in range(wl.concurrency)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: complete(port, path, p, 2, timeout), prompts))


def run_one(model_name: str, path: str, spec: Any, kv: str, connector: str, wl: Workload,
            args: argparse.Namespace, workdir: Path, log, around=None, repeat: int = 0) -> dict:
    """One server, warm-up, the workload. ``around(server)``, when given, is a
    context manager entered for the workload alone (the profiler's hook)."""
    suffix = f" #{repeat + 1}" if repeat else ""
    label = f"[{model_name} {kv} {connector}{suffix}]"
    groups = kv_groups(spec, hma=connector != "lmcache")
    max_len = -(-wl.max_context() // BLOCK) * BLOCK
    blocks = None
    if kv == "pressure":
        blocks = args.pressure_blocks or pressure_blocks(wl, spec, groups, max_len)
    sspec = ServerSpec(model=path, connector=connector, max_model_len=max_len,
                       num_blocks=blocks, lmcache_cpu_gb=args.lmcache_gb,
                       chunk_size=args.chunk_size)
    stem = f"{model_name}-{kv}-{connector}" + (f"-{repeat + 1}" if repeat else "")
    server = Server(sspec, workdir / f"{stem}.log")
    try:
        server.wait_ready(START_TIMEOUT_S, log, label)
        log(f"{label} ready in {server.ready_s:.0f} s; vLLM KV cache {server.kv_tokens()} tokens"
            + (f" ({blocks} blocks override)" if blocks else "")
            + f"; working set {wl.working_set()} tokens")
        warm_up(server.port, path, wl, args.request_timeout)
        before = settled_metrics(server.port, METRICS, wait_s=6)
        with around(server) if around else contextlib.nullcontext():
            res = run_workload(server.port, path, wl, args.time_limit, args.request_timeout,
                               log, label)
        after = settled_metrics(server.port, METRICS)
    finally:
        server.stop()
    recs = [record_dict(r) for r in res.records]
    return {"model": model_name, "kv": kv, "connector": connector, "repeat": repeat,
            "num_blocks": blocks,
            "kv_tokens": server.kv_tokens(), "max_model_len": max_len,
            "server_ready_s": server.ready_s, "truncated": res.truncated,
            "figures": figures(recs, res.wall_s, before, after), "records": recs}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,gemma3")
    ap.add_argument("--kv", default="pressure,fit", help="KV settings: pressure, fit")
    ap.add_argument("--connectors", default="none,ascend,lmcache",
                    help="none (required: the reference), ascend, lmcache (single-group models); "
                         "run in this order within each model and KV setting")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument("--repeats", type=int, default=1,
                    help="servers per configuration: the --connectors list runs this many "
                         "times per model and KV setting, reversed every other time (ABBA), "
                         "and ratios compare the means over the servers")
    ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--history", type=int, default=1536, help="per-user history tokens (round 1)")
    ap.add_argument("--question", type=int, default=64, help="new tokens per round")
    ap.add_argument("--answer", type=int, default=32, help="generated tokens per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="the tests' tiny models and a small workload (checks, not figures)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a correctness failure (never on timings)")
    ap.add_argument("--chunk-size", type=int, default=BLOCK, help="LMCache chunk, every route")
    ap.add_argument("--lmcache-gb", type=float, default=2.0, help="LMCache local CPU cache size")
    ap.add_argument("--pressure-blocks", type=int, default=None,
                    help="vLLM KV blocks under pressure (default: sized for the requests in flight)")
    ap.add_argument("--logprob-tol", type=float, default=1e-3)
    ap.add_argument("--time-limit", type=float, default=600,
                    help="seconds per workload; no request is sent after it")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=3600,
                    help="seconds for the whole run; later configurations are skipped")
    ap.add_argument("--code-label", default=None,
                    help="describe the code measured (default: git HEAD of this checkout and "
                         "where lmcache_ascend is imported from)")
    ap.add_argument("--model-cache", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the server logs here")
    ap.add_argument("--json", type=Path, default=None, help="write figures as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT per round")
    ap.add_argument("--report", type=Path, default=None, help="re-print a --json run (no servers)")
    return ap


def prepare(args: argparse.Namespace, ap: argparse.ArgumentParser):
    """Applies --quick, validates; returns (workload, specs, models, KV settings, connectors)."""
    if args.quick:
        args.system, args.history, args.question, args.answer = 256, 384, 32, 8
        args.users, args.rounds = min(args.users, 6), min(args.rounds, 3)
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    conns = [c.strip() for c in args.connectors.split(",") if c.strip()]
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    specs = model_specs(args.quick)
    for k in kvs:
        if k not in ("pressure", "fit"):
            ap.error(f"unknown KV setting {k!r}; valid: pressure, fit")
    for c in conns:
        if c not in CONNECTOR_NAMES:
            ap.error(f"unknown connector {c!r}; valid: {', '.join(CONNECTOR_NAMES)}")
    if "none" not in conns:
        ap.error("--connectors must include none: it is the reference for ratios and outputs")
    for n in names:
        if n not in specs:
            ap.error(f"unknown model {n!r}; valid: {sorted(specs)}")
    if args.chunk_size % BLOCK:
        ap.error(f"--chunk-size must be a multiple of vLLM-CPU's block ({BLOCK})")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: need at least 1")
    if len(set(conns)) != len(conns):
        ap.error(f"--connectors {args.connectors!r} names a configuration twice; "
                 "use --repeats for several servers of each")
    if args.concurrency < 1 or args.users < args.concurrency or args.rounds < 1:
        ap.error("need rounds >= 1 and users >= concurrency >= 1")
    wl = Workload(args.users, args.rounds, args.concurrency, args.system, args.history,
                  args.question, args.answer, args.seed)
    if args.model_cache is None:
        from lmcache_ascend.cli.tiny_models import default_cache_dir

        args.model_cache = default_cache_dir() / ("" if args.quick else "bench-e2e")
    return wl, specs, names, kvs, conns


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report is not None:
        data = json.loads(args.report.read_text())
        print_report(data)
        if args.plot:
            plot(data, args.plot, log)
        return 0
    wl, specs, names, kvs, conns = prepare(args, ap)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_serving_")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    code = args.code_label or code_label()
    mach = machine()
    log(f"machine: {mach}; code: {code}; workload {asdict(wl)}; working set "
        f"{wl.working_set()} tokens, last prompt + answer {wl.max_context()} tokens")
    t_start = time.time()
    runs: list[dict] = []
    equality: list[dict] = []
    skipped: list[str] = []
    failed: list[str] = []
    from lmcache_ascend.cli.tiny_models import build_tiny_model

    def snapshot() -> dict:
        """The run so far, JSON-ready (written after every configuration)."""
        return {"machine": mach, "code": code, "workload": asdict(wl),
                "max_context": wl.max_context(), "working_set_tokens": wl.working_set(),
                "chunk_size": args.chunk_size, "lmcache_gb": args.lmcache_gb,
                "repeats": args.repeats,
                "logprob_tol": args.logprob_tol, "quick": args.quick,
                "models": {n: asdict(specs[n]) for n in names}, "runs": [slim(r) for r in runs],
                "ratios": ratios(runs), "equality": equality, "skipped": skipped,
                "failed": failed, "total_s": time.time() - t_start}

    for name in names:
        path = str(build_tiny_model(specs[name], cache_dir=args.model_cache))
        for kv in kvs:
            # ABBA order over repeats: slow drift and the position after another
            # server cost every configuration alike.
            order = [(rep, c) for rep in range(args.repeats)
                     for c in (conns if rep % 2 == 0 else conns[::-1])]
            for rep, conn in order:
                tag = f"{name} {kv} {conn}" + (f" #{rep + 1}" if rep else "")
                if conn == "lmcache" and sum(kv_groups(specs[name])) > 1:
                    log(f"[{tag}] skipped: the adapter route serves single-group models here")
                    continue
                if time.time() - t_start > args.deadline:
                    skipped.append(tag)
                    log(f"[{tag}] skipped: --deadline {args.deadline:.0f} s reached")
                    continue
                try:
                    run = run_one(name, path, specs[name], kv, conn, wl, args, workdir, log,
                                  repeat=rep)
                except (RuntimeError, OSError, TimeoutError) as e:
                    failed.append(f"{tag}: {str(e).splitlines()[0]}")
                    log(f"[{tag}] FAILED: {e}")
                    continue
                runs.append(run)
                f = run["figures"]
                log(f"[{tag}] TTFT mean {f['ttft_mean_s']:.3f} s, {f['output_tok_s']:.2f} "
                    f"output tok/s, vLLM hit rate {f['vllm_prefix_hit_rate']:.3f}, LMCache hit "
                    f"{f['lmcache_hit_tokens']:.0f} tokens ({time.time() - t_start:.0f} s so far)")
                if args.json:
                    args.json.write_text(json.dumps(snapshot(), indent=1, default=str))
        for r in runs:  # any order of --connectors: compared once the model is done
            ref = lookup(runs, name, r["kv"], "none")
            if r["model"] == name and r is not ref and ref is not None:
                equality.append({"model": name, "kv": r["kv"], "connector": r["connector"],
                                 "repeat": r.get("repeat", 0),
                                 "result": compare(r["records"], ref["records"], args.logprob_tol)})
        p, f = lookup(runs, name, "pressure", "none"), lookup(runs, name, "fit", "none")
        if p and f:  # vLLM alone: eviction must not change outputs either
            equality.append({"model": name, "kv": "pressure vs fit", "connector": "none",
                             "result": compare(p["records"], f["records"], args.logprob_tol)})
    data = snapshot()
    print()
    print_report(data)
    print(f"\ntotal {data['total_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
        log(f"figures written to {args.json}")
    if args.plot and data["runs"]:
        plot(data, args.plot, log)
    if tmp is not None:
        tmp.cleanup()
    if args.check:
        bad = check(data) + [f"failed: {x}" for x in failed]
        for b in bad:
            print(f"CHECK FAILED: {b}")
        if bad:
            return 1
        print("checks passed: every request equal to vLLM alone, connector hits under pressure, "
              "vLLM alone evicts under pressure, every figure present")
    return 1 if failed else 0


def slim(run: dict) -> dict:
    """A run without token ids, logprobs and per-token gaps (JSON stays small)."""
    out = dict(run)
    out["records"] = []
    for rec in run["records"]:
        r = {k: v for k, v in rec.items() if k not in ("tokens", "logprobs", "itls")}
        r["itl_mean_s"] = sum(rec["itls"]) / len(rec["itls"]) if rec["itls"] else math.nan
        out["records"].append(r)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
