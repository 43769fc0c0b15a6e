"""The ``pure`` marker is true: a stack whose torch an earlier stack already
ran skips the modules carrying it (Makefile, SAME_TORCH_TESTS: vllm-0.23,
0.27, 0.29, 0.30), which is only sound if importing them loads neither vLLM
nor LMCache, the only things such a stack changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

UNIT = Path(__file__).resolve().parent
TESTS = UNIT.parent

# Run in a fresh interpreter, tests/ on its PYTHONPATH (support/pure_probe.py).
PROBE = TESTS / "support" / "pure_probe.py"


def _marked_pure() -> list[Path]:
    return sorted(p for p in UNIT.glob("test_*.py") if "pytestmark = pytest.mark.pure" in p.read_text())


def test_some_modules_are_marked():
    assert len(_marked_pure()) >= 5


@pytest.mark.parametrize("path", _marked_pure(), ids=lambda p: p.stem)
def test_pure_module_loads_neither_vllm_nor_lmcache(path):
    paths = [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(
        [sys.executable, str(PROBE), str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["pure"], f"{path.name}: the marker is not set on the module"
    assert not result["loaded"], f"{path.name} is marked pure but loads {result['loaded'][:5]}"
