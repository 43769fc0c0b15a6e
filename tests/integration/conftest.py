"""Integration fixtures: tiny local models and a real vLLM engine per run.

Each engine run is a fresh subprocess (`lmcache_ascend.cli.engine_run`),
so vLLM's and LMCache's process-wide state never leaks between tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

import engine_errors
import engine_zygote
import sched_trace
from faults import support_env
from lmcache_ascend.cli.engine_run import PhaseResult, Scenario
from lmcache_ascend.cli.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / "tests" / ".models"
ENGINE_MODULE = "lmcache_ascend.cli.engine_run"
ENGINE_TIMEOUT_S = 600
EXIT_GRACE_S = 60


# The facts (support/stack_facts.py) a Mamba/GDN state hit's code path
# depends on: where its compatibility-stack runs are chosen.
STATE_FACTS = pytest.mark.compat("torch", "lmcache", "connector_hooks", "kv_layout_source", "hash_block_size",
                                 "prefix_match_unit", "state_copy", "checkpoint_blocks", "admission_watermark")


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: name -> path of a locally built tiny random-weight model."""

    def get(name: str) -> str:
        return str(build_tiny_model(name, cache_dir=MODEL_CACHE))

    return get


@pytest.fixture
def run_engine(tmp_path):
    """Run a Scenario in a fresh engine process (forked from a zygote where
    it runs in one process: ``support/engine_zygote.py``); returns (phase results, log text).

    PYTHONHASHSEED is removed from the engine's environment unless the test
    sets it: chunk keys must agree across vLLM's processes without it (vLLM <
    0.32 seeds its block hashes randomly then). The process must also exit
    by itself within ``EXIT_GRACE_S`` of writing its results: vLLM < 0.32
    never shuts an in-process engine's connector down, and LMCache's storage
    thread would keep the process alive."""

    def run(scenario: Scenario, extra_env: dict[str, str] | None = None):
        return run_engine_in(tmp_path, scenario, extra_env)

    return run


# LMCache CPU cache (GB) for engines the tests start: LMCache's default (5 GB)
# takes seconds to allocate at every start (more with the compatibility stacks
# beside it) and no test stores a tenth of 1 GB; a test that needs another
# size sets its own.
LMCACHE_CPU_GB = "1"
# Cores vLLM-CPU keeps off its compute threads (see run_engine_in): none, so
# every engine computes on all of the machine's cores (2 here), read back by
# tests from vLLM's thread-binding lines where they compare thread counts.
RESERVED_CPUS = "0"


def run_engine_in(work: Path, scenario: Scenario, extra_env: dict[str, str] | None = None,
                  expect_ok: bool = True, schedule: list | None = None) -> tuple[list[PhaseResult], str]:
    """The body of ``run_engine``, usable outside a function-scoped fixture:
    files go to the first free ``scenarioN/outN/engineN`` names in ``work``.
    With ``expect_ok=False`` a failed start is returned (no results) for the
    caller to inspect; a hang still fails. A ``schedule`` list receives the
    engine's forward steps (``support/sitecustomize.py``, read by
    ``sched_trace.read``)."""
    run = _launch(work, scenario, extra_env, schedule)
    assert run.hung is None, f"engine run {run.hung}; {engine_errors.report(run.log)}"
    if not expect_ok:
        return [], run.log
    assert run.returncode == 0, f"engine run failed (rc={run.returncode}); {engine_errors.report(run.log)}"
    return run.results(), run.log


def run_reference_in(work: Path, scenario: Scenario, schedule: list | None = None) -> tuple[list[PhaseResult], str]:
    """The same workload on vLLM without any connector: the reference of a
    comparison, and the control of a failure. If vLLM itself cannot serve it
    on this machine (a crash in its own CPU kernels, say), the test that
    needs it is skipped with vLLM's own error: not a pass, and not silent.
    A run with the connector that fails where this one serves stays a
    failure of ours."""
    assert scenario.connector == "none", scenario.connector
    run = _launch(work, scenario, None, schedule)
    if run.hung is None and run.returncode == 0:
        return run.results(), run.log
    why = run.hung or f"exit code {run.returncode}"
    pytest.skip(f"vLLM itself fails this workload on this machine without any connector ({why}); "
                f"{engine_errors.report(run.log, tail_lines=15)}")


@dataclass
class _Run:
    returncode: int | None
    hung: str | None
    log: str
    out: Path

    def results(self) -> list[PhaseResult]:
        return [PhaseResult.from_json(r) for r in json.loads(self.out.read_text())]


def _launch(work: Path, scenario: Scenario, extra_env: dict[str, str] | None, schedule: list | None) -> _Run:
    n = 1
    while (work / f"scenario{n}.json").exists():
        n += 1
    sc, out, log = work / f"scenario{n}.json", work / f"out{n}.json", work / f"engine{n}.log"
    sc.write_text(json.dumps(asdict(scenario)))
    env = support_env(dict(os.environ))  # the faulty connector's module path
    env.pop("PYTHONHASHSEED", None)
    env.update(extra_env or {})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(scenario.kv_cache_gib))
    env.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", LMCACHE_CPU_GB)
    env.setdefault("LMCACHE_LOG_LEVEL", "INFO")
    # Lower-case logger names of ours go through vLLM's logging config.
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # vLLM-CPU reserves one more core when any KV connector is configured
    # (for NIXL), so on a small machine an engine with the connector would
    # compute on other threads than one without: another reduction split,
    # other bf16 bits. Every engine of a test reserves the same.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS)
    # A process killed by a signal prints its Python stack (engine_errors).
    env.setdefault("PYTHONFAULTHANDLER", "1")
    trace = work / f"sched{n}"
    if schedule is not None:
        trace.mkdir(exist_ok=True)
        env["LMCA_SCHED_TRACE_DIR"] = str(trace)
    args = [str(sc), str(out)]
    # The scenario's variables are set before vLLM is imported (engine_run),
    # so a zygote's environment includes them.
    full = {**env, **scenario.env}
    proc = engine_zygote.pool().launch(ENGINE_MODULE, args, full, work, log, owner=str(work))
    if proc is None:
        with open(log, "w") as lf:
            proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, *args], stdout=lf,
                                    stderr=subprocess.STDOUT, cwd=str(work), env=env)
    hung = wait_for_exit(proc, out, ENGINE_TIMEOUT_S, EXIT_GRACE_S)
    if schedule is not None:
        schedule.extend(sched_trace.read(trace))
    return _Run(proc.returncode, hung, log.read_text(errors="replace"), out)


def wait_for_exit(proc: subprocess.Popen, out: Path, timeout_s: float, grace_s: float) -> str | None:
    """Waits for ``proc``; kills it and says why if it runs past ``timeout_s``
    or lives more than ``grace_s`` after ``out`` appeared. None when it exited."""
    start = time.monotonic()
    done_at = None
    while proc.poll() is None:
        now = time.monotonic()
        if done_at is None and out.exists():
            done_at = now
        if now - start > timeout_s or (done_at is not None and now - done_at > grace_s):
            proc.kill()
            proc.wait()
            if done_at is None:
                return f"did not finish within {timeout_s:.0f} s"
            return f"finished its workload but did not exit within {grace_s:.0f} s"
        time.sleep(0.5)
    return None
