"""What the engine tests compare a run with the connector against: the
chunk unit their prompts are built in, and outputs equal to a run without
the connector (tokens exactly, logprobs within a tolerance).

Shared by tests/integration/test_engine_hits.py and the engine tests that
reuse its comparison (test_adapter_route, test_engine_modes,
test_lookup_ahead), and the preemption tests' checks (test_engine_modes,
test_mamba_hits)."""

from __future__ import annotations

CHUNK = 256
LOGPROB_TOL = 1e-3


def worst_common(got, ref) -> float:
    """Largest logprob difference over the tokens both runs generated alike
    (bf16 noise may flip a later token; past it the runs differ in input)."""
    n = next((i for i, (x, y) in enumerate(zip(got.tokens, ref.tokens)) if x != y), len(got.tokens))
    return max((abs(a - b) for a, b in zip(got.logprobs[:n], ref.logprobs[:n])), default=0.0)


def assert_same(got, ref, what: str, tol: float = LOGPROB_TOL) -> None:
    assert len(got.completions) == len(ref.completions), what
    for i, (g, r) in enumerate(zip(got.completions, ref.completions)):
        assert g.tokens == r.tokens, f"{what}[{i}]: tokens {g.tokens} != {r.tokens}"
        assert len(g.logprobs) == len(r.logprobs)
        worst = max((abs(a - b) for a, b in zip(g.logprobs, r.logprobs)), default=0.0)
        assert worst <= tol, f"{what}[{i}]: logprobs differ by {worst} (tolerance {tol})"


def one_core_per_rank(ranks: int = 2) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` ranks one core
    of those this process may run on (read, not assumed to be 0 and 1: a
    container may be pinned elsewhere). vLLM-CPU runs TP/DP > 1 only with
    its threads bound."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise RuntimeError(f"{ranks} ranks need {ranks} cores; this process may run on {cores}")
    return "|".join(str(c) for c in cores[:ranks])


def check_preempted_resumes(batch: list, got, ref, free, steps: list, ref_steps: list, log: str,
                            resumed: set[int], what: str) -> None:
    """The checks of a preemption test (test_mamba_hits, test_engine_modes):
    one phase of ``batch`` run with the connector (``got``, its log and
    traced ``steps``), without it under the same preemptions (``ref``,
    ``ref_steps``), and without it never preempted (``free``); ``resumed``:
    the requests the connector's log says loaded a hit.

    Both preempted engines ran the same steps until the first resume that
    loaded (checked): every token before it is equal at tolerance 0. After
    it the connector computes on from the loaded prefix where vLLM
    recomputes the whole request, so the difference is held within the
    noise vLLM's own recomputation makes (reference vs never preempted, same
    run). Then nothing may be left held at close, and no load may fail."""
    import re

    import sched_trace

    g, r, f = got.completions, ref.completions, free.completions
    differ_at = sched_trace.first_differing(steps, ref_steps)
    alike = [sched_trace.tokens_before(steps, i, len(batch[i]), differ_at) for i in range(len(batch))]
    noise = max(worst_common(y, z) for y, z in zip(r, f))
    print(f"\n{what}: preemptions {got.preemptions}/{ref.preemptions}/{free.preemptions}, resumed from a hit "
          f"{sorted(resumed)}, steps alike until {differ_at} ({alike} tokens), noise {noise}, "
          f"diffs {[worst_common(x, y) for x, y in zip(g, r)]}")
    assert got.preemptions > 0 and ref.preemptions > 0 and free.preemptions == 0
    assert resumed, "no preempted request resumed from a hit"
    # The runs part where a resume loaded and computed on from its hit.
    assert differ_at < len(steps) and any(
        req in {str(i) for i in resumed} and computed > 0 for req, computed, _ in steps[differ_at].batch
    ), (steps[differ_at], ref_steps[differ_at])
    for i, (x, y) in enumerate(zip(g, r)):
        n = alike[i]
        assert x.tokens[:n] == y.tokens[:n] and x.logprobs[:n] == y.logprobs[:n], f"request {i}: first {n} tokens"
        assert worst_common(x, y) <= noise, f"request {i}: {worst_common(x, y)} > noise {noise}"
    assert "lmcache-ascend: closing: 0 staged chunk(s) still held" in log, log[-3000:]
    assert re.search(r"lmcache-ascend: closing: 0 of \d+ chunk\(s\) in LMCache's CPU cache still pinned", log), \
        log[-3000:]
    assert "Cannot get" not in log
    counters = got.counters
    assert counters.get("loaded_tokens", 0) > 0, counters
    assert counters.get("load_errors", 0) == 0 and counters.get("checksum_failures", 0) == 0, counters
