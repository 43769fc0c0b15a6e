"""Two vLLM engines, two processes, one Redis: sharing and damaged entries.

Engine A (fresh process) stores six prompts through LMCache's Redis remote
backend (plus its local CPU cache). The test then damages some of the
stored entries directly in Redis, and engine B (another fresh process,
empty local cache) serves the same prompts:

* S0 intact                          -> external hit of all 3 chunks
* S1 chunk 1: bytes flipped          -> our checksum refuses it
* S2 chunk 0: value truncated        -> LMCache's get fails (size mismatch)
* S3 chunk 1: truncated, metadata rewritten to match
                                     -> our size check refuses it
* S4 chunk 2: value deleted, metadata kept
                                     -> LMCache returns nothing for it
* S5 chunk 0: both keys deleted      -> plain miss at lookup

The lookup reads and verifies what it reports (lmcache_bridge/integrity/staging.py),
so each hit ends before the bad chunk and no load fails; the recomputed
chunks are stored again, and the second pass hits them whole.

Every completion of both engines must equal the no-connector run (tokens
and logprobs). Both engine processes must exit within a bound after their
workload although LMCache 0.5.6's Redis close never returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt
from faults import (
    CHUNK,
    MULTIPROCESS,
    EngineProcess,
    chunk_hashes,
    mismatch,
    reference_outputs,
    reliability_prompts,
    request_transfers,
    run_engine_process,
)

from redis_entries import chunk_base, redis_engine_env, rewrite_metadata_smaller
from redis_server import RedisServer, ensure_redis_server

pytestmark = [pytest.mark.engine, pytest.mark.redis]

NAMES = [f"S{i}" for i in range(6)]
CHUNKS_PER_PROMPT = 3
FULL = CHUNKS_PER_PROMPT * CHUNK
EXIT_BOUND_S = 60.0  # start of the last phase -> process gone


@dataclass
class Shared:
    a: EngineProcess
    b: EngineProcess
    keys_after_a: list[bytes]
    dbsize_after_a: int
    chunk_keys: dict[str, list[bytes]]  # prompt -> base key of each chunk
    damage_log: list[str]
    ref: dict


def _damage(server: RedisServer, chunk_keys: dict[str, list[bytes]]) -> list[str]:
    done = []
    with server.client() as c:
        k = chunk_keys["S1"][1] + b"kv_bytes"
        val = bytearray(c.get(k))
        for off in (17, len(val) // 3, len(val) // 2 + 5):
            val[off] ^= 0xFF
        c.set(k, bytes(val))
        done.append("S1 chunk 1: 3 bytes flipped")

        k = chunk_keys["S2"][0] + b"kv_bytes"
        val = c.get(k)
        c.set(k, val[: len(val) // 2])
        done.append(f"S2 chunk 0: value truncated {len(val)} -> {len(val) // 2} bytes")

        base = chunk_keys["S3"][1]
        val = c.get(base + b"kv_bytes")
        md, new_len = rewrite_metadata_smaller(c.get(base + b"metadata"), len(val) // 2)
        c.set(base + b"metadata", md)
        c.set(base + b"kv_bytes", val[:new_len])
        done.append(f"S3 chunk 1: truncated {len(val)} -> {new_len} bytes, metadata rewritten to match")

        assert c.delete(chunk_keys["S4"][2] + b"kv_bytes") == 1
        done.append("S4 chunk 2: kv_bytes deleted, metadata kept")

        assert c.delete(chunk_keys["S5"][0] + b"kv_bytes", chunk_keys["S5"][0] + b"metadata") == 2
        done.append("S5 chunk 0: both keys deleted")
    return done


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model) -> Shared:
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("llama")
    work = tmp_path_factory.mktemp("redis_sharing")
    ref = reference_outputs(model, work)
    prompts = reliability_prompts()
    with RedisServer(work) as server:
        env = redis_engine_env(server.url)
        # A: vLLM's multiprocess engine core (the connector's halves in two
        # processes), B: everything in one process; both must exit in time.
        a = run_engine_process(
            Scenario(model=model, phases=[Phase("store", [prompts[n] for n in NAMES], sequential=True)]),
            work,
            "engine_a",
            env={**env, **MULTIPROCESS},
            timeout_s=300,
            exit_bound_s=EXIT_BOUND_S,
        )
        assert a.results is not None, "engine A failed:\n" + a.log[-6000:]
        with server.client() as c:
            keys = c.keys()
            dbsize = c.dbsize()
        chunk_keys = {
            n: [chunk_base(keys, h) for h in chunk_hashes(prompts[n])] for n in NAMES
        }
        damage_log = _damage(server, chunk_keys)
        # B runs vLLM in one process (no engine-core / worker processes),
        # so nothing but our own shutdown path can end LMCache's threads.
        b = run_engine_process(
            Scenario(
                model=model,
                phases=[
                    Phase("load", [prompts[n] for n in NAMES], sequential=True),
                    Phase("again", [prompts[n] for n in NAMES], reset_prefix_cache=True, sequential=True),
                    # No whole chunk: flushes the worker's summary line of the
                    # last request (logged when its finish reaches the worker).
                    Phase("flush", [token_prompt(100, seed=999)], sequential=True),
                ],
                engine_kwargs={"distributed_executor_backend": "uni"},
            ),
            work,
            "engine_b",
            env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            timeout_s=300,
            exit_bound_s=EXIT_BOUND_S,
        )
    return Shared(a, b, keys, dbsize, chunk_keys, damage_log, ref)


def _by_name(run: EngineProcess, phase: int) -> dict:
    assert run.results is not None, "engine failed:\n" + run.log[-6000:]
    return dict(zip(NAMES, run.results[phase].completions))


def test_engine_a_matches_no_connector(shared):
    for name, comp in _by_name(shared.a, 0).items():
        assert comp.num_cached_tokens == 0, name
        assert mismatch(comp, shared.ref[name]) is None, (name, mismatch(comp, shared.ref[name]))
    stored = request_transfers(shared.a.log)
    assert [stored[i].stored for i in range(len(NAMES))] == [FULL] * len(NAMES)


def test_chunks_are_in_redis(shared):
    # Two Redis keys (kv_bytes + metadata) per whole chunk, nothing else.
    assert shared.dbsize_after_a == 2 * CHUNKS_PER_PROMPT * len(NAMES)
    assert len(shared.keys_after_a) == shared.dbsize_after_a
    for bases in shared.chunk_keys.values():
        for base in bases:
            # model+layoutfingerprint@world@worker@hash@dtype
            model_part, world, worker, _, dtype = base.decode().rsplit("@", 4)
            assert "+" in model_part and (world, worker, dtype) == ("1", "0", "uint8")
            assert base + b"kv_bytes" in shared.keys_after_a


def test_engine_b_gets_external_hits_identical_to_no_connector(shared):
    load = _by_name(shared.b, 0)
    s0 = load["S0"]
    assert s0.num_cached_tokens >= CHUNKS_PER_PROMPT * CHUNK, s0.num_cached_tokens
    assert "lmcache-ascend" in shared.b.log
    # Before any damaged entry was read, every lookup was answered.
    assert not any(_unanswered(shared.b.log, n) for n in range(NAMES.index("S4") + 1))
    assert mismatch(s0, shared.ref["S0"]) is None
    again = _by_name(shared.b, 1)["S0"]
    assert again.num_cached_tokens >= CHUNKS_PER_PROMPT * CHUNK
    assert mismatch(again, shared.ref["S0"]) is None


def test_damaged_entries_never_change_outputs(shared):
    for phase in (0, 1):
        for name, comp in _by_name(shared.b, phase).items():
            assert mismatch(comp, shared.ref[name]) is None, (phase, name, mismatch(comp, shared.ref[name]))


def _unanswered(log: str, number: int) -> bool:
    """Request ``number`` came after a lookup LMCache never answered (served
    as a miss; the lookup server stays blocked from then on). LMCache 0.5.6's
    remote executor loses a worker whenever a failed batched get cancels the
    gets behind it; lmcache-ascend patches that (lmcache_ascend/lmcache_bridge/patching/patches.py),
    so this should not happen. Should it, the exact-count checks below accept
    the documented degradation, never a wrong output."""
    first = [int(n) for n in re.findall(r"request (\d+)-\S+: LMCache lookup got no answer", log)]
    return bool(first) and number >= min(first)


def _second(name: str) -> int:
    return len(NAMES) + NAMES.index(name)


def _b_transfers(shared) -> tuple[dict, dict]:
    """Worker summaries of engine B by prompt name: (load pass, again pass).
    B's requests are numbered in submission order: load S0..S5, again S0..S5."""
    tr = request_transfers(shared.b.log)
    n = len(NAMES)
    first = {name: tr.get(i) for i, name in enumerate(NAMES)}
    second = {name: tr.get(n + i) for i, name in enumerate(NAMES)}
    return first, second


def test_engine_b_loaded_intact_entry_completely(shared):
    first, second = _b_transfers(shared)
    for t in (first["S0"], second["S0"]):
        assert t is not None and (t.hit, t.loaded, t.load_error) == (FULL, FULL, False), t


def _refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if "refused at lookup" in line]


def test_bit_flips_are_refused_by_checksum(shared):
    # Chunk 0 of S1 is intact and used; chunk 1 fails its crc32 at lookup, so
    # the hit ends at token 256 and vLLM computes the rest, which B stores
    # again: the second request hits all of it.
    first, second = _b_transfers(shared)
    if _unanswered(shared.b.log, 1):
        assert first["S1"] is not None and (first["S1"].hit, first["S1"].loaded) == (0, 0), first["S1"]
        return
    assert (first["S1"].hit, first["S1"].loaded, first["S1"].load_error) == (CHUNK, CHUNK, False), first["S1"]
    assert any("checksum" in line for line in _refusals(shared.b.log)), _refusals(shared.b.log)
    s1 = second["S1"]
    if not _unanswered(shared.b.log, _second("S1")):
        assert (s1.hit, s1.loaded, s1.load_error) == (FULL, FULL, False), s1


def test_truncated_entries_are_refused(shared):
    first, _ = _b_transfers(shared)
    # S2: value shorter than its metadata: LMCache's get fails, nothing is hit.
    assert (first["S2"].hit, first["S2"].loaded, first["S2"].load_error) == (0, 0, False)
    # S3: consistently truncated (metadata rewritten): our size check refuses it.
    assert (first["S3"].hit, first["S3"].loaded, first["S3"].load_error) == (CHUNK, CHUNK, False)
    assert any("truncated or from another layout" in line for line in _refusals(shared.b.log))
    # Each bad entry (S1, S2, S3, and S4's vanished value) is refused once:
    # the recomputing request stored it again.
    assert len(_refusals(shared.b.log)) == 4, _refusals(shared.b.log)


def _diagnostics(log: str, number: int) -> str:
    """Log lines that explain a request's hits: its own lines and any
    lookup or remote-connection trouble."""
    tag = f"request {number}-"
    keep = ("lookup", "Remote connection", "Timeout occurred", "Key exists")
    return "\n".join(
        line for line in log.splitlines() if tag in line or any(k in line for k in keep)
    )[-6000:]


def test_deleted_entries_become_misses(shared):
    first, second = _b_transfers(shared)
    # S4: value gone, metadata left: LMCache returns nothing for chunk 2, so
    # the lookup reports the two chunks before it; B stores the recomputed
    # chunk again and the next request hits all three.
    assert (first["S4"].hit, first["S4"].loaded, first["S4"].load_error) == (2 * CHUNK, 2 * CHUNK, False)
    assert first["S4"].stored == CHUNK
    s4 = second["S4"]
    if _unanswered(shared.b.log, _second("S4")):
        assert (s4.hit, s4.loaded) == (0, 0), _diagnostics(shared.b.log, _second("S4"))
    else:
        assert (s4.hit, s4.loaded, s4.stored) == (FULL, FULL, 0), _diagnostics(shared.b.log, _second("S4"))
    # S5: both keys of chunk 0 gone: a plain miss; B stores the prompt again
    # and its next request hits.
    assert (first["S5"].hit, first["S5"].stored) == (0, FULL)
    s5 = second["S5"]
    if _unanswered(shared.b.log, _second("S5")):
        assert (s5.hit, s5.loaded) == (0, 0), _diagnostics(shared.b.log, _second("S5"))
    else:
        assert (s5.hit, s5.loaded) == (FULL, FULL), _diagnostics(shared.b.log, _second("S5"))


def test_engines_exit_within_bound_with_redis_remote(shared):
    """LMCache 0.5.6's Redis connector deadlocks its event-loop thread on
    close (a non-daemon thread). A (vLLM's engine-core and worker processes)
    and B (everything in one process) must both exit on their own."""
    for name, run in (("A (multiprocess)", shared.a), ("B (in-process)", shared.b)):
        assert not run.timed_out, name
        assert not run.hung_at_exit, (
            f"engine {name} wrote its results but was still alive {EXIT_BOUND_S:.0f} s later"
        )
        assert run.returncode == 0, name
        assert run.last_phase_to_exit_s is not None and run.last_phase_to_exit_s < EXIT_BOUND_S + 30
