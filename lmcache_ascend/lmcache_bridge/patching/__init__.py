"""Every change lmcache-ascend makes to LMCache (and vLLM) objects, and the
import hook that makes the module patches.

* ``overrides``: the registry of every such change, each with the releases
  it was verified on, and ``apply``, the one function that makes them.
* ``patches``: the patches of LMCache modules and their gate; ``hook``
  applies them when LMCache loads those modules.
* ``lmcache_modules``: where the installed LMCache release keeps each module
  used here (0.5.7rc2 moved its in-process engine under ``lmcache.inprocess``).
* ``adapter_shim``: the patch of LMCache's vLLM adapter (the
  LMCacheConnectorV1 route, LMCache side); ``route_registry``: that route's
  vLLM steps, registered from above
  (``lmcache_ascend.integration.vllm.adapter_route``), never imported here.
* ``log_filters``: LMCache log lines that do not apply under this connector,
  filtered through logging's own hook and said once in our words.

Importing this package imports nothing. Of its modules only
``adapter_shim`` imports LMCache when imported. ``hook`` must never import
it (the hook is installed before LMCache initializes, and on an NPU host
LMCache imports ``lmcache_ascend.ops`` while it does); the patches import
what they change once LMCache has loaded it.
"""
