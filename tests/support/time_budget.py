"""A time budget for a test run (loaded by tests/conftest.py; plain pytest
hooks, no vLLM or LMCache).

`make test` runs under a limit (CI's is 90 minutes) on machines whose speed
differs by an order of magnitude: the same suite took 35 minutes on one CI
machine and could not finish its setup in 75 on another. A run cut off by
the limit says nothing about the tests it never reached and loses the
verdict on those it did. So `make test` (scripts/test_all.py) gives each
suite a deadline, and this plugin:

- runs the tests that start no engine first (planning, layouts, kernels,
  the bridge to LMCache: seconds each), then the engine tests, each group in
  its collection order (a module's tests stay together, so module fixtures
  are set up once);
- starts no engine test once ``LMCA_TEST_DEADLINE`` (epoch seconds) has
  passed: such a test is not run, not skipped, not passed. Tests that start
  no engine always run. At the end it names what it did not start, and
  writes them to ``LMCA_TEST_CUT_FILE`` (JSON) for `make test`'s summary.

Without ``LMCA_TEST_DEADLINE`` (a plain pytest) nothing is cut.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import pytest

SHOWN = 20  # node ids named in the log; the cut file has them all

_cut: list[str] = []
_deadline: Optional[float] = None


def _is_engine(item: pytest.Item) -> bool:
    return item.get_closest_marker("engine") is not None


def _parse_deadline() -> Optional[float]:
    raw = os.environ.get("LMCA_TEST_DEADLINE", "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(
            f"LMCA_TEST_DEADLINE={raw!r}: expected epoch seconds (e.g. $(date +%s)), or unset for no deadline"
        ) from None


def pytest_configure(config: pytest.Config) -> None:
    global _deadline
    _deadline = _parse_deadline()
    _cut.clear()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Stable: each group keeps its collection order. Last, so that every
    # other plugin's deselection has happened.
    items[:] = [i for i in items if not _is_engine(i)] + [i for i in items if _is_engine(i)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Optional[bool]:
    if _deadline is None or not _is_engine(item) or time.time() < _deadline:
        return None
    if not _cut:
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"[tests] time budget: the deadline passed "
                                f"{time.time() - _deadline:.0f} s ago; no further engine test starts")
    _cut.append(item.nodeid)
    return True  # handled: pytest runs nothing and reports nothing for it


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("LMCA_TEST_CUT_FILE", "").strip()
    if path:
        with open(path, "w") as f:
            json.dump({"cut": list(_cut)}, f)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not _cut:
        return
    terminalreporter.write_line(f"[tests] time budget: {len(_cut)} engine test(s) not run "
                                f"(not passed, not failed: never started):")
    for nodeid in _cut[:SHOWN]:
        terminalreporter.write_line(f"    {nodeid}")
    if len(_cut) > SHOWN:
        terminalreporter.write_line(f"    ... and {len(_cut) - SHOWN} more")
