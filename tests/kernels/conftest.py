# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the native kernel tests; helpers live in kernel_helpers.py,
the checks that the CPU op tests and the AscendC simulation's tests share in
*_checks.py (test modules import no test module)."""

from __future__ import annotations

import pytest
import torch

import lmcache_ascend.ops as ops


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture(scope="session")
def native():
    return ops
