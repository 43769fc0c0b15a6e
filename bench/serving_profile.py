# SPDX-License-Identifier: Apache-2.0
"""Where a bench_serving.py workload spends the server's CPU: py-spy samples
every process of the server (API server, engine core, worker) while the
workload runs, and this prints, per process, the active samples, the top
functions by self time and the connector's share (frames of
``lmcache_ascend`` and ``lmcache`` and vLLM's KV-connector glue, inclusive).

py-spy is not part of any stack; install it outside them:

  .venv/bin/python -m pip install --no-deps --target build/bench-prof py-spy

With ``--steps`` it does not sample: it times every model-runner step, every
scheduler call and every connector hook in the server's processes instead
(``bench/step_trace/sitecustomize.py``), and prints them side by side for the
configurations, vLLM alone included: where a configuration's wall time goes,
and how much of it is the connector's own code.

Usage (the workload options are bench_serving.py's):

  python bench/serving_profile.py --config llama:fit:ascend --config llama:fit:none
  python bench/serving_profile.py --quick --config llama:fit:ascend --rate 200
  python bench/serving_profile.py --steps --config llama:fit:none --config llama:fit:ascend
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import bench_serving as bs
from serving_client import pythonpath_with

ROOT = Path(__file__).resolve().parents[1]
PROC_RE = re.compile(r'^process (\d+):"(.*?)"$')
# Frames counted as connector work (inclusive of what they call).
CONNECTOR_FRAMES = ("lmcache_ascend/", "/lmcache/", "kv_connector/")


def pyspy_binary() -> str:
    for cand in (ROOT / "build" / "bench-prof" / "bin" / "py-spy", shutil.which("py-spy")):
        if cand and Path(cand).exists():
            return str(cand)
    raise SystemExit("py-spy not found; install it outside the stacks with:\n"
                     "  .venv/bin/python -m pip install --no-deps --target build/bench-prof py-spy")


@contextlib.contextmanager
def recording(server, out: Path, rate: int):
    proc = subprocess.Popen(
        [pyspy_binary(), "record", "--pid", str(server.proc.pid), "--subprocesses",
         "--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def role(cmdline: str, frames: list[str]) -> str:
    text = cmdline + " " + " ".join(frames[:8])
    for key, name in (("run_engine_core", "engine core"), ("worker_main", "worker"),
                      ("WorkerProc", "worker"), ("api_server", "API server")):
        if key in text:
            return name
    return "other"


def summarize(raw: Path, rate: int, requests: int, top: int) -> None:
    per_proc: dict[str, Counter] = defaultdict(Counter)
    self_t: dict[str, Counter] = defaultdict(Counter)
    conn: dict[str, Counter] = defaultdict(Counter)
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        m = PROC_RE.match(frames[0])
        who = role(m.group(2) if m else "", frames[1:]) if m else "other"
        body = frames[1:] if m else frames
        count = int(n)
        per_proc[who]["samples"] += count
        if body:
            self_t[who][body[-1]] += count
        outer = next((f for f in body if any(k in f for k in CONNECTOR_FRAMES)), None)
        if outer is not None:
            conn[who][outer] += count
    ms = 1e3 / rate / max(1, requests)
    for who in sorted(per_proc, key=lambda w: -per_proc[w]["samples"]):
        total = per_proc[who]["samples"]
        c_total = sum(conn[who].values())
        print(f"\n## {who}: {total * ms:.1f} ms active per request; connector frames "
              f"{c_total * ms:.1f} ms ({100 * c_total / max(1, total):.1f}%)\n")
        print("| ms/request | self time, function |")
        print("|---|---|")
        for f, n in self_t[who].most_common(top):
            print(f"| {n * ms:.2f} | `{f[-110:]}` |")
        if conn[who]:
            print("\n| ms/request | outermost connector frame (inclusive) |")
            print("|---|---|")
            for f, n in conn[who].most_common(top):
                print(f"| {n * ms:.2f} | `{f[-110:]}` |")


STEP_TRACE = Path(__file__).resolve().parent / "step_trace"


@contextlib.contextmanager
def step_tracing(out: Path):
    """Servers started inside trace their steps into ``out`` (the server
    copies this process's environment when it starts)."""
    out.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("LMCA_STEP_TRACE_DIR", "PYTHONPATH")}
    os.environ["LMCA_STEP_TRACE_DIR"] = str(out)
    os.environ["PYTHONPATH"] = pythonpath_with(STEP_TRACE, os.environ)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def window(span: list[float]):
    """The workload's start and end on the clock the tracer uses (monotonic,
    shared by the server's processes)."""
    span.append(time.perf_counter())
    try:
        yield
    finally:
        span.append(time.perf_counter())


def step_figures(trace_dir: Path, start: float, end: float) -> dict[str, float]:
    """Seconds per kind of call inside [start, end], from the tracer's files."""
    recs = [json.loads(line) for f in sorted(trace_dir.glob("steps-*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if start <= r["t"] <= end]
    steps = [r for r in recs if r["f"] == "GPUModelRunner.execute_model" and "tokens" in r]
    decode = [r["d"] for r in steps if r["tokens"] == r["reqs"]]  # one token per request
    mixed = [r for r in steps if r["tokens"] != r["reqs"]]
    out = {"wall_s": end - start, "steps": len(steps),
           "step_s": sum(r["d"] for r in steps),
           "decode_steps": len(decode),
           "decode_step_ms": 1e3 * sum(decode) / max(1, len(decode)),
           "prefill_steps": len(mixed),
           "prefill_ms_per_token": 1e3 * sum(r["d"] for r in mixed)
           / max(1, sum(r["tokens"] for r in mixed))}
    calls: Counter = Counter()
    for r in recs:
        calls[r["f"]] += r["d"]
    calls.pop("GPUModelRunner.execute_model", None)
    for name in ("Scheduler.schedule", "Scheduler.update_from_output",
                 "GPUModelRunner.sample_tokens"):
        out[name.split(".")[1] + "_s"] = calls.pop(name, 0.0)
    out["connector_s"] = sum(calls.values())  # what is left: the connector's hooks
    out.update({f"{k.split('.')[1]}_s": v for k, v in sorted(calls.items())})
    return out


def print_steps(table: dict[str, dict[str, float]]) -> None:
    """One column per traced server; units are in the row names."""
    rows = list(dict.fromkeys(k for f in table.values() for k in f))
    print("\n| figure | " + " | ".join(table) + " |")
    print("|---|" + "---|" * len(table))
    for k in rows:
        cells = [f.get(k) for f in table.values()]
        print(f"| {k} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in cells) + " |")
    for cfg, f in table.items():
        if f["connector_s"]:
            print(f"\n{cfg}: the connector's hooks took {1e3 * f['connector_s']:.0f} ms, "
                  f"{100 * f['connector_s'] / f['wall_s']:.2f}% of the workload's "
                  f"{f['wall_s']:.1f} s ({1e3 * f['connector_s'] / max(1, f['steps']):.3f} ms "
                  "per step)")


def main(argv: list[str]) -> int:
    ap = bs.build_parser()
    ap.add_argument("--config", action="append", default=[],
                    help="MODEL:KV:CONNECTOR to profile, e.g. llama:fit:ascend (repeatable)")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", action="store_true",
                    help="time steps, scheduler calls and connector hooks instead of sampling")
    args = ap.parse_args(argv)
    if not args.config:
        ap.error("give at least one --config MODEL:KV:CONNECTOR")
    wl, specs, _, _, _ = bs.prepare(args, ap)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="serving_profile_"))
    workdir.mkdir(parents=True, exist_ok=True)
    from lmcache_ascend.cli.tiny_models import build_tiny_model

    table: dict[str, dict[str, float]] = {}
    for i, cfg in enumerate(args.config):
        try:
            model, kv, conn = cfg.split(":")
        except ValueError:
            ap.error(f"--config {cfg!r}: expected MODEL:KV:CONNECTOR")
        path = str(build_tiny_model(specs[model], cache_dir=args.model_cache))
        if args.steps:
            trace, span = workdir / f"steps-{i}-{model}-{kv}-{conn}", []
            with step_tracing(trace):
                run = bs.run_one(model, path, specs[model], kv, conn, wl, args, workdir, bs.log,
                                 around=lambda server: window(span))
            table[f"{cfg} ({i + 1})"] = step_figures(trace, *span)
            f = run["figures"]
            print(f"# {cfg}: TTFT mean {f['ttft_mean_s']:.3f} s, {f['output_tok_s']:.2f} "
                  f"output tok/s, wall {f['wall_s']:.1f} s; trace in {trace}")
            continue
        raw = workdir / f"{model}-{kv}-{conn}.pyspy.txt"
        run = bs.run_one(model, path, specs[model], kv, conn, wl, args, workdir, bs.log,
                         around=lambda server: recording(server, raw, args.rate))
        f = run["figures"]
        print(f"\n# {cfg}: TTFT mean {f['ttft_mean_s']:.3f} s, ITL mean {f['itl_mean_ms']:.1f} ms, "
              f"{f['output_tok_s']:.2f} output tok/s, {f['requests']} requests, wall "
              f"{f['wall_s']:.0f} s, LMCache hit {f['lmcache_hit_tokens']:.0f} tokens; "
              f"samples in {raw}")
        summarize(raw, args.rate, f["requests"], args.top)
    if table:
        print_steps(table)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
