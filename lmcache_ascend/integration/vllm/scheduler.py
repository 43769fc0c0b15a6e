"""Scheduler half: lookups, per-group block tracking, per-step transfer plans.

Runs in vLLM's engine-core process. It never touches KV memory; it decides
which chunks each worker loads (before a request's first forward) and
stores (after each step), and ships that as ``StepTransfers``.
"""

from __future__ import annotations

import enum
import itertools
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lmcache_ascend.integration.vllm.lookup_ahead import LookupAhead, StepWaits
from lmcache_ascend.integration.vllm.seams import LookupFn, OwnedLookup
from lmcache_ascend.integration.vllm.stats import SchedulerCounters
from lmcache_ascend.integration.vllm.transfer_meta import (
    LoadSpec,
    RequestTransfer,
    StateLoad,
    StateStore,
    StepTransfers,
    StoreSpec,
)
from lmcache_ascend.integration.vllm.vllm_keys import RequestView
from lmcache_ascend.planning.isolation import Refusal
from lmcache_ascend.integration.vllm.vllm_step_view import StepView
from lmcache_ascend.planning.agreement import HalfAgreement
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, SchedulerGroup
from lmcache_ascend.planning.slot_mapping import primary_group
from lmcache_ascend.planning.state_align import hit_block_index, running_block_index

logger = logging.getLogger(__name__)

# A failing lookup path is logged on the first failure and then every this
# many, so a dead lookup server cannot flood the log.
_LOOKUP_FAILURE_LOG_EVERY = 100
# Lookups one admission may spend looking for a chunk boundary with a stored
# Mamba state, walking down from the longest stored KV prefix. A probe that
# finds the KV ending at r jumps straight to r, so probes are only spent on
# boundaries whose KV is stored but whose state is not: every boundary a
# decode crossed has state, prefill steps leave one where they end.
MAX_STATE_PROBES = 16


@dataclass(frozen=True)
class StateHits:
    """Mamba state hits (planning/state_align.py): the block size B of the
    state groups and the marks appended to ``tokens[:P]`` to key the
    snapshot at P."""

    groups: tuple[int, ...]
    block_size: int
    marks: tuple[int, ...]


class RequestPhase(enum.Enum):
    """Where a request is in the connector's protocol with vLLM's scheduler."""

    # Looked up (or followed without a lookup); vLLM has not scheduled it
    # with its hit yet. Also a preempted request that is looked up again.
    ADMITTING = "admitting"
    # vLLM allocated blocks for its external tokens: the load ships with the
    # step being built.
    LOAD_PENDING = "load_pending"
    # Scheduled: its blocks are followed and each step plans its stores.
    RUNNING = "running"


# Legal moves. An asynchronous load adds its phases (waiting for the
# fetch, fetched, failed) here, not as another per-request dict.
_MOVES: dict[RequestPhase, frozenset[RequestPhase]] = {
    RequestPhase.ADMITTING: frozenset({RequestPhase.ADMITTING, RequestPhase.LOAD_PENDING, RequestPhase.RUNNING}),
    RequestPhase.LOAD_PENDING: frozenset({RequestPhase.RUNNING, RequestPhase.ADMITTING}),
    RequestPhase.RUNNING: frozenset({RequestPhase.RUNNING, RequestPhase.ADMITTING}),
}


@dataclass
class _PendingLoad:
    skip_tokens: int
    hit_tokens: int
    lookup_id: Optional[str] = None


@dataclass
class _Blocks:
    """What a scheduled request has in vLLM's KV cache and in LMCache."""

    block_ids: list[list[int]]
    # Tokens [0, saved_upto) are in LMCache or were deliberately not stored.
    saved_upto: int = 0
    # Mamba state: positions up to this one were loaded or stored already.
    state_upto: int = 0


@dataclass(frozen=True)
class _Found:
    """What one admission's lookup found. Computed where the lookup runs (the
    lookup thread when lookups run ahead), applied to the request by the
    scheduler's own thread."""

    hit: int  # chunk-aligned tokens found (state models: a boundary with its state)
    lookup_id: Optional[str] = None  # the state probe whose pins hold the hit
    staged: bool = False  # a plain lookup staged chunks under the request id
    unpin: tuple[str, ...] = ()  # probes whose pins are dropped with the next step
    failed: bool = False  # LMCache gave no answer: served as a miss

    def pins(self, req_id: str) -> tuple[str, ...]:
        """Every lookup id this lookup left pinned (for a request gone
        before its lookup ended)."""
        return self.unpin + ((self.lookup_id,) if self.lookup_id else ()) + ((req_id,) if self.staged else ())


@dataclass
class _Request:
    """Everything the scheduler half knows of one request; forgotten whole
    when it finishes."""

    # Isolation keys (cache_salt, LoRA adapter, multimodal items) reach the
    # half inside the view's token ids and refusal (vllm_keys.py): keying a
    # request differently never needs a field, let alone a dict, of its own.
    view: RequestView
    phase: RequestPhase = RequestPhase.ADMITTING
    # Tokens its last lookup hit (chunk-aligned).
    hit: int = 0
    # The state probe whose pins hold its hit, until its load or a miss.
    lookup_id: Optional[str] = None
    # Its own lookup (id = request id) staged chunks on the worker, held
    # until a load or an unpin releases them.
    staged: bool = False
    load: Optional[_PendingLoad] = None
    blocks: Optional[_Blocks] = None
    # Its lookup, running ahead on the lookup thread (ascend_async_lookup).
    pending: Optional["Future[_Found]"] = None

    def move(self, to: RequestPhase) -> None:
        if to not in _MOVES[self.phase]:
            raise RuntimeError(f"request {self.view.req_id}: {self.phase.value} -> {to.value} is not a legal move")
        self.phase = to


class SchedulerHalf:
    def __init__(
        self,
        groups: Sequence[SchedulerGroup],
        chunk_size: int,
        # (token ids, lookup id) -> stored prefix (seams.LookupFn); one
        # with a close() (seams.OwnedLookup: lmcache_bridge.engine.lmcache_engine.
        # SchedulerLookup) is owned by the half and closed with it.
        lookup: LookupFn,
        hit_blockers: Sequence[SchedulerGroup] = (),
        agreement: Optional[HalfAgreement] = None,
        state: Optional[StateHits] = None,
        refusal: Optional[str] = None,
        refuse_all: Optional[Refusal] = None,
        before_admission: Optional[Callable[[], None]] = None,
        ahead: Optional[LookupAhead] = None,
    ) -> None:
        """``agreement``: what this half planned with; shipped with every step
        so the worker can refuse transfers planned under another one.
        ``state``: Mamba state groups whose state is stored and loaded at
        step-end chunk boundaries. ``refusal``: the one line to log when
        ``hit_blockers`` refuse hits (default: a generic one). ``refuse_all``:
        why no request can be keyed (the model's identity is unknown).
        ``before_admission``: run before every lookup (``align_repair``).
        ``ahead``: run lookups on this thread (``lookup_ahead.py``); a
        request whose lookup is not done yet is answered None ("ask again
        next step")."""
        self.refuse_all = refuse_all
        self._before_admission = before_admission
        self.groups = tuple(groups)
        self.chunk_size = chunk_size
        self._lookup = lookup
        self.agreement = agreement
        self._state = state
        if state is not None and chunk_size % state.block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of the state block size {state.block_size}")
        # Lookup ids whose pins the worker drops with the next step (missed
        # state probes, released hits).
        self._unpin: list[str] = []
        # Probe ids are drawn on the lookup thread too: next() on a count is atomic.
        self._probe_ids = itertools.count(1)
        self._ahead = ahead
        self._waits = StepWaits()
        # Lookups of requests that went away while their lookup ran: their
        # pins are dropped once it ends (request id, lookup).
        self._orphans: list[tuple[str, "Future[_Found]"]] = []
        self._abandoned_total = 0  # abandoned_transfers over the half's life (stats are deltas)
        # Groups whose state we cannot restore at a chunk boundary: any hit
        # would leave them stale, so hits are refused (outputs stay exact).
        self._hit_blockers = tuple(hit_blockers)
        if self._hit_blockers and refusal:
            logger.warning("%s", refusal)
        elif self._hit_blockers:
            logger.warning(
                "lmcache-ascend: KV cache group(s) %s hold recurrent state "
                "(%s) that cannot be restored exactly at chunk boundaries: "
                "external cache hits are refused for this model, and nothing is stored (a "
                "chunk without the state behind it can serve no instance of this model). "
                "Outputs stay identical to a no-cache run.",
                [g.index for g in self._hit_blockers],
                sorted({g.spec_name for g in self._hit_blockers}),
            )
        self._requests: dict[str, _Request] = {}
        self._refusal_kinds: set[str] = set()
        self.stats = SchedulerCounters()

    def take_stats(self) -> dict[str, float]:
        """Counter changes since the previous call (vLLM's stats hooks)."""
        return self.stats.take()

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()  # the lookup client is the thread's alone until then
        if isinstance(self._lookup, OwnedLookup):  # a plain function owns nothing
            self._lookup.close()

    # ---- admission -------------------------------------------------------

    def max_hit(self, num_tokens: int) -> int:
        """Whole chunks only, and never the whole prompt: vLLM must compute
        at least one token to produce logits."""
        return ((num_tokens - 1) // self.chunk_size) * self.chunk_size if num_tokens > 0 else 0

    def phase(self, req_id: str) -> Optional[RequestPhase]:
        """Where a request is (None: not followed)."""
        rec = self._requests.get(req_id)
        return rec.phase if rec is not None else None

    def _admit(self, view: RequestView) -> _Request:
        rec = self._requests.get(view.req_id)
        if rec is None:
            rec = self._requests[view.req_id] = _Request(view)
        rec.view = view
        rec.move(RequestPhase.ADMITTING)
        rec.hit = 0
        return rec

    def track(self, view: RequestView) -> None:
        """Follow a request without looking it up (kv_producer: store only)."""
        if self._refuse(view) or self._hit_blockers:
            return
        self._admit(view)

    def _refuse(self, view: RequestView) -> bool:
        """A request whose chunk keys cannot cover what vLLM's prefix cache
        keys on is neither looked up nor stored: never followed, so no step
        plans a transfer for it (fail closed). Logged once per kind."""
        refusal = view.refusal
        if refusal is None:
            return False
        self.stats.isolation_refusals += 1
        if refusal.kind not in self._refusal_kinds:
            self._refusal_kinds.add(refusal.kind)
            logger.warning(
                "lmcache-ascend: request %s is neither looked up nor stored: %s. vLLM's prefix cache "
                "keys on this, the connector's chunk keys cannot: such requests are served without "
                "the connector (counted in isolation_refusals; logged once per kind, %r).",
                view.req_id, refusal.detail or refusal.kind, refusal.kind,
            )
        return True

    def get_num_new_matched_tokens(
        self, view: RequestView, num_computed_tokens: int
    ) -> tuple[Optional[int], bool]:
        if self._before_admission is not None:
            self._before_admission()
        if self._refuse(view):
            self._requests.pop(view.req_id, None)
            return 0, False
        limit = self.max_hit(view.num_tokens)
        if self._hit_blockers:
            # Not followed, so no step stores it either: a hit needs the
            # state behind its chunks, which this model's instances cannot
            # restore, so its chunks alone could never be loaded (issue 39).
            if limit > num_computed_tokens:
                self.stats.refused_lookups += 1
            return 0, False
        rec = self._admit(view)
        if limit <= num_computed_tokens:
            self._orphan(rec)
            return 0, False
        if self._ahead is not None:
            found = self._found_ahead(rec, num_computed_tokens, limit)
            if found is None:
                return None, False  # vLLM asks again next step; the others are scheduled
        else:
            self._release_lookup(rec)  # an earlier admission attempt's probe
            found = self._find(view.req_id, view.token_ids, num_computed_tokens, limit)
        self.stats.lookup_requests += 1
        self._unpin.extend(found.unpin)
        if found.failed:
            self._lookup_failed(view.req_id)
        rec.lookup_id = found.lookup_id
        rec.staged = rec.staged or found.staged
        hit = found.hit
        rec.hit = hit
        self.stats.hit_tokens += hit
        return (hit - num_computed_tokens, False) if hit > num_computed_tokens else (0, False)

    def _found_ahead(self, rec: _Request, num_computed: int, limit: int) -> Optional[_Found]:
        """The request's lookup result if its lookup (submitted on its first
        call) has ended, else None. Waits ``StepWaits.take()`` at most."""
        assert self._ahead is not None
        if rec.pending is None:
            self._release_lookup(rec)
            view = rec.view
            rec.pending = self._ahead.submit(
                lambda: self._find(view.req_id, view.token_ids, num_computed, limit))
        try:
            found = rec.pending.result(timeout=0 if rec.pending.done() else self._waits.take())
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - a lookup that raised is a miss, as a failed one
            logger.exception("lmcache-ascend: request %s: lookup raised; served as a miss", rec.view.req_id)
            found = _Found(0, failed=True)
        rec.pending = None
        return found

    def _orphan(self, rec: _Request) -> None:
        """A lookup still running for a request that no longer wants it."""
        if rec.pending is not None:
            self._orphans.append((rec.view.req_id, rec.pending))
            rec.pending = None

    def _drop_orphans(self) -> None:
        keep = []
        for req_id, fut in self._orphans:
            if not fut.done():
                keep.append((req_id, fut))
            elif fut.exception() is None:
                self._unpin.extend(fut.result().pins(req_id))
        self._orphans = keep

    def _find(self, req_id: str, token_ids: Sequence[int], num_computed: int, limit: int) -> _Found:
        """The lookup itself: touches no request state, so it may run on the
        lookup thread."""
        if self._state is not None:
            return self._state_find(req_id, token_ids, num_computed, limit)
        found = self._lookup(token_ids[:limit], req_id)
        if found is None:
            return _Found(0, failed=True)
        hit = int(found)
        return _Found(min(hit - hit % self.chunk_size, limit), staged=bool(found))

    def _state_find(self, req_id: str, token_ids: Sequence[int], num_computed: int, limit: int) -> _Found:
        """The longest chunk boundary P <= ``limit`` (beyond what vLLM has)
        whose KV chunks and Mamba state are both stored, or 0.

        One lookup of ``tokens[:P] + marks`` answers both: LMCache counts the
        stored prefix of that sequence's chunks. Each probe pins what it
        found under its own lookup id (LMCache replaces the pins of a repeated
        id instead of adding to them): the hit's pins are released after its
        load, a miss's with the next step."""
        assert self._state is not None
        marks = self._state.marks
        unpin: list[str] = []
        pos = limit
        for _ in range(MAX_STATE_PROBES):
            if pos <= num_computed:
                break
            # "<request id>#...": the worker releases every lookup id of this
            # form with the request (staging.REQUEST_ID_SEP, request_ended).
            lookup_id = f"{req_id}#state{next(self._probe_ids)}"
            found = self._lookup(list(token_ids[:pos]) + list(marks), lookup_id)
            if found is None:
                return _Found(0, unpin=tuple(unpin) + (lookup_id,), failed=True)
            if found >= pos + len(marks):
                return _Found(pos, lookup_id=lookup_id, unpin=tuple(unpin))
            unpin.append(lookup_id)
            # KV stored up to `found`: the state there is the next candidate;
            # KV stored past pos but no (whole) state at pos: one chunk back.
            pos = found - found % self.chunk_size if found < pos else pos - self.chunk_size
        return _Found(0, unpin=tuple(unpin))

    def _release_lookup(self, rec: _Request) -> None:
        if rec.lookup_id is not None:
            self._unpin.append(rec.lookup_id)
            rec.lookup_id = None

    def _release_staged(self, rec: _Request) -> None:
        if rec.staged:
            rec.staged = False
            self._unpin.append(rec.view.req_id)

    def _lookup_failed(self, req_id: str) -> None:
        self.stats.lookup_failures += 1
        n = self.stats.lookup_failures
        if n == 1 or n % _LOOKUP_FAILURE_LOG_EVERY == 0:
            logger.warning(
                "lmcache-ascend: request %s: LMCache lookup got no answer (timeout or "
                "transport error; see LMCache's lookup_timeout_ms); served as a miss, "
                "output unaffected. %d lookup failure(s) so far.",
                req_id,
                n,
            )

    def update_state_after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        rec = self._requests.get(req_id)
        if num_external_tokens <= 0:
            if rec is not None:
                rec.load = None
                self._release_lookup(rec)
                self._release_staged(rec)
            return
        hit = rec.hit if rec is not None else 0
        skip = hit - num_external_tokens
        if rec is None or skip < 0:
            raise RuntimeError(
                f"request {req_id}: vLLM allocated {num_external_tokens} external "
                f"tokens but the lookup hit only {hit}"
            )
        rec.move(RequestPhase.LOAD_PENDING)
        # The load releases what the lookup staged.
        rec.staged = False
        rec.load = _PendingLoad(skip, hit, rec.lookup_id)
        rec.lookup_id = None

    # ---- per step --------------------------------------------------------

    def build(self, step: StepView) -> StepTransfers:
        out: list[RequestTransfer] = []
        for req_id in step.preempted_req_ids:
            rec = self._requests.get(req_id)
            if rec is not None and rec.blocks is not None:
                # Blocks are gone; they come back complete on resume.
                rec.blocks.block_ids = [[] for _ in self.groups]
        for sched in step.scheduled:
            rec = self._requests.get(sched.req_id)
            tracked = self._track(rec, sched) if rec is not None else None
            if rec is None or tracked is None:
                continue
            load, rec.load = rec.load, None
            load_spec = None
            if load is not None:
                load_spec = LoadSpec(
                    load.skip_tokens,
                    load.hit_tokens,
                    load.lookup_id,
                    self._state_load(tracked, load.hit_tokens, sched.num_scheduled_tokens),
                )
                tracked.saved_upto = max(tracked.saved_upto, load.hit_tokens)
                tracked.state_upto = max(tracked.state_upto, load.hit_tokens)
            computed_after = sched.num_computed_tokens + sched.num_scheduled_tokens
            store_spec = self._store_range(rec, tracked, computed_after)
            state_store = self._state_store(rec, tracked, sched.num_scheduled_tokens, computed_after)
            if load_spec is None and store_spec is None and state_store is None:
                continue
            end = max(
                load_spec.hit_tokens if load_spec else 0,
                store_spec.end if store_spec else 0,
                state_store.position if state_store else 0,
            )
            out.append(
                RequestTransfer(
                    req_id=sched.req_id,
                    token_ids=tuple(rec.view.token_ids[:end]),
                    block_ids=tuple(tuple(ids) for ids in tracked.block_ids),
                    load=load_spec,
                    store=store_spec,
                    state_store=state_store,
                )
            )
        for req_id in step.finished_req_ids:
            self._forget(req_id)
        self._waits.step_built(sum(sched.num_scheduled_tokens for sched in step.scheduled))
        if self._orphans:
            self._drop_orphans()
        unpin, self._unpin = tuple(self._unpin), []
        return StepTransfers(
            requests=tuple(out),
            finished_req_ids=step.finished_req_ids,
            agreement=self.agreement,
            unpin_lookup_ids=unpin,
        )

    def _state_blocks(self, tracked: _Blocks, index: int) -> tuple[tuple[int, int], ...]:
        """(group, block id) at ``index`` of every state group; a missing
        position reads as the null block (the worker refuses it)."""
        assert self._state is not None
        out = []
        for g in self._state.groups:
            ids = tracked.block_ids[g] if g < len(tracked.block_ids) else []
            out.append((g, int(ids[index]) if 0 <= index < len(ids) else NULL_BLOCK_ID))
        return tuple(out)

    def _state_load(self, tracked: _Blocks, hit: int, scheduled: int) -> Optional[StateLoad]:
        if self._state is None:
            return None
        bs = self._state.block_size
        return StateLoad(
            hit_blocks=self._state_blocks(tracked, hit_block_index(hit, bs)),
            running_blocks=self._state_blocks(tracked, running_block_index(hit, scheduled, bs)),
        )

    def _state_store(self, rec: _Request, tracked: _Blocks, scheduled: int, end: int) -> Optional[StateStore]:
        """The state this step leaves at ``end``, if ``end`` is a chunk
        boundary: only a step's end has state (align mode), in block
        end/B - 1 of every state group, valid until the step's stores."""
        if self._state is None or scheduled <= 0 or end <= 0 or end % self.chunk_size:
            return None
        if end <= tracked.state_upto or end > len(rec.view.token_ids):
            return None
        blocks = self._state_blocks(tracked, hit_block_index(end, self._state.block_size))
        if any(b == NULL_BLOCK_ID for _, b in blocks):
            return None
        tracked.state_upto = end
        return StateStore(end, blocks)

    def _track(self, rec: _Request, sched) -> Optional[_Blocks]:
        """The request's blocks after this step's allocation. (A request
        vLLM schedules that never went through get_num_new_matched_tokens,
        e.g. admitted while the connector was not consulted, has no record
        and is not followed.)"""
        rec.move(RequestPhase.RUNNING)
        tracked = rec.blocks
        if sched.is_new or tracked is None:
            # Chunks below what the request starts with are not stored again:
            # they came from LMCache (a hit) or from vLLM's own prefix cache,
            # i.e. from an earlier request that stored them already.
            computed = sched.num_computed_tokens - sched.num_computed_tokens % self.chunk_size
            tracked = rec.blocks = _Blocks(
                block_ids=[list(ids) for ids in (sched.block_ids or ())] or [[] for _ in self.groups],
                saved_upto=max(rec.hit, computed),
            )
            return tracked
        if sched.resumed:
            tracked.block_ids = [list(ids) for ids in (sched.block_ids or ())]
            # A resumed request went through a new lookup; chunks it hit are
            # in the cache already.
            tracked.saved_upto = max(tracked.saved_upto, rec.hit)
        elif sched.block_ids is not None:
            for g, ids in enumerate(sched.block_ids):
                if ids:
                    tracked.block_ids[g].extend(ids)
        return tracked

    def _store_range(self, rec: _Request, tracked: _Blocks, computed_after: int) -> Optional[StoreSpec]:
        """Chunks completed by this step and not yet stored."""
        primary = primary_group(self.groups, tracked.block_ids)
        span = len(tracked.block_ids[primary]) * self.groups[primary].block_size
        known = min(computed_after, span, len(rec.view.token_ids))
        end = known - known % self.chunk_size
        if end <= tracked.saved_upto:
            return None
        spec = StoreSpec(tracked.saved_upto, end)
        tracked.saved_upto = end
        return spec

    def _forget(self, req_id: str) -> None:
        rec = self._requests.pop(req_id, None)
        if rec is None:
            return
        if rec.pending is not None or rec.lookup_id is not None or rec.staged or rec.load is not None:
            self._abandoned(req_id)
        self._orphan(rec)
        self._release_lookup(rec)
        self._release_staged(rec)
        if rec.load is not None and rec.load.lookup_id is not None:
            self._unpin.append(rec.load.lookup_id)

    def _abandoned(self, req_id: str) -> None:
        """A request went away (a client that disconnected, an abort) with a
        transfer in flight: its lookup still fetching, or its hit promised
        and not loaded. Nothing was copied into its blocks; the pins and
        staged chunks are dropped with the next step (``_forget``)."""
        self.stats.abandoned_transfers += 1
        self._abandoned_total += 1
        log = logger.info if self._abandoned_total == 1 else logger.debug
        log(
            "lmcache-ascend: request %s ended with its lookup or load in flight; what its lookup "
            "pinned or staged is released with the next step. Counted as abandoned_transfers "
            "(%d so far; later ones are logged at DEBUG).",
            req_id,
            self._abandoned_total,
        )

    def request_finished(self, req_id: str) -> tuple[bool, None]:
        # Stores run synchronously in the step that completes them, so vLLM
        # may free the blocks right away.
        self._forget(req_id)
        return False, None
