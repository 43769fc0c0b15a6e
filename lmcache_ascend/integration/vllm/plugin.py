"""vLLM general plugin (this package's ``vllm.general_plugins`` entry point).

vLLM runs it in every process (front end, engine core, workers) before it
builds a KV connector. It

* installs the LMCache patches (``adapter_route.install``). ``import
  lmcache_ascend`` no longer does that, so this is what serves vLLM's own
  ``LMCacheConnectorV1`` and vLLM-Ascend's ``LMCacheAscendConnector`` (which
  only imports the package) on the CPU and on NPUs;
* makes ``"kv_connector": "LMCacheAscendConnectorV1Dynamic"`` resolvable
  without ``kv_connector_module_path``.

vLLM may load general plugins several times per process; both steps are
idempotent.
"""

from __future__ import annotations

import logging

from lmcache_ascend.integration.vllm import adapter_route

CONNECTOR_NAME = "LMCacheAscendConnectorV1Dynamic"
CONNECTOR_MODULE = "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"

logger = logging.getLogger(__name__)


def register() -> None:
    # First, and whatever happens below: the patches are needed by vLLM's
    # LMCacheConnectorV1 even where our connector name is registered already.
    adapter_route.install()

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    logger.debug("lmcache-ascend: registered KV connector %s", CONNECTOR_NAME)
