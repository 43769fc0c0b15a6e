"""vLLM general plugin: makes ``"kv_connector": "LMCacheAscendConnectorV1Dynamic"``
resolvable in every vLLM process without ``kv_connector_module_path``.

vLLM may load general plugins several times per process; registration is
idempotent.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "LMCacheAscendConnectorV1Dynamic"
CONNECTOR_MODULE = "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"

logger = logging.getLogger(__name__)


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    logger.debug("lmcache-ascend: registered KV connector %s", CONNECTOR_NAME)
