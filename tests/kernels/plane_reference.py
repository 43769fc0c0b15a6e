# SPDX-License-Identifier: Apache-2.0
"""numpy references for multi_plane_kv_transfer and block_page_transfer.

Pools and chunks are uint8 numpy arrays sharing memory with the torch
tensors the native op sees; the reference works on copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Plane:
    block_size: int
    row_bytes: int
    num_blocks: int
    stride: int  # bytes between blocks (>= block_size * row_bytes)


def _gather_index(starts: np.ndarray, width: int) -> np.ndarray:
    return (starts[:, None] + np.arange(width)[None, :]).reshape(-1)


def multi_plane(
    chunk: np.ndarray,
    pools: list[list[np.ndarray]],  # [layer][plane] uint8
    planes: list[Plane],
    slot_lists: list[np.ndarray],
    to_chunk: bool,
) -> None:
    """In place on the given numpy arrays."""
    counts = [len(s) for s in slot_lists]
    prefix = np.concatenate([[0], np.cumsum([n * p.row_bytes for n, p in zip(counts, planes)])])
    layer_bytes = int(prefix[-1])
    for layer, layer_pools in enumerate(pools):
        for p, (pl, slots) in enumerate(zip(planes, slot_lists)):
            rows = np.nonzero(slots >= 0)[0]
            if rows.size == 0:
                continue
            s = slots[rows]
            paged = _gather_index((s // pl.block_size) * pl.stride + (s % pl.block_size) * pl.row_bytes,
                                  pl.row_bytes)
            packed = _gather_index(layer * layer_bytes + prefix[p] + rows * pl.row_bytes,
                                   pl.row_bytes)
            if to_chunk:
                chunk[packed] = layer_pools[p][paged]
            else:
                layer_pools[p][paged] = chunk[packed]


def block_pages(
    chunk: np.ndarray,
    pools: list[np.ndarray],
    page_bytes: int,
    stride: int,
    block_ids: np.ndarray,
    to_chunk: bool,
) -> None:
    n = len(block_ids)
    idx = np.nonzero(block_ids >= 0)[0]
    for layer, pool in enumerate(pools):
        paged = _gather_index(block_ids[idx] * stride, page_bytes)
        packed = _gather_index((layer * n + idx) * page_bytes, page_bytes)
        if to_chunk:
            chunk[packed] = pool[paged]
        else:
            pool[paged] = chunk[packed]


def plane_slots(pl: Plane, n: int, rng: np.random.Generator, neg_frac: float = 0.15) -> np.ndarray:
    """n distinct slots of a plane: shuffled blocks, runs inside blocks, -1s."""
    order = rng.permutation(pl.num_blocks)
    all_slots = (order[:, None] * pl.block_size + np.arange(pl.block_size)).reshape(-1)
    start = int(rng.integers(0, max(1, len(all_slots) - n + 1)))
    slots = all_slots[start : start + n].astype(np.int64)
    assert len(slots) == n
    slots[rng.random(n) < neg_frac] = -1
    return slots


def native_args(planes: list[Plane], slot_lists: list[np.ndarray], ptrs: list[list[int]]):
    """Tensors for lmcache_ascend.ops.multi_plane_kv_transfer."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in slot_lists])])
    slots = np.concatenate(slot_lists) if slot_lists else np.zeros(0, np.int64)
    return dict(
        plane_ptrs=t([p for layer in ptrs for p in layer]),
        plane_block_sizes=t([p.block_size for p in planes]),
        plane_block_stride_bytes=t([p.stride for p in planes]),
        plane_row_bytes=t([p.row_bytes for p in planes]),
        plane_num_blocks=t([p.num_blocks for p in planes]),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        plane_slot_offsets=t(offsets.tolist()),
    )


def layout_bytes(planes: list[Plane], slot_lists: list[np.ndarray], num_layers: int) -> int:
    return num_layers * sum(len(s) * p.row_bytes for p, s in zip(planes, slot_lists))


def check_multi_plane(native, planes, slot_lists, num_layers, to_chunk, rng, extra_chunk=0):
    """Runs multi_plane_kv_transfer on random pools and chunk and compares
    whole pools and the whole chunk with ``multi_plane`` on copies."""
    pools = [[torch.from_numpy(rng.integers(0, 256, p.num_blocks * p.stride, dtype=np.uint8))
              for p in planes] for _ in range(num_layers)]
    need = layout_bytes(planes, slot_lists, num_layers)
    chunk = torch.from_numpy(rng.integers(0, 256, need + extra_chunk, dtype=np.uint8))
    exp_pools = [[p.numpy().copy() for p in layer] for layer in pools]
    exp_chunk = chunk.numpy().copy()
    ptrs = [[p.data_ptr() for p in layer] for layer in pools]
    native.multi_plane_kv_transfer(chunk, **native_args(planes, slot_lists, ptrs),
                                   to_chunk=to_chunk, num_layers=num_layers)
    multi_plane(exp_chunk, exp_pools, planes, slot_lists, to_chunk)
    np.testing.assert_array_equal(chunk.numpy(), exp_chunk)
    for layer, exp_layer in zip(pools, exp_pools):
        for p, e in zip(layer, exp_layer):
            np.testing.assert_array_equal(p.numpy(), e)
    return chunk, pools


def check_block_pages(native, pools, chunk, page, stride, num_blocks, ids, to_chunk):
    """Runs block_page_transfer and compares whole pools and the whole chunk
    with ``block_pages`` on copies."""
    exp_pools, exp_chunk = [p.numpy().copy() for p in pools], chunk.numpy().copy()
    native.block_page_transfer(chunk, torch.tensor([p.data_ptr() for p in pools]),
                               page, stride, num_blocks, torch.from_numpy(ids), to_chunk)
    block_pages(exp_chunk, exp_pools, page, stride, ids, to_chunk)
    np.testing.assert_array_equal(chunk.numpy(), exp_chunk)
    for p, e in zip(pools, exp_pools):
        np.testing.assert_array_equal(p.numpy(), e)
