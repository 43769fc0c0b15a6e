"""A damaged or vanished entry never takes a multi-group model down.

vLLM cannot recover from a failed load when a model has several KV cache
groups (Gemma-3: full and sliding-window attention): 0.23-0.29 crash on a
tuple unpack, 0.30 recomputes the whole request, 0.32 raises "A KV connector
reported block-level load failures (invalid_block_ids) which is not
supported for models with multiple KV cache groups". The connector's
lookups therefore read and verify every chunk they report and hold it until
the load (lmcache_bridge/integrity/staging.py), so no load fails afterwards.

Engine A stores prompts through a real Redis (LMCache's remote backend,
local CPU cache on). The test then damages entries in Redis the way a
failing store or another writer would, and engine B (a fresh process,
empty local cache) serves the same prompts, with a request's chunks deleted and
Redis killed between a lookup and its load. Every completion must equal a
run without the connector, B must stay up and report no load error, each
bad entry must be counted once in the connector's metrics and logged with
its key, and the next requests must not pay for it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt
from faults import (
    CHUNK,
    EngineProcess,
    chunk_hashes,
    faulty_transfer_config,
    mismatch,
    reference_outputs,
    reliability_prompts,
    request_transfers,
    run_engine_process,
)

from redis_server import RedisServer, ensure_redis_server
from redis_entries import chunk_base, redis_engine_env, rewrite_metadata_smaller

pytestmark = [pytest.mark.engine, pytest.mark.redis]

# Damaged in Redis between A and B: prompt -> (chunk, what).
DAMAGE = {
    "S1": (1, "flip"),  # bytes flipped: checksum
    "S2": (0, "truncate"),  # value shorter than its metadata: unreadable
    "S3": (1, "shrink"),  # truncated, metadata rewritten to match: size check
    "S4": (2, "nonsense"),  # metadata overwritten with garbage
    "S5": (1, "foreign"),  # S0's chunk 1 (well-formed) under S5's key
    "E2": (1, "vanish"),  # value deleted, metadata kept
}
LOAD = ["S0", "S1", "S2", "S3", "S4", "S5", "E2"]
# Between the lookup and the load: the chunks deleted (E0), Redis killed (E1).
BETWEEN = ["E0", "E1"]
STORED = LOAD + BETWEEN


def whole(name: str) -> int:
    return len(reliability_prompts()[name]) // CHUNK * CHUNK


def expected_hit(name: str) -> int:
    """Tokens of the chunks before the damaged one."""
    return DAMAGE[name][0] * CHUNK if name in DAMAGE else whole(name)


@dataclass
class Run:
    a: EngineProcess
    b: EngineProcess
    ref: dict


def _damage(server: RedisServer, bases: dict[str, list[bytes]]) -> None:
    with server.client() as c:
        for name, (chunk, what) in DAMAGE.items():
            base = bases[name][chunk]
            val = c.get(base + b"kv_bytes")
            if what == "flip":
                v = bytearray(val)
                for off in (17, len(v) // 3, len(v) // 2 + 5):
                    v[off] ^= 0xFF
                c.set(base + b"kv_bytes", bytes(v))
            elif what == "truncate":
                c.set(base + b"kv_bytes", val[: len(val) // 2])
            elif what == "shrink":
                md, new_len = rewrite_metadata_smaller(c.get(base + b"metadata"), len(val) // 2)
                c.set(base + b"metadata", md)
                c.set(base + b"kv_bytes", val[:new_len])
            elif what == "nonsense":
                md = c.get(base + b"metadata")
                c.set(base + b"metadata", bytes((i * 37 + 11) % 256 for i in range(len(md))))
            elif what == "foreign":
                src = bases["S0"][chunk]
                c.set(base + b"kv_bytes", c.get(src + b"kv_bytes"))
                c.set(base + b"metadata", c.get(src + b"metadata"))
            elif what == "vanish":
                assert c.delete(base + b"kv_bytes") == 1
            else:
                raise AssertionError(what)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_model) -> Run:
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("gemma3")
    work = tmp_path_factory.mktemp("load_reliability")
    ref = reference_outputs(model, work)
    prompts = reliability_prompts()
    with RedisServer(work) as server:
        env = redis_engine_env(server.url)
        a = run_engine_process(
            Scenario(model=model, phases=[Phase("store", [prompts[n] for n in STORED], sequential=True)]),
            work, "engine_a", env=env, timeout_s=300,
        )
        assert a.results is not None, "engine A failed:\n" + a.log[-6000:]
        with server.client() as c:
            keys = c.keys()
        bases = {n: [chunk_base(keys, h) for h in chunk_hashes(prompts[n])] for n in STORED}
        _damage(server, bases)
        first_between = len(LOAD) + 1  # the scheduler's lookups are numbered from 1
        b = run_engine_process(
            Scenario(
                model=model,
                connector="none",
                engine_kwargs={
                    "kv_transfer_config": faulty_transfer_config(),
                    "distributed_executor_backend": "uni",
                },
                phases=[
                    Phase("load", [prompts[n] for n in LOAD], sequential=True),
                    Phase("between", [prompts[n] for n in BETWEEN], sequential=True),
                    Phase("again", [prompts[n] for n in STORED], reset_prefix_cache=True, sequential=True),
                    # No whole chunk: flushes the worker's summary line of the
                    # last request (logged when its finish reaches the worker).
                    Phase("flush", [token_prompt(100, seed=999)], sequential=True),
                ],
            ),
            work,
            "engine_b",
            env={
                **env,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "LMCA_FAULT_AFTER_LOOKUP": f"{first_between}:dropkeys:{server.port},"
                f"{first_between + 1}:kill:{server.pid}",
            },
            timeout_s=400,
        )
    return Run(a, b, ref)


def _phase(run: EngineProcess, index: int, names: list[str]) -> dict:
    assert run.results is not None, "engine failed:\n" + run.log[-8000:]
    return dict(zip(names, run.results[index].completions))


def test_engine_b_stays_up_and_every_output_equals_no_connector(gemma3):
    assert gemma3.b.returncode == 0 and not gemma3.b.timed_out, gemma3.b.log[-8000:]
    assert "invalid_block_ids" not in gemma3.b.log
    for index, names in ((0, LOAD), (1, BETWEEN), (2, STORED)):
        for name, comp in _phase(gemma3.b, index, names).items():
            assert mismatch(comp, gemma3.ref[name]) is None, (index, name, mismatch(comp, gemma3.ref[name]))


def test_hits_end_before_the_bad_chunk_and_nothing_fails_to_load(gemma3):
    tr = request_transfers(gemma3.b.log)
    for i, name in enumerate(LOAD):
        t = tr.get(i)
        assert t is not None, (name, sorted(tr))
        assert (t.hit, t.loaded, t.load_error) == (expected_hit(name), expected_hit(name), False), (name, t)
    # Its chunks deleted, then Redis killed, after the lookup: the load copies what the
    # lookup verified and holds.
    for j, name in enumerate(BETWEEN):
        t = tr.get(len(LOAD) + j)
        assert t is not None and (t.hit, t.loaded, t.load_error) == (whole(name),) * 2 + (False,), (name, t)
    # Afterwards every prompt hits whole from B's CPU cache: the recomputed
    # chunks were stored, the verified ones written back.
    for j, name in enumerate(STORED):
        t = tr.get(len(LOAD) + len(BETWEEN) + j)
        assert t is not None and (t.hit, t.load_error) == (whole(name), False), (name, t)


def test_each_bad_entry_is_counted_once_and_logged_with_its_key(gemma3):
    load, between, again = (gemma3.b.results[i].counters for i in range(3))
    assert load, "the engine exported no connector counters"
    refused = load.get("checksum_failures", 0) + load.get("unreadable_chunks", 0)
    assert refused == len(DAMAGE), load
    # Not read again: no new refusal, no load error, no fallback read.
    for counters in (between, again):
        assert counters.get("checksum_failures", 0) + counters.get("unreadable_chunks", 0) == refused, counters
    assert again.get("load_errors", 0) == 0 and again.get("unstaged_loads", 0) == 0, again
    lines = [l for l in gemma3.b.log.splitlines() if "refused at lookup" in l]
    assert len(lines) == len(DAMAGE), lines
    assert all("@" in l for l in lines)  # the LMCache key is named


# ---- Qwen3-Next (Mamba state hits) on LMCache's local disk backend -----------

STATE_ENGINE = {"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"}


@dataclass
class StateRun:
    block: int
    results: list
    log: str
    ref: list


@pytest.fixture(scope="module")
def qwen3_next_disk(tmp_path_factory, tiny_model) -> StateRun:
    """One engine, LMCache's disk backend only (no CPU cache, so every hit
    is read from disk): a prompt is stored, then chunk 1's file is damaged
    just before the prompt comes again, then it comes a third time."""
    from lmcache_ascend.cli.plan_file import plan_env, read_plan

    from .conftest import run_engine_in, run_reference_in

    model = tiny_model("qwen3_next")
    work = tmp_path_factory.mktemp("load_reliability_state")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # vLLM picks the hybrid block size B per machine: read it, never assume.
    plan_file = work / "plan.json"
    _, log = run_engine_in(
        work, Scenario(model=model, phases=[], dtype="bfloat16", engine_kwargs=STATE_ENGINE,
                       env={**env, **plan_env(plan_file)})
    )
    record = read_plan(plan_file)
    assert record["state"] and record["state"]["enabled"], log[-4000:]
    b = record["state"]["block_size"]
    prompt = token_prompt(2 * b + 48, seed=11)
    # Budget B: every prefill step ends on a block boundary, where a state is stored.
    kwargs = {**STATE_ENGINE, "max_num_batched_tokens": b}
    phases = [
        Phase("store", [prompt], sequential=True),
        Phase("damaged", [prompt], reset_prefix_cache=True, sequential=True),
        Phase("again", [prompt], reset_prefix_cache=True, sequential=True),
        Phase("flush", [token_prompt(100, seed=999)], sequential=True),
    ]
    disk = work / "disk"
    disk.mkdir()
    results, log = run_engine_in(
        work,
        Scenario(
            model=model, phases=phases, dtype="bfloat16", connector="none",
            engine_kwargs={**kwargs, "kv_transfer_config": faulty_transfer_config()},
            env={
                **env,
                "LMCACHE_LOCAL_CPU": "False",
                "LMCACHE_LOCAL_DISK": f"file://{disk}/",
                "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
                "LMCACHE_CHUNK_SIZE": str(b),
                "LMCA_FAULT_BEFORE_LOOKUP": "2:flipchunk:1",
            },
        ),
    )
    ref, _ = run_reference_in(
        work, Scenario(model=model, phases=phases, dtype="bfloat16", connector="none", engine_kwargs=kwargs, env=env)
    )
    return StateRun(b, results, log, ref)


def test_state_model_on_disk_hits_the_last_intact_boundary_and_repairs(qwen3_next_disk):
    run, b = qwen3_next_disk, qwen3_next_disk.block
    for got, ref in zip(run.results, run.ref, strict=True):
        assert [c.tokens for c in got.completions] == [c.tokens for c in ref.completions], got.name
    tr = request_transfers(run.log)
    assert (tr[0].hit, tr[0].stored) == (0, 2 * b), tr[0]
    # Chunk 1 refused at lookup: the hit falls back to the boundary before
    # it (chunk 0 and the state stored at B), and nothing fails to load.
    assert (tr[1].hit, tr[1].loaded, tr[1].load_error) == (b, b, False), tr[1]
    states = dict(re.findall(r"lmcache-ascend: request (\d+)-\S+: hit .*?Mamba state \(\d+ bytes each\): loaded (at \d+|none)", run.log))
    assert (states.get("1"), states.get("2")) == (f"at {b}", f"at {2 * b}"), states
    # The refused file was removed and chunk 1 stored again: a whole hit.
    assert (tr[2].hit, tr[2].loaded, tr[2].load_error) == (2 * b, 2 * b, False), tr[2]
    damaged, again = run.results[1].counters, run.results[2].counters
    assert damaged.get("checksum_failures", 0) == 1 and damaged.get("load_errors", 0) == 0, damaged
    assert again.get("checksum_failures", 0) == 1 and again.get("load_errors", 0) == 0, again
    refused = [l for l in run.log.splitlines() if "refused at lookup" in l]
    assert len(refused) == 1 and "LocalDiskBackend" in refused[0] and "removed" in refused[0], refused
