"""tests/support/time_budget.py, in a pytest of its own on small test files
(`pytest -q`, as CI runs the suite): the tests that start no engine run
first, an engine test does not start once the deadline has passed and is
named as not run (never as passed), the tests that start no engine still
run, and without a deadline nothing is cut."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

SUPPORT = Path(__file__).resolve().parents[1] / "support"

# Engine tests first in the file, each appending its name to a file, so the
# order they ran in is read back; a module fixture that an engine test and a
# plain test share must be torn down even when the engine tests are cut.
TESTS = '''
from pathlib import Path

import pytest

RAN = Path(__file__).with_name("ran")


def _ran(name):
    with open(RAN, "a") as f:
        f.write(name + "\\n")


@pytest.fixture(scope="module")
def server():
    yield
    Path(__file__).with_name("torn_down").write_text("yes")


@pytest.mark.engine
def test_engine_one(server):
    _ran("engine_one")


@pytest.mark.engine
def test_engine_two():
    _ran("engine_two")


def test_plain_one(server):
    _ran("plain_one")


def test_plain_two():
    _ran("plain_two")
'''


def _run(tmp_path: Path, deadline: str | None) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "test_x.py").write_text(TESTS)
    env = dict(os.environ, PYTHONPATH=str(SUPPORT), LMCA_TEST_CUT_FILE=str(tmp_path / "cut.json"))
    env.pop("LMCA_TEST_DEADLINE", None)
    if deadline is not None:
        env["LMCA_TEST_DEADLINE"] = deadline
    # -c /dev/null and --rootdir: nothing of this repository's configuration.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "time_budget", "-c", os.devnull,
                          "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "test_x.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ran = (tmp_path / "ran").read_text().split() if (tmp_path / "ran").exists() else []
    return out, ran


def test_without_a_deadline_every_test_runs_the_plain_ones_first(tmp_path):
    out, ran = _run(tmp_path, None)
    assert out.returncode == 0, out.stdout
    assert ran == ["plain_one", "plain_two", "engine_one", "engine_two"], ran
    assert re.search(r"^4 passed", out.stdout, re.M), out.stdout
    assert json.loads((tmp_path / "cut.json").read_text()) == {"cut": []}
    assert "time budget" not in out.stdout, out.stdout


def test_past_the_deadline_no_engine_test_starts_and_the_cut_ones_are_named_not_passed(tmp_path):
    out, ran = _run(tmp_path, f"{time.time() - 5:.0f}")
    assert out.returncode == 0, out.stdout  # nothing failed
    assert ran == ["plain_one", "plain_two"], ran  # the plain tests still ran
    assert re.search(r"^2 passed", out.stdout, re.M), out.stdout  # the cut ones are not counted
    assert "[tests] time budget: 2 engine test(s) not run" in out.stdout, out.stdout
    assert "test_x.py::test_engine_one" in out.stdout and "test_x.py::test_engine_two" in out.stdout
    assert json.loads((tmp_path / "cut.json").read_text()) == {
        "cut": ["test_x.py::test_engine_one", "test_x.py::test_engine_two"]}
    assert (tmp_path / "torn_down").read_text() == "yes"  # the shared module fixture


def test_a_deadline_still_ahead_cuts_nothing(tmp_path):
    out, ran = _run(tmp_path, f"{time.time() + 3600:.0f}")
    assert out.returncode == 0 and len(ran) == 4, (out.stdout, ran)
    assert json.loads((tmp_path / "cut.json").read_text()) == {"cut": []}


def test_a_deadline_that_is_no_time_is_refused_naming_it(tmp_path):
    out, ran = _run(tmp_path, "in an hour")
    assert out.returncode != 0 and not ran, out.stdout
    assert "LMCA_TEST_DEADLINE='in an hour': expected epoch seconds" in out.stdout + out.stderr
