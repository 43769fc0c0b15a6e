"""Everything of lmcache-ascend that touches LMCache's internals, in one place.

* ``patches``: the patches of LMCache modules, each with the LMCache releases
  it was verified on and the upstream problem it works around; ``hook``
  applies them when LMCache loads those modules.
* ``config``: our config keys in LMCache's config, startup validation.
* ``engine``: the LMCache engine, lookup client/server and chunk hashing as
  the connector's halves own them.
* ``chunk_io``: the chunk buffer and GPU-connector hook LMCache calls.
* ``adapter_shim``: the LMCacheConnectorV1 route (LMCache's vLLM adapter),
  LMCache side; ``route_registry``: its vLLM steps, registered from above
  (``lmcache_ascend.integration.vllm.adapter_route``), never imported here.
* ``hash_memo``, ``resources``: prefix-hash memo, bounded close.
* ``lmcache_modules``: where the installed LMCache release keeps the modules
  used here (0.5.7rc2 moved its in-process engine under ``lmcache.inprocess``).

Importing this package imports nothing of LMCache; its modules do (except
``hook``, ``patches``, ``lmcache_modules`` and ``route_registry``), so only
import them once LMCache is loaded.
"""
