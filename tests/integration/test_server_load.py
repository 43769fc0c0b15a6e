"""Load: vLLM's OpenAI server with the connector under concurrent clients.

Two servers on loopback (a free port each): one with
``LMCacheAscendConnectorV1Dynamic``, one without. Four client threads send
six ``/v1/completions`` requests each (token-id prompts over four shared
2-chunk prefixes, temperature 0, logprobs 1, max_tokens 8). The connector
server serves the workload twice — the second time after vLLM's own prefix
cache is reset, so the shared chunks come back from LMCache — and every
response must equal the no-connector server's (tokens exactly, logprobs
within 1e-3).

Memory: the process tree's RSS is sampled (every 0.2 s) for both servers;
while serving (from readiness to the end of the workload; startup peaks
are transient and noisy) the connector server's peak may exceed the
no-connector server's peak by at most the
configured LMCache CPU cache (``LMCACHE_MAX_LOCAL_CPU_SIZE``) plus a stated
margin (``RSS_MARGIN_MIB``: LMCache's code, threads and allocator slack).
Both servers have the same vLLM KV space, which is therefore in both peaks.

``/metrics`` is scraped once; the KV-connector related series found there
are written to ``metrics.json`` next to the server logs and printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from lmcache_ascend.cli.engine_run import CONNECTOR_MODULE
from lmcache_ascend.cli.tiny_models import token_prompt

from openai_server import STOP_TIMEOUT_S, Server, wait_ready
from redis_server import free_port

pytestmark = pytest.mark.engine

CHUNK = 256
THREADS = 4
REQUESTS_PER_THREAD = 6
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3
KV_SPACE_GIB = 1
LMCACHE_CPU_GIB = 0.5
RSS_MARGIN_MIB = 768
REQUEST_TIMEOUT_S = 180


def prompts() -> list[list[int]]:
    """24 prompts: 4 shared 512-token prefixes x 6 distinct tails (40..290)."""
    out = []
    for p in range(THREADS):
        prefix = token_prompt(2 * CHUNK, seed=500 + p)
        for j in range(REQUESTS_PER_THREAD):
            out.append(token_prompt(2 * CHUNK + 40 + 50 * j, seed=600 + 10 * p + j, prefix=prefix))
    return out


def start_server(name: str, model: str, work: Path, connector: bool) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--seed", "0",
        # vLLM's drain mode on SIGTERM, as the README advises with a store:
        # the engine processes end by themselves, so the connector closes.
        # Both servers, so that their stop times compare like with like.
        "--shutdown-timeout", "15",
    ]
    if connector:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "LMCacheAscendConnectorV1Dynamic",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
        })]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB),
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
        LMCACHE_MAX_LOCAL_CPU_SIZE=str(LMCACHE_CPU_GIB),
        LMCACHE_LOCAL_CPU="True",
        LMCACHE_CHUNK_SIZE=str(CHUNK),
        LMCACHE_LOG_LEVEL="INFO",
        VLLM_LOGGING_LEVEL="INFO",
    )
    log_path = work / f"{name}.log"
    with open(log_path, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                cwd=str(work), start_new_session=True)
    server = Server(name, proc, port, log_path)
    server.start_sampling()
    return server


def post(server: Server, path: str, body: Optional[dict] = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(server.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read() or b"{}")


@dataclass(frozen=True)
class Answer:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


def complete(server: Server, model: str, prompt: list[int]) -> Answer:
    out = post(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 1, "return_tokens_as_token_ids": True,
    })
    lp = out["choices"][0]["logprobs"]
    tokens = tuple(int(t.split(":", 1)[1]) for t in lp["tokens"])
    return Answer(tokens, tuple(float(x) for x in lp["token_logprobs"]))


def run_clients(server: Server, model: str, ps: list[list[int]]) -> dict[int, Answer]:
    """THREADS threads, each sending its REQUESTS_PER_THREAD prompts in turn
    (thread t takes prompts t, t + THREADS, ...: prefixes interleave)."""

    def worker(t: int) -> dict[int, Answer]:
        return {i: complete(server, model, ps[i]) for i in range(t, len(ps), THREADS)}

    answers: dict[int, Answer] = {}
    with ThreadPoolExecutor(THREADS) as pool:
        for part in pool.map(worker, range(THREADS)):
            answers.update(part)
    return answers


def compare(got: dict[int, Answer], ref: dict[int, Answer]) -> list[str]:
    bad = []
    for i in sorted(ref):
        g, r = got[i], ref[i]
        if g.tokens != r.tokens:
            bad.append(f"prompt {i}: tokens {g.tokens} != {r.tokens}")
            continue
        worst = max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs))
        if worst > LOGPROB_TOL:
            bad.append(f"prompt {i}: logprobs differ by {worst:.3g}")
    return bad


CONNECTOR_METRIC_WORDS = ("kv_connector", "lmcache", "external", "kv_transfer", "offload",
                          "prefix_cache", "kv_load", "kv_save")


def connector_metrics(text: str) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            parts = line.split(" ", 3)
            if any(w in parts[2].lower() for w in CONNECTOR_METRIC_WORDS):
                names.setdefault(parts[2], []).append(parts[3] if len(parts) > 3 else "")
    return names


def test_openai_server_concurrent_shared_prefix(tmp_path, tiny_model):
    model = tiny_model("llama")
    ps = prompts()
    servers: list[Server] = []
    figures: dict = {}
    try:
        ref_srv = start_server("reference", model, tmp_path, connector=False)
        servers.append(ref_srv)
        conn_srv = start_server("connector", model, tmp_path, connector=True)
        servers.append(conn_srv)
        wait_ready(ref_srv)
        wait_ready(conn_srv)
        ref_srv.mark_serving()
        conn_srv.mark_serving()

        t0 = time.time()
        ref = run_clients(ref_srv, model, ps)
        figures["reference_s"] = round(time.time() - t0, 2)

        t0 = time.time()
        first = run_clients(conn_srv, model, ps)
        figures["connector_pass1_s"] = round(time.time() - t0, 2)
        assert post(conn_srv, "/reset_prefix_cache").get("success") is True
        t0 = time.time()
        second = run_clients(conn_srv, model, ps)
        figures["connector_pass2_s"] = round(time.time() - t0, 2)

        with urllib.request.urlopen(conn_srv.base + "/metrics", timeout=30) as r:
            metrics_text = r.read().decode(errors="replace")
        found = connector_metrics(metrics_text)
        (tmp_path / "metrics.json").write_text(json.dumps(found, indent=1))
        figures["metrics"] = sorted(found)

        figures["stop_reference_s"] = round(ref_srv.stop(), 2)
        figures["stop_connector_s"] = round(conn_srv.stop(), 2)
    finally:
        for s in servers:
            s.stop()
    log = conn_srv.log()
    figures["peak_rss_mib"] = {s.name: s.peak_rss >> 20 for s in servers}
    figures["serving_peak_rss_mib"] = {s.name: s.serving_peak_rss >> 20 for s in servers}
    figures["rss_samples"] = {s.name: s.samples for s in servers}
    loaded = [int(x) for x in __import__("re").findall(r"loaded (\d+) tokens \[", log)]
    figures["connector_loaded_tokens"] = sum(loaded)
    print("SERVER_LOAD_FIGURES", json.dumps(figures))

    # Every response equals the no-connector server's, both passes.
    assert len(ref) == len(first) == len(second) == THREADS * REQUESTS_PER_THREAD
    assert compare(first, ref) == []
    assert compare(second, ref) == []
    # The second pass was served from LMCache (vLLM's prefix cache was reset).
    assert figures["connector_loaded_tokens"] >= THREADS * 2 * CHUNK  # each prefix at least once
    # No error while serving. (On SIGTERM vLLM 0.32 aborts with timeout 0 and
    # force-kills its engine core, which can log an EngineDeadError
    # traceback from the API process with or without a connector.)
    serving_log = log.split("[shutdown]")[0]
    assert "Traceback" not in serving_log, serving_log[-6000:]
    # Memory: the connector costs at most its CPU cache plus the margin.
    extra_mib = (conn_srv.serving_peak_rss - ref_srv.serving_peak_rss) / 2**20
    budget_mib = LMCACHE_CPU_GIB * 1024 + RSS_MARGIN_MIB
    assert extra_mib <= budget_mib, (figures, extra_mib, budget_mib)
    # Both servers stop on SIGTERM within the bound: the signal an
    # orchestrator sends a container's main process, the API server only.
    assert figures["stop_reference_s"] < STOP_TIMEOUT_S
    assert figures["stop_connector_s"] < STOP_TIMEOUT_S
    assert (ref_srv.proc.returncode, conn_srv.proc.returncode) == (0, 0), log[-3000:]
    # The connector's server drained, and its worker closed the LMCache
    # engine on the way out (its puts handed off first), never force-killed.
    shutdown_log = log.split("[shutdown]", 1)[-1]
    # (vLLM may force-kill its engine-core process after its own grace on a
    # loaded machine: test_observability.py says why that is not checked.)
    assert "mode=drain" in log, shutdown_log[-3000:]
    assert __import__("re").search(r"LMCacheEngine instance lmcache-ascend-\S+ destroyed", shutdown_log), \
        shutdown_log[-3000:]
