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
from dataclasses import asdict
from pathlib import Path

import pytest

from faults import support_env
from lmcache_ascend.cli.engine_run import PhaseResult, Scenario
from lmcache_ascend.cli.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / "tests" / ".models"
ENGINE_TIMEOUT_S = 600
EXIT_GRACE_S = 60


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: name -> path of a locally built tiny random-weight model."""

    def get(name: str) -> str:
        return str(build_tiny_model(name, cache_dir=MODEL_CACHE))

    return get


@pytest.fixture
def run_engine(tmp_path):
    """Run a Scenario in a fresh process; returns (phase results, log text).

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


def run_engine_in(work: Path, scenario: Scenario, extra_env: dict[str, str] | None = None,
                  expect_ok: bool = True) -> tuple[list[PhaseResult], str]:
    """The body of ``run_engine``, usable outside a function-scoped fixture:
    files go to the first free ``scenarioN/outN/engineN`` names in ``work``.
    With ``expect_ok=False`` a failed start is returned (no results) for the
    caller to inspect; a hang still fails."""
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
    with open(log, "w") as lf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_ascend.cli.engine_run", str(sc), str(out)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            cwd=str(work),
            env=env,
        )
        hung = wait_for_exit(proc, out, ENGINE_TIMEOUT_S, EXIT_GRACE_S)
    text = log.read_text(errors="replace")
    tail = "\n".join(text.splitlines()[-60:])
    assert hung is None, f"engine run {hung}; last log lines:\n{tail}"
    if not expect_ok:
        return [], text
    assert proc.returncode == 0, f"engine run failed (rc={proc.returncode}); last log lines:\n{tail}"
    return [PhaseResult.from_json(r) for r in json.loads(out.read_text())], text


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
