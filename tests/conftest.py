"""Test support lives in tests/ (never in the shipped package): `fixtures`
(layout fixtures and their oracle) and `support` (fault injection, shared
by the integration tests and the engine processes they start)."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_terminal_summary(terminalreporter):
    """How many test engines were forked from zygotes (support/engine_zygote.py)
    and how many zygotes that took: the figure that says whether they pay."""
    zygote = sys.modules.get("engine_zygote")
    pool = getattr(zygote, "_POOL", None)
    if pool is not None:
        terminalreporter.write_line(
            f"engine zygotes: {pool.started} started, {pool.forks} engines forked from them")
