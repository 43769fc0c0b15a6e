# SPDX-License-Identifier: Apache-2.0
"""Helpers of bench_serving.py: one vLLM OpenAI server process, a streaming
``/v1/completions`` client, ``/metrics`` scraping and the multi-round
conversation workload (split from bench_serving.py for size).

Traffic goes to 127.0.0.1 only. Every wait is bounded: server start
(``start_timeout``), each request (``request_timeout``), the workload
(``time_limit``: no new request is sent after it), metrics polling.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

CONNECTOR_MODULE = "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"
HOST = "127.0.0.1"
VOCAB_LOW, VOCAB_HIGH = 4, 512  # the tiny models' WordLevel ids without specials
# The API process can outlive a failed engine core; these lines mean it did.
ENGINE_FAILED = ("EngineCore failed to start", "Engine core initialization failed")


def pythonpath_with(directory: Path, env: dict[str, str]) -> str:
    """``env``'s PYTHONPATH with ``directory`` first (for a server to import
    bench-side modules: the noop connector, the step tracer)."""
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return os.pathsep.join([str(directory)] + rest)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------- server --


@dataclass(frozen=True)
class ServerSpec:
    model: str
    connector: str  # "none" | "ascend" | "lmcache" (vLLM's LMCacheConnectorV1, adapter route)
    max_model_len: int
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    num_blocks: Optional[int] = None  # --num-gpu-blocks-override (None: what the space holds)
    lmcache_cpu_gb: float = 2.0
    chunk_size: int = 128
    reserved_cpus: int = 0  # VLLM_CPU_NUM_OF_RESERVED_CPU, the same for every server


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own session."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--host", HOST, "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--max-model-len", str(spec.max_model_len),
            "--enable-prompt-tokens-details",
        ]
        if spec.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(spec.num_blocks)]
        if spec.connector != "none":
            cfg = {"kv_role": "kv_both"}
            if spec.connector == "ascend":
                cfg |= {"kv_connector": "LMCacheAscendConnectorV1Dynamic",
                        "kv_connector_module_path": CONNECTOR_MODULE}
            elif spec.connector == "lmcache":
                cfg |= {"kv_connector": "LMCacheConnectorV1"}
            elif spec.connector == "noop":  # bench/noop_connector.py: the plumbing alone
                cfg |= {"kv_connector": "NoopConnector",
                        "kv_connector_module_path": "noop_connector"}
            else:
                raise ValueError(f"unknown connector {spec.connector!r}; "
                                 "valid: none, ascend, lmcache, noop")
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(spec.kv_space_gib),
            VLLM_CPU_NUM_OF_RESERVED_CPU=str(spec.reserved_cpus),
            LMCACHE_LOCAL_CPU="True",
            LMCACHE_MAX_LOCAL_CPU_SIZE=str(spec.lmcache_cpu_gb),
            LMCACHE_CHUNK_SIZE=str(spec.chunk_size),
        )
        if spec.connector == "noop":
            env["PYTHONPATH"] = pythonpath_with(Path(__file__).resolve().parent, env)
        env.setdefault("LMCACHE_LOG_LEVEL", "INFO")
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        self.started = time.time()
        with open(log_path, "w") as lf:
            self.proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(log_path.parent), start_new_session=True)
        self.ready_s = float("nan")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float, progress: Callable[[str], None], label: str) -> None:
        deadline = self.started + timeout
        last = 0.0
        while time.time() < deadline:
            text = self.log()
            failed = next((m for m in ENGINE_FAILED if m in text), None)
            if self.proc.poll() is not None or failed:
                tail = "\n".join(text.splitlines()[-30:])
                raise RuntimeError(f"{label}: server failed to start (rc={self.proc.poll()}, "
                                   f"{failed or 'exited'}); log {self.log_path}:\n{tail}")
            try:
                c = http.client.HTTPConnection(HOST, self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    self.ready_s = time.time() - self.started
                    return
            except OSError:
                pass
            if time.time() - last >= 10:
                last = time.time()
                progress(f"{label}: starting vLLM ({time.time() - self.started:.0f} s)")
            time.sleep(1.0)
        raise RuntimeError(f"{label}: server not ready in {timeout:.0f} s; log {self.log_path}")

    def kv_tokens(self) -> Optional[int]:
        """vLLM's own figure: 'CPU KV cache size: N tokens'."""
        m = re.search(r"KV cache size: ([\d,]+) tokens", self.log())
        return int(m.group(1).replace(",", "")) if m else None

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its session
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


# --------------------------------------------------------------- client --


@dataclass
class Reply:
    tokens: list[int]
    logprobs: list[float]
    ttft: float  # send -> first token
    itls: list[float]  # gaps between consecutive tokens
    e2e: float
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (vLLM + connector)


def complete(port: int, model: str, prompt: list[int], max_tokens: int, timeout: float) -> Reply:
    """One streamed greedy completion of a token-id prompt."""
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True,
        "stream": True, "stream_options": {"include_usage": True},
    })
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:2000]!r}")
    tokens: list[int] = []
    lps: list[float] = []
    stamps: list[float] = []
    cached = -1
    deadline = t0 + timeout
    for raw in resp:  # server-sent events, one "data: {...}" line each
        if time.perf_counter() > deadline:
            raise TimeoutError(f"completion still streaming after {timeout:.0f} s")
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            cached = int((ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        for ch in ev.get("choices", []):
            lp = ch.get("logprobs") or {}
            new = lp.get("tokens") or []
            if new:
                stamps.append(time.perf_counter())
                tokens += [int(t.split(":", 1)[1]) for t in new]
                lps += [float(x) for x in lp.get("token_logprobs") or []]
    end = time.perf_counter()
    conn.close()
    if not tokens:
        raise RuntimeError("completion returned no tokens")
    return Reply(tokens, lps, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])],
                 end - t0, cached)


def scrape(port: int, timeout: float = 30.0) -> dict[str, float]:
    """Counters and gauges of ``/metrics``, summed over their labels."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode(errors="replace")
    conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_created" in line.split("{")[0]:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


def settled_metrics(port: int, keys: tuple[str, ...], wait_s: float = 20.0) -> dict[str, float]:
    """Scrape until ``keys`` stop changing (vLLM aggregates connector stats
    asynchronously): two equal scrapes 2 s apart, at most ``wait_s``."""
    prev = scrape(port)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        time.sleep(2.0)
        cur = scrape(port)
        if all(cur.get(k) == prev.get(k) for k in keys):
            return cur
        prev = cur
    return prev


# ------------------------------------------------------------- workload --


@dataclass(frozen=True)
class Workload:
    users: int
    rounds: int
    concurrency: int  # requests in flight at most
    system_tokens: int  # shared by every user
    history_tokens: int  # each user's own context, sent in round 0
    question_tokens: int  # new user text per round
    answer_tokens: int  # generated per round (ignore_eos: exactly this many)
    seed: int = 0

    def max_context(self) -> int:
        """Tokens of the last round's prompt plus its answer."""
        return (self.system_tokens + self.history_tokens
                + self.rounds * (self.question_tokens + self.answer_tokens))

    def working_set(self) -> int:
        """Distinct tokens of every conversation at its end (system prompt once)."""
        return self.system_tokens + self.users * (self.max_context() - self.system_tokens)

    def _ids(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    def system(self) -> list[int]:
        return self._ids(self.system_tokens, self.seed * 7919 + 1)

    def history(self, user: int) -> list[int]:
        return self._ids(self.history_tokens, self.seed * 7919 + 1000 + user)

    def question(self, user: int, rnd: int) -> list[int]:
        return self._ids(self.question_tokens, self.seed * 7919 + 100_000 + 1000 * user + rnd)


@dataclass
class Record:
    user: int
    round: int
    prompt_tokens: int
    start: float  # seconds since the workload started
    reply: Optional[Reply] = None
    error: str = ""


@dataclass
class WorkloadResult:
    records: list[Record]
    wall_s: float
    truncated: bool  # the time limit stopped it before every round was sent
    errors: int = field(default=0)


def run_workload(port: int, model: str, wl: Workload, time_limit: float, request_timeout: float,
                 progress: Callable[[str], None], label: str) -> WorkloadResult:
    """Users take turns: a FIFO of ready users, ``wl.concurrency`` sender
    threads; a user whose round finished goes to the back of the queue with
    its next prompt = previous prompt + the generated token ids + a new
    question. Between two rounds of one user the others' rounds run, which is
    what pushes its conversation out of a small KV space."""
    convo = {u: wl.system() + wl.history(u) + wl.question(u, 0) for u in range(wl.users)}
    ready: deque[tuple[int, int]] = deque((u, 0) for u in range(wl.users))
    lock = threading.Lock()
    records: list[Record] = []
    state = {"truncated": False, "errors": 0, "done": 0, "in_flight": 0, "last": 0.0}
    total = wl.users * wl.rounds
    t0 = time.perf_counter()

    def next_job() -> Optional[tuple[int, int, list[int]]]:
        while True:
            with lock:
                if state["errors"]:
                    return None
                if ready:
                    if time.perf_counter() - t0 > time_limit:
                        state["truncated"] = True
                        return None
                    u, r = ready.popleft()
                    state["in_flight"] += 1
                    return u, r, list(convo[u])
                if state["in_flight"] == 0:
                    return None  # every conversation is finished
            time.sleep(0.01)  # a user is in flight; its next round comes back soon

    def sender(i: int) -> None:
        while True:
            job = next_job()
            if job is None:
                return
            u, r, prompt = job
            rec = Record(u, r, len(prompt), time.perf_counter() - t0)
            try:
                rec.reply = complete(port, model, prompt, wl.answer_tokens, request_timeout)
            except Exception as e:  # noqa: BLE001 - reported, stops the workload
                rec.error = f"{type(e).__name__}: {e}"
            with lock:
                records.append(rec)
                if rec.error:
                    state["errors"] += 1
                else:
                    state["done"] += 1
                    if r + 1 < wl.rounds:
                        convo[u] = prompt + rec.reply.tokens + wl.question(u, r + 1)
                        ready.append((u, r + 1))
                state["in_flight"] -= 1
                now = time.perf_counter()
                if now - state["last"] >= 3.0 or state["done"] == total:
                    state["last"] = now
                    ok = [x.reply.ttft for x in records if x.reply]
                    mean = sum(ok) / len(ok) if ok else float("nan")
                    progress(f"{label}: {state['done']}/{total} requests, round {r + 1}/"
                             f"{wl.rounds} of user {u}, mean TTFT {mean:.2f} s, "
                             f"{now - t0:.0f} s")

    threads = [threading.Thread(target=sender, args=(i,), daemon=True, name=f"user-{i}")
               for i in range(wl.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_limit + request_timeout + 60)
    wall = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{label}: senders still running after the time limit")
    errs = [r for r in records if r.error]
    if errs:
        raise RuntimeError(f"{label}: {len(errs)} request(s) failed, first: {errs[0].error}")
    records.sort(key=lambda x: (x.user, x.round))
    return WorkloadResult(records, wall, state["truncated"])
