# SPDX-License-Identifier: Apache-2.0
"""The simulation's op tests on a real device (the NPU counterpart of
test_ascend_sim.py).

The op tests move host memory: they pass host addresses in pointer tables.
DeviceMirror runs lmcache_ascend.ops on LMCA_KERNEL_TEST_DEVICE instead:
for each call it copies every tensor argument and every host range the
call's pointer tables reach (sized by the call's own geometry, overlapping
ranges merged so aliased planes stay aliased) to the device, rewrites the
pointer tables to the device copies, runs the op there and copies
everything back; the unchanged test then compares bytes on the host.

Default device "cpu": the CPU backend runs on the mirrored copies, which
checks the mirror itself.  On an NPU host built with CANN:
    LMCA_KERNEL_TEST_DEVICE=npu pytest -q tests/kernels/test_ascend_sim_npu.py
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import kv_reference as ref
import lmcache_ascend.ops as ops
import block_kv_checks as bk
import multi_plane_checks as mp
import token_row_checks as tr
from kernel_helpers import DTYPES

DEVICE = os.environ.get("LMCA_KERNEL_TEST_DEVICE", "cpu")
if DEVICE.startswith("npu"):
    torch_npu = pytest.importorskip("torch_npu")
    if "ascend" not in ops.built_backends():
        pytest.skip("lmcache_ascend.ops was built without the Ascend backend",
                    allow_module_level=True)


class _Call:
    """Device copies of one op call's host memory."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copies: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        d = t.to(DEVICE, copy=True)
        self.tensors.append((t, d))
        return d

    def reach(self, addresses, nbytes) -> None:
        for a, n in zip(addresses, nbytes):
            self.ranges.append((int(a), int(a) + int(n)))

    def upload(self) -> None:
        merged: list[list[int]] = []
        for s, e in sorted(self.ranges):
            if merged and s <= merged[-1][1]:  # overlapping or adjacent: one buffer
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        for s, e in merged:
            host = torch.frombuffer((ctypes.c_uint8 * (e - s)).from_address(s), dtype=torch.uint8)
            self.copies.append((s, e, host, host.to(DEVICE, copy=True)))

    def address(self, a: int) -> int:
        for s, e, _, dev in self.copies:
            if s <= a < e:
                return dev.data_ptr() + (a - s)
        raise AssertionError(f"address {a:#x} was not mirrored")

    def table(self, addresses) -> torch.Tensor:
        return torch.tensor([self.address(int(a)) for a in addresses], dtype=torch.int64)

    def download(self) -> None:
        for t, d in self.tensors:
            t.copy_(d.cpu())
        for _, _, host, dev in self.copies:
            host.copy_(dev.cpu())


def _addresses(table) -> list[int]:
    if isinstance(table, torch.Tensor):
        return table.tolist()
    return [t.data_ptr() for t in table]


class DeviceMirror:
    """lmcache_ascend.ops on DEVICE for tests written against host memory."""

    def multi_layer_kv_transfer(self, key_value, key_value_ptrs, slot_mapping, device,
                                page_buffer_size, direction, engine_kv_format, block_size=0,
                                head_size=0, skip_prefix_n_tokens=0, block_stride_elems=0):
        fmt, hidden = int(engine_kv_format), key_value.shape[3]
        bs = block_size or page_buffer_size
        nh, hs = (hidden // head_size, head_size) if fmt in ref.HND else (1, hidden)
        pool = ref.pool_elems(fmt, page_buffer_size // bs, bs, nh, hs, block_stride_elems)
        c, ptrs = _Call(), _addresses(key_value_ptrs)
        c.reach(ptrs, [pool * key_value.element_size()] * len(ptrs))
        kv = c.tensor(key_value)
        c.upload()
        ops.multi_layer_kv_transfer(kv, c.table(ptrs), slot_mapping, torch.device(DEVICE),
                                    page_buffer_size, direction, engine_kv_format,
                                    block_size=block_size, head_size=head_size,
                                    skip_prefix_n_tokens=skip_prefix_n_tokens,
                                    block_stride_elems=block_stride_elems)
        c.download()

    def single_layer_kv_transfer(self, lmc, vllm, slot_mapping, direction, engine_kv_format,
                                 token_major=False):
        c = _Call()
        ops.single_layer_kv_transfer(c.tensor(lmc), c.tensor(vllm), slot_mapping, direction,
                                     engine_kv_format, token_major=token_major)
        c.download()

    def multi_layer_block_kv_transfer(self, ptrs, objects, block_ids, device, direction,
                                      d, chunk_size, engine_kv_format, skip):
        fmt = int(engine_kv_format)
        nh = 1 if fmt == ref.NB_BS_HS else d.nh
        pool = ref.pool_elems(fmt, d.nb, d.bs, nh, d.hs, d.block_stride_elems)
        c, addrs = _Call(), _addresses(ptrs)
        c.reach(addrs, [pool * d.element_size] * len(addrs))
        # Objects given as addresses are host memory (pinned MemoryObjs): the
        # Ascend path stages them itself.
        objs = [c.tensor(o) if isinstance(o, torch.Tensor) else o for o in objects]
        c.upload()
        ops.multi_layer_block_kv_transfer(c.table(addrs), objs, block_ids, torch.device(DEVICE),
                                          direction, d, chunk_size, engine_kv_format, skip)
        c.download()

    def multi_plane_kv_transfer(self, chunk, plane_ptrs, plane_block_sizes,
                                plane_block_stride_bytes, plane_row_bytes, plane_num_blocks,
                                slot_mapping, plane_slot_offsets, to_chunk, num_layers):
        per_plane = [(nb - 1) * st + bs * rb for bs, st, rb, nb in zip(
            plane_block_sizes.tolist(), plane_block_stride_bytes.tolist(),
            plane_row_bytes.tolist(), plane_num_blocks.tolist())]
        c, addrs = _Call(), plane_ptrs.tolist()
        c.reach(addrs, per_plane * num_layers)
        dev_chunk = c.tensor(chunk)
        c.upload()
        ops.multi_plane_kv_transfer(dev_chunk, c.table(addrs), plane_block_sizes,
                                    plane_block_stride_bytes, plane_row_bytes, plane_num_blocks,
                                    slot_mapping, plane_slot_offsets, to_chunk, num_layers)
        c.download()

    def block_page_transfer(self, chunk, layer_ptrs, page_bytes, block_stride_bytes,
                            num_blocks, block_ids, to_chunk):
        c, addrs = _Call(), layer_ptrs.tolist()
        c.reach(addrs, [(num_blocks - 1) * block_stride_bytes + page_bytes] * len(addrs))
        dev_chunk = c.tensor(chunk)
        c.upload()
        ops.block_page_transfer(dev_chunk, c.table(addrs), page_bytes, block_stride_bytes,
                                num_blocks, block_ids, to_chunk)
        c.download()


@pytest.fixture
def device_ops() -> DeviceMirror:
    return DeviceMirror()


@pytest.mark.parametrize("padded", [False, True], ids=["tight", "padded"])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.ALL_FORMATS)
def test_token_rows_vs_reference(device_ops, gen, fmt, d2h, padded):
    tr.check_multi_layer_vs_reference(device_ops, gen, fmt, d2h, padded)


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.NHD_FORMATS)
def test_token_rows_vs_lmcache_baseline(device_ops, gen, fmt, d2h):
    for dtype in DTYPES:
        tr.check_multi_layer_vs_lmcache_baseline(device_ops, gen, fmt, dtype, d2h)


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.ALL_FORMATS)
def test_single_layer(device_ops, gen, fmt, d2h, token_major):
    tr.check_single_layer(device_ops, gen, fmt, d2h, token_major)


def test_strided_chunk_and_short_slot_mapping(device_ops, gen):
    tr.check_strided_chunk_and_short_slot_mapping(device_ops, gen)


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", bk.ALL_FORMATS)
def test_block_kv(device_ops, gen, fmt, d2h):
    bk.check_block_kv_vs_lmcache_baseline(device_ops, gen, fmt, d2h)
    bk.check_block_kv_padded_vs_reference(device_ops, gen, fmt, d2h)


@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_multi_plane(device_ops, to_chunk):
    mp.check_dsv4_like_many_layers(device_ops, to_chunk)
    mp.check_random_geometries(device_ops, to_chunk)


def test_multi_plane_shared_blob_and_round_trip(device_ops):
    mp.check_shared_blob_planes(device_ops)
    mp.check_round_trip_restores_selected_rows(device_ops)


@pytest.mark.parametrize("tight", [True, False], ids=["tight", "padded"])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_block_pages(device_ops, to_chunk, tight):
    mp.check_block_pages(device_ops, to_chunk, tight)
    mp.check_block_pages_vllm_cpu_layout(device_ops)


def test_mirror_copies_and_merges_aliased_ranges():
    """Planes that alias one blob are mirrored as one device buffer."""
    blob = torch.arange(64, dtype=torch.uint8)
    c = _Call()
    base = blob.data_ptr()
    c.reach([base, base + 16, base + 60], [32, 32, 4])  # [0, 48) and [60, 64)
    c.upload()
    assert [(s - base, e - base) for s, e, _, _ in c.copies] == [(0, 48), (60, 64)]
    dev = c.copies[0][3]
    assert c.address(base + 20) == dev.data_ptr() + 20 and dev.data_ptr() != base
    dev[20] = 255
    c.download()
    assert int(blob[20]) == 255
