"""SchedulerHalf driven the way vLLM's scheduler drives a connector
(support/scheduler_driver.py): lookups, loads, stores, per-group block
tracking, preemption."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="driven through vLLM's real scheduler types")

from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec, StoreSpec
from lmcache_ascend.integration.vllm.vllm_keys import request_view
from lmcache_ascend.integration.vllm.vllm_step_view import step_view
from lmcache_ascend.planning.groups import NULL_BLOCK_ID

from scheduler_driver import (  # noqa: E402
    CHUNK, LAYOUTS, STATE, Engine, gemma3, llama, mixed_5, mixed_11, prefill, prompt,
)

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
    # Nor stored: chunks without the state behind them could never be loaded.
    steps = prefill(eng, "r", 2048)
    assert all("r" not in step for step in steps), steps
    assert eng.half.phase("r") is None


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

