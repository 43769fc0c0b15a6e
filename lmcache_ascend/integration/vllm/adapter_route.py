"""vLLM's own ``LMCacheConnectorV1`` on the CPU and on NPUs: the vLLM side.

``lmcache_bridge/patching/adapter_shim.py`` patches LMCache's vLLM adapter (its
GPU-connector factory and three methods of ``LMCacheConnectorV1Impl``). The
steps of that route that read vLLM's types or build the transfer plan are
here: the startup checks with vLLM's load-failure policy, a shutdown where
vLLM gives the connector none, and the plan for vLLM's KV tensors. The bridge
calls them through ``lmcache_bridge.patching.route_registry``: dependencies point
down, the bridge never imports this layer.

:func:`install` is the one place that turns the LMCache patches on: it
registers these steps, then installs the bridge's import hook
(``lmcache_bridge.patching.hook``), in that order, so the patched adapter never runs
without its steps. ``import lmcache_ascend`` does not call it: importing the
package or a lower one (``planning``, ``transfer``; ``ops``, which LMCache
itself imports while it initializes on NPU hosts) must change nothing in the
process and run no code of this layer. The entry
points call it instead, each before LMCache can load a module it patches:

* the vLLM plugin (``plugin.register``, this package's
  ``vllm.general_plugins`` entry point), which vLLM runs in every process
  (front end, engine core, workers) before it builds a KV connector. That is
  what serves vLLM's ``LMCacheConnectorV1`` and vLLM-Ascend's
  ``LMCacheAscendConnector``, which only ``import lmcache_ascend``: the
  import finds the hook already installed by the plugin. (A ``VLLM_PLUGINS``
  list that leaves out ``lmcache_ascend`` turns that off; such a process
  must call :func:`install` itself.)
* the dynamic connector's module (``lmcache_ascend_connector_v1``), at
  import, so naming it by ``kv_connector_module_path`` alone also works.

The hook also patches modules LMCache loaded before it was installed
(``hook.install``), so an entry point that runs after ``import lmcache``
is still in time; only the 0.5.7rc2 alias of the adapter's old name needs
the hook before vLLM imports that name, which the plugin ensures (vLLM runs
it before it builds any connector).

Imports nothing of vLLM or LMCache at import time; neither does
:func:`install` (it patches only LMCache modules already loaded).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from lmcache_ascend.lmcache_bridge.patching import hook, overrides, route_registry

if TYPE_CHECKING:
    # Named for readers, never imported at run time (see above); mypy skips
    # vLLM's sources, so to it vLLM's types stay untyped.
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from lmcache_ascend.planning.kv_format import LayerEntry

logger = logging.getLogger(__name__)

# Any below: LMCache's objects as its adapter hands them over, ``config``
# its LMCacheEngineConfig and ``engine`` its LMCacheEngine (LMCache ships no
# types). ``parent`` is vLLM's LMCacheConnectorV1, the other vLLM objects are
# as that adapter stores them (read through the vllm_* modules).


def prepare(config: Any, vllm_config: VllmConfig, is_scheduler: bool) -> None:
    """Our startup checks and requirements, in both vLLM roles."""
    from lmcache_ascend.compat import require_supported
    from lmcache_ascend.integration.vllm import vllm_engine_config
    from lmcache_ascend.lmcache_bridge.engine.config import enforce_engine_requirements, validate_engine_config
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import attach_logging
    from lmcache_ascend.lmcache_bridge.patching.adapter_shim import ROUTE, announce

    attach_logging()
    require_supported()
    validate_engine_config(config, os.environ)
    enforce_engine_requirements(config, 1, connector=ROUTE)
    if is_scheduler:
        vllm_engine_config.ensure_recompute_on_load_failure(vllm_config)
    announce()


def install_shutdown(parent: Optional[KVConnectorBase_V1], close: Callable[[], None]) -> None:
    """vLLM 0.32's ``LMCacheConnectorV1`` does not override ``shutdown``, so
    LMCache's engine is never closed; its storage thread is not a daemon and
    keeps an in-process engine's Python process alive forever. Give this
    connector instance (``parent``) a shutdown that runs ``close``, the
    bridge's bounded close of LMCache's engine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from lmcache_ascend.integration.vllm.shutdown import close_before_thread_join

    if parent is None or type(parent).shutdown is not KVConnectorBase_V1.shutdown:
        return  # vLLM closes it itself
    overrides.apply(overrides.CONNECTOR_SHUTDOWN, parent, "shutdown", close)
    # On every vLLM: 0.32 closes an in-process engine only when it is
    # garbage collected or at exit, after non-daemon threads are joined.
    close_before_thread_join(parent, lambda p: p.shutdown())


def bind(parent: KVConnectorBase_V1, engine: Any, config: Any, kv_caches: Mapping[str, LayerEntry]) -> None:
    """``register_kv_caches`` of the adapter: bind its engine's connector to
    the KV tensors of vLLM's connector ``parent``."""
    # getattr: vLLM's KVConnectorBase_V1 sets _vllm_config on every supported
    # vLLM (0.23-0.32); a parent without it (a stand-in) binds with no model
    # identity in the keys, as bind_engine's vllm_config=None.
    bind_engine(engine, kv_caches, parent._kv_cache_config, config, getattr(parent, "_vllm_config", None))


def _model_identity(vllm_config: VllmConfig, config: Any) -> str:
    """The weights' fingerprint for this route's chunk keys (as the dynamic
    connector's). Where the weights cannot be read, this route cannot refuse
    requests one by one in its scheduler: it refuses to start instead."""
    from lmcache_ascend.integration.vllm import wiring
    from lmcache_ascend.planning.settings import AscendConfig

    identity, refusal = wiring.model_identity(vllm_config, AscendConfig.from_lmcache(config))
    if refusal is not None:
        from lmcache_ascend.lmcache_bridge.patching.adapter_shim import ROUTE

        raise ValueError(
            f"{ROUTE}: {refusal.detail}; chunk keys could not tell these weights from others served "
            "under the same name. Set ascend_model_identity (kv_connector_extra_config "
            "'lmcache.ascend_model_identity' or LMCACHE_ASCEND_MODEL_IDENTITY) to an identifier of these weights"
        )
    return identity


def bind_engine(engine: Any, kv_caches: Mapping[str, LayerEntry], kv_cache_config: KVCacheConfig, config: Any,
                vllm_config: Optional[VllmConfig] = None) -> None:
    """Plan transfers for vLLM's KV tensors and bind ``engine``'s connector."""
    from lmcache_ascend.integration.vllm import vllm_specs, wiring
    from lmcache_ascend.lmcache_bridge.engine.config import value_encoding_tag
    from lmcache_ascend.lmcache_bridge.patching import adapter_shim
    from lmcache_ascend.planning.planner import build_plan
    from lmcache_ascend.planning.settings import AscendConfig
    from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

    connector = adapter_shim.adapter_connector(engine)
    groups = vllm_specs.scheduler_groups(kv_cache_config)
    if len(groups) != 1:
        raise ValueError(
            f"{adapter_shim.ROUTE} serves models with one KV cache group; this one has "
            f"{len(groups)} ({[g.spec_name for g in groups]}). Use {adapter_shim.DYNAMIC} "
            "(kv_connector_module_path lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1), "
            "which keeps vLLM's hybrid KV cache manager on"
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
    key = plan.layout_fingerprint + value_encoding_tag(config)
    if vllm_config is not None:
        key = f"m{_model_identity(vllm_config, config)}+{key}"
    adapter_shim.prepare_engine(engine, connector, key)
    logger.info("lmcache-ascend adapter plan:\n%s", plan.describe())
    wiring.log_copy_threads(transfer)


def refusal(request: Request) -> Optional[tuple[str, str]]:
    """LMCache's adapter keys a request's chunks by its tokens with its
    multimodal items folded in, never by its ``cache_salt`` or LoRA adapter
    (LMCache issue 2878), and not by prompt embeddings: such requests would
    be served KV vLLM's own prefix cache keeps apart, so this route neither
    looks them up nor stores them. (LMCacheAscendConnectorV1Dynamic keys all
    of them: vllm_keys.py.)"""
    # Duck-typed on purpose, as vllm_keys.request_keys: vLLM's Request has
    # these three (and LoRARequest its lora_name) on every supported vLLM
    # (0.23-0.32); one without a field has nothing to refuse for it.
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds", "the request gives prompt embeddings"
    if getattr(request, "cache_salt", None):
        return "cache_salt", "the request has a cache_salt, which LMCache's adapter leaves out of its keys"
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        return "lora", (f"the request runs LoRA adapter {getattr(lora, 'lora_name', '?')!r}, which LMCache's "
                        "adapter leaves out of its keys")
    return None


STEPS = route_registry.AdapterRoute(prepare=prepare, install_shutdown=install_shutdown, bind=bind, refusal=refusal)


def register() -> None:
    """Hands these steps to the bridge's patch of LMCache's adapter."""
    route_registry.register(STEPS)


def install() -> None:
    """Registers these steps, then installs the import hook that applies
    the LMCache patches. Idempotent and cheap; see the module docstring for
    who calls it and why ``import lmcache_ascend`` does not."""
    register()  # first: the patched adapter looks its steps up when it runs
    hook.install()
