"""Exact prefix hits for Mamba/GDN hybrids (Qwen3-Next-style) on a real
vLLM engine, in vLLM's align cache mode (planning/state_align.py).

Two tiny random-weight Qwen3-Next shapes in bf16 (vLLM-CPU's GDN kernels
take nothing else): 4 layers with full attention every 4th, and 6 layers
with full attention every 3rd and a twice larger state. vLLM picks the
hybrid block size B per machine and shape (384, 640, ...): it is read from
the worker's plan record, never assumed, and every prompt is built from it.

What is compared, and how tightly:

* tokens: always equal to an engine without the connector;
* logprobs of a hit against vLLM's own prefix-cache hit on the same prompt:
  EXACTLY equal (tolerance 0). Both resume from the same bytes (KV pages and
  the state vLLM checkpointed, copied verbatim) through the same kernels
  with the same step boundaries (the prefill budget is B, so every step of
  every engine ends on a block boundary), the same batches (the engine core
  runs in the test's process, so a batch is queued whole before its first
  step) and the same thread count (conftest pins vLLM-CPU's reserved
  cores). The steps both engines ran are recorded (support/sitecustomize.py)
  and checked equal before the outputs are: any difference left is a wrong
  byte;
* logprobs against a cold run with other step boundaries: within the bf16
  noise measured in the same test, i.e. the largest difference between two
  engines without the connector that only differ in where vLLM cut the
  prefill into steps (prefix caching off, steps of 200 tokens). vLLM-CPU's
  chunked GDN kernel works in 64-token chunks, so re-cutting on that grid
  (B is a multiple of 128 here) changes no bit; 200 is off it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from lmcache_ascend.cli.engine_run import Phase, PhaseResult, Scenario
from lmcache_ascend.cli.plan_file import plan_env, read_plan
from lmcache_ascend.cli.tiny_models import token_prompt
from lmcache_ascend.compat import vllm_features

import sched_trace
from engine_checks import check_preempted_resumes, worst_common
from faults import MULTIPROCESS

from .conftest import STATE_FACTS, run_engine_in, run_reference_in

SHAPES = ["qwen3_next", "qwen3_next_b"]
# vLLM-CPU 0.26 turns prefix caching off for hybrid models by default (and
# align mode with it), and its GDN kernel rejects a bf16 SSM state ("Input
# tensor dtype mismatch"); 0.32 picks float32 itself on AVX512-BF16 hosts.
ENGINE = {"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"}
# The engine core in the test's process (vLLM's in-process mode): a batch's
# requests are all queued before its first step. With the engine core in
# its own process they arrive one by one and the first step takes those
# that arrived, so the batch shapes, and bf16 bits on AMX, follow timing
# (seen: a connector's lookups delayed the second request by one step).
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
EXACT = 0.0

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        vllm_features().series == (0, 23),
        reason="vLLM-CPU 0.23 cannot run Qwen3-Next (its CPU GDN kernels crash in bf16) and has no "
        "CPU copy of Mamba state blocks, so align mode cannot run there; the connector refuses "
        "state hits on it (tests/unit/test_state_align.py, the 'no replacement' case)",
    ),
]


@dataclass(frozen=True)
class StateModel:
    path: str
    block: int  # B: the Mamba (= attention) block size vLLM picked
    chunk: int
    state: dict  # the plan record's "state" entry


@pytest.fixture(scope="module")
def state_model(tiny_model, tmp_path_factory):
    """name -> StateModel, read from the plan the worker writes at startup."""
    found: dict[str, StateModel] = {}

    def get(name: str) -> StateModel:
        if name not in found:
            path = tiny_model(name)
            work = tmp_path_factory.mktemp(f"facts-{name}")
            run(Scenario(model=path, phases=[], dtype="bfloat16", engine_kwargs=ENGINE,
                         env={**ENV, **plan_env(work / "plan.json")}), work)
            record = read_plan(work / "plan.json")
            state = record["state"]
            assert state is not None and state["enabled"], state
            # The startup plan (what `lmcache-ascend explain` prints) shows
            # the state bytes per chunk boundary.
            assert f"state bytes per chunk boundary {state['snapshot_bytes']}" in record["text"], record["text"]
            found[name] = StateModel(path, state["block_size"], record["plan"]["chunk_size"], state)
        return found[name]

    return get


def run(scenario: Scenario, work, expect_ok: bool = True, schedule: list | None = None
        ) -> tuple[list[PhaseResult], str]:
    """One engine in a fresh process (conftest's run_engine, usable from the
    module-scoped fixture). An engine without the connector is a reference:
    where vLLM itself fails on this machine, the test is skipped naming
    vLLM's error."""
    if scenario.connector == "none":
        return run_reference_in(work, scenario, schedule=schedule)
    return run_engine_in(work, scenario, expect_ok=expect_ok, schedule=schedule)


def same_steps(got: list, ref: list, what: str) -> None:
    """Tolerance 0 holds only where both engines ran the same forward steps
    (bf16 kernels give other bits for another batch shape or thread split,
    on AMX more than on AVX-512): check that, rather than assume it."""
    diff = sched_trace.first_difference(got, ref)
    assert diff is None, f"{what}: the engines did not run the same steps, so outputs cannot be compared exactly: {diff}"


def worst(got, ref) -> float:
    assert len(got.logprobs) == len(ref.logprobs)
    return max((abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)), default=0.0)


def same_tokens(got: PhaseResult, ref: PhaseResult) -> None:
    for i, (g, r) in enumerate(zip(got.completions, ref.completions, strict=True)):
        assert g.tokens == r.tokens, f"{got.name}[{i}]: tokens {g.tokens} != {r.tokens}"


def close(got: PhaseResult, ref: PhaseResult, tol: float, what: str) -> float:
    same_tokens(got, ref)
    diffs = [worst(g, r) for g, r in zip(got.completions, ref.completions)]
    assert max(diffs) <= tol, f"{what} {got.name}: logprobs differ by {diffs} (tolerance {tol})"
    return max(diffs)


def summaries(log: str) -> dict[int, tuple[int, int, str, str]]:
    """Request number -> (hit, loaded, state loaded, state stored) from the
    worker's per-request lines."""
    out = {}
    pat = re.compile(
        r"lmcache-ascend: request (\d+)-\S+: hit (\d+) tokens \(vLLM had \d+\), loaded (\d+) tokens.*?"
        r"Mamba state \(\d+ bytes each\): loaded (at \d+|none), stored at (\[[\d, ]*\]|none)"
    )
    for m in pat.finditer(log):
        out[int(m.group(1))] = (int(m.group(2)), int(m.group(3)), m.group(4), m.group(5))
    return out


def prompts(b: int) -> dict[str, list[int]]:
    a = token_prompt(3 * b + 48, seed=1)  # three whole chunks, then 48 tokens
    return {
        "A": a,
        "X": a[: 2 * b + 100] + token_prompt(b, seed=2),  # shares 2 chunks + 100 tokens
        "Y": a[: b + 50] + token_prompt(b + 10, seed=3),  # shares 1 chunk + 50 tokens
        "C": token_prompt(2 * b + 30, seed=4),
        "SHORT": token_prompt(100, seed=5),
    }


# vLLM-CPU 0.26 computes a fresh short request batched with prefix-hit
# prefills differently from the same request alone, with no connector at all
# (the SHORT prompt below: every token differs, logprobs by 1.06; the same in
# each of 5 runs, also on a fresh engine serving only the batch; 0.32 does
# not). So on 0.26 the batch leaves SHORT out and is held to the measured
# bf16 noise instead of exactness.
VLLM_026_BATCH = vllm_features().series == (0, 26)


# The compatibility stacks run the first shape only: the second (another B,
# another state size) exercises the same code and took 3 minutes more on
# vLLM 0.26, the longest stack of the CI run.
@pytest.mark.parametrize("shape", [pytest.param(SHAPES[0], marks=STATE_FACTS), SHAPES[1]])
def test_state_hits_equal_vllms_own_prefix_cache_hits(state_model, tmp_path, shape):
    m = state_model(shape)
    b = m.block
    assert m.chunk == b  # the default chunk: vLLM's block granularity
    p = prompts(b)
    # The concurrent batch holds only prompts that hit exactly as much from
    # LMCache as from vLLM's own cache (A and X: 3B; C and SHORT: nothing),
    # so both engines batch the same steps. Y hits B from LMCache but
    # nothing from vLLM's own cache (vLLM keeps the state of a prompt's last
    # block only), which would change every step it shares with the others:
    # it runs alone ("partial").
    batch = [p["A"], p["X"], p["C"]] + ([] if VLLM_026_BATCH else [p["SHORT"]])
    # Budget B: every prefill step ends on a block boundary, so the
    # connector stores a state at each chunk boundary (B, 2B, 3B of A).
    kw = dict(model=m.path, dtype="bfloat16", engine_kwargs={**ENGINE, "max_num_batched_tokens": b}, env=ENV)

    def phases(reset: bool) -> list[Phase]:
        return [
            Phase("cold", [p["A"]], sequential=True),
            Phase("warm", [p["A"]], reset_prefix_cache=reset, sequential=True),
            # vLLM's own cache now hits the state block the load wrote (vLLM
            # registered it under A's hash before the load): it must hold
            # the state at 3B, not whatever the block held before.
            Phase("warm_local", [p["A"]], sequential=True),
            Phase("shared", [p["X"]], reset_prefix_cache=reset, sequential=True),
            Phase("partial", [p["Y"]], reset_prefix_cache=reset, sequential=True),
            Phase("batch", batch, reset_prefix_cache=reset),
        ]

    # With the connector vLLM's own cache is reset before each phase, so a
    # hit can only come from LMCache; without it, the same prompts hit
    # vLLM's own prefix cache (the reference for a hit). The reference runs
    # first: it is also the control for a failure of vLLM's own kernels.
    steps, ref_steps = [], []
    ref, _ = run(Scenario(phases=phases(False), connector="none", **kw), tmp_path, schedule=ref_steps)
    got, log = run(Scenario(phases=phases(True), **kw), tmp_path, schedule=steps)
    # Cold runs cut into other steps (prefix caching off, 200-token steps):
    # the bf16 noise of where vLLM cuts a prefill.
    other = [Phase(n, [p[n]], sequential=True) for n in ("A", "X")]
    noise_runs, _ = run(
        Scenario(model=m.path, dtype="bfloat16", phases=other, connector="none", env=ENV,
                 engine_kwargs={"enable_prefix_caching": False, "mamba_ssm_cache_dtype": "float32",
                                "max_num_batched_tokens": 200}),
        tmp_path,
    )
    by = {r.name: r.completions[0] for r in noise_runs}
    noise = max(worst_common(by["A"], ref[0].completions[0]), worst_common(by["X"], ref[3].completions[0]))

    g = {r.name: r for r in got}
    r = {x.name: x for x in ref}
    cached = {n: [c.num_cached_tokens for c in x.completions] for n, x in g.items()}
    ref_cached = {n: [c.num_cached_tokens for c in x.completions] for n, x in r.items()}
    print(f"\n{shape}: B={b} state={m.state} cached={cached} vLLM's own={ref_cached} noise={noise}")

    # Hits cover every whole chunk that has a stored state.
    assert cached["cold"] == [0]
    assert cached["warm"] == [3 * b]  # A: 3 whole chunks (the 4th is partial)
    assert ref_cached["warm"] == [3 * b]  # ... exactly vLLM's own hit
    assert cached["warm_local"] == [3 * b]  # vLLM's own hit on the loaded block
    assert cached["shared"] == [2 * b]  # X shares A's chunks up to 2B + 100
    assert cached["partial"] == [b]  # Y shares A up to B + 50
    # Batch: A; X (its own chunk and state at 3B were stored by its step
    # [2B, 3B) in "shared"); C never seen; SHORT has no whole chunk. The
    # same as vLLM's own hits, so the same steps.
    assert cached["batch"] == [3 * b, 3 * b, 0, 0][: len(batch)]
    assert ref_cached["batch"] == cached["batch"]

    # Request numbers in submission order: cold 0, warm 1, warm_local 2,
    # shared 3, partial 4, then the batch.
    first = {"cold": 0, "warm": 1, "warm_local": 2, "shared": 3, "partial": 4, "batch": 5}
    for name in ("cold", "warm", "warm_local", "batch"):
        reqs = range(first[name], first[name] + len(g[name].completions))
        same_steps(sched_trace.of_requests(steps, reqs), sched_trace.of_requests(ref_steps, reqs), name)
    # Where LMCache hit more than vLLM's cache, the steps from the hit on.
    for name, hit in (("shared", 2 * b), ("partial", b)):
        reqs = range(first[name], first[name] + 1)
        same_steps(sched_trace.of_requests(steps, reqs, hit), sched_trace.of_requests(ref_steps, reqs, hit), name)

    # Exact against vLLM's own hit: the same bytes through the same steps
    # (checked above) on the same threads.
    close(g["warm"], r["warm"], EXACT, "LMCache hit vs vLLM's own hit")
    close(g["warm"], g["cold"], EXACT, "LMCache hit vs cold, same step boundaries")
    close(g["warm_local"], r["warm"], EXACT, "vLLM's own hit on the block the load wrote")
    close(g["shared"], r["shared"], EXACT, "shared prefix vs no connector")
    close(g["partial"], r["partial"], EXACT, "one-chunk prefix vs no connector")
    close(g["batch"], r["batch"], noise if VLLM_026_BATCH else EXACT, "concurrent batch vs no connector")
    # And no further from a cold run cut into other steps than vLLM's own
    # cold run is (the measured bf16 noise).
    assert worst_common(g["warm"].completions[0], by["A"]) <= noise
    assert worst_common(g["shared"].completions[0], by["X"]) <= noise

    # The worker's own account: states stored at every boundary A's steps
    # ended on, loaded with each hit.
    s = summaries(log)
    assert s[0] == (0, 0, "none", f"[{b}, {2 * b}, {3 * b}]"), s[0]
    assert s[1][:3] == (3 * b, 3 * b, f"at {3 * b}"), s[1]
    assert s[3][:3] == (2 * b, 2 * b, f"at {2 * b}"), s[3]
    assert s[4][:3] == (b, b, f"at {b}"), s[4]
    assert "hits are refused" not in log


@pytest.mark.redis
def test_state_hits_under_preemption(state_model, tmp_path):
    """(Primary stack only, as the Gemma-3 and MLA preemption tests in
    test_engine_modes: three engines each.) Decodes grow four requests past
    a KV cache of 13 blocks: vLLM preempts some, and each resumes with a
    state hit the connector stored while it decoded (state and KV at B),
    with Redis beside LMCache's CPU cache taking the puts beside the steps.

    The reference is an engine without the connector given the scheduler
    watermark the connector sets (its admission headroom for state hits,
    vllm_engine_config.keep_admission_blocks_free), so both admit and
    preempt alike until a resume: there the connector loads the state at B,
    where vLLM recomputes the whole request (and a state computed by
    decodes is not bit-equal to one a prefill recomputes). What must hold:
    engine_checks.check_preempted_resumes; each hit loads KV and state from
    one boundary."""
    from redis_server import RedisServer, ensure_redis_server

    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    m = state_model("qwen3_next")
    b = m.block
    batch = [token_prompt(b - 4, seed=40 + i) for i in range(4)]
    phases = [Phase("batch", batch, max_tokens=2 * b)]
    engine = {**ENGINE, "max_num_batched_tokens": b, "num_gpu_blocks_override": 13, "max_num_seqs": 4}
    kw = dict(model=m.path, dtype="bfloat16", max_model_len=3 * b)
    steps, ref_steps = [], []
    with RedisServer(tmp_path) as redis:
        # Lookups answered in the step: on a thread (the default with a
        # remote store) a late answer makes a request wait a step, and the
        # engines would admit by timing, not alike.
        env = {**ENV, "LMCACHE_REMOTE_URL": redis.url, "LMCACHE_REMOTE_SERDE": "naive",
               "LMCACHE_LOCAL_CPU": "True", "LMCACHE_LOOKUP_TIMEOUT_MS": "10000", "LMCACHE_ASCEND_ASYNC_LOOKUP": "off"}
        got, log = run(Scenario(phases=phases, engine_kwargs=engine, env=env, **kw), tmp_path, schedule=steps)
        with redis.client() as c:
            in_redis = c.dbsize()
    found = re.search(r"scheduler watermark \S+ -> (\S+)", log)
    assert found, "the connector set no scheduler watermark"
    ref, _ = run(Scenario(connector="none", phases=phases, engine_kwargs={**engine, "watermark": float(found[1])},
                          env=ENV, **kw), tmp_path, schedule=ref_steps)
    roomy = {k: v for k, v in engine.items() if k != "num_gpu_blocks_override"}
    free, _ = run(Scenario(connector="none", phases=phases, engine_kwargs=roomy, env=ENV, **kw), tmp_path)

    s = summaries(log)
    resumed = {i for i, (_, loaded, _, _) in s.items() if loaded > 0}
    assert all(s[i][2] == f"at {s[i][0]}" for i in resumed), s  # KV and state from one boundary
    # The same preemptions: the reference had the connector's watermark.
    assert got[0].preemptions == ref[0].preemptions, (got[0].preemptions, ref[0].preemptions)
    check_preempted_resumes(batch, got[0], ref[0], free[0], steps, ref_steps, log, resumed, f"B={b}")
    assert in_redis >= 2, "nothing reached Redis"
    assert "hits are refused" not in log


@pytest.mark.compat("lmcache_connector_v1")
def test_adapter_route_does_not_apply_to_state_models(state_model, tmp_path):
    """vLLM's own LMCacheConnectorV1 is not SupportsHMA, so vLLM turns its
    hybrid KV cache manager off, and a Mamba hybrid cannot start without it:
    vLLM stops at startup, before any request (no output can be wrong).
    The dynamic connector is the route for these models."""
    m = state_model("qwen3_next")
    sc = Scenario(model=m.path, dtype="bfloat16", phases=[Phase("cold", [token_prompt(100, seed=1)])],
                  connector="lmcache", engine_kwargs=ENGINE, env=ENV)
    _, log = run(sc, tmp_path, expect_ok=False)
    assert not list(tmp_path.glob("out*.json")), "the adapter route served requests on a Mamba hybrid"
    assert "Turning off hybrid kv cache manager" in log or "hybrid kv cache manager" in log.lower()
    # vLLM 0.32 / 0.26 word the same refusal differently.
    assert ("Failed to promote local KV cache specs to one unified type" in log
            or "failed to convert the KV cache specs to one unified type" in log), log[-3000:]


@STATE_FACTS
def test_every_prompt_length_hits_its_last_boundary_in_vllms_engine_core_process(state_model, tmp_path):
    """Issue 39: vLLM's default process layout (the engine core in its own
    process, as with ``vllm serve``), vLLM's default budget, prompts whose
    tail past the last block boundary is 1 token, longer than 128 tokens,
    and B-1 tokens. vLLM-CPU's engine core resets the scheduler's block size
    to 128 after startup (align_repair.py); before the repair, the longer
    tails ended no step at a boundary and nothing hit. Each prompt must hit
    its last boundary, from LMCache as from vLLM's own prefix cache, and the
    two hits must give the same outputs exactly (one request at a time, the
    same steps: checked)."""
    m = state_model(SHAPES[0])
    b = m.block
    tails = [1, 128 + b // 4, b - 1]
    lengths = [b + tails[0], 2 * b + tails[1], 2 * b + tails[2]]
    ps = [token_prompt(n, seed=60 + i) for i, n in enumerate(lengths)]
    last = [(n - 1) // b * b for n in lengths]
    steps: list = []
    got, log = run(
        Scenario(model=m.path, dtype="bfloat16", engine_kwargs=ENGINE, env=MULTIPROCESS, phases=[
            Phase("cold", ps, sequential=True),
            # vLLM's own cache emptied: hits come from LMCache only.
            Phase("lmcache", ps, reset_prefix_cache=True, sequential=True),
            # Not emptied: vLLM's own prefix cache hits (the reference).
            Phase("vllm", ps, sequential=True),
        ]),
        tmp_path, schedule=steps,
    )
    g = {r.name: r for r in got}
    cached = {n: [c.num_cached_tokens for c in r.completions] for n, r in g.items()}
    print(f"\nB={b} lengths={lengths} cached={cached}")
    assert cached["cold"] == [0, 0, 0]
    assert cached["lmcache"] == last
    assert cached["vllm"] == last  # vLLM's own cache: the same boundary
    s = summaries(log)
    for i, boundary in enumerate(last):
        # Cold: a state stored at the last boundary (and at a later one
        # where the decoded tokens reach it).
        assert str(boundary) in s[i][3].strip("[]").split(", "), (lengths[i], s[i])
        assert s[len(ps) + i][:3] == (boundary, boundary, f"at {boundary}"), (lengths[i], s[len(ps) + i])
    n = len(ps)
    for i, boundary in enumerate(last):
        same_steps(sched_trace.of_requests(steps, range(n + i, n + i + 1)),
                   [sched_trace.Step(x.threads, tuple((str(n + i), c, k) for _, c, k in x.batch))
                    for x in sched_trace.of_requests(steps, range(2 * n + i, 2 * n + i + 1))],
                   f"prompt of {lengths[i]} tokens")
    close(g["lmcache"], g["vllm"], EXACT, "LMCache hit vs vLLM's own hit")
    same_tokens(g["lmcache"], g["cold"])
    restored = [line for line in log.splitlines() if "Restored block_size" in line]
    # vLLM-CPU 0.26 ... 0.32 reset it in every engine core process.
    assert len(restored) == 1, restored
