"""Entry point: ``LMCacheAscendConnectorV1Dynamic``.

A thin role bridge. vLLM builds one instance in the scheduler process
(role SCHEDULER) and one per worker (role WORKER); each delegates to its
half. Subclassing ``SupportsHMA`` keeps vLLM's hybrid KV cache manager on,
so every KV cache group's block ids reach us.

Use it with::

    --kv-transfer-config '{"kv_connector":"LMCacheAscendConnectorV1Dynamic",
      "kv_role":"kv_both",
      "kv_connector_module_path":"lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"}'

Importing this module installs the LMCache patches (``adapter_route.install``;
our config keys, the job-executor fix and the LMCacheConnectorV1 shim): the
halves build LMCache's engine from a config that must know our keys, and
``import lmcache_ascend`` installs nothing. Where vLLM loaded this
package's plugin the patches are installed already; naming this module by
``kv_connector_module_path`` with the plugin disabled works all the same.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from lmcache_ascend.compat import require_supported
from lmcache_ascend.integration.vllm import adapter_route, vllm_keys, vllm_step_view
from lmcache_ascend.integration.vllm.transfer_meta import StepTransfers

# At import, before vLLM builds either half (both load LMCache modules).
adapter_route.install()

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
    from lmcache_ascend.integration.vllm.worker import WorkerHalf

logger = logging.getLogger(__name__)

_VALID_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class AscendConnectorMetadata(KVConnectorMetadata):
    """Carries one step's ``StepTransfers`` from scheduler to workers."""

    def __init__(self, transfers: StepTransfers) -> None:
        self.transfers = transfers


class LMCacheAscendConnectorV1Dynamic(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ) -> None:
        features = require_supported()  # one clear error before anything starts
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        if kv_role not in _VALID_ROLES:
            raise ValueError(
                f"LMCacheAscendConnectorV1Dynamic: kv_role={kv_role!r} is not valid; "
                f"use one of {list(_VALID_ROLES)}"
            )
        # getattr: duck-typed on purpose. ModelConfig has enable_sleep_mode on
        # every supported vLLM (0.23-0.32), but test configs carry no model_config.
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
            # vLLM 0.33 asks supports_sleep_mode() itself; older releases do
            # not ask, so the same answer is given here on every version.
            raise ValueError(
                "LMCacheAscendConnectorV1Dynamic does not support sleep mode "
                "(enable_sleep_mode=True): the worker addresses the KV cache tensors it "
                "registered at startup, which sleep mode frees and remaps; start vLLM "
                "without --enable-sleep-mode"
            )
        # kv_producer only stores, kv_consumer only loads.
        self._may_load = kv_role in ("kv_both", "kv_consumer")
        self._may_store = kv_role in ("kv_both", "kv_producer")
        self._features = features
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        # On every vLLM: before 0.32 nothing shuts an in-process engine's
        # connectors down, and 0.32's InprocClient does so only when it is
        # garbage collected or at exit, after the interpreter joined threads;
        # LMCache's storage thread is not a daemon, so a script that never
        # deletes its LLM would hang at exit (shutdown() is idempotent).
        from lmcache_ascend.integration.vllm.shutdown import close_before_thread_join

        close_before_thread_join(self, type(self).shutdown)
        if role == KVConnectorRole.SCHEDULER:
            from lmcache_ascend.integration.vllm.wiring import build_scheduler_half

            self._scheduler = build_scheduler_half(vllm_config, kv_cache_config)

    # Any: a hook of vLLM >= 0.33 only, whose type no installed stack
    # (0.23-0.32) can name; unused here.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: sleep mode frees and remaps the KV cache tensors this
        connector's worker registered and addresses; refused (vLLM then
        names this connector in its error), like vLLM's MooncakeStoreConnector."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM >= 0.27.1 (default: True for kv_both / kv_producer): whether a
        request preempted while its hand-off is pending must be recomputed.
        Stores finish inside the step that issues them (wait_for_save), and
        a dropped store is only a later miss: nothing is ever pending."""
        return False

    @property
    def plan(self):
        """This worker's transfer plan (None in the scheduler role)."""
        return self._worker.plan if self._worker is not None else None

    # ==== worker side =====================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from lmcache_ascend.integration.vllm.wiring import build_worker_half

        self._worker = build_worker_half(self._vllm_config, self._kv_cache_config, kv_caches)

    def _step(self) -> Optional[StepTransfers]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        return meta.transfers

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:  # vLLM's base signature
        step = self._step()
        if step is None or self._worker is None:
            return
        if self._may_load:
            self._worker.start_load(step)
        self._worker.release(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,  # vLLM's base signature
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        step = self._step()
        if step is None or not self._may_store:
            self._worker.finish_loads()  # save() does it otherwise
            return
        self._worker.save(step)

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        # Loads and stores complete inside the step that issues them.
        return None, None

    # ==== stats (both roles) ===============================================

    def get_kv_connector_stats(self):
        from lmcache_ascend.integration.vllm.stats import AscendConnectorStats

        half = self._worker if self._worker is not None else self._scheduler
        if half is None:
            return None
        delta = half.take_stats()
        if delta:
            return AscendConnectorStats(data=delta)
        if self._worker is not None and self._features.scheduler_stats_need_worker_stats:
            # vLLM 0.23 merges the scheduler's stats only in steps where a
            # worker sent some: an empty (not None) record lets them through.
            return AscendConnectorStats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None):  # vLLM's signature: a free-form dict
        from lmcache_ascend.integration.vllm.stats import AscendConnectorStats

        return AscendConnectorStats(data=dict(data)) if data else AscendConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from lmcache_ascend.integration.vllm.stats import AscendPromMetrics

        return AscendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        # Each half is dropped before it closes: a second shutdown (vLLM's,
        # after ours at exit) closes nothing twice.
        if self._scheduler is not None:
            scheduler, self._scheduler = self._scheduler, None
            scheduler.close()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.close()

    # ==== scheduler side ==================================================

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[Optional[int], bool]:
        assert self._scheduler is not None
        view = vllm_keys.request_view(request, self._scheduler.refuse_all)
        if not self._may_load:
            self._scheduler.track(view)  # stores only: follow it, never look it up
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        transfers = self._scheduler.build(vllm_step_view.step_view(scheduler_output))
        return AscendConnectorMetadata(transfers)

    # vLLM's kv_transfer_params: a free-form dict in its base class.
    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request.request_id)

    def request_finished_all_groups(  # as request_finished
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request.request_id)
