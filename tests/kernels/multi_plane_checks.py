# SPDX-License-Identifier: Apache-2.0
"""The checks of multi_plane_kv_transfer and block_page_transfer against
numpy references, for any object with lmcache_ascend.ops' signatures as
``native``: the CPU ops (test_ops_multi_plane.py), the AscendC simulation
(test_ascend_sim*.py) and a device (test_ascend_sim_npu.py) run the same
checks.

Whole pools (padding included) and whole chunks are compared, so a write
outside the selected slots/pages, or into a -1 row, fails the check.
"""

from __future__ import annotations

import numpy as np
import torch

import plane_reference as ref
from plane_reference import Plane

# DeepSeek-V4-like bundled group: 584-byte DSA rows, 132-byte indexer rows
# (128 int8 + fp32 scale), a 6-byte odd plane, a wide bf16 SWA plane.
DSV4_PLANES = [
    Plane(block_size=64, row_bytes=584, num_blocks=6, stride=64 * 584 + 96),
    Plane(block_size=64, row_bytes=132, num_blocks=6, stride=64 * 132),
    Plane(block_size=4, row_bytes=6, num_blocks=40, stride=4 * 6 + 2),
    Plane(block_size=256, row_bytes=1024, num_blocks=2, stride=256 * 1024),
]

def check_dsv4_like_many_layers(native, to_chunk):
    rng = np.random.default_rng(7)
    counts = [64, 64, 0, 3]  # indexer/attn rows, an empty plane, a tiny SW tail
    slots = [ref.plane_slots(p, n, rng) for p, n in zip(DSV4_PLANES, counts)]
    ref.check_multi_plane(native, DSV4_PLANES, slots, num_layers=61, to_chunk=to_chunk, rng=rng)


def check_random_geometries(native, to_chunk):
    rng = np.random.default_rng(11 + to_chunk)
    for _ in range(25):
        nplanes = int(rng.integers(1, 6))
        planes = []
        for _ in range(nplanes):
            bs = int(rng.choice([1, 2, 3, 4, 8, 16, 64, 128]))
            rb = int(rng.choice([1, 6, 7, 132, 584, int(rng.integers(1, 700))]))
            nb = int(rng.integers(1, 9))
            pad = int(rng.choice([0, 0, 1, 32, int(rng.integers(1, 300))]))
            planes.append(Plane(bs, rb, nb, bs * rb + pad))
        slots = [ref.plane_slots(p, int(rng.integers(0, p.num_blocks * p.block_size // 2 + 1)),
                                 rng, neg_frac=float(rng.choice([0.0, 0.2, 1.0])))
                 for p in planes]
        ref.check_multi_plane(native, planes, slots, int(rng.integers(1, 5)), to_chunk, rng,
                  extra_chunk=int(rng.integers(0, 3)) * 17)


def check_shared_blob_planes(native):
    """Planes that are views of one int8 blob per block (DSA-C8): plane 1
    starts after plane 0's rows inside every block; strides are the blob's."""
    rng = np.random.default_rng(3)
    bs, nb, rb0, rb1 = 16, 8, 584, 132
    block = bs * (rb0 + rb1) + 64
    blob = torch.from_numpy(rng.integers(0, 256, nb * block, dtype=np.uint8))
    planes = [Plane(bs, rb0, nb, block), Plane(bs, rb1, nb, block)]
    slots = [ref.plane_slots(p, 40, rng) for p in planes]
    for to_chunk in (True, False):
        chunk = torch.from_numpy(rng.integers(0, 256, ref.layout_bytes(planes, slots, 1),
                                              dtype=np.uint8))
        exp_blob, exp_chunk = blob.numpy().copy(), chunk.numpy().copy()
        ptrs = [[blob.data_ptr(), blob.data_ptr() + bs * rb0]]
        native.multi_plane_kv_transfer(chunk, **ref.native_args(planes, slots, ptrs),
                                       to_chunk=to_chunk, num_layers=1)
        # Reference on numpy views of the same blob copy.
        views = [[exp_blob, exp_blob[bs * rb0:]]]
        ref.multi_plane(exp_chunk, views, planes, slots, to_chunk)
        np.testing.assert_array_equal(chunk.numpy(), exp_chunk)
        np.testing.assert_array_equal(blob.numpy(), exp_blob)


def check_round_trip_restores_selected_rows(native):
    rng = np.random.default_rng(5)
    slots = [ref.plane_slots(p, n, rng, neg_frac=0.0) for p, n in zip(DSV4_PLANES, [50, 50, 9, 7])]
    chunk, pools = ref.check_multi_plane(native, DSV4_PLANES, slots, 3, True, rng)
    saved = [[p.clone() for p in layer] for layer in pools]
    for layer in pools:
        for p in layer:
            p.zero_()
    ptrs = [[p.data_ptr() for p in layer] for layer in pools]
    native.multi_plane_kv_transfer(chunk, **ref.native_args(DSV4_PLANES, slots, ptrs),
                                   to_chunk=False, num_layers=3)
    for layer, s_layer in zip(pools, saved):
        for pl, p, s, sl in zip(DSV4_PLANES, layer, s_layer, slots):
            for slot in sl:
                off = (slot // pl.block_size) * pl.stride + (slot % pl.block_size) * pl.row_bytes
                assert torch.equal(p[off:off + pl.row_bytes], s[off:off + pl.row_bytes])


def check_block_pages(native, to_chunk, tight):
    rng = np.random.default_rng(17 + 2 * to_chunk + tight)
    for _ in range(10):
        page = int(rng.choice([1, 6, 584, 4096, 64 * 1024 + 3]))
        stride = page if tight else page + int(rng.integers(1, 200))
        nb, layers = int(rng.integers(2, 12)), int(rng.integers(1, 6))
        n = int(rng.integers(0, nb + 1))
        # Consecutive runs and a shuffled tail, with some negative ids.
        ids = np.concatenate([np.arange(n // 2), rng.permutation(np.arange(n // 2, nb))])[:n]
        ids = ids.astype(np.int64)
        ids[rng.random(n) < 0.2] = -1
        pools = [torch.from_numpy(rng.integers(0, 256, nb * stride, dtype=np.uint8))
                 for _ in range(layers)]
        chunk = torch.from_numpy(rng.integers(0, 256, layers * n * page, dtype=np.uint8))
        ref.check_block_pages(native, pools, chunk, page, stride, nb, ids, to_chunk)


def check_block_pages_vllm_cpu_layout(native):
    """A vLLM-CPU attention layer [NB, NH, BS, 2*HS] (K transposed inside the
    block) moved as opaque pages restores the exact block contents."""
    nb, nh, bs, hs = 10, 2, 16, 32
    layers = [torch.randn(nb, nh, bs, 2 * hs, dtype=torch.bfloat16) for _ in range(3)]
    page = nh * bs * 2 * hs * 2
    ids = torch.tensor([3, 7, -1, 0], dtype=torch.int64)
    chunk = torch.empty(len(layers) * len(ids) * page, dtype=torch.uint8)
    ptrs = torch.tensor([t.data_ptr() for t in layers])
    native.block_page_transfer(chunk, ptrs, page, page, nb, ids, True)
    restored = [torch.zeros_like(t) for t in layers]
    native.block_page_transfer(chunk, torch.tensor([t.data_ptr() for t in restored]),
                               page, page, nb, ids, False)
    for t, r in zip(layers, restored):
        for b in (3, 7, 0):
            assert torch.equal(t[b].view(torch.int16), r[b].view(torch.int16))
        for b in set(range(nb)) - {3, 7, 0}:
            assert int(r[b].view(torch.int16).count_nonzero()) == 0
