"""Per-group addressing of one chunk: which rows / pages of vLLM's paged KV
belong to tokens ``[start, end)`` of a request.

Pure numpy. Every function returns the kernel-ready int64 array (``SKIP`` =
leave alone) plus the number of *needed* positions that had no real block
(the null block 0, or past the end of the block table). A store must not
persist a chunk with missing positions (it would save garbage); a load
treats them as positions vLLM does not need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
from numpy.typing import NDArray

from lmcache_ascend.planning.groups import NULL_BLOCK_ID, SKIP, GroupKind, SchedulerGroup

Int64Array = NDArray[np.int64]
# Chunk starts / ends: a list of ints or an int64 array (one per chunk).
Positions = Union[Sequence[int], Int64Array]


@dataclass(frozen=True)
class GroupAddress:
    """Addressing of one group for one chunk."""

    ids: Int64Array  # int64 slots (ROW) or block ids (PAGE); SKIP = untouched
    missing: int  # needed positions without a real block


def _lookup_blocks(block_table: Sequence[int], block_idx: Int64Array) -> Int64Array:
    """Map logical block indices to block ids; beyond the table -> null."""
    table = np.asarray(block_table, dtype=np.int64)
    out = np.full(block_idx.shape, NULL_BLOCK_ID, dtype=np.int64)
    inside = block_idx < table.shape[0]
    out[inside] = table[block_idx[inside]]
    return out


def window_start_token(group: SchedulerGroup, end: Int64Array) -> Int64Array:
    """First position kept for a hit ending at ``end`` in a sliding group.

    vLLM itself keeps positions ``>= end - sliding_window + 1``; we keep one
    more, so a window-size convention off by one elsewhere (e.g. vLLM-Ascend
    specs) can never leave a needed position unstored. The cost is that a
    chunk whose extra position sits in a freed block is not stored.
    Compressor-state groups keep exactly the rows their compressor reads
    (``SchedulerGroup.kept_window``), which lie inside vLLM's window.
    """
    window = group.kept_window
    assert window is not None
    return np.maximum(0, end - window)  # per-chunk array


def _check_range(group: SchedulerGroup, start: int, end: int, chunk_size: int) -> None:
    if start < 0 or end <= start or end - start > chunk_size:
        raise ValueError(
            f"group {group.index}: chunk range [{start}, {end}) is invalid for "
            f"chunk_size {chunk_size}"
        )
    if start % chunk_size:
        raise ValueError(
            f"group {group.index}: chunk start {start} is not a multiple of "
            f"chunk_size {chunk_size}"
        )


@dataclass(frozen=True)
class ChunkAddresses:
    """Addressing of one group for several chunks: row ``k`` of ``ids`` and
    ``missing[k]`` are chunk ``k``'s ``GroupAddress``."""

    ids: Int64Array  # int64 [chunks, physical positions]
    missing: Int64Array  # int64 [chunks]

    def at(self, k: int) -> GroupAddress:
        return GroupAddress(ids=self.ids[k], missing=int(self.missing[k]))


def _ranges(
    group: SchedulerGroup, starts: Positions, ends: Positions, chunk_size: int
) -> tuple[Int64Array, Int64Array]:
    for s, e in zip(starts, ends, strict=True):
        _check_range(group, s, e, chunk_size)
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def chunk_rows(
    group: SchedulerGroup,
    block_table: Sequence[int],
    start: int,
    end: int,
    chunk_size: int,
    rows_per_block: int | None = None,
) -> GroupAddress:
    """Row slots for the stored rows of chunk ``[start, end)`` in ``group``.

    The result always has ``group.physical_rows(chunk_size)`` entries, so a
    chunk buffer has a fixed geometry. Row ``j`` (a compressed position,
    ``token // compress_ratio``) lives at ``block_table[j // bpr] * bpr +
    j % bpr`` where ``bpr`` is the plane's rows per block. Sliding groups
    keep only the rows of the window that ends at ``end``.
    """
    return chunks_rows(group, block_table, [start], [end], chunk_size, rows_per_block).at(0)


def chunks_rows(
    group: SchedulerGroup,
    block_table: Sequence[int],
    starts: Positions,
    ends: Positions,
    chunk_size: int,
    rows_per_block: int | None = None,
) -> ChunkAddresses:
    """``chunk_rows`` for many chunks at once (one numpy pass, not one per chunk)."""
    start, end = _ranges(group, starts, ends, chunk_size)
    ratio = group.compress_ratio
    bpr = rows_per_block or group.rows_per_block
    n_phys = group.physical_rows(chunk_size)
    first_row = start // ratio
    chunk_end_row = first_row + group.logical_rows(chunk_size)
    end_row = -(-end // ratio)  # ceil: a partially covered row is still written
    # FULL: the chunk's rows. SLIDING: the n_phys rows ending at the window
    # end (the chunk end, or `end` for a partial chunk).
    hi = chunk_end_row
    if group.kind is GroupKind.SLIDING:
        hi = np.minimum(chunk_end_row, np.maximum(first_row + n_phys, end_row))
    rows = (hi - n_phys)[:, None] + np.arange(n_phys, dtype=np.int64)[None, :]
    valid = rows < end_row[:, None]
    windowed = group.kept_window is not None
    if windowed:
        window_row = window_start_token(group, end) // ratio
        valid &= rows >= window_row[:, None]
    blocks = _lookup_blocks(block_table, rows // bpr)
    real = blocks != NULL_BLOCK_ID
    ids = np.where(valid & real, blocks * bpr + rows % bpr, SKIP)
    missing = (valid & ~real).sum(axis=1)
    if windowed:
        # A window ending mid-row of a partial chunk can need one row more
        # than the fixed geometry holds: count it so a store is refused.
        missing += np.maximum(0, rows[:, 0] - np.maximum(first_row, window_row))
    return ChunkAddresses(ids=ids.astype(np.int64, copy=False), missing=missing.astype(np.int64))


def chunk_pages(
    group: SchedulerGroup,
    block_table: Sequence[int],
    start: int,
    end: int,
    chunk_size: int,
) -> GroupAddress:
    """Block ids of the pages stored for chunk ``[start, end)``.

    ``chunk_size`` must be a multiple of the group's block size (checked at
    startup). Sliding groups keep the pages that intersect the window ending
    at ``end``. The result has ``group.physical_pages(chunk_size)`` entries.
    """
    return chunks_pages(group, block_table, [start], [end], chunk_size).at(0)


def chunks_pages(
    group: SchedulerGroup,
    block_table: Sequence[int],
    starts: Positions,
    ends: Positions,
    chunk_size: int,
) -> ChunkAddresses:
    """``chunk_pages`` for many chunks at once (one numpy pass, not one per chunk)."""
    start, end = _ranges(group, starts, ends, chunk_size)
    bs = group.block_size
    n_phys = group.physical_pages(chunk_size)
    first = start // bs
    chunk_end_block = first + group.logical_pages(chunk_size)
    end_block = -(-end // bs)
    hi = chunk_end_block
    if group.kind is GroupKind.SLIDING:
        hi = np.minimum(chunk_end_block, np.maximum(first + n_phys, end_block))
    idx = (hi - n_phys)[:, None] + np.arange(n_phys, dtype=np.int64)[None, :]
    valid = idx < end_block[:, None]
    windowed = group.kept_window is not None
    if windowed:
        window_token = window_start_token(group, end)
        valid &= (idx + 1) * bs > window_token[:, None]
    blocks = _lookup_blocks(block_table, idx)
    real = blocks != NULL_BLOCK_ID
    ids = np.where(valid & real, blocks, SKIP)
    missing = (valid & ~real).sum(axis=1)
    if windowed:
        # A window ending mid-block (partial chunk) can touch one block more
        # than the fixed geometry holds: count it so a store is refused.
        missing += np.maximum(0, idx[:, 0] - np.maximum(first, window_token // bs))
    return ChunkAddresses(ids=ids.astype(np.int64, copy=False), missing=missing.astype(np.int64))


def primary_group(groups: Sequence[SchedulerGroup], block_tables: Sequence[Sequence[int]]) -> int:
    """The group spanning the most tokens (len(blocks) * block_size, where
    block_size counts tokens, compressed groups included); it drives chunk
    hashing and masks. Ties go to the lowest index."""
    best, best_span = 0, -1
    for g in groups:
        span = len(block_tables[g.index]) * g.block_size
        if span > best_span:
            best, best_span = g.index, span
    return best
