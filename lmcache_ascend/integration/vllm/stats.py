"""KV-connector stats and Prometheus metrics through vLLM's connector hooks.

Workers (and the scheduler, for lookups) return counter deltas each step via
``get_kv_connector_stats``; vLLM aggregates them, logs them periodically
and feeds ``AscendPromMetrics.observe`` for ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    # Named for readers; mypy skips vLLM's sources, so to it this stays untyped.
    from vllm.config import VllmConfig


class _Counters:
    """Additive counters whose deltas flow to vLLM once per step."""

    def as_dict(self) -> dict[str, float]:
        # getattr: our own dataclass's fields, read by name; no probe.
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def take(self) -> dict[str, float]:
        """The non-zero changes since the previous call."""
        now = self.as_dict()
        # A probe of our own object: _taken is unset until the first call.
        before = getattr(self, "_taken", {})
        self._taken = now
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


@dataclass
class SchedulerCounters(_Counters):
    """What the scheduler half counts."""

    lookup_requests: int = 0
    lookup_failures: int = 0
    hit_tokens: int = 0
    # Hits refused because a state group cannot be restored at chunk boundaries.
    refused_lookups: int = 0
    # Requests neither looked up nor stored: something vLLM's prefix cache
    # keys on (prompt embeddings, an unreadable LoRA adapter or model) that
    # chunk keys cannot cover (vllm_keys.py).
    isolation_refusals: int = 0
    # Requests that ended (aborted, finished) while their lookup was still
    # fetching, or after a hit was promised and before its load.
    abandoned_transfers: int = 0


@dataclass
class WorkerCounters(_Counters):
    """What the worker half counts."""

    load_requests: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    load_errors: int = 0
    checksum_failures: int = 0
    failed_chunk_loads: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    store_failures: int = 0
    skipped_incomplete_chunks: int = 0
    unreadable_chunks: int = 0
    quarantine_skips: int = 0
    staged_chunks: int = 0
    unstaged_loads: int = 0
    backend_failures: int = 0
    remote_unavailable: int = 0
    stores_dropped_after_load_error: int = 0
    layerwise_loads: int = 0
    layerwise_stall_seconds: float = 0.0


COUNTER_NAMES = tuple(f.name for c in (SchedulerCounters, WorkerCounters) for f in fields(c))


@dataclass
class AscendConnectorStats(KVConnectorStats):
    """Serializable counter deltas (``data``: name -> number)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTER_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTER_NAMES)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTER_NAMES:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: round(v, 4) if isinstance(v, float) else v for name, v in self.data.items()
        }
        if self.data.get("load_seconds"):
            out["load_GBps"] = round(self.data["loaded_bytes"] / self.data["load_seconds"] / 1e9, 3)
        if self.data.get("store_seconds"):
            out["store_GBps"] = round(self.data["stored_bytes"] / self.data["store_seconds"] / 1e9, 3)
        return out


_DOCS = {
    "lookup_requests": "Requests looked up in LMCache.",
    "lookup_failures": "Lookups LMCache did not answer (timeout, transport error); served as misses.",
    "hit_tokens": "Prompt tokens found in LMCache (chunk-aligned hits).",
    "refused_lookups": "Lookups not made because a state group cannot be restored at chunk boundaries.",
    "isolation_refusals": "Requests neither looked up nor stored because chunk keys cannot cover something "
    "vLLM's prefix cache keys on (prompt embeddings, an unreadable LoRA adapter or model weights).",
    "abandoned_transfers": "Requests that ended (aborted, finished) while their lookup was still fetching, or "
    "after a hit was promised and before its load; what the lookup pinned or staged is released with the next step.",
    "load_requests": "Requests whose KV was loaded from LMCache.",
    "loaded_tokens": "Tokens whose KV was loaded from LMCache.",
    "loaded_bytes": "Bytes copied from LMCache into vLLM's KV cache.",
    "load_seconds": "Seconds spent loading KV from LMCache.",
    "load_errors": "Loads that failed or were partial (recomputed by vLLM).",
    "checksum_failures": "Chunks refused because their size or checksum did not match (damaged, truncated, "
    "foreign; never copied into vLLM).",
    "failed_chunk_loads": "Chunks whose copy into vLLM's KV cache raised (recomputed by vLLM).",
    "stored_tokens": "Tokens whose KV was stored into LMCache.",
    "stored_bytes": "Bytes copied from vLLM's KV cache into LMCache.",
    "store_seconds": "Seconds spent storing KV into LMCache.",
    "store_failures": "Store calls that failed (the request continued).",
    "skipped_incomplete_chunks": "Chunks not stored because a needed block was vLLM's null block.",
    "unreadable_chunks": "Chunks a backend listed but that could not be read at lookup (deleted, undecodable, "
    "backend down or stalled); served as misses.",
    "quarantine_skips": "Lookups cut short at a chunk refused earlier (skipped for a while, not read again).",
    "staged_chunks": "Chunks read from disk or remote storage and verified by the lookup that reported them.",
    "unstaged_loads": "Loads with no chunks staged by their lookup (read through LMCache's retrieve instead).",
    "remote_unavailable": "Times the remote store (remote_url) was found down or empty: at startup and at each "
    "reconnection attempt (every 10 s) until it is back; the engine serves from its local cache meanwhile.",
    "stores_dropped_after_load_error": "Request stores not made because a load for the request failed in the "
    "same step on some rank (what the step computed is recomputed by vLLM).",
    "layerwise_loads": "Steps whose staged chunks were copied into vLLM's KV cache layer by layer beside the "
    "forward (ascend_layerwise_load).",
    "layerwise_stall_seconds": "Seconds vLLM's forward waited in wait_for_layer_load for a layer's copy.",
    "backend_failures": "Failed operations of a remote store (Mooncake lookups, puts, gets; remote put hand-offs "
    "that raised); served as misses.",
}


class AscendPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per field, ``vllm:lmcache_ascend_<name>_total``."""

    def __init__(
        self,
        vllm_config: VllmConfig,  # passed through to vLLM's base class
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:lmcache_ascend_{name}_total",
                documentation=_DOCS[name],
                labelnames=labelnames,
            )
            for name in COUNTER_NAMES
        }

    # Any: vLLM's own signature (0.23-0.32): the stats as a free-form dict
    # (ours: counter name -> number).
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
