"""Typed records shared by the planning code, the worker and the scheduler.

Pure data: this module imports neither vLLM nor the compiled ops, so the
planning code can be tested on any machine.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# vLLM reserves block 0 of every group as the "null block": sliding-window
# groups point out-of-window positions at it. Its content is garbage.
NULL_BLOCK_ID = 0
# Slot / block id that kernels skip.
SKIP = -1


class GroupKind(str, enum.Enum):
    """What a scheduler group holds, as far as prefix reuse is concerned."""

    FULL = "full"  # every position's KV is kept (full attention, MLA, indexer)
    SLIDING = "sliding"  # only the last `sliding_window` positions are kept
    STATE = "state"  # recurrent / running state (Mamba, GDN, DSv4 *State specs)


class Granularity(str, enum.Enum):
    """How a plane is addressed by the copy kernels."""

    ROW = "row"  # one row of `row_bytes` per (compressed) token position
    PAGE = "page"  # whole opaque block pages (vLLM-CPU attention, state pages)


@dataclass(frozen=True)
class SchedulerGroup:
    """One vLLM ``KVCacheGroupSpec`` reduced to what transfers need."""

    index: int
    kind: GroupKind
    spec_name: str  # the spec's class name, used only for user allowlists
    block_size: int  # tokens per block (logical, before compression)
    compress_ratio: int = 1
    sliding_window: int | None = None
    layer_names: tuple[str, ...] = ()
    # vLLM may exclude a group from external KV transfer (its content is
    # rebuilt from another group after a load, vLLM 0.32's
    # KVCacheGroupSpec.enable_kv_transfer): such a group is never moved.
    transferable: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(
                f"group {self.index}: block_size must be > 0, got {self.block_size}"
            )
        if self.compress_ratio <= 0:
            raise ValueError(
                f"group {self.index}: compress_ratio must be > 0, "
                f"got {self.compress_ratio}"
            )
        if self.kind is GroupKind.SLIDING and not self.sliding_window:
            raise ValueError(
                f"group {self.index}: a sliding group needs sliding_window > 0, "
                f"got {self.sliding_window!r}"
            )

    @property
    def rows_per_block(self) -> int:
        """Physical rows per block (tokens per block after compression)."""
        return max(1, self.block_size // self.compress_ratio)

    def logical_rows(self, chunk_size: int) -> int:
        """Rows a full chunk spans in this group: ceil(chunk / ratio)."""
        return math.ceil(chunk_size / self.compress_ratio)

    def physical_rows(self, chunk_size: int) -> int:
        """Rows actually stored per chunk.

        Sliding-window groups keep only the window that ends at the chunk
        end (``sliding_window // compress_ratio`` rows), which is all a later
        hit ending at or after this chunk can need from it.
        """
        rows = self.logical_rows(chunk_size)
        if self.kind is GroupKind.SLIDING and self.sliding_window is not None:
            rows = min(rows, max(1, self.sliding_window // self.compress_ratio))
        return rows

    def logical_pages(self, chunk_size: int) -> int:
        """Whole blocks a chunk spans (chunk_size must be a block multiple)."""
        return math.ceil(chunk_size / self.block_size)

    def physical_pages(self, chunk_size: int) -> int:
        """Pages stored per chunk: sliding groups keep the blocks that
        intersect the window ending at the chunk end."""
        pages = self.logical_pages(chunk_size)
        if self.kind is GroupKind.SLIDING and self.sliding_window is not None:
            pages = min(pages, math.ceil(self.sliding_window / self.block_size))
        return pages


@dataclass(frozen=True)
class Plane:
    """One KV component of one layer, as the kernels see it."""

    layer_name: str
    plane_index: int  # position in the layer's tuple (0 for single tensors)
    sched_group: int  # scheduler group whose block table addresses it
    dtype_name: str  # e.g. "bfloat16", "int8"; informational and grouping key
    granularity: Granularity
    # Rows of ``row_bytes`` the kernels move per block: ROW planes their rows
    # per block, PAGE planes 1 (the page is one row of page bytes).
    block_rows: int
    block_tokens: int  # token positions one block covers (rows x compress ratio)
    num_blocks: int
    row_bytes: int  # ROW: bytes per row; PAGE: bytes per page
    block_stride_bytes: int  # bytes between consecutive blocks (>= payload)
    data_ptr: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.granularity is Granularity.PAGE and self.block_rows != 1:
            raise ValueError(
                f"plane {self.layer_name}[{self.plane_index}]: a page plane moves one page "
                f"per block (block_rows 1), got {self.block_rows}"
            )
        for name in ("block_rows", "block_tokens", "num_blocks", "row_bytes", "block_stride_bytes"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(
                    f"plane {self.layer_name}[{self.plane_index}]: {name} must be "
                    f"> 0, got {value}"
                )
        payload = self.block_rows * self.row_bytes
        if self.block_stride_bytes < payload:
            raise ValueError(
                f"plane {self.layer_name}[{self.plane_index}]: block_stride_bytes "
                f"{self.block_stride_bytes} is smaller than the block payload "
                f"{payload} bytes"
            )


@dataclass(frozen=True)
class ChunkRequest:
    """What one chunk transfer needs from the scheduler: where the chunk lies
    in the request and every group's block table for that request."""

    start: int
    end: int
    block_ids: tuple[tuple[int, ...], ...]  # indexed by scheduler group index
