"""Lookups beside vLLM's step (``ascend_async_lookup``,
integration/vllm/lookup_ahead.py): the scheduler half answers None ("ask
again next step") while a request's lookup runs on the lookup thread, then
admits it with what a lookup inside the step would have found.

Driven through vLLM's real request types (support/scheduler_driver.py); the
reference of every hit is the same half without the thread.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm", reason="driven through vLLM's real request types")

from lmcache_ascend.integration.vllm.lookup_ahead import IDLE_WAIT_S, WAIT_IN_STEP_S, LookupAhead
from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.vllm_keys import request_view

from scheduler_driver import CHUNK, Engine, llama, prefill, prompt  # noqa: E402


class GatedLookup:
    """The fake LMCache's lookup, held until ``gate`` opens; records the
    thread each lookup ran on."""

    def __init__(self, lookup) -> None:
        self._lookup = lookup
        self.gate = threading.Event()
        self.started = threading.Event()
        self.threads: list[str] = []
        self.raise_next = False

    def __call__(self, token_ids, req_id):
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.raise_next:
            self.raise_next = False
            raise ConnectionError("lookup server gone")
        return self._lookup(token_ids, req_id)


@pytest.fixture
def ahead():
    thread = LookupAhead()
    yield thread
    thread.close()


def engines(ahead):
    """The same stored chunks behind a half with the lookup thread and a
    half without it (the reference)."""
    eng, ref = Engine(llama()), Engine(llama())
    gated = GatedLookup(eng.cache.lookup)
    eng.half = SchedulerHalf(eng.groups, CHUNK, gated, ahead=ahead)
    return eng, ref, gated


def drain(ahead) -> None:
    """Returns once every lookup submitted so far has ended (jobs run in order)."""
    ahead.submit(lambda: None).result(timeout=30)


def ask(eng, req_id: str, local: int = 0):
    return eng.half.get_num_new_matched_tokens(request_view(eng.reqs[req_id]), local)


def test_lookup_thread_runs_jobs_in_order_and_hands_back_errors(ahead):
    seen = []
    futs = [ahead.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [f.result(timeout=10) for f in futs] == list(range(5))
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"lmcache-ascend-lookup"}
    failing = ahead.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    ahead.close()
    with pytest.raises(RuntimeError, match="closed"):
        ahead.submit(lambda: 0)


@pytest.mark.parametrize("local", [0, CHUNK])
def test_not_yet_while_the_lookup_runs_then_the_hit_a_step_lookup_finds(ahead, local):
    eng, ref, gated = engines(ahead)
    toks = prompt(1000)
    for e in (eng, ref):
        e.cache.put(toks, 0, 768)
        e.add("r", toks)
    assert ask(eng, "r", local) == (None, False)  # the gate holds the lookup
    assert ask(eng, "r", local) == (None, False)  # asked again next step: still running
    assert gated.started.wait(30)
    assert gated.threads == ["lmcache-ascend-lookup"]  # one lookup, on the lookup thread
    gated.gate.set()
    drain(ahead)
    ext, is_async = ask(eng, "r", local)
    assert (ext, is_async) == ref.half.get_num_new_matched_tokens(request_view(ref.reqs["r"]), local)
    assert ext == 768 - local
    assert len(gated.threads) == 1  # the answer came from that one lookup
    stats = eng.half.take_stats()
    assert stats["lookup_requests"] == 1 and stats["hit_tokens"] == 768
    # From here on the request runs as a synchronous hit does: the load of
    # the hit, the stores after it.
    eng.half.update_state_after_alloc("r", ext)
    eng.reqs["r"].num_computed_tokens = eng.hit["r"] = 768
    steps = prefill(eng, "r", 2048)
    assert steps[0]["r"].load.hit_tokens == 768 and steps[0]["r"].load.skip_tokens == local


def test_other_requests_are_answered_while_one_lookup_runs(ahead):
    """One thread, lookups in order: a request behind a running lookup also
    waits, then both are admitted with their own hits."""
    eng, _, gated = engines(ahead)
    a, b = prompt(1000, seed=1), prompt(900, seed=2)
    eng.cache.put(a, 0, 768)
    eng.cache.put(b, 0, 512)
    eng.add("a", a)
    eng.add("b", b)
    assert ask(eng, "a") == (None, False)
    assert ask(eng, "b") == (None, False)
    gated.gate.set()
    drain(ahead)
    assert ask(eng, "a") == (768, False)
    assert ask(eng, "b") == (512, False)


def test_a_request_gone_before_its_lookup_ends_has_its_pins_dropped(ahead):
    eng, _, gated = engines(ahead)
    toks = prompt(1000)
    eng.cache.put(toks, 0, 768)
    eng.add("r", toks)
    assert ask(eng, "r") == (None, False)
    eng.half.request_finished("r")  # aborted while waiting for its lookup
    assert eng.half.phase("r") is None
    gated.gate.set()
    drain(ahead)
    step = eng.step({})
    # The lookup pinned what it staged under the request's id; nothing will
    # load it, so the next step ships the unpin.
    assert "r" in eng.last_transfers.unpin_lookup_ids, eng.last_transfers
    assert step == {}
    assert eng.half.take_stats()["abandoned_transfers"] == 1


def _looked_up(ahead):
    """An engine whose request "r" (1000 tokens, 768 stored) asked once (None:
    its lookup runs on the thread) and whose lookup has since ended."""
    eng, _, gated = engines(ahead)
    toks = prompt(1000)
    eng.cache.put(toks, 0, 768)
    eng.add("r", toks)
    assert ask(eng, "r") == (None, False)
    gated.gate.set()
    drain(ahead)
    return eng


def test_a_request_served_to_its_end_is_not_counted_abandoned(ahead):
    eng = _looked_up(ahead)
    assert eng.admit("r") == 768
    assert eng.step({"r": 1000 - 768})["r"].load is not None
    eng.finish("r")
    eng.step({})
    assert eng.half.take_stats().get("abandoned_transfers", 0) == 0


def test_a_request_gone_between_its_promised_hit_and_its_load_is_counted_and_unpinned(ahead):
    eng = _looked_up(ahead)
    assert eng.admit("r") == 768  # vLLM allocated the blocks for the hit
    eng.finish("r")  # and the request was aborted before the step that loads it
    assert eng.step({}) == {}
    # The worker drops a finished request's own pins (finished_req_ids).
    assert "r" in eng.last_transfers.finished_req_ids, eng.last_transfers
    assert eng.half.take_stats()["abandoned_transfers"] == 1


def test_a_lookup_that_raises_is_a_miss_counted_as_a_failure(ahead):
    eng, _, gated = engines(ahead)
    toks = prompt(1000)
    eng.cache.put(toks, 0, 768)
    eng.add("r", toks)
    gated.raise_next = True
    assert ask(eng, "r") == (None, False)
    gated.gate.set()
    drain(ahead)
    assert ask(eng, "r") == (0, False)
    assert eng.half.take_stats()["lookup_failures"] == 1


class RecordingAhead(LookupAhead):
    """The lookup thread, recording how long the half waited on each
    lookup's result inside a step."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list = []

    def submit(self, job):
        fut = super().submit(job)
        real, waits = fut.result, self.waits

        def result(timeout=None):
            waits.append(timeout)
            return real(timeout)

        fut.result = result
        return fut


def test_a_long_wait_once_per_step_only_while_nothing_computes():
    """An engine that computes nothing waits longer inside a step for a
    lookup (it spins through fewer empty steps, which take the GIL and a core
    from the lookup's reads); with any request computing, the short wait."""
    ahead = RecordingAhead()
    try:
        eng, ref, gated = engines(ahead)
        toks = {rid: prompt(1000, seed=i) for i, rid in enumerate("abc")}
        for rid, t in toks.items():
            eng.cache.put(t, 0, 768)
            ref.cache.put(t, 0, 768)
            eng.add(rid, t)
            ref.add(rid, t)
        # No step yet: nothing runs. One long wait in the step, then short ones.
        assert ask(eng, "a") == (None, False)
        assert ask(eng, "b") == (None, False)
        assert ahead.waits == [IDLE_WAIT_S, WAIT_IN_STEP_S]
        eng.step({})  # a step that computed nothing
        assert ask(eng, "a") == (None, False)
        assert ahead.waits[-1] == IDLE_WAIT_S
        eng.step({"c": 256})  # another request computes (a prefill, a decode)
        assert ask(eng, "a") == (None, False)
        assert ahead.waits[-1] == WAIT_IN_STEP_S
        gated.gate.set()
        drain(ahead)
        eng.step({})
        before = len(ahead.waits)
        expect = ref.half.get_num_new_matched_tokens(request_view(ref.reqs["a"]), 0)
        assert ask(eng, "a") == expect == (768, False)
        assert ahead.waits[before:] == [0]  # a finished lookup is taken without waiting
    finally:
        ahead.close()


def test_close_stops_the_thread_before_the_lookup_client():
    order = []

    class Client:
        def __call__(self, token_ids, req_id):
            return 0

        def close(self):
            order.append(("client", thread._thread.is_alive()))

    thread = LookupAhead()
    half = SchedulerHalf(tuple(llama()), CHUNK, Client(), ahead=thread)
    half.close()
    assert order == [("client", False)]
