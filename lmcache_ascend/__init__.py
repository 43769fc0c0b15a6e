"""lmcache-ascend: multi-group (hybrid) KV-cache offload for vLLM through LMCache.

``import lmcache_ascend`` imports neither LMCache nor vLLM and changes nothing
by itself: it exposes the version, registers the vLLM steps of the
LMCacheConnectorV1 route with the bridge, and installs an import hook
(``lmcache_ascend.lmcache_bridge.hook``) that applies this package's LMCache
patches, each once, when LMCache loads the module it patches, and only on the
LMCache releases it was verified on (``lmcache_bridge/patches.py``). That is
what makes vLLM's own ``LMCacheConnectorV1`` (and vLLM-Ascend's
``LMCacheAscendConnector``, which imports this package for exactly this) work
on the CPU and on NPUs. The package adds no log handlers: its loggers
(``lmcache_ascend.*``) follow LMCache's logging configuration once a
connector starts.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

from lmcache_ascend.integration.vllm import adapter_route as _adapter_route  # noqa: E402
from lmcache_ascend.lmcache_bridge import hook as _hook  # noqa: E402

# The vLLM steps of the LMCacheConnectorV1 route, before the patch that calls
# them can run: the bridge must not import the vLLM integration itself.
_adapter_route.register()
_hook.install()
