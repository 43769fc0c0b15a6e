# SPDX-License-Identifier: Apache-2.0
"""Finds the test-only AscendC simulation module, lmca_ascend_sim.

It is not part of the lmcache_ascend package (a wheel must not ship it): the
build writes it to build/ascend-sim/ when LMCA_BUILD_ASCEND_SIM=1 (`make
build` sets it).  Tests call ``require()`` (skips the module's tests, with
the reason, when it was not built); benchmarks call ``load()``.  A module
built for another torch is an error, never skipped.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SIM_DIR = ROOT / "build" / "ascend-sim"
NAME = "lmca_ascend_sim"
HOW_TO_BUILD = (
    f"build it with LMCA_BUILD_ASCEND_SIM=1 (`make build` does), which writes {NAME} to {SIM_DIR}"
)


def built() -> bool:
    return any(SIM_DIR.glob(f"{NAME}.*.so"))


def load() -> ModuleType:
    """The module; ImportError naming the fix when it is absent or stale."""
    import torch  # first: the module resolves torch's libraries from the process

    if not built():
        raise ImportError(f"the AscendC simulation module is not built; {HOW_TO_BUILD}")
    module = sys.modules.get(NAME) or _import_built()
    if module._torch_version != torch.__version__:
        raise ImportError(
            f"{module.__file__} was built against torch {module._torch_version}, but this "
            f"process runs torch {torch.__version__}; rebuild: {HOW_TO_BUILD}"
        )
    return module


def _import_built() -> ModuleType:
    """Imports the module from its file in SIM_DIR (the one this Python's
    import system would pick, by extension suffix), leaving SIM_DIR off the
    import path."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = SIM_DIR / f"{NAME}{suffix}"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(NAME, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[NAME] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[NAME]
                raise
            return module
    raise ImportError(f"no {NAME} in {SIM_DIR} is built for this Python "
                      f"({', '.join(importlib.machinery.EXTENSION_SUFFIXES)}); {HOW_TO_BUILD}")


def require() -> ModuleType:
    """For test modules: skip them (with the reason) when the module was not built."""
    import pytest

    if not built():
        pytest.skip(f"AscendC simulation not built: {HOW_TO_BUILD}", allow_module_level=True)
    return load()


class SimOps:
    """Stands in for lmcache_ascend.ops (e.g. as ChunkTransfer's ``ops``):
    every op runs on the simulation with the keyword-only ``machine``
    arguments, and the counters of all calls are summed in ``totals``."""

    COUNTERS = ("launches", "copies_in", "copies_out", "bursts_in", "bursts_out",
                "bytes_in", "bytes_out")

    def __init__(self, module: ModuleType, **machine) -> None:
        self.module, self.machine = module, machine
        self.totals = dict.fromkeys(self.COUNTERS, 0)

    def __getattr__(self, name: str):
        op = getattr(self.module, name)  # AttributeError for ops the simulation lacks

        def call(*args, **kwargs):
            run = op(*args, **kwargs, **self.machine)
            for key in self.COUNTERS:
                self.totals[key] += run[key]
            return run

        return call
