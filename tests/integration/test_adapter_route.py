"""vLLM's own ``LMCacheConnectorV1`` on the CPU, through the adapter shim.

Without lmcache-ascend, LMCache 0.5.6's adapter stops at startup on this
platform (``No supported cpu connector found``; see
tests/unit/test_adapter_shim.py). With it installed, vLLM's plugin loading
runs the package's plugin in every vLLM process, which installs the patches
(``adapter_route.install``), and the shim gives LMCache's engine our chunk
path. Each run is compared with a run without a connector.
"""

from __future__ import annotations

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

from engine_checks import CHUNK, assert_same

pytestmark = pytest.mark.engine

ANNOUNCE = "LMCache has no vLLM connector for device 'cpu'"


def _phases(prompt: list[int], other: list[int]) -> list[Phase]:
    return [
        Phase("cold", [prompt], sequential=True),
        Phase("warm", [prompt], reset_prefix_cache=True, sequential=True),
        # Shares the first two chunks, then diverges.
        Phase("shared", [prompt[: 2 * CHUNK] + other], reset_prefix_cache=True, sequential=True),
        # LMCache's adapter leaves cache_salt out of its keys: the route must
        # neither serve a salted request the unsalted prompt's KV nor store it.
        Phase("salted", [prompt], reset_prefix_cache=True, sequential=True, salts=["tenant-1"]),
        Phase("salted_again", [prompt], reset_prefix_cache=True, sequential=True, salts=["tenant-1"]),
    ]


@pytest.mark.parametrize(
    "model_name, env",
    [
        # vLLM's multiprocess engine core, as users run it (test engines
        # default to in-process: tests/support/faults.py).
        pytest.param("llama", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, marks=pytest.mark.compat("torch", "lmcache", "lmcache_connector_v1", "kv_layout_source")),
        # Gemma-3 has six KV cache groups under vLLM's hybrid manager; this
        # connector is not SupportsHMA, so vLLM turns the manager off and
        # hands over one group. Engine core in-process this time.
        ("gemma3", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    ],
)
def test_lmcache_connector_v1_hits_and_matches_no_connector(run_engine, tiny_model, model_name, env):
    model = tiny_model(model_name)
    prompt = token_prompt(3 * CHUNK + 60, seed=41)
    phases = _phases(prompt, token_prompt(90, seed=42))
    got, log = run_engine(Scenario(model=model, phases=phases, connector="lmcache", env=env))
    ref, _ = run_engine(Scenario(model=model, phases=phases, connector="none", env=env))
    for g, r in zip(got, ref):
        assert_same(g, r, g.name)
    cold, warm, shared, salted, salted_again = (p.completions[0] for p in got)
    assert salted.num_cached_tokens == 0 and salted_again.num_cached_tokens == 0
    assert "neither looked up nor stored by" in log and "'cache_salt'" in log
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 3 * CHUNK  # every whole chunk
    assert shared.num_cached_tokens == 2 * CHUNK
    # LMCache's adapter drove it, our chunk path moved the bytes.
    assert ANNOUNCE in log
    assert "lmcache-ascend adapter plan" in log
    assert f"Retrieved {3 * CHUNK} out of {3 * CHUNK} required tokens" in log
    assert "not loaded" not in log and "storing request" not in log
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # vLLM 0.32's LMCacheConnectorV1 never closes LMCache's engine, whose
        # non-daemon thread would keep this process alive; the shim closes it.
        assert "LMCacheEngine instance vllm-instance destroyed" in log
