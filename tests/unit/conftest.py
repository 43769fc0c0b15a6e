"""Unit tests run without vLLM and without the native extension; where the
extension is importable, the transfer tests also run through it."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The checkout (when not installed) and tests/ (for the `fixtures` package;
# a stray `tests` package in site-packages shadows `tests.fixtures`).
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _ops_modules():
    from lmcache_ascend.v1 import reference_ops

    mods = [pytest.param(reference_ops, id="reference")]
    try:
        mods.append(pytest.param(importlib.import_module("lmcache_ascend.ops"), id="native"))
    except ImportError:
        pass
    return mods


@pytest.fixture(params=_ops_modules())
def ops(request):
    return request.param
