"""Flat entries + scheduler groups -> kernel groups and chunk geometry.

A chunk is one flat byte buffer (one LMCache MemoryObj) holding every kernel
group at its own offset. Inside a kernel group the bytes run layer-major,
then plane-major, then row (or page) order; every plane stores the rows its
group physically keeps for a chunk (sliding groups only their window,
compressed groups ceil(chunk / ratio) rows). Skipped groups take no bytes.

One op call moves one kernel group of one chunk, so in bundled mode a chunk
costs ``len(plan.kernel_groups)`` calls whatever the number of planes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.flatten import (
    FlatEntry,
    LayerPlanes,
    PlaneAddressing,
    UnlistedLayer,
    flat_entries,
    group_entries,
    place_layers,
)
from lmcache_ascend.planning.groups import Granularity, Plane, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayerEntry, LayoutHints, check_layers_own_their_memory
from lmcache_ascend.planning.state_skip import (
    SkippedGroup,
    skipped_groups,
    unrestorable_groups,
)

# Version of what a chunk buffer holds after the payload (the trailer
# lmcache_bridge/engine/chunk_io.py writes: 2 = MAC tag, crc, magic). Part of the
# layout fingerprint, so entries written in another format get other keys
# and are never read as this one.
CHUNK_FORMAT_VERSION = 2

__all__ = [
    "KernelGroup",
    "KernelOp",
    "TransferPlan",
    "build_plan",
    "unrestorable_groups",
    "skipped_groups",
]


class KernelOp(str, enum.Enum):
    MULTI_PLANE = "multi_plane_kv_transfer"
    BLOCK_PAGE = "block_page_transfer"


@dataclass(frozen=True)
class KernelGroup:
    """Flat entries moved by one op call per chunk."""

    index: int
    granularity: Granularity  # PAGE only if every plane is a page plane
    op: KernelOp
    labels: tuple[str, ...]  # one per entry: layer (bundled) or layer[plane]
    planes: tuple[tuple[Plane, ...], ...]  # [entry][plane], with data_ptr
    addressing: tuple[PlaneAddressing, ...]  # per plane position
    plane_heads: tuple[tuple[int, ...], ...]  # [entry][plane]: HND head index, else 0
    offset: int  # byte offset inside the chunk buffer
    nbytes: int

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p[0].layer_name for p in self.planes))

    @property
    def sched_groups(self) -> tuple[int, ...]:
        """Scheduler group of each plane position."""
        return tuple(a.sched_group for a in self.addressing)

    @property
    def rows_per_chunk(self) -> tuple[int, ...]:
        """Rows (ROW planes) or pages (PAGE planes) per chunk, per plane."""
        return tuple(a.rows_per_chunk for a in self.addressing)

    @property
    def num_layers(self) -> int:
        return len(self.planes)

    @property
    def num_planes(self) -> int:
        return len(self.addressing)

    def group_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for a, p in zip(self.addressing, self.planes[0]):
            out[a.sched_group] = out.get(a.sched_group, 0) + a.rows_per_chunk * p.row_bytes * self.num_layers
        return out


@dataclass(frozen=True)
class GroupSizing:
    """Bytes per chunk of one scheduler group: planned vs naive."""

    group: int
    spec_name: str
    kind: str
    stored: bool
    planned_bytes: int  # physical rows / pages actually stored
    naive_bytes: int  # every plane at the full logical chunk, no window cap


@dataclass(frozen=True)
class PlaneSummary:
    element: int
    group: int
    dtype: str
    granularity: str
    block_rows: int  # rows moved per block (PAGE: 1, the page)
    block_tokens: int  # token positions one block covers
    row_bytes: int  # ROW: bytes per row; PAGE: bytes per page
    block_stride_bytes: int
    stored: bool


@dataclass(frozen=True)
class LayerSummary:
    name: str
    format: str
    element_groups: tuple[int, ...]
    planes: tuple[PlaneSummary, ...]

    @staticmethod
    def of(lp: LayerPlanes) -> "LayerSummary":
        def one(p: Plane, stored: bool) -> PlaneSummary:
            return PlaneSummary(
                p.plane_index, p.sched_group, p.dtype_name, p.granularity.value,
                p.block_rows, p.block_tokens, p.row_bytes, p.block_stride_bytes, stored,
            )

        planes = [one(p.plane, True) for p in lp.stored] + [one(p, False) for p in lp.unstored]
        return LayerSummary(lp.layer_name, lp.format.value, lp.element_groups, tuple(planes))


@dataclass(frozen=True)
class KernelGroupSummary:
    index: int
    op: str
    entries: int
    planes: int
    sched_groups: tuple[int, ...]
    rows_per_chunk: tuple[int, ...]
    row_bytes: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PlanDescription:
    """Everything ``explain`` shows; ``to_json`` for machines."""

    chunk_size: int
    chunk_bytes: int
    bundled: bool
    op_calls_per_chunk: int
    exact_hits: bool
    groups: tuple[GroupSizing, ...]
    layers: tuple[LayerSummary, ...]
    kernel_groups: tuple[KernelGroupSummary, ...]
    skipped: tuple[SkippedGroup, ...]
    unrestorable: tuple[int, ...]
    unlisted_layers: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)

    def __str__(self) -> str:
        lines = [
            f"chunk {self.chunk_size} tokens = {self.chunk_bytes} bytes; "
            f"{'bundled' if self.bundled else 'exploded'}, {self.op_calls_per_chunk} op call(s) "
            f"per chunk; exact hits: {'yes' if self.exact_hits else 'NO (unrestorable state groups)'}",
            f"hit granularity: {self.chunk_size} tokens (hits are whole chunks)"
            if self.exact_hits
            else "hit granularity: none (hits refused)",
            "groups (bytes per chunk, planned / naive):",
        ]
        for g in self.groups:
            lines.append(
                f"  g{g.group:<2} {g.kind:<7} {g.spec_name:<24} "
                f"{'stored    ' if g.stored else 'not stored'} {g.planned_bytes:>10} / {g.naive_bytes}"
            )
        formats: dict[str, int] = {}
        for layer in self.layers:
            formats[layer.format] = formats.get(layer.format, 0) + 1
        lines.append(
            f"layers: {len(self.layers)} ("
            + ", ".join(f"{n} {f}" for f, n in formats.items())
            + "; per-plane detail in to_json())"
        )
        lines.append("kernel groups:")
        for k in self.kernel_groups:
            lines.append(
                f"  k{k.index:<2} {k.op:<24} {k.entries} entr{'y' if k.entries == 1 else 'ies'} "
                f"x {k.planes} plane(s) groups {list(k.sched_groups)} rows/chunk "
                f"{list(k.rows_per_chunk)} row bytes {list(k.row_bytes)} @ {k.offset} +{k.nbytes}"
            )
        for s in self.skipped:
            lines.append(f"skipped g{s.index} ({s.spec_name}): {s.reason.value}: {s.detail}")
        if self.unrestorable:
            lines.append(f"unrestorable state groups (hits refused): {list(self.unrestorable)}")
        if self.unlisted_layers:
            lines.append(f"layers in no group (not moved): {list(self.unlisted_layers)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class TransferPlan:
    chunk_size: int
    groups: tuple[SchedulerGroup, ...]
    kernel_groups: tuple[KernelGroup, ...]
    chunk_bytes: int  # one chunk buffer: sum of kernel group bytes
    stored_groups: frozenset[int]
    skipped_groups: tuple[SkippedGroup, ...]
    unrestorable_groups: frozenset[int]  # hits must be refused while non-empty
    layers: tuple[LayerPlanes, ...]
    unlisted_layers: tuple[UnlistedLayer, ...]
    bundled: bool

    @property
    def op_calls_per_chunk(self) -> int:
        return len(self.kernel_groups)

    @property
    def layout_fingerprint(self) -> str:
        """Hash of the chunk buffer's byte layout (order, rows, row bytes,
        dtypes; not pointers or cache sizes). Chunks are only interchangeable
        between plans with equal fingerprints, e.g. not between bundled and
        exploded mode, or of another trailer format: fold it into the cache
        key of persistent backends."""
        parts: list[object] = [f"chunk-format-{CHUNK_FORMAT_VERSION}", self.chunk_size]
        for kg in self.kernel_groups:
            parts.append(
                (
                    kg.op.value, kg.labels, kg.plane_heads, kg.offset, kg.nbytes,
                    tuple(dataclasses.astuple(a) for a in kg.addressing),
                    tuple(
                        (p.plane_index, p.dtype_name, p.granularity.value, p.block_rows, p.block_tokens, p.row_bytes)
                        for planes in kg.planes
                        for p in planes
                    ),
                )
            )
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    @property
    def exact_hits(self) -> bool:
        return not self.unrestorable_groups

    def group_bytes(self) -> dict[int, int]:
        """Stored bytes per chunk per scheduler group."""
        out: dict[int, int] = {}
        for kg in self.kernel_groups:
            for g, n in kg.group_bytes().items():
                out[g] = out.get(g, 0) + n
        return out

    def naive_group_bytes(self) -> dict[int, int]:
        """Bytes per chunk if every plane (skipped and state groups included)
        stored the full logical chunk: what sizing without sliding-window,
        compression awareness and state skip would allocate."""
        out: dict[int, int] = {}
        by_index = {g.index: g for g in self.groups}
        for layer in self.layers:
            for p in layer.stored:
                g = p.addressing.group_view(by_index[p.addressing.sched_group])
                if p.plane.granularity is Granularity.PAGE:
                    n = g.logical_pages(self.chunk_size) * p.addressing.kernel_split
                else:
                    n = g.logical_rows(self.chunk_size)
                out[g.index] = out.get(g.index, 0) + n * p.plane.row_bytes
            for q in layer.unstored:
                g = by_index[q.sched_group]
                if q.granularity is Granularity.PAGE:
                    n = -(-self.chunk_size // q.block_tokens)
                else:
                    n = g.logical_rows(self.chunk_size)
                out[g.index] = out.get(g.index, 0) + n * q.row_bytes
        return out

    def describe(self) -> PlanDescription:
        planned, naive = self.group_bytes(), self.naive_group_bytes()
        return PlanDescription(
            chunk_size=self.chunk_size,
            chunk_bytes=self.chunk_bytes,
            bundled=self.bundled,
            op_calls_per_chunk=self.op_calls_per_chunk,
            exact_hits=self.exact_hits,
            groups=tuple(
                GroupSizing(
                    g.index, g.spec_name, g.kind.value, g.index in self.stored_groups,
                    planned.get(g.index, 0), naive.get(g.index, 0),
                )
                for g in self.groups
            ),
            layers=tuple(
                LayerSummary.of(lp) for lp in self.layers
            ),
            kernel_groups=tuple(
                KernelGroupSummary(
                    kg.index, kg.op.value, kg.num_layers, kg.num_planes, kg.sched_groups,
                    kg.rows_per_chunk, tuple(p.row_bytes for p in kg.planes[0]), kg.offset, kg.nbytes,
                )
                for kg in self.kernel_groups
            ),
            skipped=self.skipped_groups,
            unrestorable=tuple(sorted(self.unrestorable_groups)),
            unlisted_layers=tuple(u.layer_name for u in self.unlisted_layers),
        )


def _check_chunk_size(layers: Sequence[LayerPlanes], groups: Mapping[int, SchedulerGroup], chunk_size: int) -> None:
    """Chunks must start on page and compressed-row boundaries, or a chunk's
    pages / rows would straddle two chunks."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    for layer in layers:
        for p in layer.stored:
            a = p.addressing
            g = groups[a.sched_group]
            if a.granularity is Granularity.PAGE and chunk_size % g.block_size:
                raise ValueError(
                    f"chunk_size {chunk_size} is invalid for group {g.index} ({g.spec_name}): "
                    f"its blocks are moved as whole pages, so chunk_size must be a multiple "
                    f"of its block_size {g.block_size} (e.g. {_multiples(g.block_size, chunk_size)})"
                )
            if a.compress_ratio > 1 and chunk_size % a.compress_ratio:
                raise ValueError(
                    f"chunk_size {chunk_size} is invalid for group {g.index} ({g.spec_name}, "
                    f"layer {layer.layer_name!r}): compress ratio {a.compress_ratio} requires "
                    f"a multiple of {a.compress_ratio} (e.g. {_multiples(a.compress_ratio, chunk_size)})"
                )


def _check_compressor_chunks(groups: Sequence[SchedulerGroup], chunk_size: int) -> None:
    """A compressor-state group is stored as only the rows its compressor
    reads at a boundary that is a multiple of its ratio (or not at all):
    chunk boundaries must be such multiples, or the hit would need more."""
    for g in groups:
        c = g.compressor
        if c is not None and chunk_size % c.ratio:
            raise ValueError(
                f"chunk_size {chunk_size} is invalid for group {g.index} ({g.spec_name}): it holds "
                f"the compressor state of ratio-{c.ratio} layers, which a hit can only resume "
                f"from at a multiple of {c.ratio} tokens (e.g. {_multiples(c.ratio, chunk_size)})"
            )


def _multiples(unit: int, near: int) -> str:
    lo = max(unit, near // unit * unit)
    return ", ".join(str(v) for v in (lo, lo + unit))


def build_plan(
    kv_caches: Mapping[str, LayerEntry],
    groups: Sequence[SchedulerGroup],
    chunk_size: int,
    config: Optional[AscendConfig] = None,
    hints: Optional[LayoutHints] = None,
) -> TransferPlan:
    """Plan the chunk transfers for one worker's KV caches.

    ``groups`` are all vLLM KV cache groups (index == group id); a group's
    ``layer_names`` say which layers it addresses. Raises ValueError for
    layouts, group assignments or chunk sizes that cannot be moved exactly.
    """
    config = config or AscendConfig()
    hints = hints or LayoutHints()
    groups = tuple(groups)
    for pos, g in enumerate(groups):
        if g.index != pos:
            raise ValueError(f"groups[{pos}] has index {g.index}; groups must be in vLLM group order")
    _check_compressor_chunks(groups, chunk_size)
    skipped = skipped_groups(groups, config)
    blocked = unrestorable_groups(groups, config)
    not_stored = frozenset(s.index for s in skipped) | frozenset(g.index for g in blocked)
    layers, unlisted = place_layers(
        kv_caches, groups, chunk_size, hints, not_stored, allow_multi_spec=config.flatten_multi_spec
    )
    # KVPP scratch buffers and the like: one buffer, several layers.
    check_layers_own_their_memory(
        [(lp.layer_name, p.plane.sched_group, p.plane.plane_index, p.plane.data_ptr) for lp in layers for p in lp.stored]
    )
    by_index = {g.index: g for g in groups}
    _check_chunk_size(layers, by_index, chunk_size)
    kernel_groups = _kernel_groups(flat_entries(layers, config.bundle_multi_spec))
    stored = frozenset(p.addressing.sched_group for lp in layers for p in lp.stored)
    return TransferPlan(
        chunk_size=chunk_size,
        groups=groups,
        kernel_groups=kernel_groups,
        chunk_bytes=sum(kg.nbytes for kg in kernel_groups),
        stored_groups=stored,
        skipped_groups=skipped,
        unrestorable_groups=frozenset(g.index for g in blocked),
        layers=layers,
        unlisted_layers=unlisted,
        bundled=config.bundle_multi_spec,
    )


def _kernel_groups(entries: Sequence[FlatEntry]) -> tuple[KernelGroup, ...]:
    out: list[KernelGroup] = []
    offset = 0
    for index, bucket in enumerate(group_entries(entries)):
        first = bucket[0].planes
        addressing = tuple(p.addressing for p in first)
        all_pages = all(p.plane.granularity is Granularity.PAGE for p in first)
        op = KernelOp.BLOCK_PAGE if all_pages and len(first) == 1 else KernelOp.MULTI_PLANE
        per_entry = sum(p.addressing.rows_per_chunk * p.plane.row_bytes for p in first)
        nbytes = per_entry * len(bucket)
        out.append(
            KernelGroup(
                index=index,
                granularity=Granularity.PAGE if all_pages else Granularity.ROW,
                op=op,
                labels=tuple(e.label for e in bucket),
                planes=tuple(tuple(p.plane for p in e.planes) for e in bucket),
                addressing=addressing,
                plane_heads=tuple(tuple(p.head for p in e.planes) for e in bucket),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += nbytes
    return tuple(out)

