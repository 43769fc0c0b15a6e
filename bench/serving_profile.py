# SPDX-License-Identifier: Apache-2.0
"""Where a bench_serving.py workload spends the server's CPU: py-spy samples
every process of the server (API server, engine core, worker) while the
workload runs, and this prints, per process, the active samples, the top
functions by self time and the connector's share (frames of
``lmcache_ascend`` and ``lmcache`` and vLLM's KV-connector glue, inclusive).

py-spy is not part of any stack; install it outside them:

  .venv/bin/python -m pip install --no-deps --target build/bench-prof py-spy

Usage (the workload options are bench_serving.py's):

  python bench/serving_profile.py --config llama:fit:ascend --config llama:fit:none
  python bench/serving_profile.py --quick --config llama:fit:ascend --rate 200
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import bench_serving as bs

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


def main(argv: list[str]) -> int:
    ap = bs.build_parser()
    ap.add_argument("--config", action="append", default=[],
                    help="MODEL:KV:CONNECTOR to profile, e.g. llama:fit:ascend (repeatable)")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not args.config:
        ap.error("give at least one --config MODEL:KV:CONNECTOR")
    wl, specs, _, _, _ = bs.prepare(args, ap)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="serving_profile_"))
    workdir.mkdir(parents=True, exist_ok=True)
    from lmcache_ascend.cli.tiny_models import build_tiny_model

    for cfg in args.config:
        try:
            model, kv, conn = cfg.split(":")
        except ValueError:
            ap.error(f"--config {cfg!r}: expected MODEL:KV:CONNECTOR")
        path = str(build_tiny_model(specs[model], cache_dir=args.model_cache))
        raw = workdir / f"{model}-{kv}-{conn}.pyspy.txt"
        run = bs.run_one(model, path, specs[model], kv, conn, wl, args, workdir, bs.log,
                         around=lambda server: recording(server, raw, args.rate))
        f = run["figures"]
        print(f"\n# {cfg}: TTFT mean {f['ttft_mean_s']:.3f} s, ITL mean {f['itl_mean_ms']:.1f} ms, "
              f"{f['output_tok_s']:.2f} output tok/s, {f['requests']} requests, wall "
              f"{f['wall_s']:.0f} s, LMCache hit {f['lmcache_hit_tokens']:.0f} tokens; "
              f"samples in {raw}")
        summarize(raw, args.rate, f["requests"], args.top)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
