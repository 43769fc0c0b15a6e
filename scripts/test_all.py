#!/usr/bin/env python3
"""`make test`'s schedule: the primary stack's whole suite and every
compatibility stack's selection, with the machine's cores kept busy.

An engine test keeps a 2-core machine about half busy (process start-up,
model building and shutdown are mostly one thread): measured on vllm-0.26's
compat engine tests alone, 56% of two cores. So the compatibility stacks do
not wait for the primary suite: each one is installed and built in the
background (one at a time: downloads and unpacking), then tested beside the
primary suite, ``--beside`` stacks at a time while it runs and ``--jobs``
once it has ended. While the primary suite runs, a second stack joins the
first when every stack is prepared and the cores were less than
``--idle-below`` busy over the last ``--idle-window-s`` (the primary suite
and one stack left 12-22% of two cores idle for 15 minutes of a run; two
stacks beside it at all times overloaded the machine). Stacks are tested
longest first (``--order``; the Makefile's ``COMPAT_RUN_ORDER``), so what
runs after the primary suite, where the cores idle most, is the shortest.
Each stack writes its own log,
``build/stacks/<stack>.test.log``, printed when everything has ended; the
primary suite prints to the terminal as it runs.

Every stack runs even when another failed; the exit status says whether all
passed, and the last lines name those that did not.

Usage (the Makefile passes its variables):
  test_all.py --primary vllm-0.32 --compat vllm-0.26 vllm-0.30 ... \
      [--order vllm-0.26 ...] [--beside 1] [--beside-max 2] [--jobs 3] \
      [--idle-below 0.85] [--idle-window-s 120] [--goal-min 45] [--start EPOCH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "stacks"
POLL_S = 2.0


def minutes(since: float) -> str:
    return f"{(time.time() - since) / 60:.1f} min"


def say(msg: str) -> None:
    print(f"[test] {msg}", flush=True)


def cpu_jiffies() -> Optional[tuple[int, int]]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (None
    where there is none): their difference over the run says how busy the
    machine kept its cores, i.e. whether less work or a better order would
    shorten it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class _RecentBusy:
    """How busy the cores were over the last ``window_s``: the admission
    test for one more stack beside the primary suite."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: list[tuple[float, tuple[int, int]]] = []

    def sample(self) -> Optional[float]:
        """Record now; the busy fraction since the sample ``window_s`` ago
        (None until the window is full, or where /proc/stat is missing)."""
        now, jiffies = time.time(), cpu_jiffies()
        if jiffies is None:
            return None
        self.samples.append((now, jiffies))
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.window_s:
            self.samples.pop(0)
        t0, old = self.samples[0]
        if now - t0 < self.window_s or jiffies[1] <= old[1]:
            return None
        return (jiffies[0] - old[0]) / (jiffies[1] - old[1])


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    log: Optional[object] = None

    def done(self) -> Optional[int]:
        rc = self.proc.poll()
        if rc is not None and self.log is not None:
            self.log.close()
            self.log = None
        return rc


class _BusyWindows:
    """How busy the cores were in each WINDOW_S of the run, and what ran:
    where the machine idles is where a better schedule can gain, and where
    it is saturated only less work can (printed at the end)."""

    WINDOW_S = 300.0

    def __init__(self, jiffies: Optional[tuple[int, int]], start: float) -> None:
        self.last, self.start, self.t0 = jiffies, start, time.time()
        self.ran: set[str] = set()
        self.rows: list[str] = []

    def sample(self, primary_running: bool, stacks: list[str], preparing: Optional[str],
               last: bool = False) -> None:
        self.ran.update((["primary"] if primary_running else []) + stacks
                        + ([f"preparing {preparing}"] if preparing else []))
        if self.last is None or time.time() - self.t0 < (10.0 if last else self.WINDOW_S):
            return
        now = cpu_jiffies()
        if now is not None and now[1] > self.last[1]:
            busy = (now[0] - self.last[0]) / (now[1] - self.last[1])
            self.rows.append(f"{(self.t0 - self.start) / 60:4.1f}-{(time.time() - self.start) / 60:4.1f} min "
                             f"{busy:4.0%}: {', '.join(sorted(self.ran))}")
        self.last, self.t0, self.ran = now, time.time(), set()

    def report(self) -> None:
        self.sample(False, [], None, last=True)  # the tail: the last, shorter window
        if self.rows:
            say("cores busy per window (and what ran in it):")
            for row in self.rows:
                print(f"    {row}")


def make(*args: str) -> list[str]:
    return [os.environ.get("MAKE", "make"), "--no-print-directory", *args]


def run(opts: argparse.Namespace) -> int:
    logs = Path(opts.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    start = opts.start or time.time()
    say(f"setup (system deps, primary stack, build): {minutes(start)}")

    # Installs and builds, one stack after the other, in the background.
    prepare_log = open(logs / "prepare.log", "w")
    prepared: list[str] = []
    prepare_failed: list[str] = []
    preparing: Optional[Job] = None
    order = list(opts.order or opts.compat)
    if sorted(order) != sorted(opts.compat):
        raise SystemExit(f"--order {order} must name each of --compat {opts.compat} once")
    to_prepare = list(order)  # prepared in the order they are tested

    def next_prepare() -> Optional[Job]:
        if not to_prepare:
            return None
        name = to_prepare.pop(0)
        prepare_log.write(f"[test] preparing stack {name}\n")
        prepare_log.flush()
        return Job(name, subprocess.Popen(
            make("prepare-stack", f"STACK={name}", "CMAKE_BUILD_PARALLEL_LEVEL=1"),
            stdout=prepare_log, stderr=subprocess.STDOUT, cwd=ROOT))

    preparing = next_prepare()
    cpu_start = cpu_jiffies()
    primary = Job(opts.primary, subprocess.Popen(make("test-primary"), cwd=ROOT))
    primary_rc: Optional[int] = None
    queue = list(order)  # tested in this order, once prepared
    recent = _RecentBusy(opts.idle_window_s)
    last_start = 0.0
    running: list[Job] = []
    results: dict[str, str] = {}
    finished_at: dict[str, str] = {}

    windows = _BusyWindows(cpu_start, start)
    while True:
        windows.sample(primary_rc is None, [j.name for j in running], preparing and preparing.name)
        busy = recent.sample()
        if preparing is not None and (rc := preparing.done()) is not None:
            (prepared if rc == 0 else prepare_failed).append(preparing.name)
            prepare_log.write(f"[test] prepared stack {preparing.name} in {minutes(preparing.started)}"
                              f"{'' if rc == 0 else f' - FAILED (exit {rc})'}\n")
            prepare_log.flush()
            preparing = next_prepare()
        if primary_rc is None and (rc := primary.done()) is not None:
            primary_rc = rc
            results[opts.primary] = "passed" if rc == 0 else f"FAILED (exit {rc})"
            say(f"stack {opts.primary}: {minutes(primary.started)} "
                f"({len(running)} compatibility stack(s) still running beside it)")
        for job in list(running):
            if (rc := job.done()) is not None:
                running.remove(job)
                results[job.name] = "passed" if rc == 0 else f"FAILED (exit {rc})"
                finished_at[job.name] = minutes(start)
        while queue and queue[0] in prepare_failed:
            name = queue.pop(0)
            results[name] = "FAILED (its install or build failed: build/stacks/prepare.log)"
        limit = opts.beside if primary_rc is None else opts.jobs
        why = ""
        if (primary_rc is None and len(running) == limit and limit < opts.beside_max and preparing is None
                and busy is not None and busy < opts.idle_below
                and time.time() - last_start >= opts.idle_window_s):
            limit += 1  # the cores idled: one more beside the primary suite
            why = f" (cores {busy:.0%} busy over the last {opts.idle_window_s:.0f} s)"
        while queue and queue[0] in prepared and len(running) < limit:
            name = queue.pop(0)
            log = open(logs / f"{name}.test.log", "w")
            say(f"stack {name}: tests start at {minutes(start)}{why}")
            last_start = time.time()
            running.append(Job(name, subprocess.Popen(
                make("test-stack", f"STACK={name}"), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
                log=log))
        if primary_rc is not None and not running and not queue and preparing is None:
            break
        time.sleep(opts.poll_s)
    prepare_log.close()

    for name in opts.compat:
        log = logs / f"{name}.test.log"
        shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
        say(f"---- stack {name} ({shown}) ----")
        if log.exists():
            sys.stdout.write(log.read_text(errors="replace"))
    if prepare_failed:
        say("preparing a compatibility stack failed; the end of build/stacks/prepare.log:")
        sys.stdout.write("".join((logs / "prepare.log").read_text(errors="replace").splitlines(True)[-40:]))
    for name in [opts.primary, *opts.compat]:
        at = f", ended at {finished_at[name]}" if name in finished_at else ""
        say(f"{name}: {results.get(name, 'not run')}{at}")
    total_s = time.time() - start
    cpu_end = cpu_jiffies()
    if cpu_start is not None and cpu_end is not None and cpu_end[1] > cpu_start[1]:
        cores = os.cpu_count() or 1
        busy = (cpu_end[0] - cpu_start[0]) / (cpu_end[1] - cpu_start[1])
        say(f"cores busy while testing: {busy * cores:.2f} of {cores} on average ({busy:.0%})")
        windows.report()
    say(f"total wall time {total_s / 60:.1f} min (setup included); goal {opts.goal_min} min")
    if total_s > opts.goal_min * 60:
        say(f"WARNING: over the {opts.goal_min}-minute goal (a warning, not a failure)")
    failed = [n for n in [opts.primary, *opts.compat] if results.get(n) != "passed"]
    if failed:
        say("FAILED on: " + " ".join(failed))
        return 1
    say("passed on " + " ".join([opts.primary, *opts.compat]))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--primary", required=True)
    p.add_argument("--compat", nargs="*", default=[])
    p.add_argument("--order", nargs="*", default=None,
                   help="the order the compatibility stacks are prepared and tested in (default: --compat's)")
    p.add_argument("--beside", type=int, default=1,
                   help="compatibility stacks tested at once while the primary suite runs")
    p.add_argument("--beside-max", type=int, default=2,
                   help="at most this many beside it when the cores idle (--idle-below)")
    p.add_argument("--idle-below", type=float, default=0.85,
                   help="busy fraction of all cores under which one more stack joins the primary suite")
    p.add_argument("--idle-window-s", type=float, default=120.0,
                   help="the window that fraction is measured over, and the least time between two starts")
    p.add_argument("--jobs", type=int, default=3,
                   help="compatibility stacks tested at once after it")
    p.add_argument("--goal-min", type=float, default=45)
    p.add_argument("--logs", default=str(LOGS), help="where the stacks' logs go")
    p.add_argument("--poll-s", type=float, default=POLL_S, help="how often the schedule looks at its jobs")
    p.add_argument("--start", type=float, default=0.0, help="when make started (epoch seconds)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
