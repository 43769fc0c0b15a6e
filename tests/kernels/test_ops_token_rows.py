# SPDX-License-Identifier: Apache-2.0
"""multi_layer_kv_transfer / single_layer_kv_transfer, byte-exact, on the CPU
ops. The checks themselves are in token_row_checks.py, which the AscendC
simulation's tests (test_ascend_sim*.py) run too.
"""

from __future__ import annotations

import pytest
import torch

import kv_reference as ref
import token_row_checks as checks
from kernel_helpers import DTYPES, assert_bytes_equal
from token_row_checks import ALL_FORMATS, NHD_FORMATS, make_case, run_native


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", NHD_FORMATS)
def test_multi_layer_vs_lmcache_baseline(native, gen, fmt, dtype, d2h):
    checks.check_multi_layer_vs_lmcache_baseline(native, gen, fmt, dtype, d2h)


@pytest.mark.parametrize("padded", [False, True], ids=["tight", "padded"])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_multi_layer_vs_reference(native, gen, fmt, d2h, padded):
    checks.check_multi_layer_vs_reference(native, gen, fmt, d2h, padded)


def test_strided_chunk_and_short_slot_mapping(native, gen):
    checks.check_strided_chunk_and_short_slot_mapping(native, gen)


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_single_layer(native, gen, fmt, d2h, token_major):
    checks.check_single_layer(native, gen, fmt, d2h, token_major)


def test_threads_do_not_change_results(native, gen):
    fmt = ref.TWO_NB_BS_NH_HS
    c = make_case(fmt, torch.bfloat16, gen, padded=False)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kv = torch.zeros_like(c["kv"])
            run_native(native, fmt, c, kv, c["pools"], True)
            outs.append(kv)
    finally:
        torch.set_num_threads(old)
    assert_bytes_equal(outs[0], outs[1], "1 vs 2 threads")


def test_pointer_list_and_plain_ints(native, gen):
    """key_value_ptrs may be a list of tensors; direction/format may be ints."""
    fmt = ref.NB_TWO_NH_BS_HS
    c = make_case(fmt, torch.float16, gen, padded=True)
    a, b = torch.zeros_like(c["kv"]), torch.zeros_like(c["kv"])
    run_native(native, fmt, c, a, c["pools"], True)
    native.multi_layer_kv_transfer(
        b, list(c["pools"]), c["slots"], "cpu", c["nb"] * c["bs"], 1, fmt,
        block_size=c["bs"], head_size=c["hs"], skip_prefix_n_tokens=c["skip"],
        block_stride_elems=c["stride"])
    assert_bytes_equal(a, b, "list-of-tensors vs pointer tensor")
