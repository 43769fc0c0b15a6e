"""Typed records the scheduler half sends to the worker half each step.

Plain frozen dataclasses (picklable: vLLM ships them to worker processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lmcache_ascend.planning.agreement import HalfAgreement


@dataclass(frozen=True)
class LoadSpec:
    """Load chunks covering tokens ``[skip_tokens, hit_tokens)``.

    ``skip_tokens`` is what vLLM already has locally (its own prefix cache);
    those positions are never written. ``hit_tokens`` is chunk aligned.
    """

    skip_tokens: int
    hit_tokens: int


@dataclass(frozen=True)
class StoreSpec:
    """Store the whole chunks covering tokens ``[start, end)`` (chunk aligned)."""

    start: int
    end: int


@dataclass(frozen=True)
class RequestTransfer:
    req_id: str
    token_ids: tuple[int, ...]  # tokens [0, max(load.hit_tokens, store.end))
    block_ids: tuple[tuple[int, ...], ...]  # per vLLM KV cache group
    load: LoadSpec | None = None
    store: StoreSpec | None = None


@dataclass(frozen=True)
class StepTransfers:
    requests: tuple[RequestTransfer, ...] = ()
    # Requests that ended: their lookup pins are released on the worker.
    finished_req_ids: frozenset[str] = field(default_factory=frozenset)
    # What the scheduler planned with (chunk size, groups); the worker
    # refuses to move chunks planned under another agreement.
    agreement: Optional[HalfAgreement] = None
