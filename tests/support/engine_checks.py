"""What the engine tests compare a run with the connector against: the
chunk unit their prompts are built in, and outputs equal to a run without
the connector (tokens exactly, logprobs within a tolerance).

Shared by tests/integration/test_engine_hits.py and the engine tests that
reuse its comparison (test_adapter_route, test_engine_modes,
test_lookup_ahead)."""

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
