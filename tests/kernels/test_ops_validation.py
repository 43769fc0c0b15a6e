# SPDX-License-Identifier: Apache-2.0
"""Bad inputs raise a clear error BEFORE any byte is written.

Each case mutates one argument of a valid call, checks the exception type
and that its message names the argument/value, then checks that the
destination (chunk for stores, pools for loads) is byte-identical.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from lmcache.lmcache_native import EngineKVFormat, TransferDirection

import plane_reference as ref
from plane_reference import Plane

PLANES = [Plane(4, 6, 5, 4 * 6 + 2), Plane(2, 132, 7, 2 * 132)]
SLOTS = [np.array([0, 1, 2, -1, 19], np.int64), np.array([13], np.int64)]
L = 2


@pytest.fixture
def mp_case():
    rng = np.random.default_rng(0)
    pools = [[torch.from_numpy(rng.integers(0, 256, p.num_blocks * p.stride, dtype=np.uint8))
              for p in PLANES] for _ in range(L)]
    chunk = torch.from_numpy(rng.integers(0, 256, ref.layout_bytes(PLANES, SLOTS, L),
                                          dtype=np.uint8))
    args = ref.native_args(PLANES, SLOTS, [[p.data_ptr() for p in lp] for lp in pools])
    return chunk, pools, args


def _t(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


MP_CASES = {
    "slot_out_of_range": (dict(slot_mapping=_t([0, 1, 2, -1, 20, 13])), ValueError,
                          r"slot_mapping\[4\] = 20 is out of range.*plane 0"),
    "slot_out_of_range_plane1": (dict(slot_mapping=_t([0, 1, 2, -1, 19, 14])), ValueError,
                                 r"slot_mapping\[5\] = 14 is out of range.*plane 1"),
    "offsets_length": (dict(plane_slot_offsets=_t([0, 6])), ValueError,
                       r"plane_slot_offsets.*2 entries; expected 3"),
    "offsets_end": (dict(plane_slot_offsets=_t([0, 5, 5])), ValueError,
                    r"end at slot_mapping.numel\(\) = 6"),
    "offsets_decreasing": (dict(plane_slot_offsets=_t([0, 7, 6])), ValueError,
                           "non-decreasing"),
    "row_bytes_length": (dict(plane_row_bytes=_t([6])), ValueError,
                         r"plane_row_bytes' has 1 entries; expected 2"),
    "ptrs_length": (dict(plane_ptrs=_t([1, 2, 3])), ValueError,
                    r"plane_ptrs' has 3 entries; expected 4"),
    "slot_dtype": (dict(slot_mapping=_t([0, 1, 2, -1, 19, 13], torch.int32)), TypeError,
                   r"slot_mapping' must have dtype torch.int64, got Int"),
    "block_sizes_dtype": (dict(plane_block_sizes=_t([4, 2], torch.int32)), TypeError,
                          "plane_block_sizes' must have dtype torch.int64"),
    "zero_row_bytes": (dict(plane_row_bytes=_t([6, 0])), ValueError,
                       r"plane_row_bytes\[1\] = 0.*must all be > 0"),
    "zero_block_size": (dict(plane_block_sizes=_t([0, 2])), ValueError,
                        r"plane_block_sizes\[0\] = 0"),
    "negative_num_blocks": (dict(plane_num_blocks=_t([5, -1])), ValueError,
                            r"plane_num_blocks\[1\] = -1"),
    "stride_too_small": (dict(plane_block_stride_bytes=_t([23, 264])), ValueError,
                         r"plane_block_stride_bytes\[0\] = 23 is below block_size x row_bytes = 24"),
    "ptrs_on_meta": (dict(plane_ptrs=torch.zeros(4, dtype=torch.int64, device="meta")),
                     RuntimeError, r"plane_ptrs' must be a CPU tensor.*'meta'"),
    "slots_on_meta": (dict(slot_mapping=torch.zeros(6, dtype=torch.int64, device="meta")),
                      RuntimeError, r"slot_mapping' is on device 'meta'.*not compiled"),
}


@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("case", sorted(MP_CASES))
def test_multi_plane_rejects_before_writing(native, mp_case, case, to_chunk):
    chunk, pools, args = mp_case
    change, exc, pattern = MP_CASES[case]
    chunk0, pools0 = chunk.clone(), [[p.clone() for p in lp] for lp in pools]
    with pytest.raises(exc, match=pattern):
        native.multi_plane_kv_transfer(chunk, **{**args, **change}, to_chunk=to_chunk,
                                       num_layers=L)
    assert torch.equal(chunk, chunk0)
    for lp, lp0 in zip(pools, pools0):
        for p, p0 in zip(lp, lp0):
            assert torch.equal(p, p0)


def test_multi_plane_bad_chunk_and_pointers(native, mp_case):
    chunk, pools, args = mp_case
    call = lambda c, **kw: native.multi_plane_kv_transfer(  # noqa: E731
        c, **{**args, **kw}, to_chunk=True, num_layers=L)
    with pytest.raises(ValueError, match=r"'chunk' holds \d+ bytes but the layout"):
        call(chunk[:-1])
    with pytest.raises(ValueError, match="'chunk' must be contiguous"):
        call(torch.zeros(2 * chunk.numel(), dtype=torch.uint8)[::2])
    with pytest.raises(RuntimeError, match=r"'chunk' is on device 'meta'.*NPU \(Ascend\) backend"):
        call(torch.empty_like(chunk, device="meta"))
    ptrs = args["plane_ptrs"].clone()
    ptrs[3] = 0
    with pytest.raises(ValueError, match=r"plane_ptrs\[3\] \(layer 1, plane 1\) is a null pointer"):
        call(chunk, plane_ptrs=ptrs)
    with pytest.raises(ValueError, match="num_layers' = 0"):
        native.multi_plane_kv_transfer(chunk, **args, to_chunk=True, num_layers=0)


def test_block_pages_reject_before_writing(native):
    pools = [torch.randint(0, 255, (4 * 100,), dtype=torch.uint8) for _ in range(2)]
    ptrs = torch.tensor([p.data_ptr() for p in pools])
    chunk = torch.randint(0, 255, (2 * 3 * 90,), dtype=torch.uint8)
    ids = torch.tensor([1, -1, 3])
    snap = [chunk.clone()] + [p.clone() for p in pools]
    cases = [
        (dict(block_ids=torch.tensor([1, 4, 3])), ValueError, r"block_ids\[1\] = 4 is out of range"),
        (dict(block_ids=torch.tensor([1, 2, 3], dtype=torch.int32)), TypeError, "int64"),
        (dict(page_bytes=0), ValueError, "page_bytes' = 0"),
        (dict(block_stride_bytes=80), ValueError, "block_stride_bytes' = 80 must be >= page_bytes = 90"),
        (dict(num_blocks=0), ValueError, "num_blocks' = 0"),
        (dict(chunk=chunk[:-1]), ValueError, "'chunk' holds 539 bytes"),
        (dict(layer_ptrs=torch.tensor([ptrs[0].item(), 0])), ValueError, r"layer_ptrs\[1\].*null"),
        (dict(layer_ptrs=ptrs.to(torch.int32)), TypeError, "layer_ptrs' must have dtype"),
        (dict(chunk=torch.empty(540, dtype=torch.uint8, device="meta")), RuntimeError,
         "'meta'.*not compiled"),
    ]
    base = dict(chunk=chunk, layer_ptrs=ptrs, page_bytes=90, block_stride_bytes=100,
                num_blocks=4, block_ids=ids)
    for change, exc, pattern in cases:
        for to_chunk in (True, False):
            with pytest.raises(exc, match=pattern):
                native.block_page_transfer(**{**base, **change}, to_chunk=to_chunk)
            assert all(torch.equal(a, b) for a, b in zip([chunk] + pools, snap))


def _kv_call(native, **over):
    nl, nb, bs, h = 2, 4, 4, 8
    pools = over.pop("pools")
    kv = over.pop("kv")
    args = dict(key_value=kv, key_value_ptrs=torch.tensor([p.data_ptr() for p in pools]),
                slot_mapping=torch.tensor([0, 5, -1, 15]), paged_memory_device=torch.device("cpu"),
                page_buffer_size=nb * bs, direction=TransferDirection.H2D,
                engine_kv_format=EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, block_size=bs,
                head_size=h)
    args.update(over)
    native.multi_layer_kv_transfer(**args)
    return nl


KV_CASES = [
    (dict(slot_mapping=torch.tensor([0, 5, -1, 16])), ValueError,
     r"slot_mapping\[3\] = 16 is out of range: valid slots are 0..15"),
    (dict(slot_mapping=torch.tensor([0, 5], dtype=torch.int32)), TypeError, "int64"),
    (dict(slot_mapping=torch.arange(5)), ValueError, "at most key_value.size\\(2\\) = 4"),
    (dict(engine_kv_format=EngineKVFormat.NB_NL_TWO_BS_NH_HS), ValueError,
     "engine_kv_format' = .* is not supported"),
    (dict(direction=5), ValueError, "direction' = 5 is not a TransferDirection"),
    (dict(paged_memory_device="npu:0"), RuntimeError,
     "paged_memory_device' is on device 'npu:0'.*NPU \\(Ascend\\) backend was not compiled"),
    (dict(engine_kv_format=EngineKVFormat.NL_X_TWO_NB_NH_BS_HS, head_size=3), ValueError,
     "head_size' = 3 must be > 0 and divide"),
    (dict(block_stride_elems=5), ValueError, "block stride of 10 bytes, below the tight"),
    (dict(key_value_ptrs=torch.tensor([1])), ValueError, "1 entries but key_value has 2 layers"),
    (dict(key_value_ptrs=torch.tensor([1, 0])), ValueError, r"key_value_ptrs\[1\] is a null pointer"),
    (dict(page_buffer_size=15), ValueError, "not a multiple of block_size = 4"),
    (dict(skip_prefix_n_tokens=-1), ValueError, "skip_prefix_n_tokens' = -1"),
]


@pytest.mark.parametrize("idx", range(len(KV_CASES)))
def test_multi_layer_kv_rejects_before_writing(native, idx):
    change, exc, pattern = KV_CASES[idx]
    pools = [torch.randn(2 * 16 * 8).to(torch.bfloat16) for _ in range(2)]
    kv = torch.randn(2, 2, 4, 8).to(torch.bfloat16)
    snap = [p.clone() for p in pools]
    with pytest.raises(exc, match=pattern):
        _kv_call(native, pools=pools, kv=kv, **change)
    assert all(torch.equal(p.view(torch.int16), s.view(torch.int16)) for p, s in zip(pools, snap))


def test_non_cpu_tensor_raises_naming_device(native):
    kv = torch.empty(2, 2, 4, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="'key_value' is on device 'meta'.*built backends: cpu"):
        _kv_call(native, pools=[torch.zeros(256)] * 2, kv=kv)


def test_built_backends(native):
    backends = native.built_backends()
    assert backends[0] == "cpu"
    if not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")):
        assert backends == ["cpu"]


def test_bind_native_surface(native):
    """LMCache binds every public callable/type of the module onto DeviceOps:
    only LMCache's own op names plus our documented extras may appear."""
    from lmcache.v1.platform.base.device_ops import DeviceOps

    lmcache_ops = {"multi_layer_kv_transfer", "single_layer_kv_transfer",
                   "multi_layer_block_kv_transfer", "lmcache_memcpy_async", "batched_memcpy"}
    extras = {"multi_plane_kv_transfer", "block_page_transfer", "built_backends",
                  "cpu_copy_threads"}
    public = {n for n in dir(native) if not n.startswith("_")}
    assert public == lmcache_ops | extras
    for name in lmcache_ops:
        assert hasattr(DeviceOps, name), name
    for name in extras:
        assert not hasattr(DeviceOps, name), f"{name} would shadow a DeviceOps member"
    dev = DeviceOps()
    dev.bind_native(native)
    assert dev.multi_layer_kv_transfer is native.multi_layer_kv_transfer
    assert not any(isinstance(getattr(native, n), type) for n in public)
