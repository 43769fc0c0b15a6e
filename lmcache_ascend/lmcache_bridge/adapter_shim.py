"""Lets vLLM's own ``LMCacheConnectorV1`` run on the CPU and on NPUs.

LMCache 0.5.6's in-process vLLM adapter builds its engine with a "GPU
connector" that exists only for CUDA, XPU, MUSA and HPU; on any other device
``CreateGPUConnector`` raises. This shim (applied by ``import lmcache_ascend``,
see ``lmcache_ascend.lmcache_bridge.hook``) changes exactly that, and only on
devices LMCache has no connector for:

* ``CreateGPUConnector`` returns an :class:`AdapterChunkConnector`: our
  device-neutral chunk path (the same planner, ``ChunkTransfer`` and native
  ops as ``LMCacheAscendConnectorV1Dynamic``), bound to vLLM's KV tensors in
  ``register_kv_caches``;
* the adapter's config step also applies our checks (startup errors for bad
  values, whole chunks only, a deterministic chunk hash, recompute on load
  failure) and registers our config keys.

The adapter reads ``block_ids[0]`` only, so this route serves models with one
KV cache group (vLLM turns its hybrid manager off for this connector);
hybrid models need ``LMCacheAscendConnectorV1Dynamic``. On CUDA and the other
devices LMCache supports, nothing changes.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping

import torch

from lmcache_ascend.lmcache_bridge import lmcache_modules
from lmcache_ascend.lmcache_bridge.chunk_io import LoadOutcome, PagedChunkConnector, TransferContext

logger = logging.getLogger(__name__)

ROUTE = "vLLM's LMCacheConnectorV1 (lmcache-ascend chunk path)"
DYNAMIC = "LMCacheAscendConnectorV1Dynamic"
# Devices LMCache (0.5.6, 0.5.7rc2) has vLLM GPU connectors for: left to LMCache.
NATIVE_DEVICES = frozenset({"cuda", "xpu", "musa", "hpu"})

_announced = False
# Keyword the guarded retrieve passes through LMCache to the chunk connector:
# that call's own outcome record.
OUTCOME_KWARG = "lmcache_ascend_outcome"


def device_type() -> str:
    from lmcache import torch_device_type

    return str(torch_device_type)


def shim_active() -> bool:
    return device_type() not in NATIVE_DEVICES


class AdapterChunkConnector(PagedChunkConnector):
    """LMCache's GPU-connector hook for the adapter route.

    The adapter sizes each chunk's MemoryObj from its own metadata
    (``kv_shape``), so our payload must fit in it exactly and there is no room
    for the checksum trailer; sizes are still checked on load. The adapter
    passes a per-token ``slot_mapping``; the block table of the (single)
    group is read from it.
    """

    def __init__(self, config: Any, metadata: Any) -> None:
        super().__init__(
            0, int(config.chunk_size), self._unbound, self._unbound, checksums=False, trailer=False
        )
        self._metadata = metadata
        self.block_size = 0

    @staticmethod
    def _unbound(*_args, **_kwargs):
        raise RuntimeError(
            "lmcache-ascend: the adapter's chunk connector was used before vLLM "
            "registered its KV caches"
        )

    def capacity_bytes(self) -> int:
        shapes = self._metadata.get_shapes(self.chunk_size)
        dtypes = self._metadata.get_dtypes()
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(shapes, dtypes)
        )

    def bind(self, chunk_bytes: int, store, load, block_size: int) -> None:
        capacity = self.capacity_bytes()
        if chunk_bytes > capacity:
            raise ValueError(
                f"lmcache-ascend: a chunk of this model needs {chunk_bytes} bytes but "
                f"LMCache's adapter allocates {capacity} (kv_shape "
                f"{tuple(self._metadata.kv_shape)}, {self._metadata.kv_dtype}); use "
                f"{DYNAMIC}, which sizes chunks from the KV layout"
            )
        self.chunk_bytes = chunk_bytes
        self._store = store
        self._load = load
        self.block_size = block_size

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size(self._metadata.get_shapes(num_tokens)[0])

    def _ctx(self, kwargs: Mapping[str, Any]) -> TransferContext:
        slots = kwargs.get("slot_mapping")
        if slots is None:
            raise RuntimeError("lmcache-ascend: LMCache called the chunk connector without slot_mapping")
        bs = self.block_size
        firsts = slots.detach().to("cpu", torch.int64)[::bs]
        real = firsts[firsts >= 0]
        if bool((real % bs).any()):
            raise ValueError(
                f"lmcache-ascend: slot_mapping is not block aligned for block size {bs} "
                f"(first slots {real[:4].tolist()}); cannot address whole blocks"
            )
        block_ids = tuple(torch.div(firsts, bs, rounding_mode="floor").tolist())
        outcome = kwargs.get(OUTCOME_KWARG)
        return TransferContext(
            req_id=str(kwargs.get("req_id", "?")),
            block_ids=(block_ids,),
            outcome=outcome if isinstance(outcome, LoadOutcome) else LoadOutcome(),
        )


# ---- patches -----------------------------------------------------------------


def patch_v1_adapter(module: Any) -> None:
    """Patch LMCache's vLLM adapter module (``lmcache_modules.VLLM_ADAPTER``;
    idempotent)."""
    cls = module.LMCacheConnectorV1Impl
    if getattr(cls, "_lmcache_ascend_patched", False):
        return
    from lmcache_ascend.lmcache_bridge.config import register_config_keys

    register_config_keys()
    _patch_gpu_connector_factory()
    apply_extra = cls._apply_extra_config
    register = cls.register_kv_caches
    init = cls.__init__

    def __init__(self, vllm_config, role, parent):
        init(self, vllm_config, role, parent)
        if shim_active():
            seed_lookup_hashes(self)

    def _apply_extra_config(self, config, vllm_config):
        apply_extra(self, config, vllm_config)
        if shim_active():
            prepare(config, vllm_config, is_scheduler=self._role.name == "SCHEDULER")
            install_shutdown(self)

    def register_kv_caches(self, kv_caches):
        if shim_active():
            bind(self, kv_caches)
        register(self, kv_caches)

    cls.__init__ = __init__
    cls._apply_extra_config = _apply_extra_config
    cls.register_kv_caches = register_kv_caches
    cls._lmcache_ascend_patched = True


def _patch_gpu_connector_factory() -> None:
    from lmcache.utils import EngineType

    # The module the adapter's service factory imports CreateGPUConnector from
    # when it builds the engine.
    gpu_connector = lmcache_modules.load(lmcache_modules.GPU_CONNECTOR_FACTORY)
    original = gpu_connector.CreateGPUConnector
    if getattr(original, "_lmcache_ascend", False):
        return

    def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802 - LMCache's name
        if engine == EngineType.VLLM and shim_active():
            return AdapterChunkConnector(config, metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    CreateGPUConnector._lmcache_ascend = True  # type: ignore[attr-defined]
    CreateGPUConnector.__wrapped__ = original  # type: ignore[attr-defined]
    gpu_connector.CreateGPUConnector = CreateGPUConnector


def prepare(config: Any, vllm_config: Any, is_scheduler: bool) -> None:
    """Our startup checks and requirements, in both vLLM roles."""
    global _announced
    from lmcache_ascend.compat import require_supported
    from lmcache_ascend.integration.vllm import vllm_layout
    from lmcache_ascend.lmcache_bridge.config import enforce_engine_requirements, validate_engine_config
    from lmcache_ascend.lmcache_bridge.engine import attach_logging

    attach_logging()

    require_supported()
    validate_engine_config(config, os.environ)
    enforce_engine_requirements(config, 1, connector=ROUTE)
    if is_scheduler:
        vllm_layout.ensure_recompute_on_load_failure(vllm_config)
    if not _announced:
        _announced = True
        logger.info(
            "lmcache-ascend: LMCache has no vLLM connector for device '%s'; %s moves "
            "the chunks (one KV cache group; hybrid models need %s)",
            device_type(),
            ROUTE,
            DYNAMIC,
        )


def seed_lookup_hashes(adapter: Any) -> None:
    """The scheduler's lookup client hashes chunks in its own process: give
    it the worker's deterministic chunk-hash seed (engine.pin_init_hash)."""
    from lmcache_ascend.lmcache_bridge.engine import prepare_token_database

    client = adapter.lookup_client
    if client is not None and getattr(client, "token_database", None) is not None:
        prepare_token_database(client, int(adapter.config.chunk_size), "adapter scheduler")


def install_shutdown(adapter: Any) -> None:
    """vLLM 0.32's ``LMCacheConnectorV1`` does not override ``shutdown``, so
    LMCache's engine is never closed; its storage thread is not a daemon and
    keeps an in-process engine's Python process alive forever. Give this
    connector instance a bounded shutdown that closes LMCache's engine.

    Only the engine: LMCache's full ``stop_services`` closes its offload
    server's ZMQ socket while that server's (daemon) thread is blocked on it,
    which aborts the process inside libzmq."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from lmcache_ascend.compat import vllm_features
    from lmcache_ascend.integration.vllm.shutdown import close_before_thread_join
    from lmcache_ascend.lmcache_bridge.resources import bounded_close, detach_remote_backends

    parent = getattr(adapter, "_parent", None)
    if parent is None or type(parent).shutdown is not KVConnectorBase_V1.shutdown:
        return  # vLLM closes it itself
    builder = lmcache_modules.load(lmcache_modules.CACHE_ENGINE).LMCacheEngineBuilder

    def shutdown() -> None:
        engine = adapter.lmcache_engine
        if engine is None:
            return
        bounded_close("remote backends", lambda: detach_remote_backends(engine))
        bounded_close("LMCache engine", lambda: builder.destroy(ENGINE_NAME))

    parent.shutdown = shutdown
    if not vllm_features().inproc_engine_shuts_down:
        close_before_thread_join(parent, lambda p: p.shutdown())


def bind(adapter: Any, kv_caches: Mapping[str, Any]) -> None:
    """``register_kv_caches`` of the adapter: bind its engine's connector."""
    bind_engine(adapter.lmcache_engine, kv_caches, adapter._parent._kv_cache_config, adapter.config)


def bind_engine(engine: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, config: Any) -> None:
    """Plan transfers for vLLM's KV tensors and bind ``engine``'s connector."""
    from lmcache_ascend.integration.vllm import vllm_layout, wiring
    from lmcache_ascend.lmcache_bridge.engine import prepare_token_database
    from lmcache_ascend.planning.planner import build_plan
    from lmcache_ascend.planning.settings import AscendConfig
    from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

    connector = getattr(engine, "gpu_connector", None)
    if not isinstance(connector, AdapterChunkConnector):
        raise RuntimeError(
            f"lmcache-ascend: LMCache's engine uses {type(connector).__name__}, not the "
            "lmcache-ascend chunk connector (was the engine created before "
            "lmcache_ascend was imported?)"
        )
    groups = vllm_layout.scheduler_groups(kv_cache_config)
    if len(groups) != 1:
        raise ValueError(
            f"{ROUTE} serves models with one KV cache group; this one has {len(groups)} "
            f"({[g.spec_name for g in groups]}). Use {DYNAMIC} (kv_connector_module_path "
            "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1), which keeps "
            "vLLM's hybrid KV cache manager on"
        )
    plan = build_plan(
        kv_caches,
        groups,
        int(config.chunk_size),
        AscendConfig.from_lmcache(config),
        wiring.worker_layout_hints(kv_cache_config),
    )
    transfer = ChunkTransfer(plan, kv_device=wiring.kv_device(kv_caches), kv_caches=kv_caches)
    connector.bind(plan.chunk_bytes, transfer.store, transfer.load, groups[0].block_size)
    # Chunks of this layout must never meet chunks LMCache's own connectors
    # wrote (another byte layout) in shared or persistent storage.
    metas = (engine.metadata, getattr(engine.token_database, "metadata", None))
    for metadata in {id(m): m for m in metas if m is not None}.values():
        if "+" not in metadata.model_name:
            metadata.model_name = f"{metadata.model_name}+{plan.layout_fingerprint}"
    _guard_engine(engine, connector)
    prepare_token_database(engine, int(config.chunk_size), "adapter worker")
    logger.info("lmcache-ascend adapter plan:\n%s", plan.describe())
    wiring.log_copy_threads(transfer)


def _guard_engine(engine: Any, connector: AdapterChunkConnector) -> None:
    """A chunk that fails to load must not count as loaded, and a failed
    store must not fail the request (LMCache would raise into vLLM)."""
    retrieve, store = engine.retrieve, engine.store

    def guarded_retrieve(tokens, mask=None, **kwargs):
        outcome = kwargs.setdefault(OUTCOME_KWARG, LoadOutcome())
        ret = retrieve(tokens, mask, **kwargs)
        failed = outcome.failed_from
        if failed is not None:
            with torch.inference_mode():  # LMCache returns an inference tensor
                ret[failed:] = False  # the adapter reports these blocks to vLLM
            logger.warning(
                "lmcache-ascend: request %s: tokens from %d not loaded; reported to vLLM "
                "for recomputation",
                kwargs.get("req_id", "?"),
                failed,
            )
        return ret

    def guarded_store(*args, **kwargs):
        try:
            return store(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the request goes on uncached
            logger.exception(
                "lmcache-ascend: storing request %s failed; the request continues "
                "without caching it",
                kwargs.get("req_id", "?"),
            )
            return None

    engine.retrieve = guarded_retrieve
    engine.store = guarded_store
