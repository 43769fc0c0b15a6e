"""Worker half: plans transfers for vLLM's KV tensors and moves chunks
between them and LMCache (retrieve before the forward, store after it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, cast

import torch

from lmcache_ascend.integration.vllm.layerwise import LayerwiseCounters, LayerwiseLoader
from lmcache_ascend.integration.vllm.seams import ChunkMover, ChunkPlan, FailedLoadVote, StateMover, WorkerEngineSeam
from lmcache_ascend.integration.vllm.stats import WorkerCounters
from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec, RequestTransfer, StateLoad, StateStore, StepTransfers
from lmcache_ascend.lmcache_bridge.engine.chunk_io import DeferredChunk, TransferContext
from lmcache_ascend.planning.agreement import HalfAgreement, HalvesDisagree
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, ChunkRequest, SchedulerGroup
from lmcache_ascend.planning.store_runs import StripePart, chunk_starts, complete_runs, stripe_runs

if TYPE_CHECKING:
    from lmcache_ascend.lmcache_bridge.integrity.staging import Claim

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What happened to one request on this worker; logged when it ends."""

    hit_tokens: int = 0
    vllm_tokens: int = 0  # what vLLM already had locally at the load
    loaded_tokens: int = 0
    stored_tokens: int = 0
    seconds: float = 0.0
    load_error: bool = False
    state_loaded: int = 0  # position of the Mamba state loaded (0: none)
    state_stored: list[int] = field(default_factory=list)  # positions stored


def mask_prefix_blocks(
    groups: Sequence[SchedulerGroup],
    block_ids: Sequence[Sequence[int]],
    skip_tokens: int,
) -> tuple[tuple[int, ...], ...]:
    """Block tables with every block that lies wholly below ``skip_tokens``
    replaced by the null block, so a load never writes KV vLLM already has
    (those blocks may be shared with running requests)."""
    out = []
    for g in groups:
        ids = list(block_ids[g.index]) if g.index < len(block_ids) else []
        n_skip = min(len(ids), skip_tokens // g.block_size)
        ids[:n_skip] = [NULL_BLOCK_ID] * n_skip
        out.append(tuple(ids))
    return tuple(out)


def blocks_for_range(
    groups: Sequence[SchedulerGroup],
    block_ids: Sequence[Sequence[int]],
    start: int,
    end: int,
) -> set[int]:
    """Real block ids of every group that hold token positions [start, end)."""
    bad: set[int] = set()
    if end <= start:
        return bad
    for g in groups:
        ids = block_ids[g.index] if g.index < len(block_ids) else ()
        tokens_per_block = g.block_size
        first, last = start // tokens_per_block, -(-end // tokens_per_block)
        for b in ids[first:last]:
            if b != NULL_BLOCK_ID:
                bad.add(int(b))
    return bad


class WorkerHalf:
    """Owns this worker's LMCache engine and lookup server (``engine``, an
    ``lmcache_bridge.engine.lmcache_engine.WorkerEngine``) and moves chunks with
    ``transfer`` (a ``ChunkTransfer``) by ``plan``. What each is used for:
    the Protocols in ``seams.py``."""

    def __init__(
        self,
        groups: Sequence[SchedulerGroup],
        chunk_size: int,
        engine: WorkerEngineSeam,
        transfer: ChunkMover,
        plan: ChunkPlan,
        agreement: Optional[HalfAgreement] = None,
        state: Optional[StateMover] = None,
        stripe: Optional[StripePart] = None,
        vote_failed_loads: Optional[FailedLoadVote] = None,
        layerwise: Optional[LayerwiseLoader] = None,
    ) -> None:
        """``state``: a ``StateTransfer`` when Mamba state hits are on.

        ``stripe`` (wiring, for a replicated cache in a shared backend,
        integration/vllm/parallel.py): this rank stores only its stripe.

        ``vote_failed_loads`` (wiring, at TP > 1, integration/vllm/parallel.py):
        the union over the TP ranks of the requests whose load failed in
        this step. One rank's missing KV reaches every rank's new KV through
        the layers' all-reduce, so every rank must drop those requests'
        stores.

        ``layerwise`` (``ascend_layerwise_load``): staged chunks are copied
        layer by layer beside the forward; ``finish_loads`` ends them."""
        self.groups = tuple(groups)
        self.state = state
        self.chunk_size = chunk_size
        self.engine = engine
        self.transfer = transfer
        self.plan = plan
        self.stripe = stripe
        self.vote_failed_loads = vote_failed_loads
        self.chunk_bytes = plan.chunk_bytes
        self.agreement = agreement
        self._load_errors: set[int] = set()
        # Requests whose load failed (or fell short) in this step: what the
        # step computed for them was computed on missing KV, and vLLM
        # discards and recomputes it, so it must not be stored either.
        self._failed_loads: set[str] = set()
        self.stats = WorkerCounters()
        # Stored bytes per chunk per scheduler group, for per-group logs.
        self.group_bytes = dict(plan.group_bytes())
        self._records: dict[str, RequestRecord] = {}
        self.layerwise = layerwise
        # Claims whose chunks the layer-by-layer copy still reads, with what
        # a failure of that copy needs to report.
        self._pending: list[tuple[RequestTransfer, LoadSpec, Claim]] = []

    def _record(self, req_id: str) -> RequestRecord:
        rec = self._records.get(req_id)
        if rec is None:
            rec = self._records[req_id] = RequestRecord()
        return rec

    def _per_group(self, tokens: int) -> str:
        chunks = tokens // self.chunk_size
        return ", ".join(f"g{g}={chunks * n}B" for g, n in sorted(self.group_bytes.items())) or "-"

    def take_stats(self) -> dict[str, float]:
        """Counter changes since the previous call (vLLM's stats hooks),
        with what this worker's lookups refused."""
        counts = self.engine.take_counts()
        self.stats.checksum_failures += counts.checksum_failures
        self.stats.unreadable_chunks += counts.unreadable_chunks
        self.stats.quarantine_skips += counts.quarantine_skips
        self.stats.staged_chunks += counts.staged_chunks
        self.stats.backend_failures = self.engine.backend_failures()  # cumulative: take() sends the change
        self.stats.remote_unavailable = self.engine.remote_unavailable()
        return self.stats.take()

    def close(self) -> None:
        # vLLM tells the worker that a request ended in the next step's
        # metadata; the requests an engine served last before it went idle
        # and shut down never get that step, so their lines come now.
        for req_id, rec in list(self._records.items()):
            self._log_record(req_id, rec, " (logged at shutdown)")
        self._records.clear()
        self.finish_loads()
        self.engine.close()

    def check_agreement(self, step: StepTransfers) -> None:
        """Never move chunks the scheduler planned with another chunk size or
        grouping: the bytes would land in the wrong places."""
        theirs = step.agreement
        if theirs is None or self.agreement is None or theirs == self.agreement:
            return
        raise HalvesDisagree(
            "lmcache-ascend: vLLM's scheduler and this worker derived different transfer "
            f"plans (scheduler: {theirs.describe()}; worker: {self.agreement.describe()}). "
            "Both read LMCache's configuration (LMCACHE_* variables, LMCACHE_CONFIG_FILE, "
            "kv_connector_extra_config): give every vLLM process the same settings."
        )

    # ---- loads -----------------------------------------------------------

    def start_load(self, step: StepTransfers) -> None:
        self.check_agreement(step)
        self._failed_loads = set()
        deferred: Optional[list[DeferredChunk]] = [] if self.layerwise is not None and self.layerwise.ready else None
        for req in step.requests:
            if req.load is not None:
                self._load_one(req, deferred)
        if deferred and self.layerwise is not None:
            self.layerwise.begin(deferred)

    def wait_layer(self, layer_name: str) -> None:
        if self.layerwise is not None:
            self.layerwise.wait(layer_name)

    def finish_loads(self) -> None:
        """Ends this step's layer-by-layer copies (a no-op without them):
        before anything reads the step's KV to store it or reports load
        errors. Each call ends the step's copies once."""
        if self.layerwise is None:
            return
        failed = self.layerwise.finish()
        counts, self.layerwise.counters = self.layerwise.counters, LayerwiseCounters()
        self.stats.layerwise_loads += counts.pipelined_steps
        self.stats.layerwise_stall_seconds += counts.stall_seconds
        pending, self._pending = self._pending, []
        for req, spec, claim in pending:
            try:
                self.engine.release_claim(claim)
            except Exception:  # noqa: BLE001
                logger.exception("lmcache-ascend: releasing the chunks staged for %s failed", req.req_id)
            if req.req_id in failed:
                lost_from = max(failed[req.req_id], spec.skip_tokens)
                lost = spec.hit_tokens - lost_from
                self.stats.loaded_tokens -= lost
                self.stats.loaded_bytes -= -(-lost // self.chunk_size) * self.chunk_bytes
                rec = self._record(req.req_id)
                rec.loaded_tokens -= lost
                if spec.state is not None and rec.state_loaded:
                    rec.state_loaded = 0
                self._report_short_load(req, spec, lost_from, rec)

    def _load_one(self, req: RequestTransfer, deferred: Optional[list[DeferredChunk]] = None) -> None:
        assert req.load is not None
        spec = req.load
        lookup_id = spec.lookup_id or req.req_id
        skip_aligned = spec.skip_tokens - spec.skip_tokens % self.chunk_size
        n = spec.hit_tokens - skip_aligned
        if n <= 0:
            self.engine.unpin(lookup_id)
            return
        mover = self.state
        state: Optional[_StatePieces] = None
        marks: tuple[int, ...] = ()
        if spec.state is not None:
            if mover is None:
                raise RuntimeError(
                    f"request {req.req_id}: the scheduler planned a Mamba state load but this worker "
                    "has no state transfer (the halves disagree)"
                )
            state = _StatePieces(spec.hit_tokens, mover, load=spec.state)
            marks = tuple(mover.layout.marks())
        ids = list(req.token_ids[: spec.hit_tokens]) + list(marks)
        tokens = torch.tensor(ids, dtype=torch.long)
        mask = torch.ones(len(ids), dtype=torch.bool)
        mask[:skip_aligned] = False
        ctx = TransferContext(
            req_id=req.req_id,
            block_ids=mask_prefix_blocks(self.groups, req.block_ids, spec.skip_tokens),
            state=state,
            deferred=deferred,
        )
        deferred_before = len(deferred) if deferred is not None else 0
        t0 = time.perf_counter()
        loaded_end = skip_aligned
        claim = None
        try:
            claim = self.engine.claim(lookup_id)
            if claim is not None:
                # The lookup read and verified these chunks and holds them:
                # the store is not read again, so it cannot fail us now.
                loaded_end = min(self.engine.load_claim(claim, skip_aligned, len(ids), ctx), spec.hit_tokens)
            else:
                self._unstaged_load(req.req_id, lookup_id)
                ret = self.engine.retrieve(tokens, mask, ctx)
                got = ret[skip_aligned : spec.hit_tokens]
                # Retrieved chunks form a prefix of the requested range.
                loaded_end = skip_aligned + (int(got.long().cumprod(0).sum()) if got.numel() else 0)
            if ctx.outcome.failed_from is not None:
                loaded_end = min(loaded_end, ctx.outcome.failed_from)
            if mover is not None and state is not None and ctx.outcome.state_pieces < mover.layout.pieces:
                # The KV alone resumes from a wrong state: nothing counts.
                logger.warning(
                    "lmcache-ascend: request %s: Mamba state at %d not loaded (%d of %d pieces)",
                    req.req_id,
                    spec.hit_tokens,
                    ctx.outcome.state_pieces,
                    mover.layout.pieces,
                )
                loaded_end = skip_aligned
        except Exception:  # noqa: BLE001 - a failed load must cost speed only
            logger.exception(
                "lmcache-ascend: load of request %s failed; vLLM will recompute "
                "tokens [%d, %d)",
                req.req_id,
                spec.skip_tokens,
                spec.hit_tokens,
            )
            loaded_end = skip_aligned if state is not None else loaded_end
        finally:
            try:
                if claim is not None:
                    if deferred is not None and len(deferred) > deferred_before:
                        # The layer-by-layer copy reads these buffers until
                        # finish_loads releases them.
                        self._pending.append((req, spec, claim))
                    else:
                        self.engine.release_claim(claim)
                self.engine.unpin(lookup_id)
            except Exception:  # noqa: BLE001
                logger.exception("lmcache-ascend: unpinning %s failed", lookup_id)
        dt = time.perf_counter() - t0
        self.stats.checksum_failures += ctx.outcome.checksum_failures
        self.stats.failed_chunk_loads += ctx.outcome.load_failures
        self.stats.load_requests += 1
        loaded = max(0, loaded_end - max(skip_aligned, spec.skip_tokens))
        self.stats.loaded_tokens += loaded
        self.stats.loaded_bytes += (loaded_end - skip_aligned) // self.chunk_size * self.chunk_bytes
        self.stats.load_seconds += dt
        rec = self._record(req.req_id)
        rec.hit_tokens, rec.vllm_tokens = spec.hit_tokens, spec.skip_tokens
        rec.loaded_tokens += loaded
        rec.seconds += dt
        if mover is not None and state is not None and loaded_end >= spec.hit_tokens:
            rec.state_loaded = spec.hit_tokens
            self.stats.loaded_bytes += mover.snapshot_bytes
        if loaded_end < spec.hit_tokens:
            self._report_short_load(req, spec, loaded_end, rec)
        logger.debug(
            "lmcache-ascend: request %s load: hit %d tokens (vLLM had %d), loaded %d "
            "tokens in %.4f s",
            req.req_id,
            spec.hit_tokens,
            spec.skip_tokens,
            loaded,
            dt,
        )

    def _report_short_load(self, req: RequestTransfer, spec: LoadSpec, loaded_end: int, rec: RequestRecord) -> None:
        """The KV from ``loaded_end`` to the hit's end is not in place: its
        blocks (and the Mamba state's) go to vLLM for recomputation."""
        bad = blocks_for_range(self.groups, req.block_ids, max(loaded_end, spec.skip_tokens), spec.hit_tokens)
        if spec.state is not None:
            bad |= {b for _, b in spec.state.hit_blocks + spec.state.running_blocks if b != NULL_BLOCK_ID}
        self._load_errors |= bad
        self._failed_loads.add(req.req_id)
        self.stats.load_errors += 1
        rec.load_error = True
        logger.warning(
            "lmcache-ascend: request %s: loaded %d of %d hit tokens; %d block(s) "
            "reported for recomputation",
            req.req_id,
            loaded_end - spec.skip_tokens if loaded_end > spec.skip_tokens else 0,
            spec.hit_tokens - spec.skip_tokens,
            len(bad),
        )

    def _unstaged_load(self, req_id: str, lookup_id: str) -> None:
        """A load whose lookup staged nothing here (its answer came from
        another path, or the staging expired): LMCache's retrieve reads the
        store again, which can fail. Logged once, then counted."""
        self.stats.unstaged_loads += 1
        if self.stats.unstaged_loads == 1:
            logger.warning(
                "lmcache-ascend: request %s: no chunks staged for lookup %s; loading through "
                "LMCache's retrieve (reads the store again; a failure there is reported to vLLM). "
                "Counted as unstaged_loads.",
                req_id,
                lookup_id,
            )

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- stores ----------------------------------------------------------

    def _failed_this_step(self, step: StepTransfers) -> set[str]:
        failed, self._failed_loads = self._failed_loads, set()
        loading = [
            r.req_id
            for r in step.requests
            if r.load is not None and (r.store is not None or r.state_store is not None)
        ]
        if self.vote_failed_loads is not None and loading:
            # Every rank gets the same scheduler output, so every rank calls
            # this with the same list, in the same steps.
            return self.vote_failed_loads(loading, failed)
        return failed

    def save(self, step: StepTransfers) -> None:
        self.finish_loads()
        self.check_agreement(step)
        failed = self._failed_this_step(step)
        stored: list[str] = []
        # The step's remote puts are handed to LMCache once, when its stores
        # are done, off this thread (lmcache_bridge/engine/step_puts.py).
        with self.engine.step() as handoff:
            for req in step.requests:
                if req.req_id in failed and (req.store is not None or req.state_store is not None):
                    self.stats.stores_dropped_after_load_error += 1
                    logger.warning(
                        "lmcache-ascend: request %s: not storing what this step computed (tokens up to "
                        "%d): a load for it failed on this or another rank, so it was computed on "
                        "missing KV; vLLM recomputes it",
                        req.req_id,
                        # One of the two is set (the condition above).
                        req.store.end if req.store is not None else cast(StateStore, req.state_store).position,
                    )
                    continue
                if req.store is not None and self._store_one(req):
                    stored.append(req.req_id)
                if req.state_store is not None and self.state is not None and self._store_state(req):
                    stored.append(req.req_id)
        stored = list(dict.fromkeys(stored))  # a request may store KV and state
        if stored:
            # One hand-off carried every store of the step: each request gets
            # an equal share of its time, so per-request and total store times
            # add up to what the step waited for.
            self.stats.store_seconds += handoff.seconds
            for req_id in stored:
                self._record(req_id).seconds += handoff.seconds / len(stored)

    def _store_state(self, req: RequestTransfer) -> bool:
        """The Mamba state this step left at ``state_store.position``, keyed
        by ``tokens[:position] + marks`` (after the request's KV chunks, so a
        lookup finds both or neither)."""
        assert req.state_store is not None and self.state is not None  # the caller checks both
        mover = self.state
        pos = req.state_store.position
        ids = list(req.token_ids[:pos]) + list(mover.layout.marks())
        mask = torch.ones(len(ids), dtype=torch.bool)
        mask[:pos] = False
        # A req_id of its own keeps LMCache's per-request store lines (tools
        # count a request's stored tokens from them) about KV chunks only.
        ctx = TransferContext(
            req_id=f"state:{req.req_id}",
            block_ids=req.block_ids,
            state=_StatePieces(pos, mover, store=req.state_store.blocks),
        )
        t0 = time.perf_counter()
        try:
            self.engine.store(torch.tensor(ids, dtype=torch.long), mask, ctx)
        except Exception:  # noqa: BLE001 - a failed store loses no request
            self.stats.store_failures += 1
            logger.exception(
                "lmcache-ascend: storing the Mamba state of request %s at %d failed; the request "
                "continues without it",
                req.req_id,
                pos,
            )
            return False
        dt = time.perf_counter() - t0
        self.stats.stored_bytes += mover.snapshot_bytes
        self.stats.store_seconds += dt
        rec = self._record(req.req_id)
        rec.state_stored.append(pos)
        rec.seconds += dt
        return True

    def _complete_runs(self, req: RequestTransfer) -> list[tuple[int, int]]:
        """Contiguous runs of chunks whose every stored group has real blocks
        (planning/store_runs.py); each incomplete chunk is counted and logged."""
        assert req.store is not None
        complete = []
        for start in chunk_starts(req.store.start, req.store.end, self.chunk_size):
            chunk = ChunkRequest(start, start + self.chunk_size, req.block_ids)
            incomplete = self.transfer.incomplete_groups(chunk)
            if incomplete:
                self.stats.skipped_incomplete_chunks += 1
                logger.debug(
                    "lmcache-ascend: request %s chunk [%d, %d) not stored: group(s) %s "
                    "have no real blocks for needed positions",
                    req.req_id,
                    start,
                    start + self.chunk_size,
                    list(incomplete),
                )
            complete.append(not incomplete)
        return complete_runs(req.store.start, req.store.end, self.chunk_size, complete)

    def _stripe_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The part of each run this rank stores (planning/store_runs.py)."""
        return stripe_runs(runs, self.chunk_size, self.stripe)

    def _store_one(self, req: RequestTransfer) -> bool:
        """Stores the request's complete chunks (this rank's stripe); whether
        anything was stored."""
        ctx = TransferContext(req_id=req.req_id, block_ids=req.block_ids)
        t0 = time.perf_counter()
        stored = 0
        for start, end in self._stripe_runs(self._complete_runs(req)):
            tokens = torch.tensor(req.token_ids[:end], dtype=torch.long)
            mask = torch.ones(end, dtype=torch.bool)
            mask[:start] = False
            try:
                self.engine.store(tokens, mask, ctx)
                stored += end - start
            except Exception:  # noqa: BLE001 - a failed store loses no request
                self.stats.store_failures += 1
                logger.exception(
                    "lmcache-ascend: storing request %s tokens [%d, %d) failed; the "
                    "request continues without caching them",
                    req.req_id,
                    start,
                    end,
                )
        dt = time.perf_counter() - t0
        self.stats.stored_tokens += stored
        self.stats.stored_bytes += stored // self.chunk_size * self.chunk_bytes
        self.stats.store_seconds += dt
        rec = self._record(req.req_id)
        rec.stored_tokens += stored
        rec.seconds += dt
        if stored:
            logger.debug(
                "lmcache-ascend: request %s store: %d tokens (%d chunks) in %.4f s",
                req.req_id,
                stored,
                stored // self.chunk_size,
                dt,
            )
        return stored > 0

    # ---- lifecycle -------------------------------------------------------

    def release(self, step: StepTransfers) -> None:
        for lookup_id in step.unpin_lookup_ids:
            try:
                self.engine.unpin(lookup_id)
            except Exception:  # noqa: BLE001
                logger.exception("lmcache-ascend: unpinning %s failed", lookup_id)
        for req_id in step.finished_req_ids:
            try:
                self.engine.request_ended(req_id)
            except Exception:  # noqa: BLE001
                logger.exception("lmcache-ascend: unpinning %s failed", req_id)
            rec = self._records.pop(req_id, None)
            if rec is not None:
                self._log_record(req_id, rec)

    def _log_record(self, req_id: str, rec: RequestRecord, note: str = "") -> None:
        logger.info(
            "lmcache-ascend: request %s: hit %d tokens (vLLM had %d), loaded %d "
            "tokens [%s]%s, stored %d tokens [%s], %.4f s in transfers%s%s",
            req_id,
            rec.hit_tokens,
            rec.vllm_tokens,
            rec.loaded_tokens,
            self._per_group(rec.loaded_tokens),
            " (load error: recomputed)" if rec.load_error else "",
            rec.stored_tokens,
            self._per_group(rec.stored_tokens),
            rec.seconds,
            _state_summary(rec, self.state),
            note,
        )


def _state_summary(rec: RequestRecord, state: Optional[StateMover]) -> str:
    if state is None:
        return ""
    loaded = f"at {rec.state_loaded}" if rec.state_loaded else "none"
    return (
        f"; Mamba state ({state.snapshot_bytes} bytes each): loaded {loaded}, "
        f"stored at {rec.state_stored or 'none'}"
    )


class _StatePieces:
    """The Mamba state snapshot after a request's KV chunks in one LMCache
    call (``chunk_io.StatePieces``): gathered from ``store`` blocks, or
    scattered into the hit and running blocks of ``load``."""

    def __init__(
        self,
        position: int,
        transfer: StateMover,
        store: Optional[Iterable[tuple[int, int]]] = None,
        load: Optional[StateLoad] = None,
    ) -> None:
        self.position = position
        self._transfer = transfer
        self._store = dict(store or ())
        self._targets = (dict(load.hit_blocks), dict(load.running_blocks)) if load is not None else ()

    def store_piece(self, buf: torch.Tensor, piece: int) -> None:
        self._transfer.gather(buf, piece, self._store)

    def load_piece(self, buf: torch.Tensor, piece: int) -> None:
        self._transfer.scatter(buf, piece, self._targets)
