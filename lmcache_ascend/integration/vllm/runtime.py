"""Builds the scheduler and worker halves from a vLLM config.

Everything that needs both LMCache and vLLM knowledge is wired here, so the
entry class stays a thin role bridge.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from lmcache_ascend.integration.vllm import vllm_layout
from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.worker import WorkerHalf
from lmcache_ascend.v1.engine_glue import (
    ChunkBufferMetadata,
    PagedChunkConnector,
    apply_extra_config,
    enforce_engine_requirements,
    validate_engine_config,
)
from lmcache_ascend.v1.groups import GroupKind, SchedulerGroup

logger = logging.getLogger(__name__)

ENGINE_INSTANCE_PREFIX = "lmcache-ascend"


@dataclass(frozen=True)
class ConnectorSetup:
    """Everything both halves agree on, derived once from the configs."""

    lmcache_config: Any  # LMCacheEngineConfig
    ascend_config: Any  # AscendConfig
    groups: tuple[SchedulerGroup, ...]
    chunk_size: int
    model_name: str
    engine_id: str
    rank: int
    world_size: int


def load_setup(vllm_config: Any, kv_cache_config: Any) -> ConnectorSetup:
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config

    from lmcache_ascend.v1.config import AscendConfig, register_config_keys

    register_config_keys()
    config = lmcache_get_or_create_config()
    extra = vllm_layout.kv_transfer_extra_config(vllm_config)
    apply_extra_config(config, extra)
    # LMCache converts its LMCACHE_* variables itself; re-read them only to
    # name a value it dropped (it keeps None) in the error.
    validate_engine_config(config, os.environ)
    groups = vllm_layout.scheduler_groups(kv_cache_config)
    enforce_engine_requirements(config, len(groups))
    _default_chunk_size(config, groups, extra)
    chunk_size = int(config.chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"LMCache chunk_size must be > 0, got {chunk_size}")
    model, engine_id, rank, world = vllm_layout.engine_identity(vllm_config)
    return ConnectorSetup(
        lmcache_config=config,
        ascend_config=AscendConfig.from_lmcache(config),
        groups=groups,
        chunk_size=chunk_size,
        model_name=model,
        engine_id=engine_id,
        rank=rank,
        world_size=world,
    )


def _default_chunk_size(config: Any, groups: tuple[SchedulerGroup, ...], extra: Mapping[str, Any]) -> None:
    """Unless the user chose one, chunk as finely as vLLM's blocks (see
    ``v1/chunking.py``). Both halves decide alike from the same inputs."""
    from lmcache_ascend.v1.chunking import chunk_size_configured, default_chunk_size

    current = int(config.chunk_size)
    size, replaced = default_chunk_size(groups, chunk_size_configured(extra, os.environ), current)
    if not replaced:
        return
    logger.info(
        "lmcache-ascend: chunk_size not set; using %d tokens (vLLM's block granularity) "
        "instead of LMCache's default %d: a chunk must be a whole number of every "
        "group's blocks, and a hit then leaves no more tokens to compute than vLLM's "
        "own prefix cache does. Set chunk_size to choose another.",
        size,
        current,
    )
    config.chunk_size = size


def _metadata(setup: ConnectorSetup, role: str, chunk_bytes: int, num_layers: int, extra: Mapping[str, Any]):
    return ChunkBufferMetadata(
        model_name=setup.model_name,
        world_size=setup.world_size,
        local_world_size=setup.world_size,
        worker_id=setup.rank,
        local_worker_id=setup.rank,
        kv_dtype=torch.uint8,
        kv_shape=(max(1, num_layers), 1, setup.chunk_size, 1, 1),
        use_mla=False,
        role=role,
        chunk_size=setup.chunk_size,
        engine_id=setup.engine_id,
        kv_connector_extra_config=dict(extra),
        chunk_bytes=chunk_bytes,
    )


def hit_blockers(setup: ConnectorSetup) -> tuple[SchedulerGroup, ...]:
    """STATE groups that are neither skippable nor restorable: any hit would
    leave them stale, so the scheduler refuses hits."""
    from lmcache_ascend.v1.state_skip import unrestorable_groups

    return tuple(unrestorable_groups(setup.groups, setup.ascend_config))


def lookup_through(client: Any, chunk_size: int):
    """The scheduler's lookup function over an LMCache lookup client:
    tokens of the longest stored prefix, or None when nothing answered."""

    def lookup(token_ids, req_id: str) -> Optional[int]:
        tokens = list(token_ids)
        try:
            hit = client.lookup(tokens, lookup_id=req_id)
            # The client records a result only when the lookup server
            # answered; a timeout or transport error returns 0 unrecorded.
            answered = hit is not None and client.lookup_cache(req_id) != -1
        finally:
            # We keep hits ourselves; LMCache's per-request record would
            # otherwise grow for the life of the server.
            client.clear_lookup_status(req_id)
        if not answered and len(tokens) >= chunk_size:
            return None
        return int(hit or 0)

    return lookup


def build_scheduler_half(vllm_config: Any, kv_cache_config: Any) -> tuple[SchedulerHalf, Any]:
    """Returns the half and the LMCache lookup client (to close on shutdown)."""
    from lmcache.v1.lookup_client.factory import LookupClientFactory

    setup = load_setup(vllm_config, kv_cache_config)
    vllm_layout.ensure_recompute_on_load_failure(vllm_config)
    metadata = _metadata(
        setup, "scheduler", 0, 1, vllm_layout.kv_transfer_extra_config(vllm_config)
    )
    client = LookupClientFactory.create_lookup_client(setup.lmcache_config, metadata)
    prepare_token_database(client, setup.chunk_size, "scheduler")

    lookup = lookup_through(client, setup.chunk_size)

    half = SchedulerHalf(
        setup.groups, setup.chunk_size, lookup, hit_blockers=hit_blockers(setup)
    )
    logger.info(
        "lmcache-ascend scheduler: %d KV cache group(s) %s, chunk %d tokens",
        len(setup.groups),
        [f"{g.index}:{g.kind.value}/{g.spec_name}/bs{g.block_size}" for g in setup.groups],
        setup.chunk_size,
    )
    return half, client


_engine_lock = threading.Lock()


def build_worker_half(
    vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any]
) -> tuple[WorkerHalf, Any, Any]:
    """Plans transfers for ``kv_caches`` and starts this worker's LMCache
    engine and lookup server. Returns (half, plan, lookup server)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.lookup_client.factory import LookupClientFactory

    from lmcache_ascend.v1.device_connector import ChunkTransfer
    from lmcache_ascend.v1.planner import build_plan

    setup = load_setup(vllm_config, kv_cache_config)
    hints = worker_layout_hints(kv_cache_config)
    plan = build_plan(kv_caches, setup.groups, setup.chunk_size, setup.ascend_config, hints)
    transfer = ChunkTransfer(plan, kv_device=kv_device(kv_caches))
    connector = PagedChunkConnector(
        plan.chunk_bytes,
        setup.chunk_size,
        transfer.store,
        transfer.load,
        checksums=checksums_enabled(setup.lmcache_config),
    )
    metadata = _metadata(
        setup,
        "worker",
        plan.chunk_bytes,
        len(kv_caches),
        vllm_layout.kv_transfer_extra_config(vllm_config),
    )
    # Chunk keys carry the model name; adding the buffer layout's fingerprint
    # keeps chunks of different layouts (e.g. bundled vs exploded, another
    # chunk size) apart in shared or persistent storage.
    # ("@" separates key fields in LMCache's key strings, so use "+".)
    metadata.model_name = f"{setup.model_name}+{plan.layout_fingerprint}"
    instance_id = f"{ENGINE_INSTANCE_PREFIX}-{setup.engine_id}-{setup.rank}"
    with _engine_lock:
        engine = LMCacheEngineBuilder.get_or_create(
            instance_id,
            setup.lmcache_config,
            metadata,
            connector,
            _broadcast_noop,
            _broadcast_object_noop,
        )
        engine.post_init()
        prepare_token_database(engine, setup.chunk_size, "worker")
    server = LookupClientFactory.create_lookup_server(engine, metadata)
    half = WorkerHalf(
        setup.groups,
        setup.chunk_size,
        engine,
        transfer,
        plan.chunk_bytes,
        frozenset(plan.stored_groups),
        group_bytes=plan.group_bytes(),
    )
    half.instance_id = instance_id  # type: ignore[attr-defined]
    description = plan.describe()
    logger.info("lmcache-ascend worker plan:\n%s", description)
    log_copy_threads(transfer)
    # One machine-readable line for tools (demo, explain) that read logs.
    logger.info(
        "LMCACHE_ASCEND_PLAN_JSON %s",
        json.dumps(dataclasses.asdict(description), default=str, separators=(",", ":")),
    )
    return half, plan, server


# vLLM 0.32's seed of its block-hash chain when PYTHONHASHSEED is unset
# (vllm/v1/core/kv_cache_utils.py, DEFAULT_NONE_HASH_SEED).
NONE_HASH_SEED = "vllm-none-hash"


def pin_init_hash(db: Any) -> int:
    """Make ``db``'s chunk-hash chain start from a seed every process derives
    alike: ``PYTHONHASHSEED`` when set, else vLLM 0.32's fixed seed, hashed
    with the database's own hash function. LMCache copies vLLM's NONE_HASH,
    which vLLM < 0.32 draws from os.urandom per process when PYTHONHASHSEED is
    unset, so the scheduler's lookups and the worker's stores would never
    meet. The value equals what LMCache computes itself on vLLM 0.32, so
    chunks are shared between engines of every supported vLLM. Pinned per
    instance: a later token database re-seeds LMCache's module global."""
    from lmcache.v1.token_database import _normalize_hash_to_int

    seed = os.environ.get("PYTHONHASHSEED") or NONE_HASH_SEED
    value = _normalize_hash_to_int(db.hash_func(seed))
    db._get_init_hash = lambda: value
    return value


def prepare_token_database(owner: Any, chunk_size: int, where: str) -> Optional[Any]:
    """Pins the chunk-hash seed of ``owner.token_database`` (an LMCache engine
    or lookup client) and memoizes its prefix hashes (see v1/hash_memo.py).
    Returns the memo."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    from lmcache_ascend.v1 import hash_memo

    db = getattr(owner, "token_database", None)
    if not isinstance(db, ChunkedTokenDatabase):
        logger.info(
            "lmcache-ascend %s: chunk prefix hashes are not memoized (%s uses %s)",
            where,
            type(owner).__name__,
            type(db).__name__,
        )
        return None
    memo = getattr(db, "lmcache_ascend_hash_memo", None)
    if memo is None:  # a bypass lookup client shares the engine's database
        seed = pin_init_hash(db)  # before the memo captures _get_init_hash
        memo = hash_memo.install(db, chunk_size)
        logger.info(
            "lmcache-ascend %s: chunk hashes seeded with %#x, prefix hashes memoized "
            "(last %d chunks)",
            where,
            seed,
            memo.capacity,
        )
    return memo


def log_copy_threads(transfer: Any) -> Optional[int]:
    """Says how many threads the CPU copies use; warns when the ops module
    was built without OpenMP and so copies on one of several threads."""
    used = transfer.copy_threads()
    if used is None:
        return None
    available = torch.get_num_threads()
    if used < available:
        logger.warning(
            "lmcache-ascend CPU copies use %d of torch's %d threads: lmcache_ascend.ops "
            "was built without torch's OpenMP runtime (see the CMake warning of the "
            "build); loads and stores run at single-thread memory bandwidth",
            used,
            available,
        )
    else:
        logger.info("lmcache-ascend CPU copies use %d thread(s)", used)
    return used


def checksums_enabled(config: Any) -> bool:
    """Chunks that leave this process (disk, remote) can come back damaged;
    LMCache 0.5.6 does not verify them, so we checksum every chunk then."""
    return bool(config.local_disk or config.remote_url)


def worker_layout_hints(kv_cache_config: Any):
    """vLLM-CPU attention blocks are opaque pages (K is transposed inside a
    block); other platforms hand over token-row tensors in the layout vLLM
    resolved (NHD/HND), possibly with per-layer compress ratios."""
    from lmcache_ascend.v1.kv_format import LayoutHints

    if vllm_layout.is_cpu_platform():
        return LayoutHints(opaque_pages=True)
    facts = vllm_layout.layout_facts(kv_cache_config)
    return LayoutHints(kv_layout=facts.kv_layout, layer_compress_ratio=facts.layer_compress_ratio)


def kv_device(kv_caches: Mapping[str, Any]) -> torch.device:
    for entry in kv_caches.values():
        tensor = entry if isinstance(entry, torch.Tensor) else next(iter(entry))
        return tensor.device
    return torch.device("cpu")


def _broadcast_noop(tensor: torch.Tensor, src: int) -> torch.Tensor:
    return tensor


def _broadcast_object_noop(obj: Any, src: int) -> Any:
    return obj
