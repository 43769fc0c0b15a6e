"""SchedulerHalf with Mamba state hits, driven the way vLLM's scheduler
drives it in align mode.

`AlignEngine` plays vLLM 0.32's scheduler for a Qwen3-Next-like layout
(three Mamba groups, one attention group, block size B; in both group
orders engines produce, see ORDERS): real `Request`,
`SchedulerOutput`, `NewRequestData` and `CachedRequestData` objects; Mamba
block tables as vLLM's MambaManager grows them (null blocks below the
running block, plus the "hit" block at N/B - 1 after an external hit of N
tokens; appended ids include the null padding). The only fake is LMCache:
a set of stored chunk prefixes, filled from what the scheduler plans to
store (KV chunks and state snapshots keyed by tokens[:P] + marks), with
LMCache's prefix-counting lookup and per-lookup-id pins.
"""

from __future__ import annotations

import logging
import sys

import pytest

pytest.importorskip("vllm", reason="driven through vLLM's real scheduler types")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm.scheduler import MAX_STATE_PROBES, SchedulerHalf, StateHits
from lmcache_ascend.integration.vllm.vllm_keys import request_view
from lmcache_ascend.integration.vllm.vllm_step_view import step_view
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, GroupKind, SchedulerGroup

from scheduler_driver import scheduler_output  # noqa: E402

B = 384
MARKS = tuple([-21] + [-2] * (3 * B - 1))  # three snapshot pieces
STATE_GROUPS = (0, 1, 2)
ATTN = 3
# Group orders the engines produce: vLLM(-CPU)'s runner adds specs in layer
# order (GDN layer 0 first: Mamba groups first); vLLM-Ascend 0.30.0rc2's
# get_kv_cache_spec adds attention specs before Mamba ones (attention group
# first; tests/fixtures/ascend_hybrid.py, runner_specs). Every
# test runs with both, the module globals set per order.
ORDERS = {"mamba-first": ((0, 1, 2), 3), "attention-first": ((1, 2, 3), 0)}


@pytest.fixture(autouse=True, params=list(ORDERS))
def group_order(request, monkeypatch):
    state, attn = ORDERS[request.param]
    monkeypatch.setattr(sys.modules[__name__], "STATE_GROUPS", state)
    monkeypatch.setattr(sys.modules[__name__], "ATTN", attn)
    return request.param


def groups() -> tuple[SchedulerGroup, ...]:
    return tuple(
        SchedulerGroup(i, GroupKind.FULL, "FullAttentionSpec", B) if i == ATTN
        else SchedulerGroup(i, GroupKind.STATE, "MambaSpec", B)
        for i in sorted((*STATE_GROUPS, ATTN))
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FakeLMCache:
    def __init__(self) -> None:
        self.stored: set[tuple[int, ...]] = set()
        self.calls: list[tuple[str, int]] = []
        self.pinned: dict[str, int] = {}  # lookup id -> chunks pinned

    def put(self, tokens, start: int, end: int) -> None:
        for k in range(start + B, end + 1, B):
            self.stored.add(tuple(tokens[:k]))

    def lookup(self, token_ids, lookup_id: str) -> int:
        toks = list(token_ids)
        self.calls.append((lookup_id, len(toks)))
        n = 0
        while n + B <= len(toks) and tuple(toks[: n + B]) in self.stored:
            n += B
        assert lookup_id not in self.pinned, f"lookup id {lookup_id} reused: LMCache would leak its pins"
        self.pinned[lookup_id] = n // B
        return n

    def unpin(self, lookup_id: str) -> None:
        self.pinned.pop(lookup_id, None)


class AlignEngine:
    def __init__(self) -> None:
        self.cache = FakeLMCache()
        self.half = SchedulerHalf(
            groups(), B, self.cache.lookup, agreement=None, state=StateHits(STATE_GROUPS, B, MARKS)
        )
        self.reqs: dict[str, Request] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.ext_hit: dict[str, int] = {}
        self.scheduled_once: set[str] = set()
        self.finished: set[str] = set()
        self.next_id = 1
        self.state_stores: list[tuple[str, int, tuple]] = []
        self.loads: dict[str, object] = {}

    def add(self, req_id: str, tokens) -> Request:
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=4096), None)
        self.reqs[req_id] = req
        self.blocks[req_id] = [[] for _ in groups()]
        return req

    def admit(self, req_id: str, local: int = 0, alloc: bool = True) -> int:
        req = self.reqs[req_id]
        ext, is_async = self.half.get_num_new_matched_tokens(request_view(req), local)
        assert is_async is False
        if alloc:
            self.half.update_state_after_alloc(req_id, ext)
            req.num_computed_tokens = local + ext
            self.ext_hit[req_id] = local + ext if ext else 0
        return ext

    def _new(self) -> int:
        self.next_id += 1
        return self.next_id

    def _alloc(self, req_id: str, upto: int) -> list[list[int]]:
        """vLLM's managers: attention blocks for every position; Mamba
        groups null padding, the hit block (first allocation after an
        external hit) and the running block cdiv(upto, B) - 1."""
        new = []
        hit = self.ext_hit.pop(req_id, 0)
        for g in groups():
            have = self.blocks[req_id][g.index]
            want = cdiv(upto, B)
            ids = []
            for b in range(len(have), want):
                real = g.index == ATTN or b == want - 1 or (hit and b == hit // B - 1)
                ids.append(self._new() if real else NULL_BLOCK_ID)
            have.extend(ids)
            new.append(ids)
        return new

    def step(self, sched: dict[str, int]):
        new_reqs, cached = [], CachedRequestData.make_empty()
        for req_id, n in sched.items():
            req = self.reqs[req_id]
            new = self._alloc(req_id, req.num_computed_tokens + n)
            if req_id not in self.scheduled_once:
                self.scheduled_once.add(req_id)
                new_reqs.append(NewRequestData.from_request(req, tuple(list(b) for b in self.blocks[req_id])))
                continue
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(tuple(new) if any(new) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(req.num_output_tokens)
        out = scheduler_output(new_reqs, cached, sched, self.finished, ())
        self.finished.clear()
        transfers = self.half.build(step_view(out))
        for lookup_id in transfers.unpin_lookup_ids:
            self.cache.unpin(lookup_id)
        for t in transfers.requests:
            req = self.reqs[t.req_id]
            if t.load is not None:
                self.loads[t.req_id] = t.load
                self.cache.unpin(t.load.lookup_id)
            if t.store is not None:
                self.cache.put(req.all_token_ids, t.store.start, t.store.end)
            if t.state_store is not None:
                pos = t.state_store.position
                assert t.token_ids[:pos] == tuple(req.all_token_ids[:pos])
                self.state_stores.append((t.req_id, pos, t.state_store.blocks))
                self.cache.put(list(req.all_token_ids[:pos]) + list(MARKS), pos, pos + len(MARKS))
        for req_id, n in sched.items():
            self.reqs[req_id].num_computed_tokens += n
        return {t.req_id: t for t in transfers.requests}

    def finish(self, req_id: str) -> None:
        self.half.request_finished(req_id)
        self.finished.add(req_id)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def run(eng: AlignEngine, req_id: str, steps: list[int]) -> None:
    for n in steps:
        eng.step({req_id: n})


# ---- stores -----------------------------------------------------------------------


def test_state_is_stored_only_where_a_step_ends_on_a_chunk_boundary():
    eng = AlignEngine()
    eng.add("a", prompt(3 * B + 48))
    eng.admit("a")
    run(eng, "a", [B, B, B, 48])  # budget B: every prefill step ends on a boundary
    got = [(pos, blocks) for _, pos, blocks in eng.state_stores]
    assert [p for p, _ in got] == [B, 2 * B, 3 * B]
    # The block of each is the running block of the step that ended there
    # (index P/B - 1), in every state group, never the null block.
    tables = eng.blocks["a"]
    for pos, blocks in got:
        assert blocks == tuple((g, tables[g][pos // B - 1]) for g in STATE_GROUPS)
        assert all(b != NULL_BLOCK_ID for _, b in blocks)


def test_a_step_across_boundaries_leaves_state_only_at_its_end():
    eng = AlignEngine()
    eng.add("a", prompt(3 * B + 48))
    eng.admit("a")
    run(eng, "a", [3 * B, 48])  # vLLM splits at the last boundary
    assert [p for _, p, _ in eng.state_stores] == [3 * B]
    # Decode: every position is a step end; crossing 4B stores its state.
    req = eng.reqs["a"]
    for t in range(B - 48):
        req.append_output_token_ids(7 + t)
        eng.step({"a": 1})
    assert [p for _, p, _ in eng.state_stores] == [3 * B, 4 * B]


def test_unaligned_step_ends_store_no_state():
    eng = AlignEngine()
    eng.add("a", prompt(2 * B + 100))
    eng.admit("a")
    run(eng, "a", [B + 128, B - 28])  # ends at 1.33 B and 2.26 B
    assert eng.state_stores == []


# ---- lookups and loads ---------------------------------------------------------------


def test_hit_is_the_longest_boundary_with_kv_and_state():
    eng = AlignEngine()
    a = prompt(3 * B + 48)
    eng.add("a", a)
    eng.admit("a")
    run(eng, "a", [3 * B, 48])  # state at 3B only
    eng.finish("a")
    # Same prompt: KV and state at 3B.
    eng.add("b", a)
    assert eng.admit("b") == 3 * B
    t = eng.step({"b": 48})["b"]
    assert t.load.hit_tokens == 3 * B and t.load.skip_tokens == 0
    tables = eng.blocks["b"]
    # State goes to the hit block (index 2) and the running block (index 3).
    assert t.load.state.hit_blocks == tuple((g, tables[g][2]) for g in STATE_GROUPS)
    assert t.load.state.running_blocks == tuple((g, tables[g][3]) for g in STATE_GROUPS)
    assert all(tables[g][:2] == [NULL_BLOCK_ID] * 2 for g in STATE_GROUPS)
    # A prompt sharing [0, 2B + 100): KV chunks at B and 2B are stored but no
    # state there (a's steps ended at 3B): a miss, however much KV matches.
    eng.add("c", a[: 2 * B + 100] + prompt(300, seed=9))
    assert eng.admit("c") == 0


def test_probes_walk_down_to_the_stored_state_and_release_their_pins():
    eng = AlignEngine()
    a = prompt(3 * B + 48)
    eng.add("a", a)
    eng.admit("a")
    run(eng, "a", [B, B, B, 48])  # states at B, 2B, 3B
    eng.finish("a")
    eng.step({})  # a's finish reaches the worker
    eng.cache.stored -= {tuple(a[: 3 * B] + list(MARKS[: k * B])) for k in (2, 3)}  # state at 3B partly evicted
    eng.add("b", a + prompt(500, seed=3))
    calls = len(eng.cache.calls)
    assert eng.admit("b") == 2 * B
    probes = eng.cache.calls[calls:]
    # limit 4B: KV ends at 3B -> probe 3B: state incomplete -> probe 2B: hit.
    assert [n for _, n in probes] == [4 * B + len(MARKS), 3 * B + len(MARKS), 2 * B + len(MARKS)]
    ids = [i for i, _ in probes]
    assert len(set(ids)) == 3
    t = eng.step({"b": B})["b"]
    assert t.load.lookup_id == ids[-1]
    assert eng.cache.pinned == {}, "every probe's pins were released"


def test_a_local_hit_is_extended_only_by_a_deeper_state():
    eng = AlignEngine()
    a = prompt(3 * B + 48)
    eng.add("a", a)
    eng.admit("a")
    run(eng, "a", [B, B, B, 48])
    eng.add("b", a)
    assert eng.admit("b", local=B) == 2 * B  # hit 3B, vLLM had B
    t = eng.step({"b": 48})["b"]
    assert (t.load.skip_tokens, t.load.hit_tokens) == (B, 3 * B)
    eng.add("c", a)
    calls = len(eng.cache.calls)
    assert eng.admit("c", local=3 * B) == 0
    assert eng.cache.calls[calls:] == []  # nothing beyond vLLM's own hit to look up


def test_pins_of_an_unused_hit_are_released():
    eng = AlignEngine()
    a = prompt(3 * B + 48)
    eng.add("a", a)
    eng.admit("a")
    run(eng, "a", [3 * B, 48])
    # Admitted twice (vLLM could not schedule it the first time): the first
    # attempt's pins must not leak.
    eng.add("b", a)
    assert eng.admit("b", alloc=False) == 3 * B
    assert eng.admit("b", alloc=False) == 3 * B
    # vLLM then takes no external tokens after all.
    eng.half.update_state_after_alloc("b", 0)
    # A request that finishes before its load.
    eng.add("c", a)
    assert eng.admit("c") == 3 * B
    eng.finish("c")
    eng.step({})
    assert eng.cache.pinned == {}


def test_every_probe_is_bounded():
    eng = AlignEngine()
    n = (MAX_STATE_PROBES + 5) * B
    a = prompt(n + 10)
    eng.add("a", a)
    eng.admit("a")
    run(eng, "a", [n, 10])  # KV for every chunk, state only at n
    eng.cache.stored -= {tuple(a[:n] + list(MARKS[:B]))}  # ... and that state evicted
    eng.add("b", a)
    calls = len(eng.cache.calls)
    assert eng.admit("b") == 0
    assert len(eng.cache.calls) - calls == MAX_STATE_PROBES


def test_refusal_is_logged_once_with_its_reason(caplog):
    line = "lmcache-ascend: external cache hits are refused for this model: because X; set Y"
    blockers = tuple(g for g in groups() if g.index in STATE_GROUPS)
    calls = []
    with caplog.at_level(logging.WARNING):
        half = SchedulerHalf(groups(), B, lambda t, i: calls.append(i) or 0, hit_blockers=blockers, refusal=line)
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [line]
    req = Request("r", prompt(3 * B), SamplingParams(max_tokens=1), None)
    assert half.get_num_new_matched_tokens(request_view(req), 0) == (0, False)
    assert calls == [] and half.stats.refused_lookups == 1


def test_state_hits_need_a_chunk_on_the_block_grid():
    with pytest.raises(ValueError, match="not a multiple of the state block size"):
        SchedulerHalf(groups(), B + 128, lambda t, i: 0, state=StateHits(STATE_GROUPS, B, MARKS))
