"""Applies ``patches.PATCHES`` when LMCache loads the modules they change.

``import lmcache_ascend`` must stay cheap and must not import LMCache: on an
NPU host LMCache itself imports ``lmcache_ascend.ops`` while it initializes,
so importing LMCache from here would be circular. A meta-path finder instead
waits for the patched modules and patches each right after it has executed
(or at once, if it was imported before the hook was installed). vLLM
imports LMCache's vLLM adapter lazily, when its ``LMCacheConnectorV1`` is
built; by then LMCache is initialized and the shim may import from it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

from lmcache_ascend.lmcache_bridge import patches

_lock = threading.Lock()
_installed = False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, name: str, loader) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patches.apply(patches.BY_MODULE[self._name], module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in patches.BY_MODULE:
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
        # A module still executing (LMCache importing us from its own init)
        # is skipped; the connectors register and patch at startup.
        present = [
            (name, sys.modules[name])
            for name in patches.BY_MODULE
            if name in sys.modules
            and not getattr(getattr(sys.modules[name], "__spec__", None), "_initializing", False)
        ]
    for name, module in present:
        patches.apply(patches.BY_MODULE[name], module)
