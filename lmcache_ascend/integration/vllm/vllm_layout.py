"""The ONE module that reads vLLM's types.

It turns vLLM's ``KVCacheConfig``, ``SchedulerOutput`` and ``Request``
objects into our own typed records, so the scheduler and worker halves and
the planning code never depend on vLLM's classes directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vllm.v1.core.sched.output import SchedulerOutput
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

from lmcache_ascend.compat import vllm_features
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup

logger = logging.getLogger(__name__)


def _prefix_cacheable(spec: KVCacheSpec) -> bool:
    # vLLM 0.32 lets a spec declare that its blocks are not reusable; earlier
    # series have no such spec (CircularBufferSpec came with the attribute).
    return bool(spec.prefix_cacheable) if vllm_features().spec_reuse_attributes else True


def _classify(spec: KVCacheSpec) -> tuple[GroupKind, Optional[int]]:
    """Group kind and sliding window of one vLLM spec."""
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, None
    if not _prefix_cacheable(spec):
        # e.g. CircularBufferSpec: a per-request ring rewritten in place; its
        # content is not a function of token positions we could restore.
        return GroupKind.STATE, None
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING, int(spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # Only the current attention chunk is kept; a window of that length
        # before the hit end covers everything a later token can read.
        return GroupKind.SLIDING, int(spec.attention_chunk_size)
    if isinstance(spec, (FullAttentionSpec, AttentionSpec)):
        # A FullAttentionSpec with sliding_window set still keeps every block.
        return GroupKind.FULL, None
    # Anything else (vLLM-Ascend DSv4 state specs, future specs) holds state we
    # cannot rebuild from token positions: the planner decides whether it is
    # skippable (allowlist) or makes hits unservable.
    return GroupKind.STATE, None


def _compress_ratio(spec: KVCacheSpec) -> int:
    """Tokens per stored row. vLLM-Ascend's DSv4 specs and vLLM < 0.32's MLA
    specs call it ``compress_ratio``; vLLM 0.32's attention specs
    ``tokens_per_state`` (Mamba uses -1 there and Whisper a fraction below
    1: not ratios)."""
    ratio = getattr(spec, "compress_ratio", None)
    if ratio is None and isinstance(spec, AttentionSpec) and vllm_features().spec_reuse_attributes:
        tps = spec.tokens_per_state
        ratio = tps if isinstance(tps, int) and tps >= 1 else 1
    return int(ratio or 1)


def scheduler_groups(kv_cache_config: KVCacheConfig) -> tuple[SchedulerGroup, ...]:
    """One ``SchedulerGroup`` per vLLM KV cache group, index == group id."""
    out = []
    transferable = transferable_group_ids(kv_cache_config)
    for idx, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind, window = _classify(spec)
        out.append(
            SchedulerGroup(
                index=idx,
                kind=kind,
                spec_name=type(spec).__name__,
                block_size=int(spec.block_size),
                compress_ratio=_compress_ratio(spec),
                sliding_window=window,
                layer_names=tuple(group.layer_names),
                transferable=idx in transferable,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class LayoutFacts:
    """What vLLM tells about its KV tensors beyond the tensors themselves."""

    kv_layout: Optional[str]  # "NHD" / "HND" for token-row tensors, else None
    layer_compress_ratio: dict[str, int]  # per layer, where a group mixes ratios


def layout_facts(kv_cache_config: KVCacheConfig) -> LayoutFacts:
    layout = _kv_cache_layout(kv_cache_config)
    ratios: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            # One group whose layers carry their own specs (DSv4 on vLLM >=
            # 0.20 mixes compress ratios 4 and 128 in group 0).
            for name, layer_spec in spec.kv_cache_specs.items():
                ratios[name] = _compress_ratio(layer_spec)
    return LayoutFacts(
        kv_layout=layout if layout in ("NHD", "HND") else None,
        layer_compress_ratio=ratios,
    )


def _kv_cache_layout(kv_cache_config: KVCacheConfig) -> Optional[str]:
    """vLLM's resolved NHD/HND layout: in the KV cache config on 0.32, from
    the attention backends' helper before."""
    if vllm_features().spec_reuse_attributes:
        return kv_cache_config.kv_cache_layout
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return str(get_kv_cache_layout())


def transferable_group_ids(kv_cache_config: KVCacheConfig) -> frozenset[int]:
    """Groups vLLM lets connectors transfer (``enable_kv_transfer``, 0.32);
    every group before."""
    if vllm_features().spec_reuse_attributes:
        return frozenset(kv_cache_config.transfer_group_ids)
    return frozenset(range(len(kv_cache_config.kv_cache_groups)))


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def block_ids_of(block_ids: Any) -> tuple[list[int], ...]:
    """Normalize vLLM's per-group block ids (tuple of lists) to fresh lists."""
    return tuple(list(ids) for ids in block_ids)


@dataclass(frozen=True)
class RequestView:
    """What the scheduler half reads from a vLLM ``Request``."""

    req_id: str
    token_ids: Sequence[int]  # live view: prompt + generated tokens
    num_tokens: int
    num_prompt_tokens: int


def request_view(request: Any) -> RequestView:
    return RequestView(
        req_id=request.request_id,
        token_ids=request.all_token_ids,
        num_tokens=int(request.num_tokens),
        num_prompt_tokens=int(request.num_prompt_tokens),
    )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in this step, normalized from SchedulerOutput."""

    req_id: str
    is_new: bool  # first time scheduled (NewRequestData)
    resumed: bool  # rescheduled after preemption: block ids replace, not append
    block_ids: Optional[tuple[list[int], ...]]  # new/resumed: all; else the appended ones
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


@dataclass(frozen=True)
class StepView:
    scheduled: tuple[ScheduledRequest, ...]
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]


def step_view(output: SchedulerOutput) -> StepView:
    sched: list[ScheduledRequest] = []
    counts = output.num_scheduled_tokens
    for new in output.scheduled_new_reqs:
        sched.append(
            ScheduledRequest(
                req_id=new.req_id,
                is_new=True,
                resumed=False,
                block_ids=block_ids_of(new.block_ids),
                num_computed_tokens=int(new.num_computed_tokens),
                num_scheduled_tokens=int(counts.get(new.req_id, 0)),
            )
        )
    cached = output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        sched.append(
            ScheduledRequest(
                req_id=req_id,
                is_new=False,
                resumed=req_id in cached.resumed_req_ids,
                block_ids=None if new_ids is None else block_ids_of(new_ids),
                num_computed_tokens=int(cached.num_computed_tokens[i]),
                num_scheduled_tokens=int(counts.get(req_id, 0)),
            )
        )
    return StepView(
        scheduled=tuple(sched),
        finished_req_ids=frozenset(output.finished_req_ids),
        preempted_req_ids=frozenset(output.preempted_req_ids or ()),
    )


def kv_transfer_extra_config(vllm_config: Any) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(ktc.kv_connector_extra_config or {})


def engine_identity(vllm_config: Any) -> tuple[str, str, int, int]:
    """(model name, engine id, tp rank, world size) for LMCache metadata."""
    ktc = vllm_config.kv_transfer_config
    pc = vllm_config.parallel_config
    return (
        str(vllm_config.model_config.model),
        str(getattr(ktc, "engine_id", None) or "lmcache-ascend"),
        int(pc.rank),
        int(pc.world_size),
    )


def ensure_recompute_on_load_failure(vllm_config: Any) -> None:
    """A cache miss must cost speed, never the request: ask vLLM to recompute
    blocks we report through ``get_block_ids_with_load_errors``."""
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
        logger.info(
            "lmcache-ascend: kv_load_failure_policy %r -> 'recompute' (a failed or "
            "partial load from the cache is recomputed instead of failing the request)",
            ktc.kv_load_failure_policy,
        )
        ktc.kv_load_failure_policy = "recompute"

