"""Lookups beside vLLM's step (``ascend_async_lookup``), in a real engine:
a slow lookup holds only its own request, never the requests already
decoding (issue 36).

The engine runs the connector with the scheduler's third lookup held 5 s on
the lookup thread (support/faults.py, ``LMCA_FAULT_LOOKUP_DELAY``), as a
large remote fetch would hold it. Phase "store" stores prompt P; phase
"mixed" submits D (a fresh prompt) and P together. D's lookup answers at
once; P's is the held one. Inside the step (the old behaviour) every request
waited those 5 s and D's prefill ran in P's batch; beside it, D prefills and
decodes while P waits, and P is then admitted with its whole hit.
"""

from __future__ import annotations

import pytest

from engine_checks import CHUNK, assert_same
from faults import faulty_transfer_config
from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

from .conftest import run_engine_in, run_reference_in

pytestmark = pytest.mark.engine

HOLD_S = 5
TOKENS = 24


@pytest.mark.compat("connector_hooks")  # 0.23-0.30 skip a None answer (skipped_waiting), 0.32 defers it
def test_a_held_lookup_holds_only_its_own_request(tmp_path, tiny_model):
    model = tiny_model("llama")
    p = token_prompt(3 * CHUNK + 60, seed=71)
    d = token_prompt(200, seed=72)
    phases = [Phase("store", [p], sequential=True),
              Phase("mixed", [d, p], max_tokens=TOKENS, reset_prefix_cache=True)]
    ref, _ = run_reference_in(tmp_path, Scenario(model=model, phases=phases, connector="none"))
    steps: list = []
    env = {"LMCACHE_ASCEND_ASYNC_LOOKUP": "on", "LMCA_FAULT_LOOKUP_DELAY": f"3:{HOLD_S}"}
    got, log = run_engine_in(tmp_path, Scenario(model=model, phases=phases, connector="none", env=env,
                                                engine_kwargs={"kv_transfer_config": faulty_transfer_config()}),
                             schedule=steps)
    assert "lookups run beside vLLM's step (ascend_async_lookup=on)" in log
    held = [line for line in log.splitlines() if "held" in line and "lmcache-ascend-lookup" in line]
    assert len(held) == 1, held  # the third lookup, P's in "mixed", on the lookup thread
    for g, r in zip(got, ref, strict=True):
        assert_same(g, r, g.name)
    _, mixed = got
    assert mixed.completions[1].num_cached_tokens == 3 * CHUNK  # P: its whole hit, once its lookup ended
    assert mixed.completions[0].num_cached_tokens == 0
    # vLLM's request numbers: 0 = P stored, 1 = D, 2 = P again.
    first_p = next(i for i, s in enumerate(steps) if any(r == "2" for r, _, _ in s.batch))
    d_before = [s for s in steps[:first_p] if any(r == "1" for r, _, _ in s.batch)]
    d_all = [s for s in steps if any(r == "1" for r, _, _ in s.batch)]
    assert len(d_all) >= TOKENS - 1  # its prefill, then a step per further token
    assert len(d_before) == len(d_all), (
        f"D ran {len(d_before)} of its {len(d_all)} steps before P's first: the held lookup held D too; "
        f"first steps: {[s.batch for s in steps[:3]]}")
