"""Mooncake store as LMCache's remote backend, against a real
``mooncake_master`` and segment holder (``mooncake_client``) on 127.0.0.1
(tests/support/mooncake_server.py), stopped by PID.

* Startup validation: configurations that cannot work are refused within
  seconds, naming the key (the probe against real stores: no segment
  holder, a metadata-server mismatch; one real engine refusing a legacy key).
* Sharing: engine A stores, engine B (a fresh process with no local CPU
  cache, so every hit comes from Mooncake) hits, on a Llama-like and a
  Gemma-3-like model (every completion equals the no-connector run of the
  same prompt: tokens, logprobs within 1e-3), and on a Qwen3-Next-like model
  with the GDN state (B's output equals vLLM's own prefix-cache hit).
  Two engines that disagree on ``save_chunk_meta`` never read each
  other's entries.
* Faults mid-run: the segment holder killed (B of the Llama pair, after
  its hits); the store full, then the master killed (one run, own store).
  Requests are served exactly (as misses), the engine exits by itself,
  and the failures are counted and logged once (lmcache_bridge/backends/mooncake.py).

Mooncake is installed by ``make system-deps``; without it these tests fail
(mooncake_server.mooncake_bin raises), they never skip.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from faults import CHUNK, FAULT_LOG_TAG, mismatch, run_engine_process
from fault_runs import EXIT_BOUND_S, FLUSH, Run, hits, run_remote

from mooncake_server import MooncakeStore

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

TWO = 2 * CHUNK  # whole chunks of every E prompt


def _config(remote_url: str, extra: dict):
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(remote_url=remote_url, remote_serde="naive", extra_config=extra)


def _check(store: MooncakeStore, **overrides) -> float:
    """Runs the connector's config validation; returns its seconds, not
    counting the first import of LMCache's storage backends (tens of seconds
    on a loaded 2-core machine; the bound is about Mooncake's retries)."""
    import lmcache.v1.storage_backend.connector.mooncakestore_connector  # noqa: F401

    from lmcache_ascend.lmcache_bridge.engine.config import validate_engine_config

    t = time.monotonic()
    validate_engine_config(_config(f"mooncakestore://{store.master_addr}/", store.extra_config(**overrides)), {})
    return time.monotonic() - t


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mooncake")


@pytest.fixture(scope="module")
def store(work):
    """The module's shared store (256 MB held by one segment holder) for
    the probes and the sharing runs; fault runs get their own."""
    with MooncakeStore(work / "shared", segment="256MB") as s:
        yield s


# ---- startup validation against real stores ---------------------------------


def test_working_store_passes_in_seconds(store):
    assert _check(store) < 10


def test_segment_size_zero_without_holder_is_found_empty(work):
    """An empty pool is an outage, not a misconfiguration: found within
    seconds and named; the engine starts without it unless
    ascend_require_remote (tests/integration/test_remote_outage.py)."""
    import lmcache.v1.storage_backend.connector.mooncakestore_connector  # noqa: F401  (see _check)

    from lmcache_ascend.lmcache_bridge.backends import mooncake
    from lmcache_ascend.lmcache_bridge.backends.remote_pool import PoolUnavailableError

    with MooncakeStore(work / "no_holder", holder=False) as s:
        t = time.monotonic()
        with pytest.raises(PoolUnavailableError) as err:
            mooncake.check_config(_config(f"mooncakestore://{s.master_addr}/", s.extra_config()), {})
        assert time.monotonic() - t < 15
    text = str(err.value)
    assert "'mooncake_global_segment_size'=0" in text and "mooncake_client --global_segment_size" in text, text


def test_metadata_server_mismatch_is_named(work):
    """The holder registered through the master's HTTP metadata server;
    an engine configured for P2PHANDSHAKE cannot reach its segment. Mooncake
    answers as for an empty pool (no holder), so it is reported as one
    (the engine starts without the pool), naming both causes."""
    from lmcache_ascend.lmcache_bridge.backends import mooncake
    from lmcache_ascend.lmcache_bridge.backends.remote_pool import PoolUnavailableError

    with MooncakeStore(work / "http_meta", segment="16MB", http_metadata=True) as s:
        assert _check(s) < 10  # the matching metadata server works
        with pytest.raises(PoolUnavailableError) as err:
            mooncake.check_config(_config(f"mooncakestore://{s.master_addr}/",
                                          s.extra_config(mooncake_metadata_server="P2PHANDSHAKE")), {})
    assert "'mooncake_metadata_server'='P2PHANDSHAKE'" in str(err.value), str(err.value)
    assert "no segment holder is running" in str(err.value), str(err.value)


def test_engine_with_ignored_key_is_refused_at_startup(store, work, tiny_model):
    """LMCache's legacy key: Mooncake 0.3.13 ignores it, and without the
    check the engine started after ~90 s of retries and no-opped. The check
    runs before LMCache's engine is built: the worker's first error names
    the key, and Mooncake never retried."""
    env = store.engine_env()
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    extra["master_server_address"] = extra.pop("mooncake_master_server_addr")
    env["LMCACHE_EXTRA_CONFIG"] = json.dumps(extra)
    run = run_engine_process(
        Scenario(model=tiny_model("llama"), phases=[Phase("never", [[1, 2, 3]])]), work, "ignored_key",
        env=env, timeout_s=240,
    )
    assert run.results is None and run.returncode not in (0, None), run.log[-3000:]
    assert "'master_server_address'" in run.log and "'mooncake_master_server_addr'" in run.log, run.log[-3000:]
    assert "Client is not initialized" not in run.log


# ---- sharing, and the segment holder killed ---------------------------------


def _remote_env(store: MooncakeStore, local_cpu: bool) -> dict[str, str]:
    env = store.engine_env()
    env.update(
        LMCACHE_LOCAL_CPU=str(local_cpu),
        LMCACHE_MAX_LOCAL_CPU_SIZE="0.2",
        LMCACHE_CHUNK_SIZE=str(CHUNK),
        # A loaded 2-core machine must not turn a slow lookup into a miss.
        LMCACHE_LOOKUP_TIMEOUT_MS="10000",
    )
    return env


def _failures(log: str) -> list[str]:
    return re.findall(r"Mooncake (\w+) failed \(code (-?\d+|None)\)", log)


def _metric(run: Run, phase: str) -> float:
    """vllm:lmcache_ascend_backend_failures_total at the end of ``phase``
    (cumulative), as vLLM exports it."""
    assert run.proc.results is not None, run.log[-6000:]
    counters = {p.name: p.counters for p in run.proc.results}
    assert counters[phase], f"no connector counters exported in phase {phase}"
    return counters[phase].get("backend_failures", 0)


@pytest.fixture(scope="module")
def llama_pair(work, tiny_model):
    """A stores E0, E1; B (no local CPU cache) hits both from Mooncake,
    then its segment holder is killed before B's 3rd lookup."""
    model = tiny_model("llama")
    with MooncakeStore(work / "llama", segment="64MB") as s:
        a = run_remote(model, work, "llama_a", [("store", ["E0", "E1"], False)], _remote_env(s, True), faulty=False)
        env = _remote_env(s, False)
        env.update(LMCA_FAULT_PID=str(s.holder.pid), LMCA_FAULT_SIGNALS="3:KILL")
        b = run_remote(
            model, work, "llama_b",
            [
                ("shared", ["E0", "E1"], False),  # 0, 1: hits stored by A
                ("holder_killed", ["E0"], True),  # 2: holder killed before this lookup
                ("new", ["E2"], True),  # 3: its store cannot land
                ("again", ["E1", "E2"], True),  # 4, 5
            ],
            env,
        )
        assert s.holder.poll() is not None, "the segment holder was not killed"
    return a, b


def test_llama_engine_b_hits_what_a_stored(llama_pair):
    a, b = llama_pair
    assert a.assert_all_identical() == 2
    assert [a.transfers()[i].stored for i in (0, 1)] == [TWO, TWO]
    assert b.assert_all_identical() == 6
    assert hits(b)[:2] == [(TWO, TWO), (TWO, TWO)]


def test_segment_holder_killed_is_served_as_misses(llama_pair):
    _, b = llama_pair
    assert f"{FAULT_LOG_TAG} sent SIGKILL" in b.log
    for i in range(2, 6):
        hit, loaded = hits(b)[i]
        assert loaded == 0, (i, hits(b))  # never a byte from a dead holder
    fails = _failures(b.log)
    assert fails, "the holder's loss was not logged"
    assert len(fails) == len(set(op for op, _ in fails)), fails  # logged once per kind
    # vLLM's metrics count the failures: none while the holder lived.
    assert _metric(b, "shared") == 0 and _metric(b, "again") > 0, (_metric(b, "shared"), _metric(b, "again"))
    b.assert_exited_in_bound()


# ---- the store full, then the master killed ----------------------------------


@pytest.fixture(scope="module")
def full_then_master_killed(work, tiny_model) -> Run:
    """16 MB (Mooncake's smallest segment) against 42 chunks of 512 KiB:
    later puts are refused (-200). Then the master is killed (one engine run for both faults: each engine
    start costs ~30 s of the CI budget)."""
    model = tiny_model("llama")
    fill = [f"S{i}" for i in range(6)] + [f"E{i}" for i in range(12)]
    # No eviction (Mooncake otherwise evicts 5 % of the objects, leased or
    # not, whichever is oldest when a put finds no room, so which prompt
    # survives would follow timing): the first 28 chunks stay, the rest are
    # refused.
    with MooncakeStore(work / "full", segment="16MB", master_args=(
            "--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0", "--default_kv_lease_ttl=600000")) as s:
        env = _remote_env(s, False)
        env.update(LMCA_FAULT_PID=str(s.master.pid), LMCA_FAULT_SIGNALS="21:KILL")
        run = run_remote(
            model, work, "full_then_master_killed",
            [
                ("fill", fill, False),  # 0..17: the store fills up
                ("first", ["S0"], True),  # 18: stored before it filled: a hit
                ("last", ["E11"], True),  # 19: found no room: a miss
                ("after_kill", ["S0"], True),  # 20: master killed before this lookup
                ("new", ["E0"], True),  # 21
            ],
            env,
        )
        assert s.master.poll() is not None, "the master was not killed"
    return run


def test_store_full_is_served_and_counted(full_then_master_killed):
    run = full_then_master_killed
    assert run.assert_all_identical() == 22
    tr = run.transfers()
    assert (tr[18].hit, tr[18].loaded) == (3 * CHUNK, 3 * CHUNK), tr.get(18)
    assert tr[19].hit == 0, tr.get(19)
    fails = _failures(run.log)
    assert ("put", "-200") in fails, fails  # NO_AVAILABLE_HANDLE: the pool is full
    assert len(fails) == len(set(op for op, _ in fails)), fails  # logged once per kind
    assert _metric(run, "last") > 0, _metric(run, "last")  # refused puts reach vLLM's metrics
    run.assert_exited_in_bound()


def test_master_killed_is_served_as_misses(full_then_master_killed):
    run = full_then_master_killed
    assert f"{FAULT_LOG_TAG} sent SIGKILL" in run.log
    # Mooncake answers is_exist with an error code (-900) once the master
    # is gone; LMCache alone would read it as a hit (then fail the get).
    tr = run.transfers()
    assert (tr[20].hit, tr[21].hit) == (0, 0), (tr.get(20), tr.get(21))
    assert ("lookup", "-900") in _failures(run.log), _failures(run.log)
    assert _metric(run, "after_kill") > _metric(run, "last"), (_metric(run, "last"), _metric(run, "after_kill"))


# ---- sharing on a Gemma-3-like model (several KV cache groups) ---------------


@pytest.fixture(scope="module")
def gemma_pair(work, tiny_model, store):
    model = tiny_model("gemma3")
    a = run_remote(model, work, "gemma_a", [("store", ["S0", "S1"], False)], _remote_env(store, True), faulty=False)
    b = run_remote(model, work, "gemma_b", [("shared", ["S0", "S1"], False)], _remote_env(store, False), faulty=False)
    return a, b


def test_gemma3_engine_b_hits_what_a_stored(gemma_pair):
    a, b = gemma_pair
    assert a.assert_all_identical() == 2
    assert [a.transfers()[i].stored for i in (0, 1)] == [3 * CHUNK] * 2
    assert b.assert_all_identical() == 2
    assert hits(b) == [(3 * CHUNK, 3 * CHUNK)] * 2
    assert not _failures(b.log)
    for r in (a, b):
        r.assert_exited_in_bound()


# ---- instances that disagree on the value format ------------------------------


def test_instances_that_disagree_on_save_chunk_meta_never_read_each_other(work, tiny_model, store):
    """A keeps LMCache's format (save_chunk_meta: true: metadata inside each
    value); B takes the connector's default (values hold the chunk alone,
    read into LMCache's buffers). Were their keys equal, each of B's reads
    would fail on the size and be refused; keyed apart, B just misses and
    computes (its output equals the no-connector run), with no failed get.
    The Llama pair above is the positive control: same format, B hits."""
    model = tiny_model("llama")
    env = _remote_env(store, True)
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    env["LMCACHE_EXTRA_CONFIG"] = json.dumps(dict(extra, save_chunk_meta=True))
    a = run_remote(model, work, "meta_a", [("store", ["E3"], False)], env, faulty=False)
    b = run_remote(model, work, "meta_b", [("other_format", ["E3"], False)], _remote_env(store, False), faulty=False)
    assert a.assert_all_identical() == 1 and a.transfers()[0].stored == TWO
    assert "hold the chunk alone" not in a.log and "hold the chunk alone" in b.log
    assert b.assert_all_identical() == 1
    assert hits(b) == [(0, 0)]
    assert not _failures(b.log), _failures(b.log)


# ---- Qwen3-Next-like: KV and Mamba state shared through Mooncake -------------


QWEN_ENGINE = {"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"}  # as test_mamba_hits


def test_qwen3_next_state_hits_through_mooncake(work, tiny_model, store):
    """A stores a 2000-token prompt (KV and the GDN state at the last block
    boundary vLLM's align mode checkpointed); B, a fresh process with no
    local CPU cache, hits it from Mooncake. Reference: vLLM's own
    prefix-cache hit on the same prompt without any connector (the second
    request of the reference engine), which resumes from the same boundary
    through the same steps. The chunk size is left unset (the connector
    follows vLLM's block size, which vLLM picks per machine)."""
    from lmcache_ascend.cli.tiny_models import token_prompt

    model = tiny_model("qwen3_next")
    prompt = token_prompt(2000, seed=77)
    kw = dict(model=model, dtype="bfloat16", engine_kwargs=QWEN_ENGINE)

    def engine(tag, connector, phases, env):
        sc = Scenario(phases=phases + [Phase("flush", [FLUSH], sequential=True)], connector=connector, **kw)
        run = run_engine_process(sc, work, tag, env=env, timeout_s=400, exit_bound_s=EXIT_BOUND_S)
        assert run.results is not None, f"{tag} failed:\n" + run.log[-6000:]
        return run

    ref = engine("qwen_ref", "none", [Phase("cold", [prompt], sequential=True),
                                      Phase("own_hit", [prompt], sequential=True)], {})
    env = {k: v for k, v in _remote_env(store, True).items() if k != "LMCACHE_CHUNK_SIZE"}
    a = engine("qwen_a", "ascend", [Phase("store", [prompt], sequential=True)], env)
    env_b = {k: v for k, v in _remote_env(store, False).items() if k != "LMCACHE_CHUNK_SIZE"}
    b = engine("qwen_b", "ascend", [Phase("shared", [prompt], sequential=True)], env_b)

    cold, own = ref.results[0].completions[0], ref.results[1].completions[0]
    stored, shared = a.results[0].completions[0], b.results[0].completions[0]
    assert own.num_cached_tokens > 0, "vLLM's own cache did not hit: no reference"
    assert stored.tokens == cold.tokens and mismatch(stored, cold) is None, mismatch(stored, cold)
    # B's hit came from Mooncake (its first request, empty local cache) and
    # ends where vLLM's own hit does: the KV and the state at that boundary.
    assert shared.num_cached_tokens == own.num_cached_tokens, (shared.num_cached_tokens, own.num_cached_tokens)
    state = re.findall(r"Mamba state \(\d+ bytes each\): loaded (at \d+|none)", b.log)
    assert state and state[0] == f"at {own.num_cached_tokens}", state
    assert not _failures(b.log)
    assert mismatch(shared, own) is None, mismatch(shared, own)
    assert shared.tokens == cold.tokens
    for r in (a, b):
        assert not r.timed_out and not r.hung_at_exit and r.returncode == 0
