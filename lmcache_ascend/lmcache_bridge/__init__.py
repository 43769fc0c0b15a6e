"""Everything of lmcache-ascend that touches LMCache's internals, in one place,
in four rooms by concern:

* ``engine/``: the LMCache engine, lookup client/server and chunk hashing as
  the connector's halves own them (``lmcache_engine``), our keys in LMCache's config
  and startup validation (``config``), the chunk buffer and GPU-connector hook
  LMCache calls (``chunk_io``), the hand-off of a step's seals and puts
  (``step_puts``), the prefix-hash memo and bounded close (``hash_memo``,
  ``resources``).
* ``integrity/``: what makes a chunk trustworthy before it is promised: the
  lookup that verifies and holds what it reports (``staging``), the secret
  the pool entries are authenticated with (``pool_secret``).
* ``backends/``: the remote stores: outages and startup checks
  (``remote_pool``), Mooncake's setup and failures (``mooncake``), passwords
  kept out of logs (``credentials``).
* ``patching/``: every change made to LMCache's or vLLM's objects
  (``overrides``, the registry), the patches of LMCache modules and the
  import hook that applies them (``patches``, ``hook``), where the installed
  LMCache release keeps each module (``lmcache_modules``), the
  LMCacheConnectorV1 route's LMCache side (``adapter_shim``) and its vLLM
  steps registered from above (``route_registry``), LMCache log lines
  replaced (``log_filters``).

Each room's ``__init__`` says more. Importing this package or any room
imports nothing of LMCache; some modules do (each room's ``__init__`` names
them), so only import those once LMCache is loaded. Nothing here imports the
vLLM integration (``lmcache_ascend.integration``): imports point down
(tests/unit/test_layering.py).
"""
