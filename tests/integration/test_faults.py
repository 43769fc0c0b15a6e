"""Faults while a real vLLM engine serves: outages, a full cache, failing
copies. A fault may cost speed (a hit becomes a miss or a recompute); it
must never change an output, fail a request or hang the engine.

Faults are injected by ``faults``: a subclass of the
connector selected through ``kv_transfer_config`` and driven by
``LMCA_FAULT_*`` variables (production code carries no test hooks), and by
signals to a real ``redis-server``. Every completion is compared with the
no-connector run of the same prompt (tokens, logprobs within 1e-3).

Requests are submitted one by one, so vLLM numbers them 0, 1, 2, ... and
the worker's per-request summary lines can be matched to prompts.
"""

from __future__ import annotations

import os
import signal

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from faults import (
    CHUNK,
    FAULT_LOG_TAG,
    faulty_transfer_config,
    reference_outputs,
    reliability_prompts,
    run_engine_process,
)
from fault_runs import FLUSH, Run

from redis_server import RedisServer, ensure_redis_server

pytestmark = pytest.mark.engine

TWO = 2 * CHUNK  # whole chunks of every E prompt


def run_phases(model, work, tag, phases: list[tuple[str, list[str], bool]], env, faulty=False) -> Run:
    """phases: (name, prompt names, reset vLLM's prefix cache first)."""
    prompts = reliability_prompts()
    scenario = Scenario(
        model=model,
        phases=[
            Phase(name, [prompts[n] for n in names], reset_prefix_cache=reset, sequential=True)
            for name, names, reset in phases
        ]
        + [Phase("flush", [FLUSH], sequential=True)],
        connector="none" if faulty else "ascend",
        engine_kwargs={"kv_transfer_config": faulty_transfer_config()} if faulty else {},
    )
    proc = run_engine_process(scenario, work, tag, env=env, timeout_s=400)
    names = [n for _, ns, _ in phases for n in ns]
    return Run(proc, names, reference_outputs(model, work))


def summary(run: Run, i: int):
    t = run.transfers().get(i)
    assert t is not None, f"no transfer summary for request {i}"
    return t


# ---- Redis killed / frozen mid-run ------------------------------------------


def _redis_or_skip():
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")


def _remote_only_env(url: str) -> dict[str, str]:
    # No local CPU cache: every hit must come from Redis.
    return {
        "LMCACHE_REMOTE_URL": url,
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.2",
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
    }


@pytest.mark.redis
def test_redis_killed_mid_run(tmp_path, tiny_model):
    _redis_or_skip()
    model = tiny_model("llama")
    with RedisServer(tmp_path) as server:
        env = _remote_only_env(server.url)
        env.update(LMCA_FAULT_PID=str(server.pid), LMCA_FAULT_SIGNALS="3:KILL")
        run = run_phases(
            model,
            tmp_path,
            "redis_killed",
            [
                ("cold", ["E0"], False),  # 0: stored to Redis
                ("warm", ["E0"], True),  # 1: hit from Redis
                ("after_kill", ["E0"], True),  # 2: Redis killed before this lookup
                ("new", ["E1"], True),  # 3: its store cannot reach Redis
                ("new_again", ["E1"], True),  # 4
                ("batch", ["E0", "E1", "E2", "E3"], True),  # 5..8
            ],
            env,
            faulty=True,
        )
        assert server.proc.poll() is not None, "redis-server was not killed"
    served = run.assert_all_identical()
    assert served == 9
    assert f"{FAULT_LOG_TAG} sent SIGKILL" in run.log
    assert (summary(run, 0).stored, summary(run, 1).hit, summary(run, 1).loaded) == (TWO, TWO, TWO)
    # After the outage every lookup is a miss; nothing fails.
    for i in range(2, 9):
        assert summary(run, i).hit == 0, (i, summary(run, i))
    # LMCache logged the outage.
    assert "Remote connection failed" in run.log or "Error occurred" in run.log
    run.assert_exited_in_bound()


@pytest.mark.redis
def test_redis_frozen_mid_run(tmp_path, tiny_model):
    """SIGSTOP: connections stay open but nothing answers (a network
    partition). Lookups must time out instead of hanging the scheduler."""
    _redis_or_skip()
    model = tiny_model("llama")
    with RedisServer(tmp_path) as server:
        env = _remote_only_env(server.url)
        env.update(LMCA_FAULT_PID=str(server.pid), LMCA_FAULT_SIGNALS="3:STOP,6:CONT")
        try:
            run = run_phases(
                model,
                tmp_path,
                "redis_frozen",
                [
                    ("cold", ["E4"], False),  # 0: stored to Redis
                    ("warm", ["E4"], True),  # 1: hit
                    ("frozen", ["E4"], True),  # 2: Redis stopped before this lookup
                    ("frozen_new", ["E5"], True),  # 3
                    ("frozen_again", ["E4"], True),  # 4
                    ("thawed", ["E4"], True),  # 5: SIGCONT before this lookup
                ],
                env,
                faulty=True,
            )
        finally:
            if server.proc is not None and server.proc.poll() is None:
                os.kill(server.pid, signal.SIGCONT)
    served = run.assert_all_identical()
    assert served == 6
    assert f"{FAULT_LOG_TAG} sent SIGSTOP" in run.log
    assert summary(run, 1).loaded == TWO
    # While frozen, E4 (in Redis) is a miss: lookups time out, nothing hangs.
    for i in (2, 4):
        assert summary(run, i).hit == 0, (i, summary(run, i))
    # After SIGCONT, E4 is served from Redis again.
    assert (summary(run, 5).hit, summary(run, 5).loaded) == (TWO, TWO), summary(run, 5)
    run.assert_exited_in_bound()


# ---- local CPU cache full ---------------------------------------------------


def test_local_cpu_cache_full_evicts(tmp_path, tiny_model):
    """~5 MB of LMCache CPU memory holds about ten 512 KiB chunks; 24 chunks
    go through it. LMCache evicts (LRU); nothing fails, nothing differs."""
    model = tiny_model("llama")
    fill = [f"E{i}" for i in range(12)]
    run = run_phases(
        model,
        tmp_path,
        "cpu_full",
        [
            ("fill", fill, False),  # 0..11
            ("recent", ["E11"], True),  # 12
            ("oldest", ["E0"], True),  # 13
            ("batch", fill, True),  # 14..25
        ],
        {"LMCACHE_MAX_LOCAL_CPU_SIZE": "0.005", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": str(CHUNK)},
    )
    served = run.assert_all_identical()
    assert served == 26
    for i in range(12):
        assert summary(run, i).hit == 0
    stored_fill = sum(summary(run, i).stored for i in range(12))
    assert stored_fill >= 10 * TWO, stored_fill  # most of them went in
    assert (summary(run, 12).hit, summary(run, 12).loaded) == (TWO, TWO)  # most recent kept
    assert summary(run, 13).hit == 0  # oldest evicted
    run.assert_exited_in_bound()


# ---- failing copies ---------------------------------------------------------


@pytest.fixture(scope="module")
def copy_faults(tmp_path_factory, tiny_model) -> Run:
    """The first 4 chunk copies into LMCache raise; so does the first copy
    out of it. The CPU cache (~6 MB, 12 chunks) is small enough that the 8
    chunk buffers of the failed stores, if never returned, would crowd out
    the 8 chunks stored next."""
    model = tiny_model("llama")
    work = tmp_path_factory.mktemp("copy_faults")
    return run_phases(
        model,
        work,
        "copy_faults",
        [
            ("failing_stores", ["E0", "E1", "E2", "E3"], False),  # 0..3: stores raise
            ("stores_back", ["E4", "E5", "E6", "E7"], False),  # 4..7: stored
            ("hits", ["E4", "E5", "E6", "E7"], True),  # 8: load raises; 9..11 load
            ("never_stored", ["E0"], True),  # 12
        ],
        {
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.006",
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_CHUNK_SIZE": str(CHUNK),
            "LMCA_FAULT_STORE_FAIL": "4",
            "LMCA_FAULT_LOAD_FAIL": "1",
        },
        faulty=True,
    )


def test_failing_store_keeps_serving(copy_faults):
    run = copy_faults
    assert run.assert_all_identical() == 13
    assert run.log.count(f"{FAULT_LOG_TAG} injected store") == 4
    assert run.log.count("the request continues without caching them") == 4
    for i in range(4):
        assert summary(run, i).stored == 0, (i, summary(run, i))
    # Stores work again once the faults stop: the failed ones leaked nothing.
    for i in range(4, 8):
        assert summary(run, i).stored == TWO, (i, summary(run, i))
    assert summary(run, 12).hit == 0  # never stored: a miss, not an error
    run.assert_exited_in_bound()


def test_failed_store_releases_lmcache_buffers(copy_faults):
    """A store that raises inside LMCache's ``store`` must hand its buffers
    back, not leave them to the garbage collector."""
    assert "garbage collected with ref_count" not in copy_faults.log


def test_failing_load_is_recomputed(copy_faults):
    run = copy_faults
    assert run.log.count(f"{FAULT_LOG_TAG} injected load") == 1
    first = summary(run, 8)
    assert (first.hit, first.loaded, first.load_error) == (TWO, 0, True), first
    for i in (9, 10, 11):
        t = summary(run, i)
        assert (t.hit, t.loaded, t.load_error) == (TWO, TWO, False), (i, t)
