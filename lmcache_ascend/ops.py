"""Native KV copy ops of lmcache-ascend: ``lmcache_ascend.ops``.

The compiled module is ``lmcache_ascend._ops`` (CPU backend always, Ascend
backend where it was built with CANN; see docs/kernels.md). This module
checks that it was built for the running torch and re-exports its public
ops, and only those: LMCache 0.5.6 imports ``lmcache_ascend.ops`` on NPU
hosts and binds every public callable of it as a device op
(``lmcache/v1/platform/devices/npu/device_ops.py``, ``DeviceOps.bind_native``).
It must import neither LMCache nor vLLM (LMCache imports it while it
initializes).
"""

import typing as _typing

from lmcache_ascend._native import load_extension as _load_extension

if _typing.TYPE_CHECKING:  # for type checkers: the names bound below, as _ops.pyi types them
    from lmcache_ascend._ops import *  # noqa: F403

_ext = _load_extension("_ops")
__all__ = sorted(name for name in dir(_ext) if not name.startswith("_"))
globals().update({name: getattr(_ext, name) for name in __all__})
