"""A shared pool only trusted instances can write: real engines, one real
``redis-server`` with a password and TLS (``--requirepass``, ``--tls-port``,
a CA made by the test), the pool secret in the environment.

* W, an engine **without** the pool secret, stores E0 and E1;
* A, an engine **with** it, stores E2, E3 and E4;
* the test then forges two entries under real keys, with nothing but
  access to Redis:
  - E3 chunk 1: E2's chunk-1 bytes under E3's key, sealed with the checksum
    an engine without a secret writes and accepts (crc32 seeded with the
    key, magic ``LMCK``);
  - E4 chunk 1: E2's chunk-1 bytes under E4's key, E4's own MAC trailer
    kept (a replayed tag);
* B, with the secret, serves E0..E4: W's entries and both forgeries are
  refused at lookup (logged), the hits end before them, and every output
  equals the run without the connector;
* no engine's log shows the Redis password;
* an engine whose ``remote_url`` has a wrong password stops at startup,
  naming ``remote_url`` with the password masked.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt
import faults
from faults import CHUNK, EngineProcess
from redis_entries import chunk_base, redis_engine_env
from redis_server import RedisServer, ensure_redis_server

pytestmark = [pytest.mark.engine, pytest.mark.redis]

PASSWORD = "redis-pw-7Kq2-never-logged"
SECRET = "pool-secret-for-tests-0123456789"
W_NAMES = ["E0", "E1"]
A_NAMES = ["E2", "E3", "E4"]
B_NAMES = W_NAMES + A_NAMES
FULL = 2 * CHUNK  # E prompts: 2 whole chunks + 20 tokens
TRAILER = 24  # chunk_io.TRAILER_BYTES: [tag 16][crc 4][magic 4]


def engine_env(url: str, secret: bool) -> dict[str, str]:
    return redis_engine_env(url, **({"LMCACHE_ASCEND_POOL_SECRET": SECRET} if secret else {}))


@dataclass
class Trust:
    w: EngineProcess
    a: EngineProcess
    b: EngineProcess
    wrong: EngineProcess
    magics: dict[str, list[bytes]]  # prompt -> trailer magic of each chunk as stored
    ref: dict


def _trailer_at(value: bytes) -> int:
    """Offset of the trailer in a stored chunk value: payload, trailer,
    then LMCache's zero padding."""
    for magic in (b"LMCM", b"LMCK"):
        at = value.rfind(magic)
        if at >= 0:
            return at + 4 - TRAILER
    raise AssertionError("no lmcache-ascend trailer in the stored value")


def _forge(server: RedisServer, bases: dict[str, list[bytes]], prompts: dict[str, list[int]]) -> None:
    with server.client() as c:
        donor = c.get(bases["E2"][1] + b"kv_bytes")
        end = _trailer_at(donor)
        payload = donor[:end]
        # E3 chunk 1: the checksum an engine without a secret writes.
        ident = int(faults.chunk_hashes(prompts["E3"])[1], 16)
        crc = zlib.crc32(payload, zlib.crc32(str(ident).encode()))
        target = bases["E3"][1] + b"kv_bytes"
        own = c.get(target)
        assert len(own) == len(donor) and _trailer_at(own) == end
        c.set(target, payload + bytes(16) + struct.pack("<I", crc) + b"LMCK" + own[end + TRAILER:])
        # E4 chunk 1: E2's bytes with E4's own (valid for E4's bytes) MAC.
        target = bases["E4"][1] + b"kv_bytes"
        own = c.get(target)
        c.set(target, payload + own[end:])


@pytest.fixture(scope="module")
def trust(tmp_path_factory, tiny_model) -> Trust:
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("llama")
    work = tmp_path_factory.mktemp("pool_trust")
    ref = faults.reference_outputs(model, work)
    prompts = faults.reliability_prompts()

    def store(tag: str, names: list[str], env: dict[str, str]) -> EngineProcess:
        run = faults.run_engine_process(
            Scenario(model=model, phases=[Phase("store", [prompts[n] for n in names], sequential=True)]),
            work, tag, env=env, timeout_s=300)
        assert run.results is not None, f"engine {tag} failed:\n" + run.log[-6000:]
        return run

    with RedisServer(work, password=PASSWORD, tls=True) as server:
        w = store("engine_w", W_NAMES, engine_env(server.url, secret=False))
        a = store("engine_a", A_NAMES, engine_env(server.url, secret=True))
        with server.client() as c:
            keys = c.keys()
            bases = {n: [chunk_base(keys, h) for h in faults.chunk_hashes(prompts[n])] for n in B_NAMES}
            magics = {n: [c.get(b + b"kv_bytes") for b in bases[n]] for n in B_NAMES}
        magics = {n: [v[_trailer_at(v) + TRAILER - 4:_trailer_at(v) + TRAILER] for v in vs] for n, vs in magics.items()}
        _forge(server, bases, prompts)
        b = faults.run_engine_process(
            Scenario(model=model, phases=[
                Phase("load", [prompts[n] for n in B_NAMES], sequential=True),
                Phase("flush", [token_prompt(100, seed=998)], sequential=True),
            ]),
            work, "engine_b", env=engine_env(server.url, secret=True), timeout_s=300)
        wrong_url = server.url.replace(PASSWORD, "wrong-" + PASSWORD[::-1])
        wrong = faults.run_engine_process(
            Scenario(model=model, phases=[Phase("store", [prompts["E0"]], sequential=True)]),
            work, "engine_wrong_password", env=engine_env(wrong_url, secret=True), timeout_s=300)
    return Trust(w, a, b, wrong, magics, ref)


def _completions(run: EngineProcess, names: list[str]) -> dict:
    assert run.results is not None, "engine failed:\n" + run.log[-6000:]
    return dict(zip(names, run.results[0].completions))


def _refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if "refused at lookup" in line]


def test_writers_seal_as_configured(trust):
    # W (no secret) sealed with the keyed checksum, A with the MAC.
    assert all(m == [b"LMCK", b"LMCK"] for n, m in trust.magics.items() if n in W_NAMES), trust.magics
    assert all(m == [b"LMCM", b"LMCM"] for n, m in trust.magics.items() if n in A_NAMES), trust.magics
    for run in (trust.w, trust.a):
        tr = faults.request_transfers(run.log)
        assert [tr[i].stored for i in range(len(tr))] == [FULL] * len(tr)


def test_authenticated_tls_redis_is_shared_exactly(trust):
    b = _completions(trust.b, B_NAMES)
    tr = faults.request_transfers(trust.b.log)
    e2 = tr[B_NAMES.index("E2")]
    assert (e2.hit, e2.loaded, e2.load_error) == (FULL, FULL, False), e2
    assert b["E2"].num_cached_tokens >= FULL
    for name, comp in b.items():
        assert faults.mismatch(comp, trust.ref[name]) is None, (name, faults.mismatch(comp, trust.ref[name]))


def test_entries_written_without_the_secret_are_not_loaded(trust):
    tr = faults.request_transfers(trust.b.log)
    for name in W_NAMES:
        t = tr[B_NAMES.index(name)]
        assert (t.hit, t.loaded) == (0, 0), (name, t)
    refused = _refusals(trust.b.log)
    assert sum("written without the pool secret" in line for line in refused) >= 2, refused


def test_forged_entries_under_real_keys_are_refused(trust):
    tr = faults.request_transfers(trust.b.log)
    for name in ("E3", "E4"):
        t = tr[B_NAMES.index(name)]
        # Chunk 0 is A's and verifies; chunk 1 is the forgery.
        assert (t.hit, t.loaded, t.load_error) == (CHUNK, CHUNK, False), (name, t)
    refused = _refusals(trust.b.log)
    assert any("MAC does not verify" in line for line in refused), refused
    b = _completions(trust.b, B_NAMES)
    for name in ("E3", "E4"):
        assert faults.mismatch(b[name], trust.ref[name]) is None, name


def test_wrong_password_stops_startup_naming_the_setting(trust):
    run = trust.wrong
    assert run.results is None and run.returncode != 0, run.log[-3000:]
    assert "refused the credentials" in run.log and "remote_url=" in run.log, run.log[-3000:]
    assert "default:***@127.0.0.1" in run.log


def test_no_engine_log_shows_the_password(trust):
    for tag, run in (("W", trust.w), ("A", trust.a), ("B", trust.b), ("wrong", trust.wrong)):
        assert PASSWORD not in run.log, tag
        assert PASSWORD[::-1] not in run.log, tag
        assert SECRET not in run.log, tag
    # LMCache printed its configuration and its connector's URL, masked.
    assert "rediss://default:***@127.0.0.1" in trust.a.log


def test_default_shutdown_is_explained_once(trust):
    # vLLM's offline engine keeps shutdown_timeout 0 (abort): the one line
    # that accounts for writes a killed process would lose.
    for tag, run in (("W", trust.w), ("A", trust.a), ("B", trust.b)):
        lines = [line for line in run.log.splitlines() if "vLLM's shutdown_timeout is 0" in line]
        assert len(lines) == 1 and "rediss://default:***@127.0.0.1" in lines[0], (tag, lines)
