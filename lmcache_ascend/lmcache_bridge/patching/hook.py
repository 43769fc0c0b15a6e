"""Applies ``patches.PATCHES`` when LMCache loads the modules they change.

Installed by ``lmcache_ascend.integration.vllm.adapter_route.install`` (the
vLLM plugin and the dynamic connector's module call it), never by importing
a package: ``import lmcache_ascend`` changes nothing in the process. Both
this module and :func:`install` must stay cheap and must not import LMCache:
on an NPU host LMCache itself imports ``lmcache_ascend.ops`` while it
initializes, so importing LMCache from here would be circular. A meta-path finder instead
waits for the patched modules and patches each right after it has executed
(or at once, if it was imported before the hook was installed). vLLM
imports LMCache's vLLM adapter lazily, when its ``LMCacheConnectorV1`` is
built; by then LMCache is initialized and the shim may import from it.

The finder looks a module up under the name the installed LMCache gives it
(``lmcache_modules``); the installed release is read on the first import of
an LMCache module, not by :func:`install`. On LMCache 0.5.7rc2,
which moved its vLLM adapter under ``lmcache.inprocess`` without an alias,
it also serves the adapter's old name, which vLLM's ``LMCacheConnectorV1``
imports, with the moved module (said once in the log).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading

from lmcache_ascend.lmcache_bridge.patching import lmcache_modules, overrides, patches

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_installed = False
_aliased: set[str] = set()


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, name: str, loader) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patches.apply(patches.by_module()[self._name], module)


class _AliasLoader(importlib.abc.Loader):
    """Serves ``target`` (imported, and so patched, as usual) under the name
    the import asked for."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self._target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system gave the module the alias's spec; it keeps its own
        # (its __name__, file and loader were not touched).
        alias_name = module.__spec__.name
        overrides.apply(overrides.MOVED_MODULE_SPEC, module, "__spec__", self._target_spec)
        with _lock:
            _aliased.add(alias_name)
        from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import attach_logging

        attach_logging()  # the line below is for the user: LMCache's log setup
        logger.info(
            "lmcache-ascend: vLLM imports %s, which LMCache %s moved to %s without an alias; "
            "lmcache-ascend serves that name with %s",
            alias_name,
            lmcache_modules.release(),
            self._target,
            self._target,
        )


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("lmcache."):
            return None  # before the release is read: installing the hook stays cheap
        layout = lmcache_modules.verified_layout()
        alias = layout.vllm_aliases.get(fullname) if layout is not None else None
        if alias is not None:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(alias))
        if fullname not in patches.by_module():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(fullname, spec.loader)
        return spec


def aliased() -> frozenset[str]:
    """The old module names served with a moved module in this process."""
    with _lock:
        return frozenset(_aliased)


def install() -> None:
    """Idempotent. Patches already-imported targets now, the others on import."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        sys.meta_path.insert(0, _Finder())
        if "lmcache" not in sys.modules:
            return
        # A module still executing (install called from code LMCache runs
        # while importing it) is skipped: patching half a module would fail;
        # the connectors register our config keys at startup themselves.
        present = [
            (name, sys.modules[name])
            for name in patches.by_module()
            if name in sys.modules
            and not getattr(getattr(sys.modules[name], "__spec__", None), "_initializing", False)
        ]
    for name, module in present:
        patches.apply(patches.by_module()[name], module)
