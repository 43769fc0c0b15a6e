# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the native kernel tests; helpers live in kernel_helpers.py."""

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
