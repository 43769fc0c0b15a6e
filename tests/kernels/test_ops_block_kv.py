# SPDX-License-Identifier: Apache-2.0
"""multi_layer_block_kv_transfer, lmcache_memcpy_async, batched_memcpy.

The block transfer checks are in block_kv_checks.py, which the AscendC
simulation's tests (test_ascend_sim*.py) run too.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from lmcache.lmcache_native import TransferDirection
from lmcache.v1.platform import torch_ops

import block_kv_checks as checks
from block_kv_checks import ALL_FORMATS
from kernel_helpers import assert_bytes_equal, rand_tensor


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_block_kv_vs_lmcache_baseline(native, gen, fmt, d2h):
    checks.check_block_kv_vs_lmcache_baseline(native, gen, fmt, d2h)


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_block_kv_padded_vs_reference(native, gen, fmt, d2h):
    checks.check_block_kv_padded_vs_reference(native, gen, fmt, d2h)


def test_block_kv_rejects_bad_block_ids_before_writing(native, gen):
    checks.check_block_kv_rejects_bad_block_ids_before_writing(native, gen)


@pytest.mark.parametrize("pointer_mode", [False, True])
def test_lmcache_memcpy_async_vs_baseline(native, gen, pointer_mode):
    src = rand_tensor((1 << 20) + 7, torch.uint8, gen)
    dst, base = torch.zeros_like(src), torch.zeros_like(src)
    nbytes = src.numel() - 5
    args = (TransferDirection.H2D, 0, 64)
    if pointer_mode:
        # The baseline's pointer mode needs a working libcudart; the expected
        # bytes are simply the first nbytes of src.
        native.lmcache_memcpy_async(dst.data_ptr(), src.data_ptr(), nbytes, *args)
        base[:nbytes] = src[:nbytes]
    else:
        native.lmcache_memcpy_async(dst, src, nbytes, *args)
        torch_ops.lmcache_memcpy_async(base, src, nbytes, *args)
    assert_bytes_equal(dst, base, "memcpy")
    assert int(dst[-5:].count_nonzero()) == 0


def test_lmcache_memcpy_async_rejects(native):
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        native.lmcache_memcpy_async(a, b, 8, TransferDirection.H2D, 0, 3)
    with pytest.raises(TypeError, match="Mixed types"):
        native.lmcache_memcpy_async(a, b.data_ptr(), 8, TransferDirection.H2D, 0, 4)
    with pytest.raises(ValueError, match="element size"):
        native.lmcache_memcpy_async(a, b, 6, TransferDirection.H2D, 0, 4)
    with pytest.raises(ValueError, match="exceeds"):
        native.lmcache_memcpy_async(a, b, 64, TransferDirection.H2D, 0, 4)
    with pytest.raises(ValueError, match="TransferDirection"):
        native.lmcache_memcpy_async(a, b, 8, 7, 0, 4)


def test_batched_memcpy_vs_baseline(native, gen):
    srcs = [rand_tensor((n,), torch.uint8, gen) for n in (1, 6, 132, 584, 3 << 20)]
    dsts = [torch.zeros_like(s) for s in srcs]
    base = [torch.zeros_like(s) for s in srcs]
    sizes = [s.numel() for s in srcs]
    sizes[1] = 0  # skipped
    native.batched_memcpy([s.data_ptr() for s in srcs], [d.data_ptr() for d in dsts], sizes)
    torch_ops.batched_memcpy([s.data_ptr() for s in srcs], [d.data_ptr() for d in base], sizes)
    for d, b in zip(dsts, base):
        assert_bytes_equal(d, b, "batched")
    with pytest.raises(ValueError, match="equally sized"):
        native.batched_memcpy([1], [2, 3], [4])
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\] is a null pointer"):
        native.batched_memcpy([srcs[0].data_ptr()], [0], [1])
    assert ctypes.sizeof(ctypes.c_void_p) == 8
