# SPDX-License-Identifier: Apache-2.0
"""A vLLM KV connector that does nothing: the serving bench's control for
what vLLM's connector plumbing costs by itself (per-layer hooks, connector
metadata and outputs through the step, scheduler bookkeeping), before any
connector's own work. ``bench_serving.py --connectors none,noop,ascend``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    """Never finds, loads or stores anything; keeps vLLM's hybrid KV cache
    manager on, like LMCacheAscendConnectorV1Dynamic."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return False, None
