"""What a test log must say when the run is cut short (loaded by
tests/conftest.py; plain pytest hooks, no vLLM or LMCache).

`pytest -q` prints an ``F`` when a test fails and its traceback only in the
final summary. A run stopped from outside (CI's time limit, a ^C'd
`make test`) never reaches that summary: a CI log then ends in ``FFFF`` and
``Terminated`` and says neither which tests failed nor why. So:

- each failure's report is printed as soon as the test fails: its node id,
  the phase, how long it ran and the end of its traceback (the end is where
  an assertion's message and an engine's last log lines are);
- a test that took longer than ``LMCA_TEST_SLOW_S`` seconds (default 120)
  is named when it ends, so a log cut short still shows where the time went;
- SIGTERM is turned into KeyboardInterrupt in pytest's main thread, so
  pytest tears the fixtures down (engines, Redis and Mooncake servers are
  stopped by PID) and prints its summary of what failed so far before it
  exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Optional

import pytest

TAIL_CHARS = 3000

_config: Optional[pytest.Config] = None
_SLOW_KEY = pytest.StashKey[float]()
_spent: dict[str, float] = {}  # node id -> seconds of its phases so far
_PID = os.getpid()


def _slow_s() -> float:
    raw = os.environ.get("LMCA_TEST_SLOW_S", "120")
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(f"LMCA_TEST_SLOW_S={raw!r}: expected a number of seconds") from None


def _write(line: str) -> None:
    if _config is None:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    # A signal comes while a test runs, with stdout captured at the file
    # descriptor: the line would go into the test's capture, never shown.
    capman = _config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        reporter.write_line(line)


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _PID:
        # A process forked from pytest's (an engine process, a worker)
        # inherits this handler: it ends as SIGTERM ends it by default.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _write(f"[tests] SIGTERM (pid {os.getpid()}): stopping; fixtures are torn down and the summary follows")
    raise KeyboardInterrupt("SIGTERM")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    config.stash[_SLOW_KEY] = _slow_s()
    # Only where nobody chose otherwise (a test runner with its own handler
    # keeps it) and only in the main thread (signal.signal's rule).
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration
    if report.failed:
        text = report.longreprtext
        cut = f"... ({len(text) - TAIL_CHARS} characters before this)\n" if len(text) > TAIL_CHARS else ""
        _write(f"[failed] {report.nodeid} ({report.when}, after {_spent[report.nodeid]:.0f} s):\n"
               f"{cut}{text[-TAIL_CHARS:]}")
    if report.when == "teardown":
        spent = _spent.pop(report.nodeid, 0.0)
        if _config is not None and spent > _config.stash[_SLOW_KEY]:
            _write(f"[slow] {report.nodeid}: {spent:.0f} s (setup, call and teardown)")
