"""Pure numpy implementation of the two transfer ops the planner drives.

Same names, arguments and chunk layout as the native ``lmcache_ascend.ops``
(see docs/kernels.md); it works on raw data pointers, so it exercises exactly
the geometry a kernel receives. Used as the test oracle for the native ops'
contract and to run the planning code where the extension is not built.
CPU memory only.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

Bytes = NDArray[np.uint8]


def _bytes_at(ptr: int, nbytes: int) -> Bytes:
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _blocks(ptr: int, num_blocks: int, stride: int, rows: int, row_bytes: int) -> Bytes:
    """[num_blocks, rows, row_bytes] view of paged memory at ``ptr``."""
    span = (num_blocks - 1) * stride + rows * row_bytes
    return np.lib.stride_tricks.as_strided(
        _bytes_at(ptr, span), shape=(num_blocks, rows, row_bytes), strides=(stride, row_bytes, 1)
    )


def _chunk_array(chunk: torch.Tensor, nbytes: int) -> Bytes:
    if chunk.device.type != "cpu" or chunk.dtype != torch.uint8 or not chunk.is_contiguous():
        raise ValueError("chunk must be a contiguous CPU uint8 tensor")
    if chunk.numel() < nbytes:
        raise ValueError(f"chunk holds {chunk.numel()} bytes, the transfer needs {nbytes}")
    return chunk.numpy()


def _move(
    paged: Bytes, ids: NDArray[np.integer[Any]], bs: int, packed: Bytes, to_chunk: bool, where: str
) -> None:
    """Rows ``ids`` (slot = block * bs + offset; < 0 = skip) between paged
    memory and ``packed`` (one row per id, skipped rows keep their place)."""
    valid = ids >= 0
    if not valid.any():
        return
    sel = ids[valid]
    limit = paged.shape[0] * bs
    if int(sel.max()) >= limit:
        raise IndexError(f"{where}: slot {int(sel.max())} out of range (blocks x rows = {limit})")
    blk, off = sel // bs, sel % bs
    if to_chunk:
        packed[valid] = paged[blk, off]
    else:
        paged[blk, off] = packed[valid]


def multi_plane_kv_transfer(
    chunk: torch.Tensor,
    plane_ptrs: torch.Tensor,
    plane_block_sizes: torch.Tensor,
    plane_block_stride_bytes: torch.Tensor,
    plane_row_bytes: torch.Tensor,
    plane_num_blocks: torch.Tensor,
    slot_mapping: torch.Tensor,
    plane_slot_offsets: torch.Tensor,
    to_chunk: bool,
    num_layers: int,
) -> None:
    """L layers x P planes; chunk = layer-major, then plane-major rows."""
    ptrs = plane_ptrs.numpy()
    bsz = plane_block_sizes.numpy()
    strides = plane_block_stride_bytes.numpy()
    rbytes = plane_row_bytes.numpy()
    nblocks = plane_num_blocks.numpy()
    slots = slot_mapping.numpy()
    offs = plane_slot_offsets.numpy()
    planes = bsz.shape[0]
    if ptrs.shape[0] != num_layers * planes or offs.shape[0] != planes + 1:
        raise ValueError(
            f"plane_ptrs has {ptrs.shape[0]} entries for {num_layers} layers x {planes} planes; "
            f"plane_slot_offsets has {offs.shape[0]}"
        )
    counts = np.diff(offs)
    layer_bytes = int((counts * rbytes).sum())
    data = _chunk_array(chunk, layer_bytes * num_layers)
    for layer in range(num_layers):
        base = layer * layer_bytes
        for p in range(planes):
            n, rb, bs = int(counts[p]), int(rbytes[p]), int(bsz[p])
            packed = data[base : base + n * rb].reshape(n, rb)
            base += n * rb
            paged = _blocks(int(ptrs[layer * planes + p]), int(nblocks[p]), int(strides[p]), bs, rb)
            _move(paged, slots[offs[p] : offs[p + 1]], bs, packed, to_chunk, f"layer {layer} plane {p}")


def block_page_transfer(
    chunk: torch.Tensor,
    layer_ptrs: torch.Tensor,
    page_bytes: int,
    block_stride_bytes: int,
    num_blocks: int,
    block_ids: torch.Tensor,
    to_chunk: bool,
) -> None:
    """Whole pages: chunk = layer-major, then pages in ``block_ids`` order."""
    ptrs = layer_ptrs.numpy()
    ids = block_ids.numpy()
    n = ids.shape[0]
    data = _chunk_array(chunk, ptrs.shape[0] * n * page_bytes)
    for layer in range(ptrs.shape[0]):
        packed = data[layer * n * page_bytes : (layer + 1) * n * page_bytes].reshape(n, page_bytes)
        paged = _blocks(int(ptrs[layer]), num_blocks, block_stride_bytes, 1, page_bytes)
        _move(paged, ids, 1, packed, to_chunk, f"layer {layer}")
