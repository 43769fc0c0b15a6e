"""Test support lives in tests/ (never in the shipped package): `fixtures`
(layout fixtures and their oracle) and `support` (fault injection, shared
by the integration tests and the engine processes they start)."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
