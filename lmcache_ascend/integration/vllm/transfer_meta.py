"""Typed records the scheduler half sends to the worker half each step.

Plain frozen dataclasses (picklable: vLLM ships them to worker processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lmcache_ascend.planning.agreement import HalfAgreement


@dataclass(frozen=True)
class StateLoad:
    """Load the Mamba state snapshot at ``hit_tokens`` into two blocks of
    every state group: the hit block (vLLM's own prefix cache registered it
    under the hit's hash) and the running block the step's forward reads
    (vLLM copied hit -> running before ``start_load_kv``)."""

    hit_blocks: tuple[tuple[int, int], ...]  # (group, block id)
    running_blocks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StateStore:
    """Store the Mamba state after ``position`` tokens, which this step's
    forward leaves in ``blocks`` (one per state group)."""

    position: int
    blocks: tuple[tuple[int, int], ...]  # (group, block id)


@dataclass(frozen=True)
class LoadSpec:
    """Load chunks covering tokens ``[skip_tokens, hit_tokens)``.

    ``skip_tokens`` is what vLLM already has locally (its own prefix cache);
    those positions are never written. ``hit_tokens`` is chunk aligned.
    ``lookup_id``: the id LMCache pinned the hit's chunks under (the request
    id unless state probes used their own). ``state``: the Mamba state to
    load with the chunks (state hits only).
    """

    skip_tokens: int
    hit_tokens: int
    lookup_id: Optional[str] = None
    state: Optional[StateLoad] = None


@dataclass(frozen=True)
class StoreSpec:
    """Store the whole chunks covering tokens ``[start, end)`` (chunk aligned)."""

    start: int
    end: int


@dataclass(frozen=True)
class RequestTransfer:
    req_id: str
    token_ids: tuple[int, ...]  # tokens [0, max(load.hit_tokens, store.end, state_store.position))
    block_ids: tuple[tuple[int, ...], ...]  # per vLLM KV cache group
    load: LoadSpec | None = None
    store: StoreSpec | None = None
    state_store: StateStore | None = None


@dataclass(frozen=True)
class StepTransfers:
    requests: tuple[RequestTransfer, ...] = ()
    # Requests that ended: their lookup pins are released on the worker.
    finished_req_ids: frozenset[str] = field(default_factory=frozenset)
    # Lookup ids whose pins nothing will load (state probes that missed).
    unpin_lookup_ids: tuple[str, ...] = ()
    # What the scheduler planned with (chunk size, groups); the worker
    # refuses to move chunks planned under another agreement.
    agreement: Optional[HalfAgreement] = None
