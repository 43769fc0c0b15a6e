"""Runs ``engine_run`` in a subprocess, with its workers writing their
plans to a file (plan_file.py): the one way the demo and ``explain`` start an
engine (a fresh process per engine: vLLM and LMCache keep process-wide
state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from lmcache_ascend.cli.engine_run import PhaseResult, Scenario
from lmcache_ascend.cli.plan_file import plan_env


class ScenarioRun(NamedTuple):
    results: list[PhaseResult]
    log: str
    # The ascend_plan_file the engine ran with: read_plan(plan_file) is
    # worker 0's plan (written only when the connector started).
    plan_file: Path


def progress(msg: str) -> None:
    print(f"[lmcache-ascend] {msg}", flush=True)


def run_scenario(scenario: Scenario, label: str, workdir: Path, quiet: bool = False) -> ScenarioRun:
    """Run one engine in a subprocess, echoing its milestones unless
    ``quiet``; returns its phase results, its log and its plan file."""
    sc = workdir / f"{label}.json"
    out = workdir / f"{label}.out.json"
    log = workdir / f"{label}.log"
    plan_file = (workdir / f"{label}.plan.json").absolute()
    sc.write_text(json.dumps(asdict(scenario)))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(scenario.kv_cache_gib))
    # Set, not defaulted: the caller reads this path, whatever the user's
    # environment asked for.
    env.update(plan_env(plan_file))
    milestones = (
        ("Loading weights took", "model loaded"),
        ("init engine", "engine ready"),
        ("lmcache-ascend worker plan", "connector planned the KV transfers"),
    )
    start = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_ascend.cli.engine_run", str(sc), str(out)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            env=env,
        )
        seen: set[str] = set()
        while proc.poll() is None:
            time.sleep(1.0)
            text = log.read_text(errors="replace")
            for needle, msg in milestones:
                if needle in text and needle not in seen:
                    seen.add(needle)
                    if not quiet:
                        progress(f"  {label}: {msg} ({time.time() - start:.0f} s)")
            if not quiet and not seen and int(time.time() - start) % 10 == 0:
                progress(f"  {label}: starting vLLM ({time.time() - start:.0f} s)...")
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise SystemExit(f"{label} engine failed (rc={proc.returncode}); log {log}:\n{tail}")
    raw = json.loads(out.read_text())
    return ScenarioRun([PhaseResult.from_json(r) for r in raw], text, plan_file)
