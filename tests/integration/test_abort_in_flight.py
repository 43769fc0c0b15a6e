"""A request that goes away while its fetch is in flight (issue 36, bad
input): a client that disconnects while the lookup of its request is still
reading and verifying chunks from Redis, on multi-group models (Gemma-3:
sliding and full attention groups; Qwen3-Next-like: Mamba state beside
attention) and on MLA (DeepSeek-V2-like), in vLLM's OpenAI server as users
run it.

What must hold:

* the abort costs nothing else: the server keeps serving, the same prompt
  later hits its whole stored prefix from Redis, and that hit's output is
  vLLM's own prefix-cache hit's, token for token and logprob for logprob
  (same step boundaries, tolerance 0; on MLA, which vLLM-CPU runs without
  its own prefix caching, a hit from Redis made before the abort);
* nothing stays pinned: the chunks the orphaned lookup staged are released
  with the next step, and the connector's close finds none held;
* the event is counted (``abandoned_transfers``) and the connector's
  counters show no load error and no checksum failure;
* on MLA, the same server then serves the prompt with an entry damaged in
  Redis: refused at lookup and counted, the hit ends before it, and the
  output equals a hit with the same boundary (tolerance 0).

And when the pool stalls past LMCache's lookup timeout (the scheduler stops
waiting while the worker's lookup still reads): the request is a miss equal
to the cold run, and what the late lookup stages is released as it lands.

The lookup is held by the faulty connector (support/faults.py,
``LMCA_FAULT_LOOKUP_DELAY``): the second lookup sleeps HOLD_S seconds on the
lookup thread before it reads Redis, as a large remote fetch would take
that long. The client gives up after ABORT_AFTER_S.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from faults import chunk_hashes, faulty_transfer_config, support_env
from mooncake_server import free_port
from openai_server import Server, wait_ready
from redis_entries import chunk_base
from redis_server import RedisServer, ensure_redis_server
from lmcache_ascend.cli.tiny_models import token_prompt

from .test_mamba_hits import ENGINE
from .test_mamba_hits import state_model  # noqa: F401  (the fixture: B read from the worker's plan)

pytestmark = [pytest.mark.engine, pytest.mark.redis]

CHUNK = 256
HOLD_S = 8
ABORT_AFTER_S = 2


def _post(srv: Server, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(srv.base + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _metrics(srv: Server) -> dict[str, float]:
    with urllib.request.urlopen(srv.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"vllm:lmcache_ascend_(\w+)_total(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class AbortRun:
    cold: dict  # the prompt computed cold (stored to Redis)
    hit: dict  # the first hit after the abort: the whole prefix from Redis
    again: dict  # the same prompt once more, with the same step boundaries
    before: dict | None  # a hit from Redis before the abort (hit_before)
    damaged: "Damaged | None"  # with damage=True
    chunk: int
    counters: dict[str, float]
    log: str
    returncode: int | None


@dataclass
class Damaged:
    """The prompt's chunks 1 and 2 deleted from Redis, so a hit loads chunk 0
    only (``short``; vLLM computes the rest, and the connector stores it
    again), then chunk 1 damaged in Redis (``hit``: refused at lookup, so the
    hit is chunk 0 again, with the same step boundaries as ``short``)."""

    short: dict
    hit: dict
    counters: dict[str, float]  # after both


def _damage_after(srv: Server, redis: RedisServer, body: dict, chunk: int) -> Damaged:
    with redis.client() as c:
        keys = c.keys()
        bases = [chunk_base(keys, h) for h in chunk_hashes(body["prompt"], chunk)]
        assert len(bases) == 3
        for base in bases[1:]:
            c.delete(base + b"kv_bytes", base + b"metadata")
    short = _post(srv, "/v1/completions", body)
    deadline = time.monotonic() + 60  # the recomputed chunks' puts are asynchronous
    with redis.client() as c:
        while c.get(bases[1] + b"kv_bytes") is None or c.get(bases[1] + b"metadata") is None:
            assert time.monotonic() < deadline, "the recomputed chunk 1 never reached Redis"
            time.sleep(0.2)
        val = bytearray(c.get(bases[1] + b"kv_bytes") or b"")
        for off in (17, len(val) // 2):
            val[off] ^= 0xFF
        c.set(bases[1] + b"kv_bytes", bytes(val))
    hit = _post(srv, "/v1/completions", body)
    deadline = time.monotonic() + 60
    while True:
        counters = _metrics(srv)
        if counters.get("checksum_failures"):
            break
        assert time.monotonic() < deadline, counters
        time.sleep(2)
    return Damaged(short, hit, counters)


def _redis_only_server(tmp_path, redis: RedisServer, model: str, dtype: str, chunk: int,
                       env_extra: dict[str, str], engine_args: tuple[str, ...] = ()) -> Server:
    """vLLM's OpenAI server with the connector (its fault-injecting
    subclass, which injects nothing unless ``env_extra`` names a fault) and
    Redis as LMCache's only store, lookups beside the step."""
    env = support_env({
        **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        # Redis only: every hit is read, verified and staged by the lookup.
        "LMCACHE_REMOTE_URL": redis.url, "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_CHUNK_SIZE": str(chunk),
        "LMCACHE_ASCEND_ASYNC_LOOKUP": "on", **env_extra,
    })
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
           "--max-model-len", str(max(2048, 4 * chunk)), "--seed", "0", "--shutdown-timeout", "15",
           "--kv-transfer-config", json.dumps(faulty_transfer_config()), *engine_args]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
                                start_new_session=True)
    return Server("connector", proc, port, log_path)


def _abort_during_fetch(tmp_path, model: str, dtype: str, hit_before: bool = False, chunk: int = CHUNK,
                        engine_args: tuple[str, ...] = (), damage: bool = False) -> AbortRun:
    """A server with Redis as its only store: the prompt (three chunks and
    20 tokens) computed cold, (with ``hit_before``, hit once from Redis
    before anything is aborted), then asked again by a client that leaves
    while the lookup is held, then other requests, then the prompt twice
    more (with ``damage``, then ``_damage_after``)."""
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    prompt = token_prompt(3 * chunk + 20, seed=91)
    other = token_prompt(chunk + 40, seed=92)
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    with RedisServer(tmp_path) as redis:
        srv = _redis_only_server(tmp_path, redis, model, dtype, chunk, {
            "LMCA_FAULT_LOOKUP_DELAY": f"{3 if hit_before else 2}:{HOLD_S}",
            # Every later request must hit, so no lookup may give up on a
            # slow machine: LMCache's 3 s default is a property of the
            # machine's load, not of what is tested here (the held lookup
            # waits before its RPC). A lookup that gives up is a miss,
            # tested below with the store paused.
            "LMCACHE_LOOKUP_TIMEOUT_MS": "30000",
        }, engine_args)
        proc = srv.proc
        try:
            wait_ready(srv)
            cold = _post(srv, "/v1/completions", body)  # lookup 1: a miss; stored to Redis
            assert _post(srv, "/reset_prefix_cache").get("success") is True
            before = None
            if hit_before:  # lookup 2
                before = _post(srv, "/v1/completions", body)
                assert _post(srv, "/reset_prefix_cache").get("success") is True
            # This lookup is held HOLD_S s; the client leaves after ABORT_AFTER_S.
            t0 = time.monotonic()
            with pytest.raises((TimeoutError, urllib.error.URLError)):
                _post(srv, "/v1/completions", body, timeout=ABORT_AFTER_S)
            # Meanwhile the server serves others; once the held lookup ended
            # (it staged the chunks of a request that is gone), a step drops them.
            _post(srv, "/v1/completions", {**body, "prompt": other})
            time.sleep(max(0.0, HOLD_S + 2 - (time.monotonic() - t0)))
            _post(srv, "/v1/completions", {**body, "prompt": other, "max_tokens": 2})
            hit = _post(srv, "/v1/completions", body)  # the whole prefix from Redis
            again = _post(srv, "/v1/completions", body)
            deadline = time.monotonic() + 60  # vLLM aggregates connector stats asynchronously
            while True:
                counters = _metrics(srv)
                if counters.get("abandoned_transfers") and counters.get("loaded_tokens"):
                    break
                assert time.monotonic() < deadline, counters
                time.sleep(2)
            damaged = _damage_after(srv, redis, body, chunk) if damage else None
        finally:
            srv.stop()
        log = srv.log()
    return AbortRun(cold, hit, again, before, damaged, chunk, counters, log, proc.returncode)


def _story(log: str, counters: dict | None) -> str:
    """What a failed check needs to be understood without the server's log
    (a CI run keeps none): each request's summary and lookup, every warning
    and error of the connector, LMCache and the faults, and the counters."""
    keep = ("lmcache-ascend: request", "lookup staged", "lmcache-ascend-faults", "WARNING", "ERROR",
            "Traceback", "POST /v1/completions", "closing:")
    lines = [line[-400:] for line in log.splitlines() if any(k in line for k in keep)]
    return "\n".join(lines[-80:]) + f"\ncounters: {counters}"


def _loaded(log: str) -> list[int]:
    """Tokens each finished request loaded, in the order they finished."""
    return [int(x) for x in re.findall(r"request \S+: hit \d+ tokens \(vLLM had \d+\), loaded (\d+) tokens", log)]


def _check_nothing_lost_or_held(run: AbortRun, hits_loaded: int) -> None:
    log, counters = run.log, run.counters
    # The request went away while its lookup was held (the fault's own log
    # line is not printed by every vLLM's engine-core logging: ours is).
    assert "ended with its lookup or load in flight" in log, log[-4000:]
    # The aborted request was never served (no summary line names a hit for
    # it); the later requests hit the whole stored prefix.
    loaded = _loaded(log)
    assert loaded.count(3 * run.chunk) == hits_loaded, f"loaded {loaded}\n{_story(run.log, run.counters)}"
    assert counters["abandoned_transfers"] == 1, _story(run.log, run.counters)
    assert counters.get("load_errors", 0) == 0 and counters.get("checksum_failures", 0) == 0, \
        _story(run.log, run.counters)
    # The two hits after the abort are equal bit for bit (same step boundaries).
    a, b = run.hit["choices"][0], run.again["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    # The connector's close found nothing of the orphaned lookup still held.
    closes = re.findall(r"lmcache-ascend: closing: (\d+) staged chunk\(s\) still held", log)
    assert closes and all(n == "0" for n in closes), (closes, log[-3000:])
    assert run.returncode == 0, log[-3000:]


# vLLM's answer to a None from get_num_new_matched_tokens differs by release
# (0.23-0.30 skip the request for the step, 0.32 defers it), and so does how
# an abort reaches a request that is still waiting.
@pytest.mark.compat("connector_hooks")
def test_a_client_gone_during_its_fetch_leaves_nothing_pinned_and_costs_nothing_else(tmp_path, tiny_model):
    """Gemma-3: the hit after the abort comes from Redis, the one after it
    is vLLM's own prefix-cache hit (same boundary, tolerance 0), and their
    text is the text computed cold."""
    run = _abort_during_fetch(tmp_path, tiny_model("gemma3"), "float32")
    _check_nothing_lost_or_held(run, hits_loaded=1)
    # Both equal the text computed cold.
    assert run.hit["choices"][0]["text"] == run.cold["choices"][0]["text"]


def test_mla_client_gone_during_its_fetch_leaves_nothing_pinned(tmp_path, tiny_model):
    """DeepSeek-V2-like MLA (one 576-wide latent, bf16: the only MLA
    vLLM-CPU runs). vLLM-CPU turns its own prefix caching and chunked
    prefill off for MLA, so every hit comes from Redis and no cold run has a
    hit's step boundaries (a bf16 prefill of all 788 tokens differs in the
    last bits). The reference is a hit from Redis before anything was
    aborted: the hits after the abort equal it bit for bit. Primary stack
    only: the abort path does not depend on the layout, and the Gemma-3
    case runs on every hook set."""
    run = _abort_during_fetch(tmp_path, tiny_model("deepseek_v2"), "bfloat16", hit_before=True, damage=True)
    _check_nothing_lost_or_held(run, hits_loaded=3)
    assert run.before is not None
    ref = run.before["choices"][0]
    for got in (run.hit["choices"][0], run.again["choices"][0]):
        assert got["text"] == ref["text"]
        assert got["logprobs"]["token_logprobs"] == ref["logprobs"]["token_logprobs"]
    # A damaged entry (issue 36, a fault during a fetch) costs a recompute,
    # never an output: the hit with chunk 1 refused equals the hit of chunk 0
    # alone (same boundaries, tolerance 0).
    d = run.damaged
    assert d is not None
    assert d.hit["choices"][0]["text"] == d.short["choices"][0]["text"]
    assert d.hit["choices"][0]["logprobs"]["token_logprobs"] == d.short["choices"][0]["logprobs"]["token_logprobs"]
    loaded = _loaded(run.log)
    assert loaded[-2:] == [run.chunk, run.chunk], f"loaded {loaded}\n{_story(run.log, run.counters)}"
    refused = [line for line in run.log.splitlines() if "refused at lookup" in line]
    assert len(refused) == 1 and "checksum" in refused[0], _story(run.log, run.counters)
    assert d.counters["checksum_failures"] == 1 and d.counters.get("load_errors", 0) == 0, \
        f"{d.counters}\n{_story(run.log, run.counters)}"


# The lookup's RPC gives up after this (LMCache's lookup_timeout_ms, set
# low to keep the test short), while Redis stays paused for PAUSE_MS: the
# worker's lookup lands PAUSE_MS - LOOKUP_TIMEOUT_MS later, long after the
# request it read for was computed as a miss and finished.
LOOKUP_TIMEOUT_MS = 1000
PAUSE_MS = 5000


def test_mla_fetch_that_outlives_its_lookup_timeout_is_a_miss_and_holds_nothing(tmp_path, tiny_model):
    """A remote store that stalls during a fetch (issue 36: a fault during an
    asynchronous fetch; Redis's CLIENT PAUSE, as a saturated or failing-over
    pool would stall): the scheduler stops waiting after LMCache's
    lookup_timeout_ms and computes the request, which equals the cold run
    bit for bit (the same prefill of every token). The worker's lookup
    still reads the whole prefix once Redis answers, after the request has
    finished: those chunks are released when that lookup lands, and the
    connector's close finds none held (before, they stayed until the
    staging's 300 s TTL). Once Redis answers, the prompt hits its whole
    prefix again and equals the hit from before the stall (tolerance 0).
    MLA: vLLM-CPU has no prefix caching for it, so each hit is Redis's."""
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("deepseek_v2")
    body = {"model": model, "prompt": token_prompt(3 * CHUNK + 20, seed=93), "max_tokens": 6, "temperature": 0,
            "logprobs": 1}
    with RedisServer(tmp_path) as redis:
        srv = _redis_only_server(tmp_path, redis, model, "bfloat16", CHUNK,
                                 {"LMCACHE_LOOKUP_TIMEOUT_MS": str(LOOKUP_TIMEOUT_MS)})
        try:
            wait_ready(srv)
            cold = _post(srv, "/v1/completions", body)  # stored to Redis
            before = _post(srv, "/v1/completions", body)  # the reference hit
            with redis.client() as c:
                c.command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
            paused_at = time.monotonic()
            stalled = _post(srv, "/v1/completions", body)
            served_s = time.monotonic() - paused_at
            time.sleep(max(0.0, PAUSE_MS / 1000 + 2 - (time.monotonic() - paused_at)))
            after = _post(srv, "/v1/completions", body)
            deadline = time.monotonic() + 60  # vLLM aggregates connector stats asynchronously
            while True:
                counters = _metrics(srv)
                if counters.get("lookup_failures") and counters.get("loaded_tokens", 0) >= 6 * CHUNK:
                    break
                assert time.monotonic() < deadline, _story(srv.log(), counters)
                time.sleep(2)
        finally:
            srv.stop()
        log = srv.log()
    story = _story(log, counters)
    # The stalled request did not wait for the stall: it was served while
    # Redis was still paused (its lookup gave up, and it was computed).
    assert served_s < PAUSE_MS / 1000, (served_s, story)
    loaded = _loaded(log)
    assert loaded == [0, 3 * CHUNK, 0, 3 * CHUNK], f"loaded {loaded}\n{story}"
    assert "LMCache lookup got no answer" in log, story
    # The worker says why, once, with what to change.
    assert len(re.findall(r"longer than LMCache's lookup_timeout_ms \(1000 ms\)", log)) == 1, story
    assert counters["lookup_failures"] == 1, story
    assert counters.get("load_errors", 0) == 0 and counters.get("checksum_failures", 0) == 0, story
    for got, ref in ((stalled, cold), (after, before)):
        assert got["choices"][0]["text"] == ref["choices"][0]["text"], story
        assert got["choices"][0]["logprobs"]["token_logprobs"] == ref["choices"][0]["logprobs"]["token_logprobs"]
    # The worker's lookup did read the prefix during the stall (it landed
    # late), and nothing it staged was left held.
    assert len(re.findall(r"lookup staged 3 chunk\(s\)", log)) == 3, story
    closes = re.findall(r"lmcache-ascend: closing: (\d+) staged chunk\(s\) still held", log)
    assert closes == ["0"], story
    assert srv.proc.returncode == 0, story


def test_state_model_client_gone_during_its_fetch_leaves_nothing_pinned(tmp_path, state_model):
    """Qwen3-Next-like (Mamba/GDN layers beside full attention, align mode):
    the held lookup stages KV chunks and the Mamba state at their boundary.
    Chunks of B tokens (the block size vLLM picked on this machine, read
    from the worker's plan) and a prefill budget of B, as in test_mamba_hits:
    the hit from Redis after the abort loads the state at 3B, and the next
    request is vLLM's own prefix-cache hit on the state block that load
    wrote; both compute the 20-token tail in one step, so they are equal at
    tolerance 0, and equal the text computed cold. Primary stack only."""
    m = state_model("qwen3_next")
    args = ("--enable-prefix-caching", "--mamba-ssm-cache-dtype", ENGINE["mamba_ssm_cache_dtype"],
            "--max-num-batched-tokens", str(m.block))
    run = _abort_during_fetch(tmp_path, m.path, "bfloat16", chunk=m.block, engine_args=args)
    _check_nothing_lost_or_held(run, hits_loaded=1)
    assert run.hit["choices"][0]["text"] == run.cold["choices"][0]["text"]
    assert re.search(rf"Mamba state \(\d+ bytes each\): loaded at {3 * m.block}\b", run.log), run.log[-3000:]
