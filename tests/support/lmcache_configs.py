"""LMCache's real engine config for unit tests, with this package's keys
registered (what a connector's startup reads)."""

from __future__ import annotations

from typing import Any


def lmcache_config(chunk_size: int = 128, **values: Any) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys

    register_config_keys()
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size)
    for k, v in values.items():
        setattr(cfg, k, v)
    return cfg
