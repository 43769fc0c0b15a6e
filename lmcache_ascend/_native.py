"""Loads the compiled modules of this package, checking first that they were
built against the torch this process runs.

A C++ extension built for one torch and loaded into another either fails
with an unreadable ``undefined symbol`` error or, worse, loads and corrupts
memory later. The build writes the torch version it compiled against into
``_build_info.py`` beside the modules; a mismatch is refused here with an
error naming both versions, before the library is opened.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_REBUILD = (
    "rebuild lmcache-ascend in this environment: "
    "pip install --no-build-isolation --force-reinstall --no-deps <source of lmcache-ascend> "
    "(or `make build` in a checkout)"
)


def load_extension(name: str) -> ModuleType:
    import torch  # first: the extension resolves torch's libraries from the process

    try:
        from lmcache_ascend import _build_info
    except ImportError:
        raise ImportError(
            f"lmcache_ascend.{name}: the native extension is not built (no "
            f"lmcache_ascend/_build_info.py); {_REBUILD}"
        ) from None
    built = _build_info.TORCH_VERSION
    if built != torch.__version__:
        raise ImportError(
            f"lmcache_ascend.{name} was built against torch {built}, but this process "
            f"runs torch {torch.__version__}; {_REBUILD}"
        )
    module = importlib.import_module(f"lmcache_ascend.{name}")
    compiled = getattr(module, "_torch_version", built)
    if compiled != built:  # a stale _build_info.py beside a newer library
        raise ImportError(
            f"lmcache_ascend.{name} was compiled against torch {compiled}, but its "
            f"_build_info.py says {built}; {_REBUILD}"
        )
    return module
