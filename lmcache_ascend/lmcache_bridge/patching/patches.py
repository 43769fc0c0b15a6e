"""The patches lmcache-ascend applies to LMCache's modules, and the gate.

Each patch names the LMCache module it changes (by its 0.5.6 name; where
the installed release keeps it is ``lmcache_modules.resolve``), the LMCache
releases it was verified on, and the upstream problem it works around.
``apply`` runs a patch once, when its module has executed (``hook.py``), and
only when the installed LMCache is one of those releases; on any other
release LMCache is left as it is and one warning says so (the connectors
then refuse to start, naming the supported versions, see
``lmcache_ascend.compat``). Every patch has a test that fails without it
(tests/unit/test_lmcache_fixes.py, test_ascend_config.py,
test_adapter_shim.py); test_lmcache_modules.py checks that each one applies
on the installed release. In 0.5.7rc2 the three patched modules differ from
0.5.6 only in import paths (the executor, config and adapter code is the
same), so the same patches hold there.

Imports nothing of LMCache at import time.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Callable, Mapping

from lmcache_ascend.compat import supported_text, untested_allowed
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    module: str  # the LMCache module it changes (0.5.6 path), patched right after it executed
    verified_on: tuple[str, ...]  # LMCache releases
    works_around: str
    apply: Callable[[ModuleType], None]


def _shield_pq_executor(module: ModuleType) -> None:
    import asyncio

    from lmcache_ascend.lmcache_bridge.patching import overrides

    cls = module.AsyncPQExecutor

    async def submit_job(self, fn, *args, **kwargs):
        priority = kwargs.pop("priority", 0)
        done = self.loop.create_future()
        await self._queue.put((priority, next(self._counter), fn, args, kwargs, done))
        return await asyncio.shield(done)

    overrides.apply(overrides.PQ_EXECUTOR_SHIELD, cls, "submit_job", submit_job)
    # Tests and explain read it.
    overrides.apply(overrides.PQ_EXECUTOR_SHIELD, cls, "_lmcache_ascend_shielded", True)


def _native_sync_calls_on_the_loop(module: ModuleType) -> None:
    import asyncio

    from lmcache_ascend.lmcache_bridge.patching import overrides

    cls = module.ConnectorClientBase

    def on_the_loop(name: str, async_name: str) -> Callable:
        original = getattr(cls, name)

        def sync(self, *args):
            try:
                on_loop = asyncio.get_running_loop() is self.loop
            except RuntimeError:
                on_loop = False
            if on_loop:
                return original(self, *args)
            # The coroutine submits and registers in one run of the loop,
            # before the loop can drain the completion.
            return asyncio.run_coroutine_threadsafe(getattr(self, async_name)(*args), self.loop).result()

        sync.__name__ = name
        return sync

    for name, async_name in (
        ("batch_get_sync", "batch_get"), ("batch_set_sync", "batch_set"), ("batch_exists_sync", "batch_exists"),
    ):
        overrides.apply(overrides.NATIVE_SYNC_ON_LOOP, cls, name, on_the_loop(name, async_name))


def _register_config_keys(module: ModuleType) -> None:
    from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys

    register_config_keys()


def _shim_vllm_adapter(module: ModuleType) -> None:
    from lmcache_ascend.lmcache_bridge.patching.adapter_shim import patch_v1_adapter

    patch_v1_adapter(module)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "pq_executor_shield",
        "lmcache.v1.storage_backend.job_executor.pq_executor",
        ("0.5.6", "0.5.7rc2"),
        "AsyncPQExecutor.submit_job awaits its job's future directly, so a "
        "cancelled caller cancels it and the worker dies on set_result; "
        "RemoteBackend.batched_get_blocking cancels every get behind a failed "
        "one, so a few damaged remote entries kill all workers and every later "
        "remote call (even a lookup's exists) waits forever. Shield the future.",
        _shield_pq_executor,
    ),
    Patch(
        "config_keys",
        "lmcache.v1.config",
        ("0.5.6", "0.5.7rc2"),
        "LMCache's config has no registry for plugin keys that its yaml, "
        "environment and kv_connector_extra_config loaders all read: our ascend_* "
        "keys are added to its definitions and config class (lmcache_bridge/engine/config.py).",
        _register_config_keys,
    ),
    Patch(
        "vllm_adapter_shim",
        lmcache_modules.VLLM_ADAPTER,
        ("0.5.6", "0.5.7rc2"),
        "LMCache's in-process vLLM adapter has GPU connectors for CUDA, XPU, MUSA "
        "and HPU only ('No supported cpu connector found'); on the CPU and NPUs the "
        "shim gives it our chunk path (lmcache_bridge/patching/adapter_shim.py).",
        _shim_vllm_adapter,
    ),
    Patch(
        "native_client_sync_on_loop",
        "lmcache.v1.storage_backend.native_clients.connector_client_base",
        ("0.5.6", "0.5.7rc2"),
        "The native clients' blocking calls (resp://: batch_exists_sync, which "
        "RemoteBackend.batched_contains uses, batch_get_sync, batch_set_sync) "
        "submit from the calling thread and register their future after: a "
        "completion the event loop drains in between is dropped and the call "
        "waits forever (a lookup hung on its second read here). Submit and "
        "register on the loop, as the async calls do.",
        _native_sync_calls_on_the_loop,
    ),
)


@functools.lru_cache(maxsize=None)
def by_module() -> Mapping[str, Patch]:
    """The patches by the name the installed LMCache gives their module."""
    return MappingProxyType({lmcache_modules.resolve(p.module): p for p in PATCHES})


_lock = threading.Lock()
_applied: set[str] = set()
_refused: set[str] = set()


def apply(patch: Patch, module: ModuleType) -> bool:
    """Applies ``patch`` to ``module`` once; False if it is not (or not yet)
    applied because the installed LMCache is not a verified release."""
    version = lmcache_modules.release()
    with _lock:
        if patch.name in _applied:
            return True
        if version not in patch.verified_on and untested_allowed():
            # The user opted into an untested release (compat's policy):
            # patch it, since the connector relies on these patches; compat
            # has already logged the one warning.
            logger.info("lmcache-ascend: patching LMCache %s (untested, opted in): %s", version, patch.name)
        elif version not in patch.verified_on:
            if not _refused:
                logger.warning(
                    "lmcache-ascend: LMCache %s is not a release its patches were verified on "
                    "(%s); LMCache is left unpatched. Supported: %s",
                    version,
                    ", ".join(sorted({v for p in PATCHES for v in p.verified_on})),
                    supported_text(),
                )
            _refused.add(patch.name)
            return False
        patch.apply(module)
        _applied.add(patch.name)
        return True


def applied() -> frozenset[str]:
    with _lock:
        return frozenset(_applied)
