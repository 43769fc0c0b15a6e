"""tests/support/ci_report.py, run the way CI runs the suite (`pytest -q`)
on small test files in a pytest of their own: a failure's report is printed
while the run goes on, a run ended by SIGTERM tears its fixtures down and
prints pytest's summary (and a process forked from pytest's still ends by
SIGTERM as by default), slow tests are named."""

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

SUPPORT = Path(__file__).resolve().parents[1] / "support"

TESTS = '''
import time
from pathlib import Path

import pytest


@pytest.fixture
def server(tmp_path_factory):
    Path(__file__).with_name("set_up").write_text("yes")
    yield
    Path(__file__).with_name("torn_down").write_text("yes")


def test_fails():
    assert 1 + 1 == 3, "the-marker-of-test-fails"


def test_quick():
    pass


def test_a_forked_child_ends_by_sigterm_as_by_default():
    import os, signal
    pid = os.fork()
    if pid == 0:  # inherits pytest's handler
        time.sleep(120)
        os._exit(0)
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_sleeps(server):
    time.sleep(float(__import__("os").environ["SLEEP_S"]))
'''


def _start(tmp_path: Path, sleep_s: float, slow_s: str = "120") -> subprocess.Popen:
    (tmp_path / "test_x.py").write_text(TESTS)
    env = dict(os.environ, PYTHONPATH=str(SUPPORT), PYTHONUNBUFFERED="1", SLEEP_S=str(sleep_s),
               LMCA_TEST_SLOW_S=slow_s)
    # -c /dev/null and --rootdir: nothing of this repository's configuration.
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "ci_report", "-c", os.devnull,
                             "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "test_x.py"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_failure_is_reported_at_once_and_sigterm_ends_with_teardown_and_summary(tmp_path):
    proc = _start(tmp_path, sleep_s=100000)
    seen: list[str] = []
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    for line in proc.stdout:  # until the failure's report, printed while test_sleeps runs
        seen.append(line)
        if "the-marker-of-test-fails" in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    before = "".join(seen)
    assert "[failed] test_x.py::test_fails (call, after " in before, before
    while not (tmp_path / "set_up").exists():  # until test_sleeps runs
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(0.5)  # in its sleep now
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=600)  # the sleep itself would take a day
    assert "[tests] SIGTERM" in rest, rest
    assert "FAILED test_x.py::test_fails" in rest, rest  # pytest's own summary, test_sleeps unfinished
    assert re.search(r"^1 failed, 2 passed in ", rest, re.M), rest
    assert proc.returncode == 2, rest  # pytest's "interrupted"
    assert (tmp_path / "torn_down").read_text() == "yes"  # the fixture's teardown ran


def test_a_test_longer_than_the_limit_is_named_and_a_short_one_is_not(tmp_path):
    proc = _start(tmp_path, sleep_s=0.6, slow_s="0.3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out  # test_fails
    assert "[slow] test_x.py::test_sleeps: " in out, out
    assert "[slow] test_x.py::test_quick" not in out, out


def test_a_limit_that_is_no_number_is_refused_naming_it(tmp_path):
    proc = _start(tmp_path, sleep_s=0, slow_s="two minutes")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "LMCA_TEST_SLOW_S='two minutes': expected a number of seconds" in out, out
