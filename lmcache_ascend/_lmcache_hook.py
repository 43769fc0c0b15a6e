"""Applies the LMCache adapter shim when LMCache's modules are imported.

``import lmcache_ascend`` must stay cheap and must not import LMCache: on an
NPU host LMCache itself imports ``lmcache_ascend.ops`` while it initializes,
so importing LMCache from here would be circular. Instead a meta-path finder
waits for three LMCache modules and acts right after each has executed (or at
once, if it is already imported): the remote job executor gets a fix for a
hang (below), ``lmcache.v1.config`` gets our config keys;
LMCache's in-process vLLM adapter (vLLM imports it lazily, when its
``LMCacheConnectorV1`` is constructed) gets the shim. LMCache is fully
initialized by the time the adapter is imported, so the shim may import from
it freely.

The patches themselves live in
``lmcache_ascend.integration.vllm.lmcache_adapter_shim``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

_lock = threading.Lock()
_installed = False


def _config_executed(module) -> None:
    # Our keys, for any LMCache config loaded after `import lmcache_ascend`;
    # register_config_keys imports nothing else of LMCache.
    from lmcache_ascend.v1.config import register_config_keys

    register_config_keys()


def _adapter_executed(module) -> None:
    from lmcache_ascend.integration.vllm.lmcache_adapter_shim import patch_v1_adapter

    patch_v1_adapter(module)


def _pq_executor_executed(module) -> None:
    """LMCache 0.5.6's ``AsyncPQExecutor.submit_job`` awaits its job's
    future directly, so cancelling a caller cancels that future; the worker
    then fails on ``set_result`` and dies. ``RemoteBackend.batched_get_blocking``
    cancels every get behind a failed one, so a few damaged remote entries
    kill all four workers and every later remote call (even a lookup's
    ``exists``) waits forever. Shielding the future keeps workers alive."""
    import asyncio

    cls = module.AsyncPQExecutor
    if getattr(cls, "_lmcache_ascend_shielded", False):
        return

    async def submit_job(self, fn, *args, **kwargs):
        priority = kwargs.pop("priority", 0)
        done = self.loop.create_future()
        await self._queue.put((priority, next(self._counter), fn, args, kwargs, done))
        return await asyncio.shield(done)

    cls.submit_job = submit_job
    cls._lmcache_ascend_shielded = True


# LMCache module -> what to do with it once it has executed.
TARGETS = {
    "lmcache.v1.storage_backend.job_executor.pq_executor": _pq_executor_executed,
    "lmcache.v1.config": _config_executed,
    "lmcache.integration.vllm.vllm_v1_adapter": _adapter_executed,
}


_refused = False


def _apply(name: str, module) -> None:
    # Each patch was verified on specific LMCache releases only; on any other
    # release LMCache is left exactly as it is (our connector then refuses
    # to start, naming the supported versions).
    from lmcache_ascend.compat import installed_lmcache_version, lmcache_supported, supported_text

    global _refused
    if not lmcache_supported():
        if not _refused:
            _refused = True
            import logging

            logging.getLogger(__name__).warning(
                "lmcache-ascend: LMCache %s is not a release its patches were verified on "
                "(%s); LMCache is left unpatched",
                installed_lmcache_version(),
                supported_text(),
            )
        return
    TARGETS[name](module)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, name: str, loader) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(fullname, spec.loader)
        return spec


def install() -> None:
    """Idempotent. Patches already-imported targets now, the others on import."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        sys.meta_path.insert(0, _Finder())
        # A module still executing (LMCache importing us from its own
        # init) is skipped; the connectors register and patch at startup.
        present = [
            (n, sys.modules[n])
            for n in TARGETS
            if n in sys.modules and not getattr(getattr(sys.modules[n], "__spec__", None), "_initializing", False)
        ]
    for name, module in present:
        _apply(name, module)
