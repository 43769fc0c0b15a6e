"""SchedulerHalf driven the way vLLM's scheduler drives a connector.

`Engine` plays vLLM's scheduler: real `Request` objects, real
`SchedulerOutput` / `NewRequestData` / `CachedRequestData` (read through
`step_view`), per-group block tables grown as vLLM grows them (null block 0
for sliding-window positions that are out of the window after a hit, None in
`new_block_ids` when a step allocates nothing). The only fake is the LMCache
lookup: an in-memory set of stored chunk prefixes, filled from the store
ranges the scheduler plans (as the worker would store them).

Every step checks the invariants of each RequestTransfer against the
engine's own truth (block tables, tokens, hits, chunks already stored).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="driven through vLLM's real scheduler types")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec, StoreSpec
from lmcache_ascend.integration.vllm.vllm_keys import request_view
from lmcache_ascend.integration.vllm.vllm_layout import scheduler_groups, step_view
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, GroupKind, SchedulerGroup

CHUNK = 256
FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE
ATTN = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)


# ---- layouts ------------------------------------------------------------------


def _vllm_groups(*specs) -> tuple[SchedulerGroup, ...]:
    cfg = KVCacheConfig(
        num_blocks=1024,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)],
    )
    return scheduler_groups(cfg)


def _groups(*rows) -> tuple[SchedulerGroup, ...]:
    return tuple(
        SchedulerGroup(
            index=i,
            kind=k,
            spec_name=f"{k.value}Spec",
            block_size=bs,
            compress_ratio=r,
            sliding_window=w,
        )
        for i, (k, bs, r, w) in enumerate(rows)
    )


def llama():
    return _vllm_groups(FullAttentionSpec(block_size=16, **ATTN))


def gemma3():
    swa = SlidingWindowSpec(block_size=128, sliding_window=512, **ATTN)
    return _vllm_groups(swa, swa, swa, swa, swa, FullAttentionSpec(block_size=128, **ATTN))


# Synthetic multi-group tables for the scheduler's generic logic: mixed block
# sizes, compress ratios, windows and state groups. They describe no release
# (the real vLLM-Ascend DeepSeek-V4 structure is in test_scheduler_dsv4.py).
def mixed_5():
    return _groups(
        (FULL, 256, 4, None),  # compressed attention
        (SLIDING, 64, 1, 128),  # SWA
        (FULL, 64, 1, None),  # indexer
        (SLIDING, 4, 1, 8),  # compressor state, ratio 4
        (SLIDING, 8, 1, 128),  # compressor state, ratio 128
    )


def mixed_11():
    return _groups(
        (FULL, 128, 4, None),
        (SLIDING, 128, 1, 128),
        (SLIDING, 128, 1, 128),
        (FULL, 128, 4, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (SLIDING, 128, 128, 128),
        (SLIDING, 128, 1, 128),
        (STATE, 128, 1, None),
    )


LAYOUTS = {"llama": llama, "gemma3": gemma3, "mixed_5": mixed_5, "mixed_11": mixed_11}


# ---- the fake lookup and the engine ------------------------------------------------


class FakeLMCache:
    """Stored chunk prefixes; lookup returns the longest stored prefix."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.stored: set[tuple[int, ...]] = set()
        self.calls: list[tuple[str, int]] = []
        self.override: int | None = None
        self.found: dict[str, int] = {}  # req_id -> whole chunks last reported

    def put(self, tokens, start: int, end: int) -> None:
        for k in range(start + self.chunk, end + 1, self.chunk):
            self.stored.add(tuple(tokens[:k]))

    def lookup(self, token_ids, req_id: str) -> int:
        toks = list(token_ids)
        self.calls.append((req_id, len(toks)))
        n = 0
        while n + self.chunk <= len(toks) and tuple(toks[: n + self.chunk]) in self.stored:
            n += self.chunk
        if self.override is not None:
            n = self.override
        self.found[req_id] = min(n, len(toks)) // self.chunk * self.chunk
        return n


class Engine:
    def __init__(self, groups, blockers=(), chunk: int = CHUNK) -> None:
        self.groups = tuple(groups)
        self.chunk = chunk
        self.cache = FakeLMCache(chunk)
        self.half = SchedulerHalf(self.groups, chunk, self.cache.lookup, hit_blockers=blockers)
        self.reqs: dict[str, Request] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.next_id = [1000 * (g.index + 1) for g in self.groups]
        self.scheduled_once: set[str] = set()
        self.to_resume: set[str] = set()
        self.preempted: set[str] = set()
        self.finished: set[str] = set()
        self.hit: dict[str, int] = {}
        self.stored_chunks: dict[str, set[int]] = {}
        self.saw_none_entry = False
        self.saw_empty_group_entry = False

    # -- vLLM scheduler actions --
    def add(self, req_id: str, tokens) -> Request:
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=4096), None)
        self.reqs[req_id] = req
        self.blocks[req_id] = [[] for _ in self.groups]
        self.stored_chunks.setdefault(req_id, set())
        return req

    def admit(self, req_id: str, local: int = 0) -> int:
        """get_num_new_matched_tokens + update_state_after_alloc."""
        req = self.reqs[req_id]
        ext, is_async = self.half.get_num_new_matched_tokens(request_view(req), local)
        assert is_async is False and ext >= 0
        assert (local + ext) % self.chunk == 0 or ext == 0
        self.half.update_state_after_alloc(req_id, ext)
        req.num_computed_tokens = local + ext
        # chunks LMCache reported must never be stored again by this request
        found = self.cache.found.pop(req_id, 0)
        self.hit[req_id] = max(self.hit.get(req_id, 0), found, local + ext if ext else 0)
        return ext

    def preempt(self, req_id: str) -> None:
        self.blocks[req_id] = [[] for _ in self.groups]
        self.reqs[req_id].num_computed_tokens = 0
        self.preempted.add(req_id)
        self.to_resume.add(req_id)

    def finish(self, req_id: str) -> None:
        assert self.half.request_finished(req_id) == (False, None)
        self.finished.add(req_id)
        self.stored_chunks.pop(req_id, None)

    def decode(self, req_id: str, token: int) -> None:
        self.reqs[req_id].append_output_token_ids(token)

    def _alloc(self, req_id: str, upto: int, computed: int) -> list[list[int]]:
        new = []
        for g in self.groups:
            have = self.blocks[req_id][g.index]
            want = 1 if g.kind is STATE else math.ceil(upto / g.block_size)
            ids = []
            for b in range(len(have), want):
                out_of_window = (
                    g.kind is SLIDING and (b + 1) * g.block_size <= computed - g.sliding_window
                )
                if out_of_window:
                    ids.append(NULL_BLOCK_ID)
                else:
                    ids.append(self.next_id[g.index])
                    self.next_id[g.index] += 1
            have.extend(ids)
            new.append(ids)
        return new

    def step(self, sched: dict[str, int]):
        new_reqs, cached = [], CachedRequestData.make_empty()
        for req_id, n in sched.items():
            req = self.reqs[req_id]
            computed = req.num_computed_tokens
            new = self._alloc(req_id, computed + n, computed)
            if req_id not in self.scheduled_once:
                self.scheduled_once.add(req_id)
                all_ids = tuple(list(b) for b in self.blocks[req_id])
                new_reqs.append(NewRequestData.from_request(req, all_ids))
                continue
            cached.req_ids.append(req_id)
            if req_id in self.to_resume:
                self.to_resume.discard(req_id)
                cached.resumed_req_ids.add(req_id)
                cached.new_block_ids.append(tuple(list(b) for b in self.blocks[req_id]))
            elif all(not ids for ids in new):
                self.saw_none_entry = True
                cached.new_block_ids.append(None)
            else:
                self.saw_empty_group_entry |= any(not ids for ids in new)
                cached.new_block_ids.append(tuple(new))
            cached.num_computed_tokens.append(computed)
            cached.num_output_tokens.append(req.num_output_tokens)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(sched),
            total_num_scheduled_tokens=sum(sched.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(self.finished),
            free_encoder_mm_hashes=[],
            preempted_req_ids=set(self.preempted),
            num_common_prefix_blocks=[],  # required before vLLM 0.32
        )
        self.finished.clear()
        self.preempted.clear()
        transfers = self.half.build(step_view(out))
        assert transfers.finished_req_ids == frozenset(out.finished_req_ids)
        for t in transfers.requests:
            self._check(t, sched)
        for req_id, n in sched.items():
            self.reqs[req_id].num_computed_tokens += n
        return {t.req_id: t for t in transfers.requests}

    def _check(self, t, sched) -> None:
        req = self.reqs[t.req_id]
        assert t.req_id in sched
        assert t.block_ids == tuple(tuple(b) for b in self.blocks[t.req_id])
        end = max(t.load.hit_tokens if t.load else 0, t.store.end if t.store else 0)
        assert t.token_ids == tuple(req.all_token_ids[:end])
        if t.load is not None:
            assert t.load.hit_tokens % self.chunk == 0
            assert 0 <= t.load.skip_tokens < t.load.hit_tokens < req.num_tokens
        if t.store is not None:
            s = t.store
            assert s.start % self.chunk == 0 and s.end % self.chunk == 0 and s.start < s.end
            assert s.end <= req.num_computed_tokens + sched[t.req_id]
            assert s.end <= req.num_tokens
            assert s.start >= self.hit.get(t.req_id, 0), "re-stores chunks that were hit"
            chunks = set(range(s.start, s.end, self.chunk))
            assert not chunks & self.stored_chunks[t.req_id], "chunk stored twice"
            self.stored_chunks[t.req_id] |= chunks
            self.cache.put(req.all_token_ids, s.start, s.end)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def prefill(eng: Engine, req_id: str, budget: int) -> list[dict]:
    """Schedules `req_id` until its prompt is computed; returns each step's transfers."""
    req, steps = eng.reqs[req_id], []
    while req.num_computed_tokens < req.num_tokens:
        steps.append(eng.step({req_id: min(budget, req.num_tokens - req.num_computed_tokens)}))
    return steps


# ---- lookups ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,limit", [(1, 0), (255, 0), (256, 0), (257, 256), (512, 256), (513, 512), (1000, 768)]
)
def test_lookup_is_chunk_aligned_and_never_the_whole_prompt(n, limit):
    eng = Engine(llama())
    toks = prompt(n)
    eng.cache.put(toks + [0] * CHUNK, 0, n + CHUNK)  # everything is stored
    eng.add("r", toks)
    assert eng.admit("r") == limit
    if limit == 0:
        assert eng.cache.calls == []
    else:
        assert eng.cache.calls == [("r", limit)]


def test_unaligned_or_oversized_lookup_results_are_cut_to_whole_chunks():
    eng = Engine(llama())
    eng.add("a", prompt(1000))
    eng.cache.override = 700
    assert eng.admit("a") == 512
    eng.add("b", prompt(1000, 1))
    eng.cache.override = 5000
    assert eng.admit("b") == 768


@pytest.mark.parametrize("local,hit,expect", [(256, 512, 256), (512, 512, 0), (768, 512, 0), (0, 0, 0)])
def test_hit_below_num_computed_returns_zero(local, hit, expect):
    eng = Engine(gemma3())
    eng.cache.override = hit
    eng.add("r", prompt(1000))
    assert eng.admit("r", local=local) == expect


def test_hit_blockers_refuse_every_hit_without_looking_up():
    groups = mixed_11()
    blockers = tuple(g for g in groups if g.kind is STATE)
    eng = Engine(groups, blockers=blockers)
    eng.cache.override = 10**6  # a lookup would hit everything
    toks = prompt(1100)
    eng.cache.put(toks, 0, 1024)
    eng.add("r", toks)
    assert eng.admit("r") == 0
    assert eng.cache.calls == []
    assert eng.half.take_stats() == {"refused_lookups": 1}  # exported, not looked up
    # chunks are still stored for the attention groups
    steps = prefill(eng, "r", 2048)
    assert steps[0]["r"].store == StoreSpec(0, 1024) and steps[0]["r"].load is None


# ---- loads ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_spec_once_and_only_once(layout):
    eng = Engine(LAYOUTS[layout]())
    toks = prompt(1000)
    eng.cache.put(toks, 0, 768)
    eng.add("r", toks)
    assert eng.admit("r", local=256) == 512
    first = eng.step({"r": 232})["r"]
    assert first.load == LoadSpec(256, 768)
    assert first.store is None  # [768, 1000) is not a whole chunk
    assert len(first.token_ids) == 768
    for _ in range(3):
        eng.decode("r", 7)
        assert "r" not in eng.step({"r": 1})
    # One lookup, its hit counted once for vLLM's stats (the load above once).
    assert eng.half.take_stats() == {"lookup_requests": 1, "hit_tokens": 768}


def test_sliding_groups_get_null_blocks_after_hit_and_stores_start_at_hit():
    eng = Engine(gemma3())
    toks = prompt(1500)
    eng.cache.put(toks, 0, 1280)
    eng.add("r", toks)
    assert eng.admit("r") == 1280
    t = eng.step({"r": 220})["r"]
    assert t.load == LoadSpec(0, 1280) and t.store is None
    # window 512 / block 128: blocks 0..5 are out of the window at 1280
    assert t.block_ids[0][:6] == (NULL_BLOCK_ID,) * 6 and NULL_BLOCK_ID not in t.block_ids[0][6:]
    assert NULL_BLOCK_ID not in t.block_ids[5]  # the full group keeps every block
    for i in range(36):
        eng.decode("r", 100 + i)
        out = eng.step({"r": 1})
        if eng.reqs["r"].num_computed_tokens < 1536:
            assert "r" not in out
    assert out["r"].store == StoreSpec(1280, 1536) and out["r"].load is None


def test_hit_covered_by_local_prefix_cache_is_not_stored_again():
    eng = Engine(gemma3())
    toks = prompt(1000)
    eng.cache.put(toks, 0, 512)
    eng.add("r", toks)
    assert eng.admit("r", local=512) == 0  # vLLM already has the hit locally
    out = eng.step({"r": 488})
    assert out["r"].store == StoreSpec(512, 768) and out["r"].load is None


def test_allocation_failure_then_readmission_loads_once():
    eng = Engine(llama())
    toks = prompt(600)
    eng.cache.put(toks, 0, 512)
    eng.add("r", toks)
    ext, _ = eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)
    assert ext == 512  # vLLM could not allocate: no update_state_after_alloc
    assert eng.admit("r") == 512
    assert eng.step({"r": 88})["r"].load == LoadSpec(0, 512)
    eng.decode("r", 1)
    assert "r" not in eng.step({"r": 1})


def test_zero_external_tokens_plans_no_load():
    eng = Engine(llama())
    toks = prompt(600)
    eng.cache.put(toks, 0, 512)
    eng.add("r", toks)
    eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)
    eng.half.update_state_after_alloc("r", 0)
    out = eng.step({"r": 600})
    assert "r" not in out or out["r"].load is None


def test_more_external_tokens_than_hit_is_an_error():
    eng = Engine(llama())
    eng.cache.override = 256
    eng.add("r", prompt(600))
    eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)
    with pytest.raises(RuntimeError, match="512"):
        eng.half.update_state_after_alloc("r", 512)


# ---- stores ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_prefill_then_decode_stores_each_completed_chunk_once(layout):
    eng = Engine(LAYOUTS[layout]())
    eng.add("r", prompt(1000))
    assert eng.admit("r") == 0
    steps = prefill(eng, "r", 300)
    stores = [s["r"].store if "r" in s else None for s in steps]
    assert stores == [StoreSpec(0, 256), StoreSpec(256, 512), StoreSpec(512, 768), None]
    # decode up to 1024 tokens: the step computing token 1023 stores [768, 1024)
    for i in range(24):
        eng.decode("r", 5 + i)
        out = eng.step({"r": 1})
        done = eng.reqs["r"].num_computed_tokens
        if done < 1024:
            assert "r" not in out, done
    assert done == 1024 and out["r"].store == StoreSpec(768, 1024)
    assert len(out["r"].token_ids) == 1024
    for i in range(10):
        eng.decode("r", 9)
        assert "r" not in eng.step({"r": 1})
    assert eng.saw_none_entry  # decode steps inside a block allocate nothing


def test_store_never_passes_the_known_tokens():
    """Scheduled tokens beyond the request's tokens (spec-decode drafts) are
    not stored."""
    eng = Engine(llama())
    eng.add("r", prompt(254))
    eng.admit("r")
    assert "r" not in eng.step({"r": 254})
    eng.decode("r", 1)
    out = eng.step({"r": 4})  # 1 real + 3 draft tokens -> 259 scheduled
    assert "r" not in out
    eng.reqs["r"].num_computed_tokens = 255  # the 3 drafts were rejected
    eng.decode("r", 2)
    assert eng.step({"r": 1})["r"].store == StoreSpec(0, 256)


def test_shared_prefix_then_diverging():
    eng = Engine(mixed_5())
    base = prompt(600)
    eng.add("a", base)
    eng.admit("a")
    assert eng.step({"a": 600})["a"].store == StoreSpec(0, 512)
    eng.add("b", base[:520] + prompt(300, 9))
    assert eng.admit("b") == 512
    t = eng.step({"b": 308})["b"]
    assert t.load == LoadSpec(0, 512) and t.store == StoreSpec(512, 768)
    assert t.token_ids == tuple(eng.reqs["b"].all_token_ids[:768])


def test_finished_requests_are_forgotten_and_listed():
    eng = Engine(gemma3())
    eng.add("a", prompt(600))
    eng.add("b", prompt(600, 1))
    eng.admit("a")
    eng.admit("b")
    out = eng.step({"a": 300, "b": 300})
    assert set(out) == {"a", "b"}
    eng.finish("a")
    out = eng.step({"b": 300})
    assert set(out) == {"b"} and out["b"].store == StoreSpec(256, 512)
    # The forgotten id is ignored if vLLM ever schedules it again
    # (it never passed through get_num_new_matched_tokens since).
    assert eng.half.build(step_view(_cached_only("a", 300, 212))).requests == ()


def test_finished_req_ids_alone_forget_the_request():
    """A request listed in finished_req_ids is forgotten even when
    request_finished was not called for it (e.g. aborted)."""
    eng = Engine(gemma3())
    eng.add("a", prompt(600))
    eng.admit("a")
    assert eng.step({"a": 300})["a"].store == StoreSpec(0, 256)
    eng.finished.add("a")
    assert eng.step({}) == {}
    assert eng.half.build(step_view(_cached_only("a", 300, 300))).requests == ()


def _cached_only(req_id: str, computed: int, n: int) -> SchedulerOutput:
    cached = CachedRequestData.make_empty()
    cached.req_ids.append(req_id)
    cached.new_block_ids.append(([1, 2, 3],) + ([],) * 5)
    cached.num_computed_tokens.append(computed)
    cached.num_output_tokens.append(0)
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {req_id: n}
    return out


def test_finished_ids_pass_through_even_when_unknown():
    eng = Engine(llama())
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = {"never-seen"}
    assert eng.half.build(step_view(out)).finished_req_ids == frozenset({"never-seen"})


def test_request_never_looked_up_is_ignored():
    eng = Engine(llama())
    eng.add("r", prompt(600))
    assert eng.step({"r": 600}) == {}


# ---- per-group block tracking -------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mixed_5", "mixed_11"])
def test_per_group_blocks_append_with_none_entries(layout):
    eng = Engine(LAYOUTS[layout]())
    eng.add("r", prompt(900))
    eng.admit("r")
    n_stores = 0
    for step_tokens in (100, 100, 100, 100, 100, 100, 100, 100, 100):
        out = eng.step({"r": step_tokens})
        n_stores += "r" in out  # _check compares block_ids with the engine's tables
    for i in range(300):
        eng.decode("r", i)
        out = eng.step({"r": 1})
        n_stores += "r" in out
    assert n_stores == 4  # 1200 tokens computed: chunks 0..3
    assert eng.saw_none_entry and eng.saw_empty_group_entry
    assert eng.stored_chunks["r"] == {0, 256, 512, 768}


def test_preempted_request_drops_blocks_and_resumed_replaces_them():
    eng = Engine(mixed_5())
    toks = prompt(1000)
    eng.add("r", toks)
    eng.admit("r")
    t0 = eng.step({"r": 600})["r"]
    assert t0.store == StoreSpec(0, 512)
    eng.preempt("r")
    assert eng.step({}) == {}  # the preemption step: nothing for "r"
    assert eng.step({}) == {}  # still waiting
    # rescheduled: new lookup (LMCache has 512), resumed with fresh blocks
    assert eng.admit("r") == 512
    t = eng.step({"r": 488})["r"]
    assert t.load == LoadSpec(0, 512) and t.store == StoreSpec(512, 768)
    # block ids are the resumed ones only (Engine._check compares them too)
    for old, new in zip(t0.block_ids, t.block_ids):
        assert not (set(old) & set(new)) - {NULL_BLOCK_ID}
    assert len(t.block_ids[0]) == math.ceil(1000 / 256)


def test_preempted_and_resumed_in_the_same_step():
    """reset_prefix_cache preempts outside schedule(); the next step lists the
    request in preempted_req_ids AND resumes it."""
    eng = Engine(gemma3())
    eng.add("r", prompt(1000))
    eng.admit("r")
    eng.step({"r": 300})
    eng.preempt("r")
    assert eng.admit("r") == 256  # LMCache keeps what was stored
    t = eng.step({"r": 600})["r"]
    assert t.load == LoadSpec(0, 256) and t.store == StoreSpec(256, 768)
    assert len(t.block_ids[0]) == math.ceil(856 / 128)


def test_preempted_then_finished_while_waiting():
    eng = Engine(llama())
    eng.add("r", prompt(700))
    eng.admit("r")
    eng.step({"r": 300})
    eng.preempt("r")
    eng.step({})
    eng.finish("r")
    out = eng.half.build(step_view(SchedulerOutput.make_empty()))
    assert out.requests == ()
    eng.add("r2", prompt(700, 3))
    eng.admit("r2")
    assert eng.step({"r2": 700})["r2"].store == StoreSpec(0, 512)


def test_one_record_per_request_moves_through_its_phases():
    """The half keeps one record per request (not parallel dicts): it is
    admitting after its lookup, load-pending once vLLM allocated its hit,
    running once scheduled, admitting again when a preempted request is
    looked up again (its stored progress kept), and gone when finished."""
    from lmcache_ascend.integration.vllm.scheduler import RequestPhase

    eng = Engine(llama())
    toks = prompt(1000)
    eng.cache.put(toks, 0, 512)
    eng.add("r", toks)
    ext, _ = eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)
    assert ext == 512 and eng.half.phase("r") is RequestPhase.ADMITTING
    eng.half.update_state_after_alloc("r", ext)
    eng.reqs["r"].num_computed_tokens = ext
    assert eng.half.phase("r") is RequestPhase.LOAD_PENDING
    t = eng.step({"r": 488})["r"]
    assert t.load == LoadSpec(0, 512) and eng.half.phase("r") is RequestPhase.RUNNING
    eng.preempt("r")
    eng.step({})
    assert eng.admit("r") == 768  # the chunk the first step stored is found too
    assert eng.half.phase("r") is RequestPhase.LOAD_PENDING
    eng.finish("r")
    assert eng.half.phase("r") is None


def test_an_illegal_phase_move_is_an_error_naming_the_request():
    """vLLM allocating external tokens for a running request, without a
    lookup, is not a protocol the half knows: it says so, by request."""
    eng = Engine(llama())
    toks = prompt(600)
    eng.cache.put(toks, 0, 256)
    eng.add("r", toks)
    eng.admit("r")
    eng.step({"r": 344})
    with pytest.raises(RuntimeError, match="request r: running -> load_pending"):
        eng.half.update_state_after_alloc("r", 256)
