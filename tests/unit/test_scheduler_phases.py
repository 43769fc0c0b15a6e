"""The scheduler half keeps one record per request with an explicit phase
and its legal moves (integration/vllm/scheduler.py, RequestPhase), driven
the way vLLM's scheduler drives a connector (support/scheduler_driver.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="driven through vLLM's real scheduler types")

from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec
from lmcache_ascend.integration.vllm.vllm_keys import request_view

from scheduler_driver import Engine, llama, prompt  # noqa: E402


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
