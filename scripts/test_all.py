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

Checks (``--check``: make targets, the type check) run beside the primary
suite from its start, each into ``build/stacks/<target>.log``, and must pass.

Every stack runs even when another failed; the exit status says whether all
passed, and the last lines name those that did not.

A time budget (``--budget-min``, the Makefile's ``TEST_BUDGET_MIN``; 0 for
none) bounds the run on a slow machine instead of CI's limit cutting it off
mid-test: the suites get a deadline ``--budget-margin-min`` before its end,
after which no engine test and no stack starts (tests/support/time_budget.py;
the tests that start no engine run first and always run), and what still
runs when the budget ends is stopped like SIGTERM stops it. The run then
passes only if every test that ran passed and the primary suite ended by
itself; what the budget cut is named, never counted as passed. Where the
setup alone took over ``--slow-setup-min`` (a slow machine: 2.5-3 minutes
on a fresh normal one), the compatibility stacks are installed and tested
after the primary suite, not beside it, so they do not slow it further.

Usage (the Makefile passes its variables):
  test_all.py --primary vllm-0.32 --compat vllm-0.26 vllm-0.30 ... \
      [--order vllm-0.26 ...] [--beside 1] [--beside-max 2] [--jobs 3] \
      [--idle-below 0.85] [--idle-window-s 120] [--goal-min 45] [--start EPOCH] \
      [--budget-min 85] [--budget-margin-min 16] [--slow-setup-min 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "stacks"
# How often the schedule looks at its jobs: every look costs (on a slow
# machine, polling every 2 s took 8% of a core), and a stack noticed 5 s late
# costs nothing.
POLL_S = 5.0
# After SIGTERM or the budget's end: time for the suites' teardown and
# pytest's summaries. 30 s was too short on a slow machine (pytest, stopping
# its zygotes, was killed before its summary); 90 s after an 85-minute budget
# still ends before CI's 90 minutes.
STOP_GRACE_S = 90.0
TAIL_LINES = 60  # of each stack's log, when the run was stopped


def minutes(since: float) -> str:
    return f"{(time.time() - since) / 60:.1f} min"


def say(msg: str) -> None:
    print(f"[test] {msg}", flush=True)


def cpu_jiffies() -> Optional[tuple[int, int, int]]:
    """(busy, total, steal) jiffies of all cores since boot, from /proc/stat
    (None where there is none): their difference over the run says how busy
    the machine kept its cores, i.e. whether less work or a better order
    would shorten it. Steal (time the hypervisor gave this machine's cores
    to others) counts as busy, since no test could use it, and is also
    reported on its own: a run that is slow because the host is
    oversubscribed says so."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields) - idle, sum(fields), steal


def share(a: Optional[tuple[int, int, int]], b: Optional[tuple[int, int, int]]) -> Optional[tuple[float, float]]:
    """(busy, steal) fractions of all cores between two cpu_jiffies()."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]), (b[2] - a[2]) / (b[1] - a[1])


def probe_machine() -> str:
    """What this machine gives the tests, measured in about two seconds and
    printed before them, so that a slow run's log says whether the machine
    was slow: the cores' steal over one second, a copy within memory already
    touched, and memory touched for the first time (every page a fault; on
    some virtual machines that alone is a hundred times slower than a copy,
    and every process start, import and engine allocation pays it)."""
    before, t0 = cpu_jiffies(), time.time()
    src, dst = bytearray(2 << 20), bytearray(2 << 20)
    n = 0
    while time.time() - t0 < 0.5:
        dst[:] = src
        n += 1
    copy = n * len(src) / (time.time() - t0) / 1e9
    t1 = time.time()
    fresh = bytearray(16 << 20)  # zero-filled: every page touched
    fault = len(fresh) / max(time.time() - t1, 1e-9) / 1e9
    del fresh
    time.sleep(max(0.0, 1.0 - (time.time() - t0)))
    cores = share(before, cpu_jiffies())
    steal = f", steal {cores[1]:.0%} of the cores" if cores is not None else ""
    return (f"this machine: {os.cpu_count()} cores, copy {copy:.3g} GB/s, "
            f"first touch of fresh memory {fault:.3g} GB/s{steal}")


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

    def __init__(self, jiffies: Optional[tuple[int, int, int]], start: float) -> None:
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
        if (shares := share(self.last, now)) is not None:
            self.rows.append(f"{(self.t0 - self.start) / 60:4.1f}-{(time.time() - self.start) / 60:4.1f} min "
                             f"{shares[0]:4.0%} (steal {shares[1]:3.0%}): {', '.join(sorted(self.ran))}")
        self.last, self.t0, self.ran = now, time.time(), set()

    def report(self) -> None:
        self.sample(False, [], None, last=True)  # the tail: the last, shorter window
        if self.rows:
            say("cores busy per window, steal included (and what ran in it):")
            for row in self.rows:
                print(f"    {row}")


class _Stopped(Exception):
    """SIGTERM (or ^C's SIGINT) reached the schedule, or its time budget ended."""

    def __init__(self, why: str = "SIGTERM") -> None:
        super().__init__(why)
        self.why = why


# Each job is the leader of its own process group, so that a stop reaches
# its whole tree: killing only make left its pytest running (seen on a slow
# machine, where pytest was still importing 30 s after its SIGTERM).
OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _raise_stop(signum: int, frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # once: the stop below is bounded by --stop-grace-s
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped()


def _signal_group(job: Job, sig: int) -> None:
    try:
        os.killpg(job.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_jobs(jobs: list[Job], grace_s: float) -> None:
    """SIGTERM to each job's process group (its make and the pytest under
    it, which tears its engines and servers down and prints its summary),
    then SIGKILL to each group after ``grace_s``, whatever is left of it."""
    for job in jobs:
        _signal_group(job, signal.SIGTERM)
    deadline = time.time() + grace_s
    for job in jobs:
        try:
            job.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            say(f"{job.name}: still running {grace_s:.0f} s after SIGTERM; killed")
        _signal_group(job, signal.SIGKILL)
        job.proc.wait()


def make(*args: str) -> list[str]:
    return [os.environ.get("MAKE", "make"), "--no-print-directory", *args]


BUDGET = "the time budget"


def _cut_tests(logs: Path, name: str) -> int:
    """Engine tests a suite did not start because its deadline had passed
    (written by tests/support/time_budget.py)."""
    try:
        return len(json.loads((logs / f"{name}.cut.json").read_text())["cut"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def run(opts: argparse.Namespace) -> int:
    logs = Path(opts.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    start = opts.start or time.time()
    setup_min = (time.time() - start) / 60
    say(f"setup (system deps, primary stack, build): {minutes(start)}")
    say(probe_machine())

    # The budget: a deadline for starting engine tests and stacks, and an
    # end where whatever still runs is stopped (module docstring).
    end = start + opts.budget_min * 60 if opts.budget_min > 0 else None
    deadline = end - opts.budget_margin_min * 60 if end is not None else None
    env = dict(os.environ)
    for name in [opts.primary, *opts.compat]:
        (logs / f"{name}.cut.json").unlink(missing_ok=True)
    if end is not None and deadline is not None:
        env["LMCA_TEST_DEADLINE"] = f"{deadline:.0f}"
        say(f"time budget {opts.budget_min:g} min from make's start (TEST_BUDGET_MIN; 0 for none): engine tests "
            f"and stacks start until {(deadline - start) / 60:.1f} min; what runs at {opts.budget_min:g} min is stopped")
    beside_ok = end is None or setup_min <= opts.slow_setup_min
    if not beside_ok:
        say(f"the setup took {setup_min:.1f} min, over --slow-setup-min {opts.slow_setup_min:g} (a slow machine): "
            "the compatibility stacks are installed and tested after the primary suite, not beside it")

    def job_env(name: str) -> dict[str, str]:
        return {**env, "LMCA_TEST_CUT_FILE": str(logs / f"{name}.cut.json")} if deadline is not None else env

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
            stdout=prepare_log, stderr=subprocess.STDOUT, cwd=ROOT, **OWN_GROUP))

    if beside_ok:
        preparing = next_prepare()
    cpu_start = cpu_jiffies()
    primary = Job(opts.primary, subprocess.Popen(make("test-primary"), cwd=ROOT, env=job_env(opts.primary),
                                                 **OWN_GROUP))
    primary_rc: Optional[int] = None
    # Checks (make targets: the type check) run beside the primary suite from
    # its start: on a slow machine a cold mypy took 15 minutes of the setup
    # while the cores had room beside pytest's collection.
    checks = []
    for target in opts.check:
        check_log = open(logs / f"{target}.log", "w")
        checks.append(Job(target, subprocess.Popen(make(target), stdout=check_log, stderr=subprocess.STDOUT,
                                                   cwd=ROOT, **OWN_GROUP), log=check_log))
    queue = list(order)  # tested in this order, once prepared
    recent = _RecentBusy(opts.idle_window_s)
    last_start = 0.0
    running: list[Job] = []
    results: dict[str, str] = {}
    finished_at: dict[str, str] = {}

    windows = _BusyWindows(cpu_start, start)
    # SIGTERM (CI's time limit, a ^C'd make) or the budget's end: the stacks
    # are stopped and what ran until then is reported, instead of a log that
    # ends mid-test.
    stopped: Optional[_Stopped] = None
    stopped_at = ""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)  # ^C reaches only this group: the jobs have their own
    try:
        while True:
            windows.sample(primary_rc is None, [j.name for j in running + checks if j.proc.poll() is None],
                           preparing and preparing.name)
            busy = recent.sample()
            now = time.time()
            if end is not None and now >= end:
                raise _Stopped(BUDGET)
            late = deadline is not None and now >= deadline
            if preparing is not None and (rc := preparing.done()) is not None:
                (prepared if rc == 0 else prepare_failed).append(preparing.name)
                prepare_log.write(f"[test] prepared stack {preparing.name} in {minutes(preparing.started)}"
                                  f"{'' if rc == 0 else f' - FAILED (exit {rc})'}\n")
                prepare_log.flush()
                preparing = None
            if late and (queue or preparing is not None):
                # No stack starts after the deadline: one being installed
                # now could not be tested in the budget.
                if preparing is not None:
                    _stop_jobs([preparing], opts.stop_grace_s)
                    prepare_log.write(f"[test] stopped preparing stack {preparing.name} ({BUDGET})\n")
                    preparing = None
                for name in queue:
                    results[name] = f"not run ({BUDGET}: the deadline passed before it started)"
                say(f"deadline of {BUDGET} at {minutes(start)}: not started: {' '.join(queue)}")
                queue.clear()
                to_prepare.clear()
            if preparing is None and to_prepare and (beside_ok or primary_rc is not None):
                preparing = next_prepare()
            if primary_rc is None and (rc := primary.done()) is not None:
                primary_rc = rc
                results[opts.primary] = "passed" if rc == 0 else f"FAILED (exit {rc})"
                say(f"stack {opts.primary}: {minutes(primary.started)} "
                    f"({len(running)} compatibility stack(s) still running beside it)")
            for job in checks:
                if job.name not in results and (rc := job.done()) is not None:
                    results[job.name] = "passed" if rc == 0 else f"FAILED (exit {rc})"
                    finished_at[job.name] = minutes(start)
            for job in list(running):
                if (rc := job.done()) is not None:
                    running.remove(job)
                    results[job.name] = "passed" if rc == 0 else f"FAILED (exit {rc})"
                    finished_at[job.name] = minutes(start)
            while queue and queue[0] in prepare_failed:
                name = queue.pop(0)
                results[name] = "FAILED (its install or build failed: build/stacks/prepare.log)"
            limit = (opts.beside if beside_ok else 0) if primary_rc is None else opts.jobs
            why = ""
            if (primary_rc is None and beside_ok and len(running) == limit and limit < opts.beside_max
                    and preparing is None and busy is not None and busy < opts.idle_below
                    and time.time() - last_start >= opts.idle_window_s):
                limit += 1  # the cores idled: one more beside the primary suite
                why = f" (cores {busy:.0%} busy over the last {opts.idle_window_s:.0f} s)"
            while queue and queue[0] in prepared and len(running) < limit:
                name = queue.pop(0)
                log = open(logs / f"{name}.test.log", "w")
                say(f"stack {name}: tests start at {minutes(start)}{why}")
                last_start = time.time()
                running.append(Job(name, subprocess.Popen(
                    make("test-stack", f"STACK={name}"), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=job_env(name), **OWN_GROUP),
                    log=log))
            if (primary_rc is not None and not running and not queue and preparing is None
                    and all(j.name in results for j in checks)):
                break
            time.sleep(opts.poll_s)
    except _Stopped as stop:
        stopped, stopped_at = stop, minutes(start)
        event = f"the end of {BUDGET}" if stop.why == BUDGET else stop.why
        say(f"{event} at {stopped_at}: stopping every stack; what ran until now follows")
        unchecked = [j for j in checks if j.name not in results]
        live = [j for j in [primary if primary_rc is None else None, preparing, *running, *unchecked]
                if j is not None]
        _stop_jobs(live, opts.stop_grace_s)
        for job in unchecked:
            results[job.name] = f"STOPPED after {minutes(job.started)} (by {stop.why})"
            job.done()
        if primary_rc is None:
            results[opts.primary] = f"STOPPED after {minutes(primary.started)} (by {stop.why})"
        for job in running:
            results[job.name] = f"STOPPED after {minutes(job.started)} (by {stop.why})"
        if preparing is not None:
            results[preparing.name] = f"STOPPED while being installed (by {stop.why}; build/stacks/prepare.log)"
            prepare_log.write(f"[test] stopped preparing stack {preparing.name} ({stop.why})\n")
        for job in running:
            job.done()  # closes its log
    prepare_log.close()

    for job in checks:
        job.done()
        say(f"---- {job.name} (build/stacks/{job.name}.log) ----")
        sys.stdout.write((logs / f"{job.name}.log").read_text(errors="replace"))
    for name in opts.compat:
        log = logs / f"{name}.test.log"
        shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
        say(f"---- stack {name} ({shown}) ----")
        if log.exists():
            text = log.read_text(errors="replace")
            if stopped is not None:  # only the end: where each stack was when it was stopped
                text = "".join(text.splitlines(True)[-TAIL_LINES:])
            sys.stdout.write(text)
    if prepare_failed:
        say("preparing a compatibility stack failed; the end of build/stacks/prepare.log:")
        sys.stdout.write("".join((logs / "prepare.log").read_text(errors="replace").splitlines(True)[-40:]))
    cut: dict[str, int] = {}
    for name in [opts.primary, *opts.check, *opts.compat]:
        at = f", ended at {finished_at[name]}" if name in finished_at else ""
        if n := _cut_tests(logs, name):
            cut[name] = n
        not_started = f"; {cut[name]} engine test(s) not started ({BUDGET})" if name in cut else ""
        say(f"{name}: {results.get(name, 'not run')}{at}{not_started}")
    total_s = time.time() - start
    if (shares := share(cpu_start, cpu_jiffies())) is not None:
        cores = os.cpu_count() or 1
        say(f"cores busy while testing: {shares[0] * cores:.2f} of {cores} on average ({shares[0]:.0%}; "
            f"steal {shares[1]:.0%}, the host's use of this machine's cores)")
        windows.report()
    say(f"total wall time {total_s / 60:.1f} min (setup included); goal {opts.goal_min} min")
    if total_s > opts.goal_min * 60:
        say(f"WARNING: over the {opts.goal_min}-minute goal (a warning, not a failure)")
    return _verdict(opts, results, cut, stopped, stopped_at)


def _verdict(opts: argparse.Namespace, results: dict[str, str], cut: dict[str, int],
             stopped: Optional[_Stopped], stopped_at: str) -> int:
    """The exit status, and the lines that say why."""
    names = [opts.primary, *opts.check, *opts.compat]
    if stopped is not None and stopped.why != BUDGET:
        say(f"STOPPED by {stopped.why} at {stopped_at}; not passed: "
            + " ".join(n for n in names if results.get(n) != "passed"))
        return 128 + signal.SIGTERM
    # Failed: a test or check failed, a stack could not be installed, or the
    # primary suite or a check did not end by itself (the suite's tests that
    # start no engine always run, so a pass means at least all of those ran).
    failed = [n for n in names if results.get(n, "").startswith("FAILED")
              or (n in (opts.primary, *opts.check) and results.get(n) != "passed")]
    partial = [n for n in names if n not in failed and (results.get(n) != "passed" or n in cut)]
    if partial:
        say(f"WARNING: PARTIAL RUN: {BUDGET} ({opts.budget_min:g} min) cut tests on: "
            + " ".join(partial) + "; what it cut was not run, so neither passed nor failed (lines above)")
    if failed:
        say("FAILED on: " + " ".join(failed))
        return 1
    full = [n for n in names if n not in partial]
    say(("passed on " + " ".join(full) if full else "passed on no stack in full")
        + (f"; partly, every test that ran passed: {' '.join(partial)}" if partial else ""))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--primary", required=True)
    p.add_argument("--compat", nargs="*", default=[])
    p.add_argument("--check", nargs="*", default=[],
                   help="make targets run beside the primary suite from its start; each must pass (typecheck)")
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
    p.add_argument("--stop-grace-s", type=float, default=STOP_GRACE_S,
                   help="after SIGTERM, how long the stacks get to end before they are killed")
    p.add_argument("--start", type=float, default=0.0, help="when make started (epoch seconds)")
    p.add_argument("--budget-min", type=float, default=0.0,
                   help="minutes from --start the run may take; at its end what still runs is stopped (0: none)")
    p.add_argument("--budget-margin-min", type=float, default=16.0,
                   help="no engine test or stack starts in the budget's last this many minutes")
    p.add_argument("--slow-setup-min", type=float, default=10.0,
                   help="under a budget, a setup longer than this tests the stacks after the primary suite")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
