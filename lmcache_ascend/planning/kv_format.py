"""Format detection: what one ``kv_caches[layer]`` entry looks like to the
copy kernels.

vLLM, vLLM-CPU and vLLM-Ascend hand over, per layer, a single tensor
(NHD, HND, MLA, K/V stacked, an opaque CPU page tensor, a raw state view) or
a tuple of "planes" (K/V, MLA, DSA, DeepSeek-V4 multi-plane tuples with mixed
dtypes and per-plane block sizes, several views of one shared blob). This
module reduces every element to :class:`PlaneGeom` records: a base pointer,
a block stride (possibly padded), rows per block and bytes per row, or whole
pages. It only reads tensor metadata: views are permuted to their physical
order (never copied), and anything it cannot explain raises
:class:`LayoutError` naming the layer, shapes, strides and dtypes.

Which scheduler group a plane belongs to is the planner's business; this
module only needs to know, per element, whether it is addressed by pages.
Imports neither vLLM nor the compiled ops.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Optional, Sequence, Union

import torch

from lmcache_ascend.planning.groups import Granularity

LayerEntry = Union[torch.Tensor, Sequence[torch.Tensor]]
KVLayout = Literal["NHD", "HND"]


class LayoutError(ValueError):
    """A KV cache entry whose layout we cannot address safely."""


@dataclass(frozen=True)
class LayoutHints:
    """What the serving engine tells us about its KV tensors.

    kv_layout: physical order of single 4-D attention tensors: "NHD" =
        ``[blocks, tokens, heads, head_size]``, "HND" = ``[blocks, heads, tokens,
        head_size]`` (vLLM's ``VLLM_KV_CACHE_LAYOUT``). ``None`` = not told: a
        single 4-D tensor with more than one head and token is then refused
        rather than guessed. Tuple elements default to NHD (vLLM-Ascend).
    opaque_pages: attention blocks are opaque pages moved whole (vLLM-CPU:
        ``[blocks, heads, block_size, 2*head_size]`` with K transposed inside).
    plane_groups: layer name -> scheduler group of each tuple element, for
        multi-spec layers whose element order is not the group order.
    layer_compress_ratio: layer name -> tokens per stored row, for vLLM groups
        that mix compress ratios (DeepSeek-V4 on vLLM >= 0.20, group 0).
    """

    kv_layout: Optional[KVLayout] = None
    opaque_pages: bool = False
    plane_groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    layer_compress_ratio: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_layout not in (None, "NHD", "HND"):
            raise ValueError(
                f"LayoutHints.kv_layout must be 'NHD', 'HND' or None, got {self.kv_layout!r}"
            )
        for name, ratio in self.layer_compress_ratio.items():
            if int(ratio) <= 0:
                raise ValueError(
                    f"LayoutHints.layer_compress_ratio[{name!r}] must be > 0, got {ratio!r}"
                )


class LayerFormat(str, enum.Enum):
    """How a layer entry was understood (reported by ``explain``)."""

    ROWS = "rows"  # single [blocks, tokens, row] tensor (MLA, NHD, 1 head)
    NHD = "nhd"
    HND = "hnd"  # per-head planes
    KV_STACKED = "kv_stacked"  # one tensor holding K and V
    PAGES = "pages"  # single tensor moved as whole pages
    KV_PAIR = "kv_pair"  # (K, V) of equal geometry
    TWO_PLANE = "two_plane"  # MLA-style (latent, rope)
    MULTI_PLANE = "multi_plane"  # 3+ planes: DSA, DSA-C8, DeepSeek-V4
    UNDETECTED = "undetected"  # only in groups we never move; not inspected further


@dataclass(frozen=True)
class PlaneGeom:
    """One plane of one layer, as the kernels see it (no group yet)."""

    element: int  # index of the tensor in the layer's tuple (K/V for stacked)
    head: int  # head index for HND per-head planes, else 0
    granularity: Granularity
    dtype_name: str
    rows_per_block: int  # rows per (kernel) block; PAGE: rows in a page, 0 = state page
    num_blocks: int
    row_bytes: int  # ROW: bytes per row; PAGE: payload bytes per page
    block_stride_bytes: int
    data_ptr: int = field(compare=False)


@dataclass(frozen=True)
class LayerLayout:
    layer_name: str
    format: LayerFormat
    num_elements: int
    planes: tuple[PlaneGeom, ...]
    # (element, primary element): views of one allocation at the same
    # address (or inside it) folded into the primary's plane.
    aliases: tuple[tuple[int, int], ...] = ()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_entry(entry: LayerEntry) -> str:
    """shapes / strides / dtypes of an entry, for error messages."""
    tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            parts.append(f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={dtype_name(t.dtype)}")
        else:
            parts.append(f"<{type(t).__name__}>")
    return "[" + "; ".join(parts) + "]"


def _fail(layer: str, entry: LayerEntry, why: str) -> LayoutError:
    return LayoutError(f"layer {layer!r}: {why}; entry {describe_entry(entry)}")


def split_elements(layer: str, entry: LayerEntry) -> tuple[torch.Tensor, ...]:
    """The tensors a layer entry consists of.

    A tuple/list is taken element by element; a single 5-D tensor with a
    size-2 K/V dimension first (``[2, blocks, ...]``) or second
    (``[blocks, 2, ...]``) is split into its K and V views.
    """
    if isinstance(entry, torch.Tensor):
        if entry.ndim == 5:
            kv_first, kv_second = entry.shape[0] == 2, entry.shape[1] == 2
            if kv_first and kv_second:
                raise _fail(layer, entry, "cannot tell the K/V dimension (dims 0 and 1 are both 2)")
            if kv_first:
                return (entry[0], entry[1])
            if kv_second:
                return (entry[:, 0], entry[:, 1])
            raise _fail(layer, entry, "5-D tensor without a size-2 K/V dimension")
        return (entry,)
    if isinstance(entry, (tuple, list)) and entry and all(isinstance(t, torch.Tensor) for t in entry):
        return tuple(entry)
    raise _fail(layer, entry, "expected a tensor or a non-empty tuple/list of tensors")


def physical_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` permuted so its dims run in memory order (outermost first).

    Metadata only (``permute``). Size-1 dims keep their positions, so a
    single-head tensor keeps its logical shape whatever stride it carries.
    """
    sizes, strides = t.shape, t.stride()
    movable = [d for d in range(t.ndim) if sizes[d] > 1]
    order = sorted(movable, key=lambda d: -strides[d])  # stable: ties keep order
    perm = list(range(t.ndim))
    for slot, dim in zip(movable, order):
        perm[slot] = dim
    return t if perm == list(range(t.ndim)) else t.permute(perm)


def _packed_from(t: torch.Tensor, first: int) -> bool:
    """Dims ``first..`` are densely packed (size-1 dims ignored)."""
    expected = 1
    for d in range(t.ndim - 1, first - 1, -1):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _block_span_bytes(t: torch.Tensor) -> int:
    """Bytes one block of ``t`` spans (first to last byte, gaps included)."""
    span = 1 + sum((t.shape[d] - 1) * t.stride(d) for d in range(1, t.ndim) if t.shape[d] > 0)
    return span * t.element_size()


@dataclass(frozen=True)
class _Extent:
    storage: int
    ptr: int
    stride: int  # bytes between blocks
    span: int  # bytes of one block
    num_blocks: int
    rows: int  # dim 1 of the physical view (token rows), 1 for 2-D views
    row_stride: int  # bytes between rows
    row_span: int  # bytes of one row, first to last


def _extent(t: torch.Tensor) -> _Extent:
    v = physical_view(t)
    isz = v.element_size()
    rows, row_stride, row_span = 1, 0, _block_span_bytes(v) if v.ndim else 0
    if v.ndim >= 3:
        rows, row_stride = v.shape[1], v.stride(1) * isz
        row_span = (1 + sum((v.shape[d] - 1) * v.stride(d) for d in range(2, v.ndim))) * isz
    return _Extent(
        storage=t.untyped_storage().data_ptr(),
        ptr=t.data_ptr(),
        stride=v.stride(0) * isz if v.ndim else 0,
        span=_block_span_bytes(v) if v.ndim else 0,
        num_blocks=v.shape[0] if v.ndim else 0,
        rows=rows,
        row_stride=row_stride,
        row_span=row_span,
    )


def _row_nested(inner: _Extent, outer: _Extent) -> bool:
    """Row r of ``inner`` lies inside row r of ``outer`` for every r: moving
    outer's rows moves inner's bytes with the same tokens."""
    off = inner.ptr - outer.ptr
    return (
        inner.rows == outer.rows
        and (inner.rows == 1 or inner.row_stride == outer.row_stride)
        and 0 <= off
        and off + inner.row_span <= outer.row_span
    )


def _fold_aliases(
    layer: str, entry: LayerEntry, elements: Sequence[torch.Tensor], paged: Sequence[bool]
) -> dict[int, int]:
    """element -> primary element for views that need no plane of their own.

    * A view inside another view of the same allocation is folded into it
      when moving the outer one moves its bytes with the same tokens: a
      dtype view at the same address, a sub-range of every row, or anything
      inside a block moved as a whole page.
    * A view whose block holds other views with a *different* row geometry
      is a reinterpretation of their bytes (vLLM-Ascend 0.23 on A5 hands the
      DeepSeek-V4 indexer as K rows, scale rows and a third "full" view of
      132-byte rows over the same page, worker/model_runner_v1.py
      ``_reshape_kv_cache_tensors`` / ``_adjust_kv_layout`` with
      ``overlap_full_kv_cache``): its row r is
      not token r's bytes, so it is folded into those views when they tile
      its block exactly, and refused otherwise.
    * Disjoint views (Mamba-style slices, K-then-scale pages) stay separate
      planes; partial overlaps are refused because their bytes would be
      addressed twice.
    """
    ext = [_extent(t) for t in elements]
    alias: dict[int, int] = {}
    covers: dict[int, list[int]] = {}
    # Largest span first, so the widest view of a blob becomes its primary.
    order = sorted(range(len(elements)), key=lambda i: (-ext[i].span, i))
    for pos, j in enumerate(order):
        for i in order[:pos]:
            if i in alias:
                continue
            a, b = ext[i], ext[j]
            if a.storage != b.storage or a.stride != b.stride or a.stride == 0:
                continue
            lo, hi = b.ptr - a.ptr, b.ptr - a.ptr + b.span
            if hi <= 0 or lo >= a.span:
                continue  # disjoint within a block
            if lo >= 0 and hi <= a.span and b.num_blocks <= a.num_blocks:
                if paged[i] or paged[j] or _row_nested(b, a):
                    alias[j] = i
                    break
                covers.setdefault(i, []).append(j)
                continue
            raise _fail(
                layer,
                entry,
                f"elements {i} and {j} partly overlap inside a block "
                f"(offsets {0}..{a.span} and {lo}..{hi}); cannot address them as planes",
            )
    for i, inner in covers.items():
        inner = [j for j in inner if j not in alias]
        spans = sorted((ext[j].ptr - ext[i].ptr, ext[j].ptr - ext[i].ptr + ext[j].span) for j in inner)
        tiled = bool(spans) and spans[0][0] == 0 and spans[-1][1] == ext[i].span
        tiled = tiled and all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:]))
        if not tiled or i in alias or i in alias.values():
            raise _fail(
                layer,
                entry,
                f"element {i} covers elements {inner} with other rows (rows of {ext[i].row_span} "
                f"bytes vs {[ext[j].row_span for j in inner]}) that do not tile its block; "
                "cannot tell which bytes belong to which token",
            )
        alias[i] = min(inner)
    return alias


def _row_planes(
    layer: str, entry: LayerEntry, idx: int, v: torch.Tensor, layout: Optional[KVLayout], in_tuple: bool
) -> list[PlaneGeom]:
    isz = v.element_size()
    nb, stride = v.shape[0], v.stride(0) * isz
    name = dtype_name(v.dtype)
    ptr = v.data_ptr()
    if v.ndim == 3:
        return [PlaneGeom(idx, 0, Granularity.ROW, name, v.shape[1], nb, v.shape[2] * isz, stride, ptr)]
    if v.ndim != 4:
        raise _fail(layer, entry, f"element {idx}: {v.ndim}-D tensor is not a known row layout")
    d1, d2, d3 = v.shape[1], v.shape[2], v.shape[3]
    if layout is None:
        if in_tuple or d2 == 1:
            layout = "NHD"  # vLLM-Ascend tuples; or one head: [blocks, tokens, 1, hs]
        elif d1 == 1:
            layout = "HND"  # [blocks, 1, tokens, row]: one head either way
        else:
            raise _fail(
                layer,
                entry,
                f"element {idx}: 4-D tensor with dims {tuple(v.shape)} is NHD or HND "
                "(or an opaque page); pass LayoutHints(kv_layout=...) or opaque_pages=True",
            )
    if layout == "NHD":
        return [PlaneGeom(idx, 0, Granularity.ROW, name, d1, nb, d2 * d3 * isz, stride, ptr)]
    # HND: a token's row is split in one run per head; each head is a plane
    # whose blocks are the head's slab inside the block.
    head_bytes = d2 * d3 * isz
    return [
        PlaneGeom(idx, h, Granularity.ROW, name, d2, nb, d3 * isz, stride, ptr + h * head_bytes)
        for h in range(d1)
    ]


def _page_plane(idx: int, v: torch.Tensor, state: bool) -> PlaneGeom:
    isz = v.element_size()
    payload = math.prod(v.shape[1:]) * isz
    if state or v.ndim == 2:
        rows = 0  # a state page is not token-addressed
    else:
        # vLLM(-CPU) pages are [blocks, heads, tokens, C] (4-D) or [blocks, tokens, C].
        rows = v.shape[2] if v.ndim == 4 else v.shape[1]
    return PlaneGeom(
        idx, 0, Granularity.PAGE, dtype_name(v.dtype), rows, v.shape[0], payload, v.stride(0) * isz, v.data_ptr()
    )


def detect_layer(
    layer: str,
    entry: LayerEntry,
    hints: Optional[LayoutHints] = None,
    paged: Optional[Sequence[bool]] = None,
    state: Optional[Sequence[bool]] = None,
) -> LayerLayout:
    """Planes of one layer entry.

    paged[i]: element i is moved as whole pages (opaque CPU pages, state);
    state[i]: element i holds per-block state rather than token rows. Both
    default to ``hints.opaque_pages`` / False for every element.
    """
    hints = hints or LayoutHints()
    elements = split_elements(layer, entry)
    n = len(elements)
    paged = list(paged) if paged is not None else [hints.opaque_pages] * n
    state = list(state) if state is not None else [False] * n
    if len(paged) != n or len(state) != n:
        raise ValueError(f"layer {layer!r}: {n} elements but {len(paged)}/{len(state)} flags")
    in_tuple = not isinstance(entry, torch.Tensor)
    alias = _fold_aliases(layer, entry, elements, [p or st for p, st in zip(paged, state)]) if n > 1 else {}
    planes: list[PlaneGeom] = []
    for idx, t in enumerate(elements):
        if idx in alias:
            continue
        if t.ndim < 2:
            raise _fail(layer, entry, f"element {idx}: {t.ndim}-D tensor has no block dimension")
        if any(s < 0 for s in t.stride()) or any(s == 0 and z > 1 for s, z in zip(t.stride(), t.shape)):
            raise _fail(layer, entry, f"element {idx}: negative or broadcast strides")
        v = physical_view(t)
        if not _packed_from(v, 1):
            raise _fail(
                layer,
                entry,
                f"element {idx}: dims inside a block are not densely packed "
                f"(physical shape {tuple(v.shape)}, strides {tuple(v.stride())})",
            )
        if v.stride(0) * v.element_size() < _block_span_bytes(v):
            raise _fail(layer, entry, f"element {idx}: blocks overlap (stride smaller than a block)")
        if paged[idx] or state[idx] or v.ndim == 2:
            planes.append(_page_plane(idx, v, state[idx]))
        else:
            planes.extend(_row_planes(layer, entry, idx, v, hints.kv_layout, in_tuple))
    return LayerLayout(
        layer_name=layer,
        format=_classify(entry, elements, planes, alias),
        num_elements=n,
        planes=tuple(planes),
        aliases=tuple(sorted(alias.items())),
    )


def _classify(
    entry: LayerEntry, elements: Sequence[torch.Tensor], planes: Sequence[PlaneGeom], alias: Mapping[int, int]
) -> LayerFormat:
    if isinstance(entry, torch.Tensor):
        if len(elements) == 2:
            return LayerFormat.KV_STACKED
        p = planes[0]
        if p.granularity is Granularity.PAGE:
            return LayerFormat.PAGES
        if len(planes) > 1:
            return LayerFormat.HND
        return LayerFormat.NHD if entry.ndim == 4 and min(entry.shape[1:3]) > 1 else LayerFormat.ROWS
    distinct = len(elements) - len(alias)
    if distinct >= 3 or alias:
        return LayerFormat.MULTI_PLANE
    if distinct == 2:
        a, b = elements
        same = a.shape == b.shape and a.dtype == b.dtype
        return LayerFormat.KV_PAIR if same else LayerFormat.TWO_PLANE
    return LayerFormat.ROWS


def check_layers_own_their_memory(planes: Sequence[tuple[str, int, int, int]]) -> None:
    """Refuse two layers of one group whose stored planes start at the same
    address: ``planes`` holds (layer, group, plane index, data_ptr).

    Layers of one group get distinct block memory in every layout this
    connector serves (layers of DIFFERENT groups may alias: DeepSeek-V4's
    tuple slots, vLLM's hybrid pages, whose block ids never collide).
    vLLM-Ascend 0.28.0rc1+'s KV pipeline parallelism gives the layers a rank
    does not own two shared scratch buffers (worker/kvpp_cache.py,
    allocate_kvpp_cache: ``scratch[target_index % KVPP_SCRATCH_BUFFER_COUNT]``):
    their bytes are whatever the last such layer wrote, not that layer's KV,
    so storing them as prefix KV would hand garbage to a later hit.
    """
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for layer, group, plane, ptr in planes:
        if not ptr:
            continue
        other = seen.setdefault((group, ptr), (layer, plane))
        if other[0] != layer:
            raise LayoutError(
                f"layers {other[0]!r} (plane {other[1]}) and {layer!r} (plane {plane}) of KV cache group "
                f"{group} address the same memory (0x{ptr:x}): a buffer shared by several layers (e.g. "
                "vLLM-Ascend's KV-pipeline-parallel scratch buffers for layers this rank does not own) "
                "does not hold any one layer's KV and cannot be stored; valid: one buffer per layer"
            )
