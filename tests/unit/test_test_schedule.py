"""`make test`'s schedule (scripts/test_all.py), run with a stand-in for
make whose targets sleep: stacks are prepared and tested in ``--order``, a
second stack joins the primary suite only when the cores idle, a failed
stack is reported and sets the exit status, and no stack is left out."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]

FAKE_MAKE = r"""#!/bin/bash
# argv: --no-print-directory TARGET [STACK=name] [...]
target="$2"; stack="${3#STACK=}"
echo "$(date +%s.%N) start $target $stack" >> "$EVENTS"
echo "$target $stack deadline=${LMCA_TEST_DEADLINE:-none}" >> "$EVENTS.env"
# a suite under a budget names the engine tests it did not start (tests/support/time_budget.py)
[ "$CUT" != 1 ] || [ "$target" != test-primary ] || echo '{"cut": ["t.py::e"]}' > "$LMCA_TEST_CUT_FILE"
case "$target" in
  test-primary) if [ "${PRIMARY_S#until:}" != "$PRIMARY_S" ]; then
      # until stack ${PRIMARY_S#until:} has started, at most 60 s: the primary
      # suite outlasts what a slow machine takes to prepare the stacks
      for i in $(seq 600); do grep -q "start test-stack ${PRIMARY_S#until:}\$" "$EVENTS" && break; sleep 0.1; done
    else sleep "$PRIMARY_S"; fi;;
  prepare-stack) sleep 0.2;;
  tc) sleep 0.5; [ "$FAIL" != tc ] || { echo "tc: error in x.py"; exit 1; };;
  test-stack) sleep "$STACK_S"; [ "$stack" != "$FAIL" ] || exit 3;;
esac
echo "$(date +%s.%N) end $target $stack" >> "$EVENTS"
"""


def _schedule(tmp_path: Path, *args: str, primary_s: float | str, stack_s: float, fail: str = "",
              cut: bool = False) -> tuple:
    make = tmp_path / "make"
    make.write_text(FAKE_MAKE)
    make.chmod(0o755)
    events = tmp_path / "events"
    env = dict(os.environ, MAKE=str(make), EVENTS=str(events), PRIMARY_S=str(primary_s),
               STACK_S=str(stack_s), FAIL=fail, CUT="1" if cut else "")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_all.py"), "--primary", "p",
                          "--compat", "a", "b", "c", "--logs", str(tmp_path / "logs"), "--poll-s", "0.1", *args],
                         env=env, capture_output=True, text=True, timeout=120)
    rows = [line.split() for line in events.read_text().splitlines()]
    return out, [(float(t), what, target, (name[0] if name else "")) for t, what, target, *name in rows]


def _starts(rows: list, target: str) -> list[str]:
    return [name for _, what, t, name in sorted(rows) if what == "start" and t == target]


def test_stacks_are_prepared_and_tested_in_the_run_order_and_one_beside_the_primary_when_busy(tmp_path):
    # --idle-below 0: the cores never count as idle, so one stack at a time
    # beside the primary suite, then up to --jobs after it.
    out, rows = _schedule(tmp_path, "--order", "c", "a", "b", "--idle-below", "0", "--idle-window-s", "0.5",
                          "--jobs", "3", primary_s=2.0, stack_s=1.0)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _starts(rows, "prepare-stack") == ["c", "a", "b"]
    assert _starts(rows, "test-stack") == ["c", "a", "b"]
    spans = {name: [t for t, what, target, n in rows if n == name and target == "test-stack"] for name in "abc"}
    primary_end = max(t for t, what, target, _ in rows if target == "test-primary")
    for x in "abc":  # never two stacks at once while the primary suite ran
        for y in "abc":
            if x < y and min(spans[x][1], spans[y][1]) > max(spans[x][0], spans[y][0]):
                assert max(spans[x][0], spans[y][0]) >= primary_end, (x, y, spans, primary_end)
    assert "passed on p a b c" in out.stdout


def test_a_second_stack_joins_the_primary_suite_when_the_cores_idle(tmp_path):
    # --idle-below 1.01: any busy share counts as idle (it is at most 1), so
    # once the window has passed a second stack starts beside the first
    # while the primary suite runs. Not 0.99 with everything here asleep:
    # what else the machine runs counts too (in `make test` the type check
    # and the stacks' installs run beside this suite, and kept the cores
    # over 99% busy: the second stack never joined).
    out, rows = _schedule(tmp_path, "--idle-below", "1.01", "--idle-window-s", "0.5", "--beside-max", "2",
                          primary_s="until:b", stack_s=5.0)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    starts = {n: t for t, what, target, n in rows if what == "start" and target == "test-stack"}
    ends = {n: t for t, what, target, n in rows if what == "end" and target == "test-stack"}
    primary_end = max(t for t, what, target, _ in rows if target == "test-primary")
    assert starts["b"] < ends["a"] and starts["b"] < primary_end, (starts, ends, primary_end)
    assert "busy over the last" in out.stdout


def test_a_failed_stack_is_named_and_fails_the_run_and_the_others_still_run(tmp_path):
    out, rows = _schedule(tmp_path, "--idle-below", "0", primary_s=1.0, stack_s=0.3, fail="a")
    assert out.returncode == 1
    assert _starts(rows, "test-stack") == ["a", "b", "c"]
    assert "[test] a: FAILED (exit 3)" in out.stdout and "FAILED on: a" in out.stdout


def test_an_order_that_leaves_out_a_stack_is_refused(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_all.py"), "--primary", "p", "--compat",
                          "a", "b", "--order", "b", "--logs", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode != 0 and "must name each of --compat ['a', 'b'] once" in out.stderr


def test_the_budget_stops_what_runs_at_its_end_and_starts_nothing_after_its_deadline(tmp_path):
    # A 24 s budget whose last 12 s start nothing: stack a starts beside the
    # primary suite and outlives the budget; b and c wait for it (one beside)
    # and never start; the primary suite ends by itself after the deadline.
    t0 = time.time()
    out, rows = _schedule(tmp_path, "--budget-min", "0.4", "--budget-margin-min", "0.2", "--idle-below", "0",
                          "--jobs", "1", "--stop-grace-s", "3", primary_s=16, stack_s=600, cut=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]  # every test that ran passed
    assert _starts(rows, "test-stack") == ["a"], rows
    assert "[test] a: STOPPED after " in out.stdout and "(by the time budget)" in out.stdout, out.stdout
    for name in "bc":
        assert f"[test] {name}: not run (the time budget: the deadline passed before it started)" in out.stdout
    # the primary passed, and says what its suite did not start
    assert "[test] p: passed; 1 engine test(s) not started (the time budget)" in out.stdout, out.stdout
    assert "WARNING: PARTIAL RUN: the time budget (0.4 min) cut tests on: p a b c" in out.stdout, out.stdout
    # the suites got the deadline: 12 s after test_all's start
    env = (tmp_path / "events.env").read_text().splitlines()
    deadlines = {line.split()[0]: float(line.split("deadline=")[1]) for line in env if line.startswith("test-")}
    assert t0 + 12 - 1 <= deadlines["test-primary"] <= t0 + 12 + 10, (t0, env)
    assert deadlines["test-stack"] == deadlines["test-primary"], env


def test_a_primary_suite_still_running_when_the_budget_ends_fails_the_run(tmp_path):
    out, rows = _schedule(tmp_path, "--budget-min", "0.2", "--budget-margin-min", "0.1", "--idle-below", "0",
                          "--stop-grace-s", "3", primary_s=600, stack_s=0.1)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "[test] p: STOPPED after " in out.stdout and "(by the time budget)" in out.stdout, out.stdout
    assert "FAILED on: p" in out.stdout, out.stdout
    assert "the end of the time budget at " in out.stdout, out.stdout


def test_after_a_slow_setup_the_stacks_are_prepared_only_once_the_primary_suite_ended(tmp_path):
    out, rows = _schedule(tmp_path, "--budget-min", "100", "--slow-setup-min", "10",
                          "--start", f"{time.time() - 11 * 60:.0f}", primary_s=2.0, stack_s=0.2)
    assert out.returncode == 0, out.stdout[-3000:]
    assert re.search(r"the setup took 11\.\d min, over --slow-setup-min 10 \(a slow machine\)", out.stdout), out.stdout
    primary_end = min(t for t, what, target, _ in rows if what == "end" and target == "test-primary")
    firsts = [t for t, what, target, _ in rows if what == "start" and target in ("prepare-stack", "test-stack")]
    assert firsts and min(firsts) >= primary_end, rows
    assert "passed on p a b c" in out.stdout, out.stdout


TRAPPING_MAKE = r"""#!/bin/bash
# Like FAKE_MAKE, but its targets run long and record a SIGTERM.
target="$2"; stack="${3#STACK=}"
trap 'echo "$(date +%s.%N) term $target $stack" >> "$EVENTS"; echo "pytest summary of $target $stack"; kill $! 2>/dev/null; exit 143' TERM
echo "$(date +%s.%N) start $target $stack" >> "$EVENTS"
# a child deaf to SIGTERM, as a pytest still importing was: only SIGKILL ends it
[ "$target" != test-primary ] || { (trap '' TERM; echo $BASHPID > "$EVENTS.deaf"; exec sleep 1000) >/dev/null 2>&1 & }
for i in $(seq 1 200); do echo "line $i of $target $stack"; done
case "$target" in
  prepare-stack) [ "$stack" = a ] || { sleep 1000 >/dev/null 2>&1 & wait $!; };;
  *) sleep 1000 >/dev/null 2>&1 & wait $!;;  # its output not ours: an orphan would hold the pipe
esac
echo "$(date +%s.%N) end $target $stack" >> "$EVENTS"
"""


def test_sigterm_stops_every_stack_and_reports_what_ran_and_where_each_was(tmp_path):
    # CI's time limit sends SIGTERM: the log must still say which stacks
    # passed, failed or were stopped, and end with where each running one was.
    make = tmp_path / "make"
    make.write_text(TRAPPING_MAKE)
    make.chmod(0o755)
    events = tmp_path / "events"
    env = dict(os.environ, MAKE=str(make), EVENTS=str(events))
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "test_all.py"), "--primary", "p",
                             "--compat", "a", "b", "--logs", str(tmp_path / "logs"), "--poll-s", "0.1",
                             "--idle-below", "0", "--stop-grace-s", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    while not (events.exists() and "start test-stack a" in events.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    time.sleep(0.5)  # the stack's log has its lines
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "[test] this machine: " in out and " GB/s" in out, out  # the probe, before the tests
    terms = [line.split()[2:] for line in events.read_text().splitlines() if line.split()[1] == "term"]
    # primary, stack a (testing) and stack b (installing) each got the signal
    assert sorted(terms) == [["prepare-stack", "b"], ["test-primary"], ["test-stack", "a"]], events.read_text()
    assert "[test] SIGTERM at " in out, out
    assert "[test] p: STOPPED after " in out and "[test] a: STOPPED after " in out, out
    assert "[test] b: STOPPED while being installed" in out, out
    # the end of stack a's log, its test runner's last words included; not the whole log
    assert "line 200 of test-stack a" in out and "pytest summary of test-stack a" in out, out
    assert "line 100 of test-stack a" not in out, out
    assert "[test] STOPPED by SIGTERM at " in out and "not passed: p a b" in out, out
    deaf = int(Path(str(events) + ".deaf").read_text())  # killed with its make's process group
    for _ in range(50):
        try:
            os.kill(deaf, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(deaf, signal.SIGKILL)
        raise AssertionError(f"pid {deaf}, a child of the primary's make, outlived the stop")


@pytest.mark.parametrize("fail", ["", "tc"])
def test_a_check_runs_beside_the_primary_suite_from_its_start_and_must_pass(tmp_path, fail):
    out, rows = _schedule(tmp_path, "--check", "tc", primary_s=2.0, stack_s=0.1, fail=fail)
    starts = {target: t for t, what, target, _ in rows if what == "start"}
    primary_end = min(t for t, what, target, _ in rows if what == "end" and target == "test-primary")
    assert starts["tc"] < primary_end, rows  # beside it, not before or after
    if fail:
        assert out.returncode == 1, out.stdout[-3000:]
        assert "[test] tc: FAILED (exit 1)" in out.stdout and "FAILED on: tc" in out.stdout, out.stdout
        assert "tc: error in x.py" in out.stdout, out.stdout  # its log, printed
    else:
        assert out.returncode == 0, out.stdout[-3000:]
        assert "[test] tc: passed" in out.stdout and "passed on p tc a b c" in out.stdout, out.stdout
