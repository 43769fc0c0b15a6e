"""`make test`'s schedule (scripts/test_all.py), run with a stand-in for
make whose targets sleep: stacks are prepared and tested in ``--order``, a
second stack joins the primary suite only when the cores idle, a failed
stack is reported and sets the exit status, and no stack is left out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]

FAKE_MAKE = r"""#!/bin/bash
# argv: --no-print-directory TARGET [STACK=name] [...]
target="$2"; stack="${3#STACK=}"
echo "$(date +%s.%N) start $target $stack" >> "$EVENTS"
case "$target" in
  test-primary) sleep "$PRIMARY_S";;
  prepare-stack) sleep 0.2;;
  test-stack) sleep "$STACK_S"; [ "$stack" != "$FAIL" ] || exit 3;;
esac
echo "$(date +%s.%N) end $target $stack" >> "$EVENTS"
"""


def _schedule(tmp_path: Path, *args: str, primary_s: float, stack_s: float, fail: str = "") -> tuple:
    make = tmp_path / "make"
    make.write_text(FAKE_MAKE)
    make.chmod(0o755)
    events = tmp_path / "events"
    env = dict(os.environ, MAKE=str(make), EVENTS=str(events), PRIMARY_S=str(primary_s),
               STACK_S=str(stack_s), FAIL=fail)
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
    # Everything here sleeps: the cores idle, so once the window has passed
    # a second stack starts beside the first while the primary suite runs.
    out, rows = _schedule(tmp_path, "--idle-below", "0.99", "--idle-window-s", "0.5", "--beside-max", "2",
                          primary_s=3.0, stack_s=2.0)
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
