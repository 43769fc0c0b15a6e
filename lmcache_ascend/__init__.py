"""lmcache-ascend: multi-group (hybrid) KV-cache offload for vLLM through LMCache.

``import lmcache_ascend`` exposes the version and nothing else: it imports
neither LMCache, vLLM nor any subpackage, installs no import hook and adds
no log handler. Importing a lower package (``planning``, ``transfer``,
``ops``; LMCache imports ``ops`` while it initializes on NPU hosts) runs no
vLLM integration code either; tests/unit/test_layering.py checks both.

The LMCache patches (``lmcache_bridge/patching/patches.py``: each applied once, when
LMCache loads the module it patches, and only on the releases it was verified
on) are turned on by ``lmcache_ascend.integration.vllm.adapter_route.install``,
which the entry points call: the vLLM plugin (this package's
``vllm.general_plugins`` entry point, run by vLLM in every process before it
builds a KV connector) and the dynamic connector's module. The plugin is what
makes vLLM's own ``LMCacheConnectorV1`` (and vLLM-Ascend's
``LMCacheAscendConnector``, which only imports this package) work on the CPU
and on NPUs; adapter_route.py says why the install is not done here.

The package's loggers (``lmcache_ascend.*``) follow LMCache's logging
configuration once a connector starts.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
