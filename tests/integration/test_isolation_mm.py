"""A multimodal request is served cached KV only where vLLM's own prefix
cache would serve it: every position of an image's placeholder range is
keyed by the image's content hash (planning/isolation.py,
integration/vllm/vllm_keys.py), so the same text with another image hits
only up to the last whole chunk before the image, the same image hits past
it.

One engine with the connector resets vLLM's prefix cache before every phase
after the first, so whatever it is served comes from LMCache; one engine
without any connector never resets, so whatever it is served comes from
vLLM's own prefix cache. Phase by phase both must be served the same number
of cached tokens and give the same tokens and logprobs at tolerance 0 (their
forward steps are checked equal first, so the computations are the same). A
connector keyed by token ids alone serves image 2's request image 1's KV:
every placeholder id is the same whatever the image.

The model is a tiny random-weight Idefics3 (tiny_models.build_tiny_vlm):
vLLM expands the prompt's one image token into an item of
``VLM_ITEM_TOKENS`` positions, after ``TEXT_BEFORE`` text tokens.
"""

from __future__ import annotations

import re

import pytest

import sched_trace
from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.plan_file import plan_env, read_plan
from lmcache_ascend.cli.tiny_models import VLM_IMAGE_TOKEN_ID, VLM_ITEM_TOKENS, build_tiny_vlm, token_prompt

from .conftest import MODEL_CACHE, run_engine_in, run_reference_in

pytestmark = pytest.mark.engine

# Three whole 128-token blocks and a part of one before the image, then the
# image's item, then text: 424 + 19 + 260 = 703 prompt tokens.
TEXT_BEFORE = 424
P = token_prompt(TEXT_BEFORE, seed=21) + [VLM_IMAGE_TOKEN_ID] + token_prompt(260, seed=22)
PROMPT_TOKENS = len(P) - 1 + VLM_ITEM_TOKENS  # after vLLM expands the image token
# The engine core in the test's process: the phases' steps do not follow
# process timing (every engine of a comparison runs the same steps).
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE = dict(max_model_len=1024, logprobs=1)

# (phase, image seed, what vLLM's own cache serves: "before" the image's
# chunk or "all" whole chunks but the last token's)
SCRIPT = [
    ("img1_cold", 1, None),
    ("img2", 2, "before"),  # same text, another image: nothing past the image
    ("img1_again", 1, "all"),
    ("img2_again", 2, "all"),
]


def _phases(reset: bool) -> list[Phase]:
    return [
        Phase(name, [P], max_tokens=4, sequential=True, reset_prefix_cache=reset and i > 0, images=[[seed]])
        for i, (name, seed, _) in enumerate(SCRIPT)
    ]


def test_images_hit_exactly_where_vllm_hits(tmp_path):
    model = str(build_tiny_vlm(cache_dir=MODEL_CACHE))
    kw = dict(model=model, env=ENV, **ENGINE)
    ref_steps, steps = [], []
    ref, _ = run_reference_in(tmp_path, Scenario(phases=_phases(reset=False), connector="none", **kw),
                              schedule=ref_steps)
    plan_file = tmp_path / "plan.json"
    conn_kw = dict(kw, env={**ENV, **plan_env(plan_file)})
    got, log = run_engine_in(tmp_path, Scenario(phases=_phases(reset=True), **conn_kw), schedule=steps)
    # The chunk the connector chose (no chunk_size set: vLLM's block size),
    # read from its plan rather than assumed.
    record = read_plan(plan_file)
    chunk = record["plan"]["chunk_size"]
    blocks = {g["block_size"] for g in record["groups"]}
    assert blocks == {chunk}, (chunk, blocks)
    expect = {None: 0, "before": TEXT_BEFORE // chunk * chunk, "all": (PROMPT_TOKENS - 1) // chunk * chunk}
    # The layout tests something: whole chunks before the image, and more
    # whole chunks past it.
    assert 0 < expect["before"] < expect["all"], (chunk, expect)
    for (name, _, where), g, r in zip(SCRIPT, got, ref, strict=True):
        assert r.completions[0].num_cached_tokens == expect[where], f"{name}: vLLM's own cache served " \
            f"{r.completions[0].num_cached_tokens}, the script expects {expect[where]}"
        assert g.completions[0].num_cached_tokens == expect[where], f"{name}: the connector served " \
            f"{g.completions[0].num_cached_tokens} cached tokens where vLLM's own cache serves {expect[where]}"
    by = {p.name: p.completions[0] for p in got}
    assert by["img2"].num_cached_tokens < by["img1_again"].num_cached_tokens
    # Same hits at the same places: the same forward steps, so the same bits.
    assert sched_trace.first_difference(steps, ref_steps) is None, sched_trace.first_difference(steps, ref_steps)
    for g, r in zip(got, ref):
        assert g.completions[0].tokens == r.completions[0].tokens, g.name
        assert g.completions[0].logprobs == r.completions[0].logprobs, g.name
    # The image changes the outputs: image 2's request served image 1's KV
    # would give image 1's.
    assert by["img2"].logprobs != by["img1_cold"].logprobs
    # Every hit came from LMCache (the connector's own lines, one per
    # request in order; the last request's may come after the engine
    # stopped, so it can be missing).
    loaded = [int(x) for x in re.findall(r"request \S+: hit \d+ tokens \(vLLM had 0\), loaded (\d+) tokens", log)]
    want = [expect[w] for _, _, w in SCRIPT]
    assert len(loaded) >= len(want) - 1 and loaded == want[:len(loaded)], (loaded, want)
