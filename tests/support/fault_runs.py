"""One engine run of numbered prompt requests, checked against the
no-connector outputs of the same prompts: what the fault and remote-store
tests (tests/integration/test_faults.py, test_mooncake.py,
test_remote_outage.py) run and read.

Requests are submitted one by one, so vLLM numbers them 0, 1, 2, ... and
the worker's per-request summary lines can be matched to prompts
(``faults.request_transfers``)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

from faults import (
    EngineProcess,
    faulty_transfer_config,
    mismatch,
    reference_outputs,
    reliability_prompts,
    request_transfers,
    run_engine_process,
)

EXIT_BOUND_S = 60.0

# A short prompt (no whole chunk: no lookup, no store) sent last: the
# worker logs a request's summary when its finish reaches the worker with
# the next step, so this flushes the summary of the last real request.
FLUSH = token_prompt(100, seed=999)


@dataclass
class Run:
    proc: EngineProcess
    names: list[str]  # prompt name of each request, in submission order
    ref: dict

    @property
    def log(self) -> str:
        return self.proc.log

    def transfers(self) -> dict:
        return request_transfers(self.proc.log)

    def assert_all_identical(self) -> int:
        assert self.proc.results is not None, "engine failed:\n" + self.proc.log[-8000:]
        comps = [c for p in self.proc.results if p.name != "flush" for c in p.completions]
        assert len(comps) == len(self.names)
        for i, (name, comp) in enumerate(zip(self.names, comps)):
            diff = mismatch(comp, self.ref[name])
            assert diff is None, f"request {i} ({name}): {diff}"
        return len(comps)

    def assert_exited_in_bound(self) -> None:
        assert not self.proc.timed_out and self.proc.returncode == 0
        assert self.proc.last_phase_to_exit_s is not None
        assert self.proc.last_phase_to_exit_s < EXIT_BOUND_S


def run_remote(model, work, tag, phases, env, faulty=True) -> Run:
    """phases: (name, prompt names, reset vLLM's prefix cache first);
    requests one by one, numbered in order (as test_faults.run_phases, with
    the faulty connector by default and the engine's exit bounded by
    EXIT_BOUND_S)."""
    prompts = reliability_prompts()
    scenario = Scenario(
        model=model,
        phases=[Phase(n, [prompts[p] for p in ps], reset_prefix_cache=r, sequential=True) for n, ps, r in phases]
        + [Phase("flush", [FLUSH], sequential=True)],
        connector="none" if faulty else "ascend",
        engine_kwargs={"kv_transfer_config": faulty_transfer_config()} if faulty else {},
    )
    proc = run_engine_process(scenario, work, tag, env=env, timeout_s=400, exit_bound_s=EXIT_BOUND_S)
    return Run(proc, [p for _, ps, _ in phases for p in ps], reference_outputs(model, work))


def hits(run: Run) -> list[tuple[int, int]]:
    """(hit, loaded) tokens of each request, None where it logged no summary."""
    tr = run.transfers()
    return [(tr[i].hit, tr[i].loaded) if i in tr else None for i in range(len(run.names))]
