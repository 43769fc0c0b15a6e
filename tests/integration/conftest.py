"""Integration fixtures: tiny local models and a real vLLM engine per run.

Each engine run is a fresh subprocess (`lmcache_ascend.testing.engine_run`),
so vLLM's and LMCache's process-wide state never leaks between tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from lmcache_ascend.testing.engine_run import PhaseResult, Scenario, Completion
from lmcache_ascend.testing.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / "tests" / ".models"
ENGINE_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: name -> path of a locally built tiny random-weight model."""

    def get(name: str) -> str:
        return str(build_tiny_model(name, cache_dir=MODEL_CACHE))

    return get


def _results(raw) -> list[PhaseResult]:
    return [
        PhaseResult(r["name"], [Completion(**c) for c in r["completions"]], r["seconds"])
        for r in raw
    ]


@pytest.fixture
def run_engine(tmp_path):
    """Run a Scenario in a fresh process; returns (phase results, log text)."""

    counter = {"n": 0}

    def run(scenario: Scenario, extra_env: dict[str, str] | None = None):
        counter["n"] += 1
        sc = tmp_path / f"scenario{counter['n']}.json"
        out = tmp_path / f"out{counter['n']}.json"
        log = tmp_path / f"engine{counter['n']}.log"
        sc.write_text(json.dumps(asdict(scenario)))
        env = dict(os.environ)
        env.update(extra_env or {})
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(scenario.kv_cache_gib))
        env.setdefault("LMCACHE_LOG_LEVEL", "INFO")
        # Lower-case logger names of ours go through vLLM's logging config.
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        with open(log, "w") as lf:
            proc = subprocess.run(
                [sys.executable, "-m", "lmcache_ascend.testing.engine_run", str(sc), str(out)],
                stdout=lf,
                stderr=subprocess.STDOUT,
                timeout=ENGINE_TIMEOUT_S,
                cwd=str(tmp_path),
                env=env,
            )
        text = log.read_text(errors="replace")
        if proc.returncode != 0:
            raise AssertionError(
                f"engine run failed (rc={proc.returncode}); last log lines:\n"
                + "\n".join(text.splitlines()[-60:])
            )
        return _results(json.loads(out.read_text())), text

    return run
