# SPDX-License-Identifier: Apache-2.0
"""multi_plane_kv_transfer and block_page_transfer vs numpy references, on
the CPU ops. The checks themselves are in multi_plane_checks.py, which the
AscendC simulation's tests (test_ascend_sim*.py) run too.
"""

from __future__ import annotations

import pytest

import multi_plane_checks as checks


@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_dsv4_like_many_layers(native, to_chunk):
    checks.check_dsv4_like_many_layers(native, to_chunk)


@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_random_geometries(native, to_chunk):
    checks.check_random_geometries(native, to_chunk)


def test_shared_blob_planes(native):
    checks.check_shared_blob_planes(native)


def test_round_trip_restores_selected_rows(native):
    checks.check_round_trip_restores_selected_rows(native)


@pytest.mark.parametrize("tight", [True, False], ids=["tight", "padded"])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_block_pages(native, to_chunk, tight):
    checks.check_block_pages(native, to_chunk, tight)


def test_block_pages_vllm_cpu_layout(native):
    checks.check_block_pages_vllm_cpu_layout(native)
