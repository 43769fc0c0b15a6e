"""How a worker's KV tensors are laid out: NHD or HND token rows, and the
per-layer compression of groups that mix ratios (``layout_facts``, turned
into planning/kv_format.py's ``LayoutHints`` by wiring.py).

Worker side only: the scheduler's config has no per-layer specs. Kept apart
from vllm_specs.py because the answer comes from vLLM's resolved layout name
or vLLM-Ascend's attention backend, not from the spec classes. The
per-layer ratio is vllm_specs' own ``_compress_ratio``, so these hints and
the scheduler groups read a spec's compression the same way.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs

from lmcache_ascend.integration.vllm.vllm_specs import _compress_ratio

if TYPE_CHECKING:
    from lmcache_ascend.planning.kv_format import KVLayout


@dataclass(frozen=True)
class LayoutFacts:
    """What vLLM tells about its KV tensors beyond the tensors themselves."""

    kv_layout: Optional[KVLayout]  # "NHD" / "HND" for token-row tensors, else None
    layer_compress_ratio: dict[str, int]  # per layer, where a group mixes ratios


def layout_facts(kv_cache_config: KVCacheConfig) -> LayoutFacts:
    """Worker side only: the scheduler's config has no per-layer specs."""
    layout = _kv_cache_layout(kv_cache_config)
    ratios: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            layer_ratios = {name: _compress_ratio(s) for name, s in spec.kv_cache_specs.items()}
            if len(set(layer_ratios.values())) > 1:
                # One group whose layers differ in compression (vLLM's own
                # DSv4 groups mix compress-4 and compress-128 layers).
                ratios.update(layer_ratios)
    kv_layout = token_row_layout(layout) if (ascend := _ascend_token_row_layout()) is None else ascend
    return LayoutFacts(kv_layout=kv_layout, layer_compress_ratio=ratios)


# vLLM >= 0.29 names its layouts by the physical order of the logical axes
# [L(ayer), B(lock), H(ead), N (token), C(ontent)] (vllm/v1/kv_cache_layout.py,
# KVCacheLayout) and takes "NHD"/"HND" as aliases of "LBNHC"/"LBHNC"
# (vllm/v1/attention/backends/utils.py, resolve_kv_cache_layout). A layer's
# block is [tokens, heads, row] or [heads, tokens, row] only in those two;
# the others interleave layers or blocks in a way a per-layer tensor of
# whole blocks does not show, so they are left unnamed (None), which makes
# kv_format refuse a multi-head 4-D tensor instead of guessing.
_LAYOUT_NAMES: dict[str, KVLayout] = {"NHD": "NHD", "HND": "HND", "LBNHC": "NHD", "LBHNC": "HND"}


def token_row_layout(name: Optional[str]) -> Optional[KVLayout]:
    """"NHD" / "HND" for vLLM's layout name (old or new style), else None."""
    return _LAYOUT_NAMES.get(str(name).upper()) if name else None


# vLLM-Ascend's own backend shapes GQA K/V (attention/attention_v1.py,
# get_kv_cache_shape): NHD in 0.26.0rc1/0.27.1rc1; 0.28.0rc1 to 0.30.0rc2: HND
# only if the VLLM_KV_CACHE_LAYOUT variable is "LBHNC"/"HND": an LBHNC vLLM took
# from a connector's preference names NHD tensors. Hence: ask the backend.
_ASCEND_ATTENTION = ("vllm_ascend", "vllm_ascend.attention.attention_v1", "AscendAttentionBackend")


def _ascend_token_row_layout() -> Optional[KVLayout]:
    """"NHD"/"HND" as vLLM-Ascend's backend shapes K/V here, or None where
    vLLM-Ascend is not loaded (never None otherwise: an answer that is
    neither raises)."""
    package, name, cls = _ASCEND_ATTENTION
    if (module := sys.modules.get(name)) is None:
        if package not in sys.modules:
            return None
        module = importlib.import_module(name)
    n, t, h, d = 5, 7, 3, 11  # distinct sizes: the answer's axis order is unambiguous
    # getattr: vLLM-Ascend's backend module is optional and imported by name.
    shape = tuple(getattr(module, cls).get_kv_cache_shape(n, t, h, d))
    layouts: dict[tuple[int, ...], KVLayout] = {(2, n, t, h, d): "NHD", (2, n, h, t, d): "HND"}
    found = layouts.get(shape)
    if found is None:
        raise ValueError(f"{name}.{cls}.get_kv_cache_shape({n}, {t}, {h}, {d}) gives {shape}: neither NHD "
                         "nor HND K/V, so their rows cannot be addressed")
    return found


def _kv_cache_layout(kv_cache_config: KVCacheConfig) -> Optional[str]:
    """vLLM's resolved layout name: in the KV cache config from 0.29 (the
    engine core resolves it once), from the attention backends' helper
    before (``get_kv_cache_layout``, removed in 0.29)."""
    if hasattr(kv_cache_config, "kv_cache_layout"):
        return kv_cache_config.kv_cache_layout
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return str(get_kv_cache_layout())
