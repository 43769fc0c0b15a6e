"""A pool that is down when the engine starts (issue: a restarted or
scaled-out instance must serve during a pool outage): the engine starts,
says so once, serves every request exactly, and stores into and hits from
the pool once it is back, without a restart. Redis and Mooncake alike.

The pool (a real redis-server, or a real Mooncake master and segment
holder) is started by this test only when the engine, before its second
lookup, signals it (``LMCA_FAULT_SIGNALS``) and then waits for it
(``LMCA_FAULT_BEFORE_LOOKUP``: waitport, then the reconnect interval).
No local CPU cache: every hit comes from the pool."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from lmcache_ascend.lmcache_bridge.backends.remote_pool import RECONNECT_S

from lmcache_ascend.cli.engine_run import Phase, Scenario

from faults import CHUNK, run_engine_process
from fault_runs import hits, run_remote
from mooncake_server import MooncakeStore, free_port
from redis_server import RedisServer, ensure_redis_server

pytestmark = pytest.mark.engine


def _pool(backend: str, tmp_path):
    if backend == "redis":
        if ensure_redis_server() is None:
            pytest.skip("redis-server is not installed and could not be installed")
        server = RedisServer(tmp_path / "redis")
        env = {"LMCACHE_REMOTE_URL": server.url, "LMCACHE_REMOTE_SERDE": "naive"}
        return server, env
    store = MooncakeStore(tmp_path / "mooncake", segment="64MB")
    return store, store.engine_env()


@pytest.mark.parametrize("backend", [pytest.param("redis", marks=pytest.mark.redis),
                                     pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_pool_down_at_startup_is_served_and_used_once_back(backend, tmp_path, tiny_model):
    pool, env = _pool(backend, tmp_path)
    ready = socket.socket()
    ready_port = free_port()
    failures: list[BaseException] = []

    def start_pool() -> None:
        try:
            pool.start()
            ready.bind(("127.0.0.1", ready_port))
            ready.listen()
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failures.append(e)

    def on_signal(*_):
        threading.Thread(target=start_pool, daemon=True).start()

    env.update(
        LMCACHE_LOCAL_CPU="False",
        LMCACHE_MAX_LOCAL_CPU_SIZE="0.2",
        LMCACHE_CHUNK_SIZE=str(CHUNK),
        LMCACHE_LOOKUP_TIMEOUT_MS="10000",
        LMCA_FAULT_PID=str(os.getpid()),
        LMCA_FAULT_SIGNALS="2:USR1",
        # The reconnect thread looks every RECONNECT_S: wait for it and for
        # the connection (Mooncake's setup takes a few seconds, more on a
        # loaded machine: with one reconnect period of slack the "hit" request
        # once found nothing in a full CI run, its store having gone nowhere).
        # Before the "hit" request's lookup (request 3), a pause: the "back"
        # request's puts run beside the steps and may still be in flight when
        # it has returned (a full CI run once found its second chunk missing
        # from Mooncake: a hit of 1 chunk, not 2).
        LMCA_FAULT_BEFORE_LOOKUP=f"2:waitport:{ready_port},2:sleep:{3 * int(RECONNECT_S) + 10},3:sleep:5",
    )
    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        run = run_remote(tiny_model("llama"), tmp_path, f"outage_{backend}",
                         [("down", ["E0"], False), ("back", ["E1"], True), ("hit", ["E1"], True)], env)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        pool.stop()
        ready.close()
    assert not failures, failures
    log = run.log
    # Started and served: every output equals the engine without the connector.
    assert run.assert_all_identical() == 3
    assert run.proc.returncode == 0, log[-4000:]
    # One ERROR naming the store and the way out, and the reconnection.
    errors = [ln for ln in log.splitlines() if "remote store unavailable at startup" in ln]
    assert len(errors) == 1 and "ascend_require_remote" in errors[0], errors or log[-4000:]
    assert "connected (was unavailable for" in log, log[-4000:]
    # Down: a miss, nothing stored anywhere (no local cache). Back: stored
    # into the pool. Then hit from it, every whole chunk.
    got = hits(run)
    assert got[0] == (0, 0) and got[1] == (0, 0), got
    assert got[2][0] == 2 * CHUNK and got[2][1] == 2 * CHUNK, got
    # Counted, as vLLM exports the connector's counters (where it does).
    counters = [p.counters for p in run.proc.results if p.counters]
    assert not counters or counters[-1].get("remote_unavailable", 0) >= 1, counters


@pytest.mark.mooncake
def test_require_remote_stops_startup_when_the_pool_is_down(tmp_path, tiny_model):
    """The strict behaviour, for operators who want it: the engine does not
    start, and the error names the pool and the key."""
    store = MooncakeStore(tmp_path / "mooncake")  # never started
    env = store.engine_env()
    env.update(LMCACHE_ASCEND_REQUIRE_REMOTE="true", LMCACHE_CHUNK_SIZE=str(CHUNK))
    run = run_engine_process(Scenario(model=tiny_model("llama"), phases=[Phase("never", [[1, 2, 3]])]), tmp_path,
                             "require_remote", env=env, timeout_s=240)
    assert run.results is None and run.returncode not in (0, None), run.log[-3000:]
    assert "no mooncake_master accepts connections" in run.log and "ascend_require_remote: true" in run.log
