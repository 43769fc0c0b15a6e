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
    STATE = "state"  # recurrent / running state (Mamba, GDN, unknown specs)


class Granularity(str, enum.Enum):
    """How a plane is addressed by the copy kernels."""

    ROW = "row"  # one row of `row_bytes` per (compressed) token position
    PAGE = "page"  # whole opaque block pages (vLLM-CPU attention, state pages)


@dataclass(frozen=True)
class CompressorState:
    """What a DeepSeek-V4 compressor-state group feeds.

    vLLM-Ascend's ``<x>.compressor.state_cache`` layers hold, per token, one
    fp32 row of kv and score that the compressor of ``<x>`` (a layer whose
    rows each cover ``ratio`` tokens) reads when a prefill resumes at
    position P. From the compressor kernel's ``ReadState``
    (vllm_ascend/_cann_ops_custom/.../compressor/arch32/
    compressor_block_vec_perf.h, identical in 0.23.0 and 0.26.0rc1), for P a
    multiple of ``ratio``: the overlapping compressor (C4, coff 2) reads the
    rows of tokens [P - ratio, P); the plain one (C128, coff 1) reads none
    (its "head holder" count P % ratio is 0 and it has no overlap).
    """

    ratio: int
    overlap: bool

    def __post_init__(self) -> None:
        if self.ratio <= 1:
            raise ValueError(f"CompressorState.ratio must be > 1, got {self.ratio}")

    @property
    def tokens_read(self) -> int:
        """Tokens before a boundary (a multiple of ``ratio``) whose state
        rows a resumed prefill reads."""
        return self.ratio if self.overlap else 0


@dataclass(frozen=True)
class SchedulerGroup:
    """One vLLM ``KVCacheGroupSpec`` reduced to what transfers need."""

    index: int
    kind: GroupKind
    spec_name: str  # the spec's class name, used only for user allowlists
    # Tokens per block. For compressed groups this is rows per block x
    # compress ratio: vLLM's own MLA specs count tokens (block 256, ratio 4:
    # 64 rows), vLLM-Ascend's count rows (block 128, ratio 4: 128 rows, 512
    # tokens); integration/vllm/vllm_specs.py converts the latter.
    block_size: int
    compress_ratio: int = 1
    sliding_window: int | None = None
    layer_names: tuple[str, ...] = ()
    # vLLM may exclude a group from external KV transfer (its content is
    # rebuilt from another group after a load, vLLM 0.32's
    # KVCacheGroupSpec.enable_kv_transfer): such a group is never moved.
    transferable: bool = True
    # Set for DeepSeek-V4 compressor-state groups (sliding groups): a hit
    # then needs fewer rows than vLLM's window keeps (see kept_window).
    compressor: CompressorState | None = None

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
        if self.compressor is not None:
            if self.kind is not GroupKind.SLIDING:
                raise ValueError(
                    f"group {self.index}: compressor state must be a sliding group, got {self.kind.value}"
                )
            if self.compressor.tokens_read > (self.sliding_window or 0):
                raise ValueError(
                    f"group {self.index}: its compressor reads {self.compressor.tokens_read} tokens "
                    f"of state, more than the sliding window {self.sliding_window} vLLM keeps"
                )

    @property
    def kept_window(self) -> int | None:
        """Tokens before a chunk end that a hit there needs from this group
        (None: every token, FULL and STATE groups).

        Sliding groups: their window. Compressor-state groups: only the rows
        their compressor reads at a boundary (valid when chunk boundaries
        are multiples of its ratio, which the planner checks); 0 means the
        group is never read at a boundary and is not stored at all.
        """
        if self.kind is not GroupKind.SLIDING:
            return None
        if self.compressor is not None:
            return self.compressor.tokens_read
        return self.sliding_window

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
        end (``kept_window // compress_ratio`` rows), which is all a later
        hit ending at or after this chunk can need from it.
        """
        rows = self.logical_rows(chunk_size)
        window = self.kept_window
        if window is not None:
            rows = min(rows, max(1, window // self.compress_ratio))
        return rows

    def logical_pages(self, chunk_size: int) -> int:
        """Whole blocks a chunk spans (chunk_size must be a block multiple)."""
        return math.ceil(chunk_size / self.block_size)

    def physical_pages(self, chunk_size: int) -> int:
        """Pages stored per chunk: sliding groups keep the blocks that
        intersect the window ending at the chunk end."""
        pages = self.logical_pages(chunk_size)
        window = self.kept_window
        if window is not None:
            pages = min(pages, max(1, math.ceil(window / self.block_size)))
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
