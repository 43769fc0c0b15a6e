"""kv_caches -> planes with their scheduler group and chunk addressing ->
flat entries.

A flat entry is what one kernel group row holds per "layer": in bundled mode
one entry per layer with every stored plane of that layer (one multi-plane
op moves them all), in exploded mode one entry per plane. Entries with equal
keys form a kernel group (see planner.py). The key contains the scheduler
group of every plane, so identically shaped layers of different groups are
never merged: their rows come from different block tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from lmcache_ascend.planning.groups import GroupKind, Granularity, Plane, SchedulerGroup
from lmcache_ascend.planning.kv_format import (
    LayerEntry,
    LayerFormat,
    LayoutError,
    LayoutHints,
    PlaneGeom,
    describe_entry,
    detect_layer,
    split_elements,
)


@dataclass(frozen=True)
class PlaneAddressing:
    """How one plane's rows (or pages) of a chunk are found. Equal for every
    layer of a kernel group at a given plane position."""

    sched_group: int
    granularity: Granularity
    compress_ratio: int  # tokens per stored row for this plane's layer
    manager_rows: int  # rows per scheduler block (block_size // ratio)
    kernel_split: int  # kernel blocks per scheduler block (vLLM block splitting)
    rows_per_chunk: int  # ROW: rows; PAGE: kernel pages, per chunk

    def group_view(self, group: SchedulerGroup) -> SchedulerGroup:
        """``group`` with this plane's compress ratio (layers of one vLLM
        group may differ, e.g. DeepSeek-V4 C4 and C128 layers)."""
        if group.compress_ratio == self.compress_ratio:
            return group
        return dataclasses.replace(group, compress_ratio=self.compress_ratio)


@dataclass(frozen=True)
class PlacedPlane:
    plane: Plane  # kernel geometry; PAGE planes: row_bytes = page bytes
    addressing: PlaneAddressing
    head: int = 0  # HND per-head plane index

    @property
    def key(self) -> tuple[object, ...]:
        p, a = self.plane, self.addressing
        return (
            a.sched_group, p.granularity.value, p.dtype_name, p.block_rows, p.block_tokens, p.row_bytes,
            p.block_stride_bytes, p.num_blocks, a.compress_ratio, a.manager_rows,
            a.kernel_split, a.rows_per_chunk,
        )

    @property
    def label(self) -> str:
        p = self.plane
        head = f".h{self.head}" if self.head else ""
        return f"{p.layer_name}[{p.plane_index}]{head}"


@dataclass(frozen=True)
class LayerPlanes:
    """One layer after detection and group assignment."""

    layer_name: str
    format: LayerFormat
    element_groups: tuple[int, ...]
    stored: tuple[PlacedPlane, ...]  # in plane order
    unstored: tuple[Plane, ...]  # planes of skipped or state groups


@dataclass(frozen=True)
class FlatEntry:
    label: str  # layer name (bundled) or layer[plane] (exploded)
    planes: tuple[PlacedPlane, ...]

    @property
    def key(self) -> tuple[tuple[object, ...], ...]:
        return tuple(p.key for p in self.planes)


@dataclass(frozen=True)
class UnlistedLayer:
    """A kv_caches layer no scheduler group addresses (e.g. a KV-sharing
    layer reading another layer's cache); nothing to move for it."""

    layer_name: str


def element_groups(
    layer: str, entry: LayerEntry, n_elements: int, listing: Sequence[int], hints: LayoutHints
) -> tuple[int, ...]:
    """Scheduler group of each element of a layer entry.

    One listing group: every element. Several: only valid for multi-plane
    layers; the element order follows the group order unless
    ``hints.plane_groups`` says otherwise.
    """
    if layer in hints.plane_groups:
        mapping = tuple(int(g) for g in hints.plane_groups[layer])
        if len(mapping) != n_elements:
            raise ValueError(
                f"layer {layer!r}: LayoutHints.plane_groups gives {len(mapping)} groups for "
                f"{n_elements} elements {describe_entry(entry)}"
            )
        if set(mapping) != set(listing):
            raise ValueError(
                f"layer {layer!r}: LayoutHints.plane_groups {list(mapping)} does not match "
                f"the groups that list the layer {list(listing)}"
            )
        return mapping
    if len(listing) == 1:
        return (listing[0],) * n_elements
    if n_elements == 1:
        raise ValueError(
            f"layer {layer!r} is listed by scheduler groups {list(listing)} but is a single "
            f"plane {describe_entry(entry)}; a layer may be shared by several groups only "
            "as a multi-plane layer (one plane per group)"
        )
    if len(listing) == n_elements:
        return tuple(listing)
    raise ValueError(
        f"layer {layer!r} is listed by groups {list(listing)} but has {n_elements} "
        f"elements {describe_entry(entry)}; pass LayoutHints.plane_groups[{layer!r}] "
        "with the group of each element"
    )


def _addressing(
    layer: str, geom: PlaneGeom, group: SchedulerGroup, ratio: int, chunk_size: int
) -> tuple[PlaneAddressing, int]:
    """Addressing of a stored plane and the rows of its kernel blocks."""
    if group.block_size % ratio:
        raise ValueError(
            f"layer {layer!r}: compress ratio {ratio} does not divide group {group.index}'s "
            f"block_size {group.block_size}"
        )
    manager_rows = group.block_size // ratio
    rows = geom.rows_per_block or manager_rows  # 2-D pages: one per scheduler block
    if manager_rows % rows:
        raise ValueError(
            f"layer {layer!r} plane {geom.element}: {rows} rows per block, but group "
            f"{group.index} ({group.spec_name}, block_size {group.block_size}, compress "
            f"ratio {ratio}) has {manager_rows} rows per block, not a multiple"
        )
    split = manager_rows // rows
    view = dataclasses.replace(group, compress_ratio=ratio) if ratio != group.compress_ratio else group
    if geom.granularity is Granularity.ROW:
        per_chunk = view.physical_rows(chunk_size)
    else:
        per_chunk = view.physical_pages(chunk_size) * split
    return PlaneAddressing(group.index, geom.granularity, ratio, manager_rows, split, per_chunk), rows


def place_layers(
    kv_caches: Mapping[str, LayerEntry],
    groups: Sequence[SchedulerGroup],
    chunk_size: int,
    hints: LayoutHints,
    not_stored: frozenset[int],
    allow_multi_spec: bool = True,
) -> tuple[tuple[LayerPlanes, ...], tuple[UnlistedLayer, ...]]:
    """Detect every layer and give each plane its group and addressing.

    ``not_stored``: groups whose planes are described but not moved
    (skipped groups, unrestorable state groups).
    """
    listing: dict[str, list[int]] = {}
    for g in groups:
        for name in g.layer_names:
            if g.index not in listing.setdefault(name, []):
                listing[name].append(g.index)
    for g in groups:
        if g.index in not_stored:
            continue
        absent = [n for n in g.layer_names if n not in kv_caches]
        if absent:
            raise ValueError(
                f"group {g.index} ({g.spec_name}) lists layers that were not registered: "
                f"{absent[:4]}{' ...' if len(absent) > 4 else ''}"
            )
    by_index = {g.index: g for g in groups}
    layers: list[LayerPlanes] = []
    unlisted: list[UnlistedLayer] = []
    for name, entry in kv_caches.items():
        gids = sorted(listing.get(name, ()))
        if not gids:
            unlisted.append(UnlistedLayer(name))
            continue
        elements = split_elements(name, entry)
        mapping = element_groups(name, entry, len(elements), gids, hints)
        if len(set(mapping)) > 1 and not allow_multi_spec:
            raise ValueError(
                f"layer {name!r} is addressed by groups {sorted(set(mapping))}; multi-spec "
                "layers need ascend_flatten_multi_spec=true"
            )
        is_state = [by_index[g].kind is GroupKind.STATE for g in mapping]
        paged = [s or hints.opaque_pages for s in is_state]
        try:
            layout = detect_layer(name, entry, hints, paged=paged, state=is_state)
        except LayoutError:
            if any(g not in not_stored for g in mapping):
                raise
            # Never moved: an exotic state layout must not stop the plan.
            layers.append(LayerPlanes(name, LayerFormat.UNDETECTED, mapping, (), ()))
            continue
        for elem, primary in layout.aliases:
            if mapping[elem] != mapping[primary]:
                raise ValueError(
                    f"layer {name!r}: elements {elem} and {primary} view the same bytes but "
                    f"belong to groups {mapping[elem]} and {mapping[primary]}"
                )
        ratio = int(hints.layer_compress_ratio.get(name, 0))
        if ratio and len(set(mapping)) > 1:
            # Planes of a multi-group layer take their ratio from their group.
            raise ValueError(
                f"layer {name!r}: LayoutHints.layer_compress_ratio applies to layers of one "
                f"group; this layer is addressed by groups {sorted(set(mapping))}"
            )
        stored: list[PlacedPlane] = []
        unstored: list[Plane] = []
        for geom in layout.planes:
            group = by_index[mapping[geom.element]]
            if group.index in not_stored or group.kind is GroupKind.STATE:
                page = geom.granularity is Granularity.PAGE
                unstored.append(
                    Plane(
                        name, geom.element, group.index, geom.dtype_name, geom.granularity,
                        1 if page else geom.rows_per_block,
                        group.block_size if page else geom.rows_per_block * group.compress_ratio,
                        geom.num_blocks, geom.row_bytes, geom.block_stride_bytes, geom.data_ptr,
                    )
                )
                continue
            plane_ratio = ratio or group.compress_ratio
            addr, rows = _addressing(name, geom, group, plane_ratio, chunk_size)
            plane = Plane(
                name, geom.element, group.index, geom.dtype_name, geom.granularity,
                1 if geom.granularity is Granularity.PAGE else rows, rows * plane_ratio,
                geom.num_blocks, geom.row_bytes, geom.block_stride_bytes, geom.data_ptr,
            )
            stored.append(PlacedPlane(plane, addr, geom.head))
        layers.append(LayerPlanes(name, layout.format, mapping, tuple(stored), tuple(unstored)))
    return tuple(layers), tuple(unlisted)


def flat_entries(layers: Sequence[LayerPlanes], bundle: bool) -> tuple[FlatEntry, ...]:
    """Bundled: one entry per layer (all its stored planes); exploded: one
    entry per plane. Layers without stored planes produce no entry."""
    out: list[FlatEntry] = []
    for layer in layers:
        if not layer.stored:
            continue
        if bundle:
            out.append(FlatEntry(layer.layer_name, layer.stored))
        else:
            out.extend(FlatEntry(p.label, (p,)) for p in layer.stored)
    return tuple(out)


def group_entries(entries: Sequence[FlatEntry]) -> tuple[tuple[FlatEntry, ...], ...]:
    """Entries with equal keys, in order of first appearance."""
    buckets: dict[tuple[tuple[object, ...], ...], list[FlatEntry]] = {}
    for e in entries:
        buckets.setdefault(e.key, []).append(e)
    return tuple(tuple(v) for v in buckets.values())

