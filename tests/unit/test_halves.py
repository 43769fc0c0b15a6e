"""The two halves' contracts that do not need a vLLM engine: each load's
outcome comes back with its own call, checksum and copy failures reach the
exported counters, each half closes what it owns, and the worker refuses
transfers planned under another chunk size or grouping."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the halves report through vLLM's stats types")

from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.stats import COUNTER_NAMES, AscendConnectorStats
from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec, RequestTransfer, StepTransfers, StoreSpec
from lmcache_ascend.integration.vllm.worker import WorkerHalf
from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext
from lmcache_ascend.lmcache_bridge.engine.step_puts import Handoff
from lmcache_ascend.lmcache_bridge.integrity.staging import StagingCounts
from lmcache_ascend.planning.agreement import HalfAgreement, HalvesDisagree
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup
from lmcache_ascend.planning.settings import AscendConfig

CHUNK, PAYLOAD = 4, 16
GROUPS = (SchedulerGroup(0, GroupKind.FULL, "FullAttentionSpec", 4, layer_names=("l0",)),)


def _obj(payload: bytes) -> SimpleNamespace:
    """A MemoryObj stand-in: LMCache's chunk connector only reads ``tensor``."""
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    return SimpleNamespace(tensor=buf)


def _connector(loaded: list[int]) -> PagedChunkConnector:
    def load(buf, req):
        loaded.append(req.start)

    return PagedChunkConnector(PAYLOAD, CHUNK, store=lambda buf, req: None, load=load, checksums=True)


def _sealed(conn: PagedChunkConnector, fill: int) -> SimpleNamespace:
    obj = _obj(bytes([fill]) * PAYLOAD)
    conn._seal(obj.tensor)  # the trailer a store writes
    return obj


def test_each_retrieve_gets_its_own_outcome():
    loaded: list[int] = []
    conn = _connector(loaded)
    good = [_sealed(conn, i) for i in range(3)]
    bad = _sealed(conn, 9)
    bad.tensor[0] ^= 0xFF  # one flipped byte: the checksum no longer matches
    first = TransferContext("a", ((1, 2, 3),))
    second = TransferContext("b", ((1, 2, 3),))
    conn.batched_to_gpu([good[0], bad, good[1]], [0, 4, 8], [4, 8, 12], lmcache_ascend_ctx=first)
    conn.batched_to_gpu([good[2]], [0], [4], lmcache_ascend_ctx=second)
    # The bad chunk and everything after it stayed out of vLLM's KV.
    assert loaded == [0, 0]
    assert (first.outcome.failed_from, first.outcome.checksum_failures, first.outcome.loaded_chunks) == (4, 1, 1)
    # A later call starts clean: nothing of the first leaks into it.
    assert (second.outcome.failed_from, second.outcome.checksum_failures, second.outcome.loaded_chunks) == (None, 0, 1)


class _Engine:
    """A WorkerEngine stand-in that runs LMCache's side of a retrieve: it
    hands the chunks to the real chunk connector with the caller's context."""

    def __init__(self, conn: PagedChunkConnector, objs: list) -> None:
        self.conn, self.objs, self.closed, self.unpinned = conn, objs, 0, []

    def retrieve(self, tokens, mask, ctx):
        starts = list(range(0, len(tokens), CHUNK))
        self.conn.batched_to_gpu(self.objs, starts, [s + CHUNK for s in starts], lmcache_ascend_ctx=ctx)
        ret = torch.ones(len(tokens), dtype=torch.bool)
        return ret

    def claim(self, lookup_id):
        return None  # nothing staged: the load goes through retrieve

    def unpin(self, req_id):
        self.unpinned.append(req_id)

    def request_ended(self, req_id):
        self.unpinned.append(req_id)

    def store(self, tokens, mask, ctx):
        self.stored = getattr(self, "stored", []) + [(ctx.req_id, int(mask.nonzero()[0]), len(tokens))]

    def close(self):
        self.closed += 1

    # The rest of what the worker half calls (seams.WorkerEngineSeam), as an
    # engine without staging, remote stores or step hand-offs answers.
    def release_claim(self, claim):
        pass

    def load_claim(self, claim, first, end, ctx):
        raise AssertionError("claim() never returns a claim here")

    def take_counts(self):
        return StagingCounts()

    def backend_failures(self):
        return 0

    def remote_unavailable(self):
        return 0

    def step(self):
        return contextlib.nullcontext(Handoff())


def _worker(engine, agreement=None, transfer=None, vote_failed_loads=None) -> WorkerHalf:
    plan = SimpleNamespace(chunk_bytes=PAYLOAD, group_bytes=lambda: {0: PAYLOAD})
    return WorkerHalf(
        GROUPS, CHUNK, engine, transfer=transfer, plan=plan, agreement=agreement, vote_failed_loads=vote_failed_loads
    )


# Every chunk complete: all its groups have real blocks.
_ALL_COMPLETE = SimpleNamespace(incomplete_groups=lambda chunk: ())


def test_checksum_and_copy_failures_are_exported_counters():
    conn = _connector([])
    objs = [_sealed(conn, 1), _sealed(conn, 2)]
    objs[1].tensor[3] ^= 0x01
    engine = _Engine(conn, objs)
    half = _worker(engine)
    req = RequestTransfer("r", tuple(range(8)), ((1, 2),), load=LoadSpec(0, 8))
    half.start_load(StepTransfers((req,)))
    delta = half.take_stats()
    assert delta["checksum_failures"] == 1 and delta["load_errors"] == 1
    assert delta["unstaged_loads"] == 1  # counted, so a fallback read is never silent
    assert delta["loaded_tokens"] == CHUNK
    # The blocks of the chunk that failed go back to vLLM for recomputation.
    assert half.take_load_errors() == {2}
    assert engine.unpinned == ["r"]
    assert {"checksum_failures", "failed_chunk_loads"} <= set(COUNTER_NAMES)
    # A copy that raises counts as a failed chunk load.
    conn._load = lambda buf, req: (_ for _ in ()).throw(RuntimeError("copy failed"))
    half.start_load(StepTransfers((req,)))
    assert half.take_stats()["failed_chunk_loads"] == 1
    stats = AscendConnectorStats(data=dict(delta))
    assert stats.reduce()["checksum_failures"] == 1


def test_halves_close_what_they_own_once():
    engine = _Engine(_connector([]), [])
    _worker(engine).close()
    assert engine.closed == 1
    closed = []
    lookup = SimpleNamespace(__call__=None, close=lambda: closed.append(1))
    SchedulerHalf(GROUPS, CHUNK, lookup).close()
    assert closed == [1]
    SchedulerHalf(GROUPS, CHUNK, lambda toks, rid: 0).close()  # a plain function owns nothing


def test_worker_refuses_steps_planned_under_another_agreement():
    config = AscendConfig()
    mine = HalfAgreement.of(GROUPS, CHUNK, config)
    # Derived alike from the same inputs, in any process.
    assert HalfAgreement.of(GROUPS, CHUNK, config) == mine
    other = HalfAgreement.of(GROUPS, 2 * CHUNK, config)
    assert other.fingerprint != mine.fingerprint
    half = _worker(_Engine(_connector([]), []), agreement=mine)
    half.start_load(StepTransfers((), agreement=mine))  # agreed: nothing to do
    with pytest.raises(HalvesDisagree) as err:
        half.save(StepTransfers((), agreement=other))
    assert f"chunk {2 * CHUNK} tokens" in str(err.value) and f"chunk {CHUNK} tokens" in str(err.value)
    with pytest.raises(HalvesDisagree):
        half.start_load(StepTransfers((), agreement=other))


def test_a_step_that_loaded_a_request_badly_stores_nothing_of_it():
    """What a step computes for a request whose load failed is computed on
    missing KV (vLLM discards and recomputes it): it is never stored. At
    TP > 1 the failure of any rank counts (the vote), since one rank's
    missing KV reaches every rank's new KV through the all-reduce."""
    conn = _connector([])
    objs = [_sealed(conn, 1), _sealed(conn, 2)]
    objs[1].tensor[3] ^= 0x01  # the second chunk fails its checksum
    engine = _Engine(conn, objs)
    half = _worker(engine, transfer=_ALL_COMPLETE)
    tokens = tuple(range(16))
    bad = RequestTransfer("bad", tokens, ((1, 2, 3, 4),), load=LoadSpec(0, 8), store=StoreSpec(8, 16))
    other = RequestTransfer("other", tokens, ((5, 6, 7, 8),), store=StoreSpec(0, 16))
    step = StepTransfers((bad, other))
    half.start_load(step)
    half.save(step)
    assert engine.stored == [("other", 0, 16)]  # "bad" stored nothing
    assert half.take_stats()["stores_dropped_after_load_error"] == 1

    # Its load succeeded here, but another rank's failed: the vote drops it.
    good = [_sealed(conn, 1), _sealed(conn, 2)]
    engine.objs, engine.stored = good, []
    votes = []

    def vote(candidates, failed):
        votes.append((list(candidates), set(failed)))
        return {"bad"}  # another rank reported "bad"

    half = _worker(engine, transfer=_ALL_COMPLETE, vote_failed_loads=vote)
    half.start_load(step)
    half.save(step)
    assert votes == [(["bad"], set())]  # only requests that load and store are voted on
    assert engine.stored == [("other", 0, 16)]
    # A step with no failure anywhere stores both.
    half = _worker(engine, transfer=_ALL_COMPLETE, vote_failed_loads=lambda candidates, failed: set(failed))
    engine.stored = []
    half.start_load(step)
    half.save(step)
    assert engine.stored == [("bad", 8, 16), ("other", 0, 16)]


def test_a_steps_handoff_time_is_shared_by_the_requests_that_stored():
    """The step's remote puts are handed off once, after its stores
    (lmcache_bridge/engine/step_puts.py): that time is part of what the step waited
    for, split evenly over the requests that stored, never lost or doubled."""
    conn = _connector([])
    engine = _Engine(conn, [])
    steps = []

    @contextlib.contextmanager
    def step():
        out = Handoff()
        steps.append(out)
        yield out
        out.seconds = 0.25  # as if queueing the step's puts took that long

    engine.step = step
    half = _worker(engine, transfer=_ALL_COMPLETE)
    tokens = tuple(range(16))
    a = RequestTransfer("a", tokens, ((1, 2, 3, 4),), store=StoreSpec(0, 16))
    b = RequestTransfer("b", tokens, ((5, 6, 7, 8),), store=StoreSpec(8, 16))
    idle = RequestTransfer("c", tokens, ((9, 10, 11, 12),))  # stores nothing
    half.save(StepTransfers((a, b, idle)))
    assert len(steps) == 1 and engine.stored == [("a", 0, 16), ("b", 8, 16)]
    recs = half._records
    assert "c" not in recs
    # Each storing request's time holds its own store plus half the hand-off.
    assert recs["a"].seconds >= 0.125 and recs["b"].seconds >= 0.125
    assert recs["a"].seconds < 0.25 and recs["b"].seconds < 0.25
    assert half.take_stats()["store_seconds"] == pytest.approx(recs["a"].seconds + recs["b"].seconds)
