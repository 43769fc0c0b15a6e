"""Lets vLLM's own ``LMCacheConnectorV1`` run on the CPU and on NPUs: the
LMCache side.

LMCache's in-process vLLM adapter (0.5.6, 0.5.7rc2) builds its engine with a
"GPU connector" that exists only for CUDA, XPU, MUSA and HPU; on any other
device ``CreateGPUConnector`` raises. This shim (applied by ``import
lmcache_ascend``, see ``lmcache_ascend.lmcache_bridge.patching.hook``) changes exactly
that, and only on devices LMCache has no connector for:

* ``CreateGPUConnector`` returns an :class:`AdapterChunkConnector`: our
  device-neutral chunk path (the same planner, ``ChunkTransfer`` and native
  ops as ``LMCacheAscendConnectorV1Dynamic``), bound to vLLM's KV tensors in
  ``register_kv_caches``;
* the adapter's config step also applies our checks (startup errors for bad
  values, whole chunks only, a deterministic chunk hash, recompute on load
  failure) and registers our config keys;
* requests whose chunk keys would leave out what vLLM's prefix cache keys
  them on (a ``cache_salt``, a LoRA adapter, prompt embeddings: LMCache's
  adapter keys tokens and multimodal items only) are neither looked up nor
  stored.

The steps that read vLLM's types or build the plan (startup checks, vLLM's
shutdown, planning for vLLM's KV tensors) are the vLLM integration's
(``integration/vllm/adapter_route.py``); the patched adapter calls them
through the route registered in ``route_registry``, so this module never
imports that layer. Here: the GPU-connector hook, the engine guard, the
engine's close and its chunk keys.

The adapter reads ``block_ids[0]`` only, so this route serves models with one
KV cache group (vLLM turns its hybrid manager off for this connector);
hybrid models need ``LMCacheAscendConnectorV1Dynamic``. On CUDA and the other
devices LMCache supports, nothing changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

import torch

from lmcache_ascend.lmcache_bridge.engine.chunk_io import LoadOutcome, PagedChunkConnector, TransferContext
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules, overrides, route_registry

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
        from lmcache_ascend.lmcache_bridge.integrity.pool_secret import PoolSecretError, load_mac_key, read_secret

        if read_secret(config)[0] is not None:
            # No room for a MAC here: entries would be unauthenticated.
            raise PoolSecretError(
                f"a pool secret is set (ascend_pool_secret_file or LMCACHE_ASCEND_POOL_SECRET), but {ROUTE} "
                f"cannot authenticate pool entries (LMCache sizes its chunk buffers); use {DYNAMIC}"
            )
        load_mac_key(config)  # says once that pool entries are not authenticated
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
    idempotent). The steps that read vLLM come from the registered route
    (``route_registry``), looked up when the adapter runs them."""
    cls = module.LMCacheConnectorV1Impl
    if getattr(cls, "_lmcache_ascend_patched", False):
        return
    from lmcache_ascend.lmcache_bridge.backends import credentials
    from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys

    # The adapter reads and prints LMCache's configuration (remote_url with
    # its password) when vLLM constructs it: mask it from then on.
    credentials.install()
    register_config_keys()
    _patch_gpu_connector_factory()
    apply_extra = cls._apply_extra_config
    register = cls.register_kv_caches
    init = cls.__init__
    matched = cls.get_num_new_matched_tokens
    build_meta = cls.build_connector_meta

    def __init__(self, vllm_config, role, parent):
        init(self, vllm_config, role, parent)
        if shim_active():
            seed_lookup_hashes(self)

    def _apply_extra_config(self, config, vllm_config):
        apply_extra(self, config, vllm_config)
        if shim_active():
            route = route_registry.registered()
            route.prepare(config, vllm_config, self._role.name == "SCHEDULER")
            route.install_shutdown(getattr(self, "_parent", None), _engine_closer(self))

    def register_kv_caches(self, kv_caches):
        if shim_active():
            route = route_registry.registered()
            route.bind(getattr(self, "_parent", None), self.lmcache_engine, self.config, kv_caches)
        register(self, kv_caches)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if shim_active() and _refused(self, request):
            return 0
        return matched(self, request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = build_meta(self, scheduler_output)
        if shim_active():
            _drop_refused_saves(self, meta, scheduler_output)
        return meta

    for name, method in (
        ("__init__", __init__),
        ("_apply_extra_config", _apply_extra_config),
        ("register_kv_caches", register_kv_caches),
        ("get_num_new_matched_tokens", get_num_new_matched_tokens),
        ("build_connector_meta", build_connector_meta),
    ):
        overrides.apply(overrides.VLLM_ADAPTER_SHIM, cls, name, method)
    overrides.apply(overrides.VLLM_ADAPTER_SHIM, cls, "_lmcache_ascend_patched", True)


def _refused(adapter: Any, request: Any) -> bool:
    """Whether ``request`` is one this route must neither look up nor store
    (route step ``refusal``); remembered until it finishes, logged once per
    kind."""
    found = route_registry.registered().refusal(request)
    if found is None:
        return False
    kind, detail = found
    refused = adapter.__dict__.setdefault("_lmcache_ascend_refused", set())
    refused.add(request.request_id)
    kinds = adapter.__dict__.setdefault("_lmcache_ascend_refusal_kinds", set())
    if kind not in kinds:
        kinds.add(kind)
        logger.warning(
            "lmcache-ascend: request %s is neither looked up nor stored by %s: %s. Such requests are "
            "served without the cache (logged once per kind, %r); %s keys them.",
            request.request_id, ROUTE, detail, kind, DYNAMIC,
        )
    return True


def _drop_refused_saves(adapter: Any, meta: Any, scheduler_output: Any) -> None:
    """No store for a refused request (LMCache's adapter plans one for every
    request it tracks)."""
    refused = adapter.__dict__.get("_lmcache_ascend_refused")
    if not refused:
        return
    for req in getattr(meta, "requests", ()):
        if req.req_id in refused and req.save_spec is not None:
            overrides.apply(overrides.REFUSED_SAVE, req.save_spec, "can_save", False)
    for req_id in scheduler_output.finished_req_ids:
        refused.discard(req_id)


def _patch_gpu_connector_factory() -> None:
    from lmcache.utils import EngineType

    # The module the adapter's service factory imports CreateGPUConnector from
    # when it builds the engine.
    gpu_connector: Any = lmcache_modules.load(lmcache_modules.GPU_CONNECTOR_FACTORY)  # LMCache's, untyped
    original = gpu_connector.CreateGPUConnector
    if getattr(original, "_lmcache_ascend", False):
        return

    def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802 - LMCache's name
        if engine == EngineType.VLLM and shim_active():
            return AdapterChunkConnector(config, metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    CreateGPUConnector._lmcache_ascend = True  # type: ignore[attr-defined]
    CreateGPUConnector.__wrapped__ = original  # type: ignore[attr-defined]
    overrides.apply(overrides.VLLM_ADAPTER_SHIM, gpu_connector, "CreateGPUConnector", CreateGPUConnector)


def announce() -> None:
    """Says once per process that this route moves the chunks."""
    global _announced
    if _announced:
        return
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
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import prepare_token_database

    client = adapter.lookup_client
    if client is not None and getattr(client, "token_database", None) is not None:
        prepare_token_database(client, int(adapter.config.chunk_size), "adapter scheduler")


def _engine_closer(adapter: Any) -> Callable[[], None]:
    """Closes the adapter's LMCache engine, bounded: the engine only.

    LMCache's full ``stop_services`` closes its offload server's ZMQ socket
    while that server's (daemon) thread is blocked on it, which aborts the
    process inside libzmq."""
    # Imported now, not at shutdown, when the interpreter may be exiting.
    from lmcache.integration.vllm.utils import ENGINE_NAME

    from lmcache_ascend.lmcache_bridge.engine.resources import bounded_close, detach_remote_backends

    builder = lmcache_modules.load(lmcache_modules.CACHE_ENGINE).LMCacheEngineBuilder

    def close() -> None:
        engine = adapter.lmcache_engine
        if engine is None:
            return
        bounded_close("remote backends", lambda: detach_remote_backends(engine))
        bounded_close("LMCache engine", lambda: builder.destroy(ENGINE_NAME))

    return close


def adapter_connector(engine: Any) -> AdapterChunkConnector:
    """The engine's chunk connector; an error if LMCache built another one."""
    connector = getattr(engine, "gpu_connector", None)
    if not isinstance(connector, AdapterChunkConnector):
        raise RuntimeError(
            f"lmcache-ascend: LMCache's engine uses {type(connector).__name__}, not the "
            "lmcache-ascend chunk connector (was the engine created before "
            "lmcache_ascend was imported?)"
        )
    return connector


def prepare_engine(engine: Any, connector: AdapterChunkConnector, layout_fingerprint: str) -> None:
    """After ``connector`` was bound: key this layout's chunks apart, guard
    the engine's retrieve and store, seed and memoize its chunk hashes."""
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import prepare_token_database

    # Chunks of this layout must never meet chunks LMCache's own connectors
    # wrote (another byte layout) in shared or persistent storage.
    metas = (engine.metadata, getattr(engine.token_database, "metadata", None))
    for metadata in {id(m): m for m in metas if m is not None}.values():
        if "+" not in metadata.model_name:
            overrides.apply(
                overrides.LAYOUT_MODEL_NAME, metadata, "model_name", f"{metadata.model_name}+{layout_fingerprint}"
            )
    _guard_engine(engine, connector)
    prepare_token_database(engine, int(connector.chunk_size), "adapter worker")


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

    overrides.apply(overrides.ENGINE_GUARD, engine, "retrieve", guarded_retrieve)
    overrides.apply(overrides.ENGINE_GUARD, engine, "store", guarded_store)
