"""The bench scripts (bench/, not a package) for the tests that check their
figures and options.

A bench script imports its siblings by plain name (``from serving_report
import ...``, some only when a function runs, e.g. bench_serving's ``from
bench_e2e import``): run as a script, bench/ is its ``sys.path[0]``. A test
importing one needs bench/ on ``sys.path`` the same way, for as long as it
runs, and this is the one place that puts it there (test modules edit no
``sys.path``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """The bench module ``name`` (e.g. "bench_serving"), imported as its
    script imports its siblings."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
