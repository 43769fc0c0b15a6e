"""What the two halves use of their collaborators, as Protocols.

The halves take their collaborators as constructor arguments: the real
ones (``lmcache_bridge.engine.lmcache_engine.WorkerEngine`` / ``SchedulerLookup``,
``transfer.chunk_transfer.ChunkTransfer``, ``transfer.state_transfer.
StateTransfer``, ``planning.planner.TransferPlan``) come from ``wiring.py``,
where mypy checks that they satisfy these; the unit tests hand in small
stand-ins. Naming only what a half calls keeps the stand-ins small and tells
a reader of ``worker.py`` / ``scheduler.py`` what each attribute is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    # For the annotations only: the scheduler half imports this module, and
    # its process needs neither torch's tensors nor the bridge's LMCache-side
    # modules for it.
    import contextlib

    import torch

    from lmcache_ascend.lmcache_bridge.engine.chunk_io import TransferContext
    from lmcache_ascend.lmcache_bridge.engine.step_puts import Handoff
    from lmcache_ascend.lmcache_bridge.integrity.staging import Claim, StagingCounts
    from lmcache_ascend.planning.groups import ChunkRequest
    from lmcache_ascend.planning.state_align import SnapshotLayout

# ---- worker half -----------------------------------------------------------


class StagedLoads(Protocol):
    """The chunks a lookup verified and holds (``lmcache_bridge/integrity/staging.py``),
    loaded without reading the store again."""

    def claim(self, lookup_id: str) -> Optional[Claim]:
        """What ``lookup_id``'s lookup staged, or None (nothing staged)."""
        ...

    def load_claim(self, claim: Claim, first: int, end: int, ctx: TransferContext) -> int:
        """Copies the claimed chunks from ``first``; where the contiguous run ends."""
        ...

    def release_claim(self, claim: Claim) -> None: ...


class ChunkStore(Protocol):
    """LMCache's own retrieve and store, and the lookup pins."""

    def retrieve(self, tokens: torch.Tensor, mask: torch.Tensor, ctx: TransferContext) -> torch.Tensor:
        """Per-token mask of what was retrieved (a prefix of ``mask``'s range)."""
        ...

    def store(self, tokens: torch.Tensor, mask: torch.Tensor, ctx: TransferContext) -> None: ...

    def unpin(self, lookup_id: str) -> None: ...

    def request_ended(self, req_id: str) -> None:
        """No load will come for ``req_id`` (finished, aborted): its pins and
        staged chunks go, also those of a lookup of it that lands later."""
        ...


class EngineCounters(Protocol):
    """What the engine counts for the worker's stats."""

    def take_counts(self) -> StagingCounts:
        """Lookup-side counts since the previous call."""
        ...

    def backend_failures(self) -> int:
        """Failed remote store operations, cumulative."""
        ...

    def remote_unavailable(self) -> int:
        """Times a remote store was found unavailable, cumulative."""
        ...


class WorkerEngineSeam(StagedLoads, ChunkStore, EngineCounters, Protocol):
    """What ``WorkerHalf`` calls of its LMCache engine
    (``lmcache_bridge.engine.lmcache_engine.WorkerEngine``)."""

    def step(self) -> contextlib.AbstractContextManager[Handoff]:
        """Around one step's stores: their remote puts are handed off once."""
        ...

    def close(self) -> None: ...


class ChunkMover(Protocol):
    """What ``WorkerHalf`` asks of its chunk mover
    (``transfer.chunk_transfer.ChunkTransfer``); the copies themselves run
    inside LMCache's calls, through the chunk connector."""

    def incomplete_groups(self, req: ChunkRequest) -> Sequence[int]:
        """Groups with no real block for a needed position of ``req``."""
        ...


class ChunkPlan(Protocol):
    """What ``WorkerHalf`` reads of its plan (``planning.planner.TransferPlan``)."""

    # Read-only: the plan is a frozen dataclass.
    @property
    def chunk_bytes(self) -> int: ...

    def group_bytes(self) -> Mapping[int, int]:
        """Stored bytes per chunk per scheduler group."""
        ...


class StateMover(Protocol):
    """Mamba state snapshots (``transfer.state_transfer.StateTransfer``)."""

    @property
    def layout(self) -> SnapshotLayout: ...

    @property
    def snapshot_bytes(self) -> int: ...

    def gather(self, buf: torch.Tensor, piece: int, blocks: Mapping[int, int]) -> int: ...

    def scatter(self, buf: torch.Tensor, piece: int, targets: Sequence[Mapping[int, int]]) -> int: ...


# (this step's requests that load and store, this rank's failed loads) ->
# those whose load failed on any TP rank (``parallel.failed_load_vote``).
FailedLoadVote = Callable[[Sequence[str], set[str]], set[str]]

# ---- scheduler half --------------------------------------------------------

# (token ids, lookup id) -> tokens of the longest stored prefix, or None
# when LMCache gave no answer (timeout, transport error): served as a miss.
LookupFn = Callable[[Sequence[int], str], Optional[int]]


@runtime_checkable
class OwnedLookup(Protocol):
    """A ``LookupFn`` that holds a resource (``lmcache_bridge.engine.lmcache_engine.
    SchedulerLookup``: LMCache's lookup client), closed with the scheduler
    half. A plain function is a lookup too, and owns nothing. Only
    ``close`` is named: the half checks a lookup against this at run time,
    and the call itself is ``LookupFn``'s."""

    def close(self) -> None: ...
