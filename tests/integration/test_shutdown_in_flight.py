"""SIGTERM while a store is in flight to a pool that went away (issue 34, bad
input): ``vllm serve`` with the connector and Redis stores a prompt; Redis is
then frozen (SIGSTOP: connections stay open, nothing answers, as in a network
partition), a second prompt is served, its remote puts hang, and the API
server gets SIGTERM as an orchestrator sends it.

What must hold:

* the server exits by itself, code 0, within the stop bound: the connector's
  close waits a bounded time for the hung puts, says how many it gave up on,
  and never hangs the shutdown;
* nothing half-written is ever accepted: once Redis runs again (and applies
  whatever reached it whole), a fresh engine sharing it serves both prompts
  with the no-connector run's outputs, hits the first prompt's whole prefix,
  and loads exactly what it hit of the second (no load error).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from faults import (
    CHUNK,
    mismatch,
    reference_outputs,
    reliability_prompts,
    request_transfers,
    run_engine_process,
)
from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt
from mooncake_server import free_port
from openai_server import STOP_TIMEOUT_S, Server, wait_ready
from redis_entries import redis_engine_env
from redis_server import RedisServer, ensure_redis_server

pytestmark = [pytest.mark.engine, pytest.mark.redis]

FULL = 3 * CHUNK  # S0..S5: 3 whole chunks + 60 tokens
CONNECTOR = {
    "kv_connector": "LMCacheAscendConnectorV1Dynamic",
    "kv_role": "kv_both",
    "kv_connector_module_path": "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1",
}


def _complete(srv: Server, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["choices"][0]["text"] is not None


def test_sigterm_with_puts_hung_on_a_frozen_pool_exits_in_bound_and_nothing_half_written_is_used(
        tmp_path, tiny_model):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("llama")
    ref = reference_outputs(model, tmp_path)
    prompts = reliability_prompts()
    with RedisServer(tmp_path) as redis:
        env = {**os.environ, **redis_engine_env(redis.url), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               # vLLM 0.32 gives its workers 5 s to exit before a SIGTERM; the
               # connector's close waits up to 5 s for the hand-off and 5 s
               # for writes to a pool that does not answer (about 4 s here:
               # LMCache's Redis client times the put out at 3 s). As the
               # README advises with a remote pool: more than the close needs.
               "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "2048", "--seed", "0",
               # Drain mode, as the README advises with a store: the engine
               # processes end by themselves, so the connector closes.
               "--shutdown-timeout", "15", "--kv-transfer-config", json.dumps(CONNECTOR)]
        log_path = tmp_path / "server.log"
        with open(log_path, "w") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
                                    start_new_session=True)
        srv = Server("connector", proc, port, log_path)
        frozen = False
        try:
            wait_ready(srv)
            _complete(srv, model, prompts["S0"])
            deadline = time.monotonic() + 60  # its puts reach Redis after the step
            with redis.client() as c:
                while c.dbsize() < 2 * 3:  # two keys per chunk
                    assert time.monotonic() < deadline, "S0's chunks never reached Redis"
                    time.sleep(0.5)
            os.kill(redis.pid, signal.SIGSTOP)
            frozen = True
            _complete(srv, model, prompts["S1"])  # stored locally; its remote puts hang
            time.sleep(1.0)
            stop_s = srv.stop()  # SIGTERM to the API server; SIGKILL after STOP_TIMEOUT_S
        finally:
            srv.stop()
            if frozen:
                os.kill(redis.pid, signal.SIGCONT)
        log = srv.log()
        assert stop_s < STOP_TIMEOUT_S, f"still alive {STOP_TIMEOUT_S} s after SIGTERM:\n{log[-4000:]}"
        assert proc.returncode == 0, log[-4000:]
        # The hung puts ended within the close's bound, each said in the log:
        # LMCache's Redis client timing the write out ("batched put error"),
        # or the connector giving up on it (step_puts.close). Then the
        # connector closed its engine: nothing was left to hang the exit.
        shutdown = log.split("[shutdown]", 1)[-1]
        assert ("batched put error" in shutdown or "still being written to the remote store" in shutdown
                or "not handed off within" in shutdown), shutdown[-4000:]
        assert re.search(r"LMCacheEngine instance lmcache-ascend-\S+ destroyed", shutdown), shutdown[-4000:]
        # A fresh engine (empty local cache) on the same Redis, which now
        # holds whatever reached it whole.
        b = run_engine_process(
            Scenario(model=model, phases=[
                Phase("load", [prompts["S0"], prompts["S1"]], sequential=True),
                # No whole chunk: flushes the worker's summary line of the
                # last request (logged when its finish reaches the worker).
                Phase("flush", [token_prompt(100, seed=999)], sequential=True)]),
            tmp_path, "engine_b", env=redis_engine_env(redis.url), timeout_s=300)
    assert b.results is not None, "engine B failed:\n" + b.log[-6000:]
    s0, s1 = b.results[0].completions
    assert mismatch(s0, ref["S0"]) is None, mismatch(s0, ref["S0"])
    assert mismatch(s1, ref["S1"]) is None, mismatch(s1, ref["S1"])
    summaries = request_transfers(b.log)
    assert (summaries[0].hit, summaries[0].loaded) == (FULL, FULL), summaries[0]
    # S1: whatever whole prefix landed is loaded in full; nothing fails to load.
    assert summaries[1].loaded == summaries[1].hit and not summaries[1].load_error, summaries[1]
    assert not any(s.load_error for s in summaries.values()), summaries
