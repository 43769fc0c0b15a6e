"""The scheduler half's one record per request (integration/vllm/scheduler.py:
``_Request``, its ``RequestPhase`` and the table of legal moves): the table
is the one written down here, every legal move is accepted (on the record and
through the half's own entry points), an illegal one is an error naming the
request and both phases, and a finished request leaves nothing behind.

Driven the way vLLM's scheduler drives a connector (support/scheduler_driver.py).
"""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest

pytest.importorskip("vllm", reason="the scheduler half reads vLLM's scheduler types")

from lmcache_ascend.integration.vllm import scheduler as sched_mod
from lmcache_ascend.integration.vllm.lookup_ahead import LookupAhead
from lmcache_ascend.integration.vllm.scheduler import RequestPhase, SchedulerHalf, StateHits
from lmcache_ascend.integration.vllm.vllm_keys import RequestView, request_view

from scheduler_driver import CHUNK, Engine, llama, prompt  # noqa: E402

A, LP, R = RequestPhase.ADMITTING, RequestPhase.LOAD_PENDING, RequestPhase.RUNNING

# Written out again on purpose: a change to the half's table has to be made
# here too, deliberately, rather than slipping through a test that reads the
# table it checks.
EXPECTED_MOVES = {
    A: {A, LP, R},  # asked again before scheduling; allocated a hit; scheduled on a miss
    LP: {R, A},  # its load ships with the step; looked up again before that step
    R: {R, A},  # the next step; preempted and looked up again
}
LEGAL = sorted(((a, b) for a, tos in EXPECTED_MOVES.items() for b in tos), key=lambda m: (m[0].value, m[1].value))
ILLEGAL = [(a, b) for a in RequestPhase for b in RequestPhase if b not in EXPECTED_MOVES.get(a, set())]


def _record(phase: RequestPhase, req_id: str = "req-7"):
    view = RequestView(req_id=req_id, token_ids=(1, 2, 3), num_tokens=3, num_prompt_tokens=3)
    return sched_mod._Request(view, phase=phase)


# ---- the table -------------------------------------------------------------------------


def test_the_table_of_moves_is_the_one_written_down_and_covers_every_phase():
    assert set(sched_mod._MOVES) == set(RequestPhase)
    assert {a: set(tos) for a, tos in sched_mod._MOVES.items()} == EXPECTED_MOVES
    assert ILLEGAL, "a table where every move is legal enforces nothing"


@pytest.mark.parametrize("src,dst", LEGAL, ids=lambda p: p.value)
def test_every_legal_move_is_accepted(src, dst):
    rec = _record(src)
    rec.move(dst)
    assert rec.phase is dst


@pytest.mark.parametrize("src,dst", ILLEGAL, ids=lambda p: p.value)
def test_an_illegal_move_names_the_request_and_both_phases_and_changes_nothing(src, dst):
    rec = _record(src)
    expected = f"request req-7: {src.value} -> {dst.value} is not a legal move"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        rec.move(dst)
    assert rec.phase is src


def test_every_legal_move_is_reached_through_the_halfs_entry_points(monkeypatch):
    """One request walked through every edge of the table by the calls vLLM
    makes, so no legal move is dead weight and none the half makes is
    missing from the table (an unlisted one would raise)."""
    seen: list[tuple[RequestPhase, RequestPhase]] = []
    move = sched_mod._Request.move

    def recording_move(self, to):
        seen.append((self.phase, to))
        move(self, to)

    monkeypatch.setattr(sched_mod._Request, "move", recording_move)
    eng = Engine(llama())
    toks = prompt(1000)
    eng.cache.put(toks, 0, 512)
    req = eng.add("r", toks)
    half = eng.half

    def ask() -> int:
        ext, _ = half.get_num_new_matched_tokens(request_view(req), req.num_computed_tokens)
        assert ext is not None
        return ext

    assert ask() == 512 and half.phase("r") is A
    assert ask() == 512 and half.phase("r") is A  # A -> A: not scheduled, asked again
    half.update_state_after_alloc("r", 512)
    assert half.phase("r") is LP  # A -> LP
    assert ask() == 512 and half.phase("r") is A  # LP -> A
    half.update_state_after_alloc("r", 512)
    req.num_computed_tokens = eng.hit["r"] = 512
    assert eng.step({"r": 256})["r"].load is not None and half.phase("r") is R  # LP -> R
    eng.step({"r": 232})
    assert half.phase("r") is R  # R -> R
    eng.preempt("r")
    eng.step({})
    assert ask() == 768 and half.phase("r") is A  # R -> A, the stored chunk found too
    half.update_state_after_alloc("r", 0)  # vLLM recomputes it instead
    eng.step({"r": 1000})
    assert half.phase("r") is R  # A -> R
    eng.finish("r")
    assert half.phase("r") is None
    assert set(seen) == set(LEGAL)


# ---- forgetting --------------------------------------------------------------------------


def _mentions(obj, req_id: str, path: str, out: list[str], seen: set[int]) -> None:
    """Every place under ``obj`` holding the request's id or one of its
    lookup ids (``<id>#state<n>``). Follows containers and records only: the
    lookup client and the lookup thread are not the half's bookkeeping."""
    if isinstance(obj, str):
        if obj == req_id or obj.startswith(req_id + "#"):
            out.append(path)
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _mentions(k, req_id, f"{path}[key]", out, seen)
            _mentions(v, req_id, f"{path}[{k!r}]", out, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            _mentions(v, req_id, f"{path}[{i}]", out, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _mentions(getattr(obj, f.name), req_id, f"{path}.{f.name}", out, seen)


def traces(half: SchedulerHalf, req_id: str) -> list[str]:
    out: list[str] = []
    seen: set[int] = set()
    for name, value in vars(half).items():
        _mentions(value, req_id, name, out, seen)
    return out


def _admitting(eng: Engine) -> None:
    # Looked up, not allocated: what the lookup staged is pinned under its id.
    eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)


def _load_pending(eng: Engine) -> None:
    eng.admit("r")  # allocated: the load would ship with the next step


def _running(eng: Engine) -> None:
    eng.admit("r")
    eng.step({"r": 344})


def _finished_by_step(eng: Engine) -> None:
    """Listed in finished_req_ids without request_finished (aborted)."""
    eng.admit("r")
    eng.step({"r": 344})
    eng.finished.add("r")


@pytest.mark.parametrize("setup,finish,unpinned", [
    (_admitting, True, ("r",)),  # its staged chunks, never loaded
    # The load held them; the worker drops a finished request's own pins.
    (_load_pending, True, ()),
    (_running, True, ()),  # the load released them
    (_finished_by_step, False, ()),
], ids=["admitting", "load_pending", "running", "finished_req_ids"])
def test_a_finished_request_leaves_nothing_behind(setup, finish, unpinned):
    eng = Engine(llama())
    toks = prompt(1000)
    eng.cache.put(toks, 0, 512)
    eng.add("r", toks)
    eng.add("other", prompt(1000, 3))
    eng.admit("other")
    setup(eng)
    assert traces(eng.half, "r"), "the scan must see a followed request"
    if finish:
        eng.finish("r")
    eng.step({"other": 256})
    # Nor on the worker: what it still had pinned is released with this step.
    assert eng.last_transfers.unpin_lookup_ids == unpinned
    assert eng.half.phase("r") is None
    assert traces(eng.half, "r") == []
    assert list(eng.half._requests) == ["other"]  # the one record per request; the other kept


def test_a_finished_state_probe_leaves_nothing_behind():
    """A Mamba state hit holds pins under its probe's id (``r#state<n>``):
    finishing before the load releases them with the next step."""
    eng = Engine(llama())
    eng.half = SchedulerHalf(eng.groups, CHUNK, lambda toks, lookup_id: len(toks), state=StateHits((0,), 16, (7,)))
    eng.add("r", prompt(1000))
    ext, _ = eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0)
    assert ext == 768
    assert any(p.endswith(".lookup_id") for p in traces(eng.half, "r"))
    eng.finish("r")
    eng.step({})
    assert any(i.startswith("r#state") for i in eng.last_transfers.unpin_lookup_ids)
    assert traces(eng.half, "r") == []


def test_a_request_gone_while_its_lookup_runs_leaves_nothing_behind_once_it_ends():
    ahead = LookupAhead()
    try:
        eng = Engine(llama())
        gate = threading.Event()
        plain = eng.cache.lookup

        def gated(toks, lookup_id):
            assert gate.wait(30), "the test never opened the gate"
            return plain(toks, lookup_id)

        eng.half = SchedulerHalf(eng.groups, CHUNK, gated, ahead=ahead)
        toks = prompt(1000)
        eng.cache.put(toks, 0, 768)
        eng.add("r", toks)
        assert eng.half.get_num_new_matched_tokens(request_view(eng.reqs["r"]), 0) == (None, False)
        eng.finish("r")
        assert eng.half.phase("r") is None
        assert traces(eng.half, "r") == ["_orphans[0][0]"]  # its lookup, still running
        gate.set()
        ahead.submit(lambda: None).result(timeout=30)  # jobs run in order: the lookup has ended
        eng.step({})
        assert "r" in eng.last_transfers.unpin_lookup_ids  # what it staged, released
        assert traces(eng.half, "r") == []
    finally:
        ahead.close()
