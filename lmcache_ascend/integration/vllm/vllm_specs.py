"""vLLM's KV cache specs, classified into our scheduler groups.

``scheduler_groups`` turns a ``KVCacheConfig`` (the scheduler's or the
worker's) into one ``planning.groups.SchedulerGroup`` per vLLM KV cache
group: its kind (full, sliding, state), tokens per block, compression and
DeepSeek-V4 compressor state. A spec whose layout cannot be addressed
exactly is refused here, at startup.

Kept apart from the other vllm_* modules: its rules follow the spec
classes of each vLLM / vLLM-Ascend release, not the per-step scheduler
types or the engine config.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from lmcache_ascend.planning.groups import CompressorState, GroupKind, SchedulerGroup

if TYPE_CHECKING:
    from types import ModuleType

    # Named for readers; mypy skips vLLM's sources, so to it this stays untyped.
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec


# vLLM-Ascend defines its spec classes here. In 0.23.0/0.26.0rc1 its
# AscendMLAAttentionSpec counts compressed ROWS in block_size: its manager
# (vllm_ascend/core/single_type_kv_cache_manager.py, CompressAttentionManager)
# divides token counts by compress_ratio before sizing blocks, and its page
# holds block_size rows (kv_cache_interface.py, page_size_bytes /
# real_page_size_bytes). From 0.27.1rc1 its specs count TOKENS and the module
# says how many rows one block holds (get_storage_block_size: block_size //
# compress_ratio, 0.29+ block_size // tokens_per_state). The module is never
# imported here: a spec of its classes exists only once vLLM-Ascend loaded it.
_ASCEND_SPECS_MODULE = "vllm_ascend.core.kv_cache_interface"
_ROW_COUNTED_SPECS = ("AscendMLAAttentionSpec",)
# Defined by vLLM-Ascend >= 0.27.1rc1, whose specs count tokens.
_TOKEN_COUNTED_MARKER = "get_storage_block_size"
# DeepSeek-V4 compressor state caches and the layers whose compressors use
# them (vllm_ascend/models/deepseek_v4.py: Compressor, Indexer): the
# attention compressor of "<x>" writes "<x>.attn", the indexer's "<x>.k_cache".
_COMPRESSOR_STATE_SUFFIX = ".compressor.state_cache"
_COMPRESSED_SIBLINGS = (".attn", ".k_cache")
# Layouts vLLM-Ascend 0.30.0rc2 declares on a spec (core/kv_cache_interface.py)
# that are not checked here: refused at startup rather than moved by a guess.
_UNCHECKED_SPEC_FLAGS = {
    "cache_sparse_sfa_turboquant": "TurboQuant SFA main cache (packed 4-bit rows, AscendMLAAttentionSpec)",
    "cache_sparse_li_c4": "LI-C4 indexer (4-bit K with a 5-D scale view, AscendSFAIndexerCacheSpec)",
}
# DeepSeek-V4 TurboQuant (0.30.0rc2 quantization/methods/kv_cache/turboquant:
# "turboquant_4bit_nc", C4 rows of 258 uint8, its own grouping).
_UNCHECKED_CACHE_DTYPE_PREFIX = "turboquant"


def _prefix_cacheable(spec: KVCacheSpec) -> bool:
    """vLLM >= 0.29's ``prefix_cacheable`` (False on per-request rings:
    CircularBufferSpec, AscendIndexerKPoolTailSpec), ``is_circular`` and
    ``participates_in_prefix_caching`` (vLLM-Ascend 0.27.1rc1+'s
    is_prefix_cacheable reads the same). Earlier series: always cacheable."""
    # is_circular / participates_in_prefix_caching: on no vLLM 0.23-0.32 spec
    # (vLLM-Ascend's); prefix_cacheable: vLLM 0.29+.
    if getattr(spec, "is_circular", False):
        return False
    return bool(getattr(spec, "prefix_cacheable", True)) and bool(
        getattr(spec, "participates_in_prefix_caching", True)
    )


def _classify(spec: KVCacheSpec) -> tuple[GroupKind, Optional[int]]:
    """Group kind and sliding window of one per-layer vLLM spec."""
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, None
    if not _prefix_cacheable(spec):
        # A per-request ring rewritten in place (DeepSeek-V4.1's compressor
        # ring, GLM-5-Next's indexer K-pool tail): its content is not a
        # function of token positions. STATE: never stored, hits refused.
        return GroupKind.STATE, None
    if isinstance(spec, SlidingWindowSpec):
        # Includes vLLM-Ascend's AscendSlidingWindowMLASpec: DeepSeek-V4's
        # SWA caches and its compressor state caches (windows 8 and 128).
        return GroupKind.SLIDING, int(spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # Only the current attention chunk is kept; a window of that length
        # before the hit end covers everything a later token can read.
        return GroupKind.SLIDING, int(spec.attention_chunk_size)
    if isinstance(spec, (FullAttentionSpec, AttentionSpec)):
        # A FullAttentionSpec with sliding_window set still keeps every block.
        return GroupKind.FULL, None
    # Anything else (a UniformTypeKVCacheSpecs nested in one, future specs)
    # holds state we cannot rebuild from token positions: hits are refused.
    return GroupKind.STATE, None


# ``value``: a spec field only some specs have (vLLM-Ascend's, some vLLM
# series'), read with a probe, of whatever type that spec gives it.
def _ratio_value(value: object) -> Optional[int]:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _compress_ratio(spec: KVCacheSpec) -> int:
    """Tokens per stored row: ``compress_ratio`` (vLLM-Ascend's DSv4 specs,
    vLLM < 0.29's MLA specs) or vLLM >= 0.29's ``tokens_per_state`` (Mamba's
    -1 and Whisper's fractions are not ratios). _spec_refusal checks that a
    spec declaring both agrees."""
    ratio = _ratio_value(getattr(spec, "compress_ratio", None))
    if ratio is None and isinstance(spec, AttentionSpec):
        ratio = _ratio_value(getattr(spec, "tokens_per_state", 1))
    return ratio or 1


def _ascend_module() -> Optional[ModuleType]:
    return sys.modules.get(_ASCEND_SPECS_MODULE)


def _is_ascend_spec(spec: KVCacheSpec) -> bool:
    # getattr: the class looked up by name in vLLM-Ascend's module, which is never imported here.
    return type(spec).__module__ == _ASCEND_SPECS_MODULE or (
        (module := _ascend_module()) is not None and getattr(module, type(spec).__name__, None) is type(spec)
    )


def _counts_rows(spec: KVCacheSpec) -> bool:
    """Whether ``spec.block_size`` counts compressed rows (only vLLM-Ascend
    0.23.0/0.26.0rc1's AscendMLAAttentionSpec; from 0.27.1rc1 the module
    defines ``get_storage_block_size`` and block_size counts tokens)."""
    module = _ascend_module()
    if module is None or hasattr(module, _TOKEN_COUNTED_MARKER):
        return False
    classes = tuple(c for c in (getattr(module, n, None) for n in _ROW_COUNTED_SPECS) if isinstance(c, type))
    return bool(classes) and isinstance(spec, classes)


def _spec_refusal(spec: KVCacheSpec) -> Optional[str]:
    """Why a spec's layout cannot be addressed exactly, from what it declares
    (never from the version), or None."""
    # Probes: the flags are vLLM-Ascend's (above); cache_dtype_str is on vLLM's
    # MLA specs only (MLAAttentionSpec, SlidingWindowMLASpec; 0.23-0.32).
    for flag, what in _UNCHECKED_SPEC_FLAGS.items():
        if getattr(spec, flag, False):
            return f"{flag}=True: {what} is not supported; valid: {flag}=False"
    cache_dtype = str(getattr(spec, "cache_dtype_str", None) or "")
    if cache_dtype.startswith(_UNCHECKED_CACHE_DTYPE_PREFIX):
        return f"cache_dtype_str={cache_dtype!r}: TurboQuant KV caches are not supported; use another --kv-cache-dtype"
    # A field at its default 1 declares nothing; the base KVCacheSpec's
    # tokens_per_state (vLLM 0.29+) raises: only attention specs carry it.
    # compress_ratio: vLLM < 0.29's MLA specs and vLLM-Ascend's DSv4 specs.
    names = ("compress_ratio", "tokens_per_state") if isinstance(spec, AttentionSpec) else ("compress_ratio",)
    declared = {n: v for n in names if (v := _ratio_value(getattr(spec, n, None))) is not None and v > 1}
    if len(set(declared.values())) > 1:
        return f"declares {declared}: which one the kernels use is not known; valid: equal ratios"
    if not _prefix_cacheable(spec) or isinstance(spec, MambaSpec):
        return None  # never stored: rows per block do not matter
    ratio = _compress_ratio(spec)
    module = _ascend_module()
    storage = getattr(module, _TOKEN_COUNTED_MARKER, None) if module is not None else None
    if storage is not None and _is_ascend_spec(spec):
        # A block of block_size tokens must hold block_size // ratio rows.
        rows = int(storage(spec))
        if rows * ratio != int(spec.block_size):
            return f"get_storage_block_size gives {rows} rows; block_size {spec.block_size} at ratio {ratio} needs " + (
                f"{int(spec.block_size) // ratio}"
            )
    return None


@dataclass(frozen=True)
class _SpecFacts:
    kind: GroupKind
    window: Optional[int]
    ratio: int
    tokens_per_block: int


def _facts(layer: str, spec: KVCacheSpec) -> _SpecFacts:
    why = _spec_refusal(spec)
    if why is not None:
        raise ValueError(f"layer {layer!r} ({type(spec).__name__}): {why}")
    replicas = getattr(spec, "sfa_dcp_replicated_indexer_size", 1)  # vLLM-Ascend's; no vLLM spec has it
    if replicas != 1:
        # vLLM-Ascend then allocates num_blocks x replicas indexer blocks
        # (model_runner_v1.py, dsa_k_cache_shape); we address one per block id.
        raise ValueError(
            f"layer {layer!r} ({type(spec).__name__}): sfa_dcp_replicated_indexer_size={replicas} "
            "(DCP-replicated SFA indexer) is not supported; valid: 1"
        )
    kind, window = _classify(spec)
    ratio = _compress_ratio(spec)
    block = int(spec.block_size)
    tokens = block * ratio if _counts_rows(spec) else block
    page_rows = _page_rows(spec)
    if ratio > 1 and page_rows is not None and page_rows * ratio != tokens:
        # A 4x mis-read the planner's rows check would miss: 512 and 16384
        # (0.27.1rc1+ C4 / C128 tokens) are multiples of 128 rows.
        raise ValueError(
            f"layer {layer!r} ({type(spec).__name__}): its page holds {page_rows} rows, but block_size "
            f"{block} read as {tokens} tokens per block at {ratio} tokens per row needs {tokens // ratio}; "
            "vLLM-Ascend's block unit (rows or tokens) is not the one expected for this release"
        )
    return _SpecFacts(kind, window, ratio, tokens)


def _page_rows(spec: KVCacheSpec) -> Optional[int]:
    """Rows per block of a vLLM-Ascend MLA spec from its page (rows x heads x
    (head x dtype + scale_dim x scale dtype)); None where that formula does
    not apply (packed SFA-C8, padded page, not an Ascend spec)."""
    # Probes: cache_sparse_sfa_c8, sparse_head_dim, scale_dim and scale_dtype
    # are vLLM-Ascend's fields (no vLLM 0.23-0.32 spec has them);
    # page_size_padded is on vLLM's AttentionSpec and MambaSpec only.
    packed = getattr(spec, "cache_sparse_sfa_c8", False) or getattr(spec, "sparse_head_dim", None)
    padded = getattr(spec, "page_size_padded", None) is not None
    if type(spec).__name__ not in _ROW_COUNTED_SPECS or not _is_ascend_spec(spec) or packed or padded:
        return None
    # Not real_page_size_bytes: vLLM-Ascend 0.23.0 overrides only
    # page_size_bytes; vLLM's base real_page_size_bytes counts ratio rows.
    page, size = int(spec.page_size_bytes), lambda d: torch.empty((), dtype=d).element_size()
    scale = int(getattr(spec, "scale_dim", 0) or 0) * size(getattr(spec, "scale_dtype", spec.dtype))
    row = int(spec.num_kv_heads) * (int(spec.head_size) * size(spec.dtype) + scale)
    return page // row if row and page % row == 0 else None


def _layer_specs(group: KVCacheGroupSpec) -> dict[str, KVCacheSpec]:
    """Per-layer specs of a group: a UniformTypeKVCacheSpecs group (every
    DeepSeek-V4 group on vLLM-Ascend, the 0.26 DSA group, and vLLM's own
    DSv4 groups on the worker side) is unwrapped; vLLM's scheduler process
    sees the first layer's spec instead (kv_cache_utils.py,
    generate_scheduler_kv_cache_config), so both halves classify a group by
    its first layer and check the others agree."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return dict(spec.kv_cache_specs)
    return {name: spec for name in group.layer_names}


def _group_facts(idx: int, group: KVCacheGroupSpec, specs: dict[str, KVCacheSpec]) -> tuple[_SpecFacts, KVCacheSpec]:
    if not specs:
        spec = group.kv_cache_spec
        return _facts(f"<group {idx}>", spec), spec
    items = list(specs.items())
    first_name, first = items[0]
    facts = _facts(first_name, first)
    for name, spec in items[1:]:
        other = _facts(name, spec)
        same = (other.kind, other.window, other.tokens_per_block) == (facts.kind, facts.window, facts.tokens_per_block)
        if not same:
            raise ValueError(
                f"KV cache group {idx}: layer {name!r} ({type(spec).__name__}: {other.kind.value}, window "
                f"{other.window}, {other.tokens_per_block} tokens per block) differs from layer "
                f"{first_name!r} ({type(first).__name__}: {facts.kind.value}, window {facts.window}, "
                f"{facts.tokens_per_block} tokens per block); vLLM's scheduler sees only the first, "
                "so such a group cannot be addressed as one"
            )
    return facts, first


def _compressor_of(
    layer_names: Sequence[str], window: Optional[int], ratios: dict[str, int]
) -> Optional[CompressorState]:
    """What a group of DeepSeek-V4 compressor state caches feeds, or None
    (then the whole sliding window is kept, which is always exact)."""
    if not layer_names or window is None:
        return None
    found = set()
    for name in layer_names:
        if not name.endswith(_COMPRESSOR_STATE_SUFFIX):
            return None
        owner = name[: -len(_COMPRESSOR_STATE_SUFFIX)]
        sibling = [ratios[owner + s] for s in _COMPRESSED_SIBLINGS if ratios.get(owner + s, 1) > 1]
        if len(sibling) != 1:
            return None
        ratio = sibling[0]
        # vLLM's CompressorStateCache: sliding_window = coff * compress_ratio,
        # coff = 2 when the compressor overlaps windows (ratio 4), else 1.
        if window % ratio or window // ratio not in (1, 2):
            return None
        found.add(CompressorState(ratio, overlap=window // ratio == 2))
    return found.pop() if len(found) == 1 else None


def scheduler_groups(kv_cache_config: KVCacheConfig) -> tuple[SchedulerGroup, ...]:
    """One ``SchedulerGroup`` per vLLM KV cache group, index == group id.

    Gives the same groups for the worker's config (UniformTypeKVCacheSpecs
    kept) and the scheduler's (unwrapped to the first layer's spec)."""
    transferable = transferable_group_ids(kv_cache_config)
    facts: list[tuple[_SpecFacts, KVCacheSpec]] = []
    ratios: dict[str, int] = {}
    for idx, group in enumerate(kv_cache_config.kv_cache_groups):
        specs = _layer_specs(group)
        facts.append(_group_facts(idx, group, specs))
        for name, spec in specs.items():
            ratios[name] = _compress_ratio(spec)
    out = []
    for idx, (group, (f, first)) in enumerate(zip(kv_cache_config.kv_cache_groups, facts)):
        names = tuple(group.layer_names)
        out.append(
            SchedulerGroup(
                index=idx,
                kind=f.kind,
                # The first layer's class: what vLLM's scheduler process sees.
                spec_name=type(first).__name__,
                block_size=f.tokens_per_block,
                compress_ratio=f.ratio,
                sliding_window=f.window,
                layer_names=names,
                transferable=idx in transferable,
                compressor=_compressor_of(names, f.window, ratios) if f.kind is GroupKind.SLIDING else None,
            )
        )
    return tuple(out)


def transferable_group_ids(kv_cache_config: KVCacheConfig) -> frozenset[int]:
    """Groups vLLM lets connectors transfer (``enable_kv_transfer``, from
    0.29); every group before."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    if ids is None:
        return frozenset(range(len(kv_cache_config.kv_cache_groups)))
    return frozenset(ids)
