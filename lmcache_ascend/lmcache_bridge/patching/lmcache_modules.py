"""Where the installed LMCache keeps the modules lmcache-ascend uses.

LMCache 0.5.7rc2 moved its in-process engine (engine, token database, lookup
client, GPU connectors, its vLLM adapter) under ``lmcache.inprocess`` and
labels that package deprecated; the old paths are gone, with no aliases.
Everything of this package that imports one of those modules asks here,
by the name the module had up to 0.5.6 (the constants below), so the
difference is written down once. The installed release is read once.

Imports nothing of LMCache: ``resolve`` only maps names (the import hook
uses it before LMCache has loaded); ``load`` imports.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Optional

from packaging.version import InvalidVersion, Version

from lmcache_ascend.compat import installed_lmcache_version

logger = logging.getLogger(__name__)

# The modules that moved, by their name up to LMCache 0.5.6.
VLLM_ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter"
CACHE_ENGINE = "lmcache.v1.cache_engine"
TOKEN_DATABASE = "lmcache.v1.token_database"
LOOKUP_CLIENT_FACTORY = "lmcache.v1.lookup_client.factory"
# CreateGPUConnector; the package name stays in 0.5.7rc2, but only for the
# multiprocess mode's GDS code: the factory moved.
GPU_CONNECTOR_FACTORY = "lmcache.v1.gpu_connector"
GPU_CONNECTORS = "lmcache.v1.gpu_connector.gpu_connectors"  # GPUConnectorInterface
# RemoteMetadata (the metadata key of LMCache's Redis entries: backends/redis_reads.py).
PROTOCOL = "lmcache.v1.protocol"
# lmcache_get_or_create_config, ENGINE_NAME: LMCache's vLLM helpers. Not
# mapped in any layout below: its path in 0.5.7rc2 was not read, so it is
# imported by this name on every release, as before.
VLLM_UTILS = "lmcache.integration.vllm.utils"


@dataclass(frozen=True)
class ModuleLayout:
    """The module paths of one LMCache release (read in its wheel)."""

    release: str
    moved: Mapping[str, str] = field(default_factory=dict)  # 0.5.6 name -> this release's
    # Names vLLM imports from LMCache that this release no longer has, served
    # by the moved module (hook.py). vLLM 0.32's LMCacheConnectorV1
    # (kv_connector/v1/lmcache_connector.py) imports LMCacheConnectorV1Impl
    # from the 0.5.6 path.
    vllm_aliases: Mapping[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str:
        return self.moved.get(name, name)


_INPROCESS = {
    VLLM_ADAPTER: "lmcache.inprocess.integration.vllm.vllm_v1_adapter",
    CACHE_ENGINE: "lmcache.inprocess.v1.cache_engine",
    TOKEN_DATABASE: "lmcache.inprocess.v1.token_database",
    LOOKUP_CLIENT_FACTORY: "lmcache.inprocess.v1.lookup_client.factory",
    GPU_CONNECTOR_FACTORY: "lmcache.inprocess.v1.gpu_connector",
    GPU_CONNECTORS: "lmcache.inprocess.v1.gpu_connector.gpu_connectors",
    # 0.5.7rc2 keeps a lmcache.v1.protocol too, without RemoteMetadata; its
    # RedisConnector imports it from here.
    PROTOCOL: "lmcache.inprocess.v1.protocol",
}

# Oldest first. A release not listed gets the layout of the newest listed
# release not newer than it (logged once; the patches refuse such a release
# anyway, see patches.py).
LAYOUTS: tuple[ModuleLayout, ...] = (
    ModuleLayout("0.5.6"),
    ModuleLayout("0.5.7rc2", _INPROCESS, {VLLM_ADAPTER: _INPROCESS[VLLM_ADAPTER]}),
)


def _version(text: str) -> Optional[Version]:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def layout_for(release: Optional[str]) -> tuple[ModuleLayout, bool]:
    """The layout of ``release`` and whether it was read in that release
    (False: assumed from the nearest older one)."""
    for layout in LAYOUTS:
        if layout.release == release:
            return layout, True
    parsed = _version(release) if release else None
    if parsed is None:
        return LAYOUTS[0], False
    older = [lay for lay in LAYOUTS if Version(lay.release) <= parsed]
    return (older[-1] if older else LAYOUTS[0]), False


@functools.lru_cache(maxsize=None)
def release() -> Optional[str]:
    """The installed LMCache release, read once per process."""
    return installed_lmcache_version()


@functools.lru_cache(maxsize=None)
def layout() -> ModuleLayout:
    installed = release()
    found, verified = layout_for(installed)
    if not verified and installed is not None:
        logger.warning(
            "lmcache-ascend: LMCache %s is not a release whose module paths were read "
            "(%s); assuming those of %s",
            installed,
            ", ".join(lay.release for lay in LAYOUTS),
            found.release,
        )
    return found


def verified_layout() -> Optional[ModuleLayout]:
    """The layout only when it was read in the installed release."""
    found, verified = layout_for(release())
    return found if verified else None


def resolve(name: str) -> str:
    """The installed release's path of the module called ``name`` up to 0.5.6."""
    return layout().resolve(name)


def load(name: str) -> ModuleType:
    return importlib.import_module(resolve(name))


def engine_config() -> Any:
    """LMCache's engine config for this process (``LMCacheEngineConfig``):
    created from LMCache's config file and environment on first call, the
    same object afterwards. Through here so the integration layer imports
    nothing of LMCache itself."""
    return load(VLLM_UTILS).lmcache_get_or_create_config()
