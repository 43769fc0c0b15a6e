"""Keyed integrity of pool entries (issue 37, item 1): with a pool secret
every chunk carries a keyed BLAKE3 MAC and lookups accept only a MAC that
verifies; without one, a lookup that knows a chunk's key accepts only a crc
seeded with that key (the unkeyed-crc downgrade is closed). The secret comes
from one place, is checked at startup and never reaches a log or an error.

Chunk buffers come from LMCache's own allocator; the engine tests run a real
LMCache engine over its local disk backend and damage the entries on disk as
a foreign writer would. Every expected trailer, tag and crc is recomputed
here from the blake3 and zlib packages, not with the code under test."""

from __future__ import annotations

import logging
import os
import struct
import time
import uuid
import zlib
from pathlib import Path

import blake3
import pytest
import torch

from lmcache.v1.config import LMCacheEngineConfig

from fixtures.lmcache_objs import memory_obj
from lmcache_ascend.lmcache_bridge.engine.chunk_io import (
    TRAILER_BYTES,
    ChunkCorrupted,
    PagedChunkConnector,
    TransferContext,
)
from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine
from lmcache_ascend.lmcache_bridge.integrity import pool_secret
from lmcache_ascend.planning.groups import ChunkRequest

SECRET = b"correct horse battery staple 42"
OTHER_SECRET = b"another pool, another secret!!!"
CONTEXT = "lmcache-ascend pool entry MAC v1"  # fixed by the format: spelled out here
PAYLOAD = 4096
SCOPE = "model+mabc+fp0123@1@0"
IDENT = 0x1234_5678_9ABC_DEF0


def ref_key(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=CONTEXT).digest()


def ref_tag(secret: bytes, ident, scope: str, payload: bytes) -> bytes:
    ident_bytes = b"" if ident is None else (ident & (2**64 - 1)).to_bytes(8, "little")
    return blake3.blake3(ident_bytes + scope.encode() + payload, key=ref_key(secret)).digest()[:16]


def ref_crc(payload: bytes, ident=None) -> int:
    seed = 0 if ident is None else zlib.crc32(str(ident).encode())
    return zlib.crc32(payload, seed)


def _conn(secret=None, scope=SCOPE, loaded=None) -> PagedChunkConnector:
    def load(buf, req):
        if loaded is not None:
            loaded[req.start] = bytes(buf[:PAYLOAD].numpy())

    key = None if secret is None else pool_secret.derive_mac_key(secret)
    return PagedChunkConnector(PAYLOAD, 16, store=lambda b, r: None, load=load, checksums=True,
                               mac_key=key, key_scope=scope)


def _chunk(allocator, fill: int = 7):
    obj = memory_obj(allocator, PAYLOAD + TRAILER_BYTES)
    gen = torch.Generator().manual_seed(fill)
    obj.tensor[:PAYLOAD].copy_(torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=gen))
    return obj


def _payload(obj) -> bytes:
    return bytes(obj.tensor[:PAYLOAD].numpy())


def _trailer(obj) -> bytes:
    return bytes(obj.tensor[PAYLOAD:PAYLOAD + TRAILER_BYTES].numpy())


def _write_trailer(obj, raw: bytes) -> None:
    obj.tensor[PAYLOAD:PAYLOAD + len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def forged_unkeyed(payload: bytes) -> bytes:
    """What issue 37's forger wrote: crc32(payload) and b"LMCA" (the crc the
    code before format 2 accepted under any key)."""
    return bytes(16) + struct.pack("<I", ref_crc(payload)) + b"LMCA"


def keyed_crc(payload: bytes, ident) -> bytes:
    return bytes(16) + struct.pack("<I", ref_crc(payload, ident)) + b"LMCK"


def mac_trailer(secret: bytes, ident, scope: str, payload: bytes) -> bytes:
    return ref_tag(secret, ident, scope, payload) + bytes(4) + b"LMCM"


# ---- the connector ----------------------------------------------------------


def test_round_trip_with_a_secret_writes_the_reference_mac(allocator):
    loaded: dict = {}
    conn = _conn(SECRET, loaded=loaded)
    obj = _chunk(allocator)
    ctx = TransferContext("s", ((0,),), chunk_ids={0: IDENT})
    conn.batched_from_gpu([obj], [0], [16], lmcache_ascend_ctx=ctx)
    assert _trailer(obj) == mac_trailer(SECRET, IDENT, SCOPE, _payload(obj))
    conn.verify(obj, 0, IDENT)
    load = TransferContext("l", ((0,),), chunk_ids={0: IDENT})
    conn.batched_to_gpu([obj], [0], [16], lmcache_ascend_ctx=load)
    assert load.outcome.loaded_chunks == 1 and load.outcome.checksum_failures == 0
    assert loaded[0] == _payload(obj)


def test_a_mac_binds_key_identity_and_scope(allocator):
    conn = _conn(SECRET)
    obj = _chunk(allocator)
    _write_trailer(obj, mac_trailer(SECRET, IDENT, SCOPE, _payload(obj)))
    conn.verify(obj, 0, IDENT)
    with pytest.raises(ChunkCorrupted, match="MAC does not verify"):
        conn.verify(obj, 0, IDENT + 1)  # another chunk's key
    with pytest.raises(ChunkCorrupted, match="MAC does not verify"):
        conn.verify(obj, 0, None)  # a load that does not know the key
    with pytest.raises(ChunkCorrupted, match="MAC does not verify"):
        _conn(SECRET, scope="model+mabc+fp0123@2@1").verify(obj, 0, IDENT)  # another rank's key
    obj.tensor[5] ^= 0x01
    with pytest.raises(ChunkCorrupted, match="MAC does not verify"):
        conn.verify(obj, 0, IDENT)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_forged_unkeyed_crc_under_a_real_key_is_refused(allocator, secret):
    conn = _conn(secret)
    obj = _chunk(allocator)
    _write_trailer(obj, forged_unkeyed(_payload(obj)))
    with pytest.raises(ChunkCorrupted):
        conn.verify(obj, 0, IDENT)
    # Through the load path: counted as a refused chunk, never loaded.
    ctx = TransferContext("l", ((0,),), chunk_ids={0: IDENT})
    conn.batched_to_gpu([obj], [0], [16], lmcache_ascend_ctx=ctx)
    assert (ctx.outcome.checksum_failures, ctx.outcome.load_failures, ctx.outcome.loaded_chunks) == (1, 0, 0)
    assert ctx.outcome.failed_from == 0


def test_without_a_secret_keyed_crc_is_accepted_and_unkeyed_only_without_a_key(allocator):
    conn = _conn(None)
    obj = _chunk(allocator)
    _write_trailer(obj, keyed_crc(_payload(obj), IDENT))
    conn.verify(obj, 0, IDENT)
    with pytest.raises(ChunkCorrupted, match="loaded without one"):
        conn.verify(obj, 0, None)
    _write_trailer(obj, forged_unkeyed(_payload(obj)))
    conn.verify(obj, 0, None)  # LMCache's own route: it never knows keys
    # What the connector writes without a secret is the keyed crc.
    conn.batched_from_gpu([obj], [0], [16], lmcache_ascend_ctx=TransferContext("s", ((0,),), chunk_ids={0: IDENT}))
    assert _trailer(obj) == keyed_crc(_payload(obj), IDENT)


@pytest.mark.parametrize("written", ["keyed-crc", "unkeyed-crc"])
def test_an_entry_written_without_the_secret_is_refused_by_an_engine_with_it(allocator, written):
    obj = _chunk(allocator)
    raw = keyed_crc(_payload(obj), IDENT) if written == "keyed-crc" else forged_unkeyed(_payload(obj))
    _write_trailer(obj, raw)
    with pytest.raises(ChunkCorrupted, match="written without the pool secret"):
        _conn(SECRET).verify(obj, 0, IDENT)


def test_an_entry_under_another_secret_is_refused(allocator):
    obj = _chunk(allocator)
    _write_trailer(obj, mac_trailer(OTHER_SECRET, IDENT, SCOPE, _payload(obj)))
    _conn(OTHER_SECRET).verify(obj, 0, IDENT)  # the reference is a valid entry there
    with pytest.raises(ChunkCorrupted, match="MAC does not verify"):
        _conn(SECRET).verify(obj, 0, IDENT)


def test_a_maced_entry_is_refused_by_an_engine_without_the_secret(allocator):
    obj = _chunk(allocator)
    _write_trailer(obj, mac_trailer(SECRET, IDENT, SCOPE, _payload(obj)))
    with pytest.raises(ChunkCorrupted, match="sealed with a pool secret this engine does not have"):
        _conn(None).verify(obj, 0, IDENT)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize(
    "damage",
    ["zeros", "garbage", "short-tag", "bad-magic", "old-format-size", "payload-only"],
)
def test_malformed_trailers_are_ordinary_refused_entries(allocator, secret, damage):
    conn = _conn(secret)
    obj = _chunk(allocator)
    good = mac_trailer(SECRET, IDENT, SCOPE, _payload(obj)) if secret else keyed_crc(_payload(obj), IDENT)
    buf = obj.tensor
    if damage == "zeros":
        _write_trailer(obj, bytes(TRAILER_BYTES))
    elif damage == "garbage":
        _write_trailer(obj, os.urandom(TRAILER_BYTES - 4) + b"LMCM")
    elif damage == "short-tag":  # a tag of the wrong length: the magic moved up
        _write_trailer(obj, good[:12] + good[16:] + bytes(4))
    elif damage == "bad-magic":
        _write_trailer(obj, good[:-4] + b"LMCX")
    elif damage == "old-format-size":  # a buffer sized for the 8-byte trailer
        _write_trailer(obj, good)
        buf = obj.tensor[: PAYLOAD + 8]
    else:
        buf = obj.tensor[:PAYLOAD]
    with pytest.raises(ChunkCorrupted):
        conn._verify(buf.reshape(-1), 0, IDENT)


def test_our_stores_never_write_an_unkeyed_seal(allocator):
    conn = _conn(None)
    obj = _chunk(allocator)
    refs = obj.get_ref_count()
    with pytest.raises(RuntimeError, match="no key identity"):
        conn.batched_from_gpu([obj], [0], [16], lmcache_ascend_ctx=TransferContext("s", ((0,),)))
    assert obj.get_ref_count() == refs - 1  # released, as on every failed store


def test_the_trailer_format_is_in_the_layout_fingerprint(monkeypatch):
    from lmcache_ascend.planning import planner
    from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup

    caches = {"l0": torch.zeros(8, 16, 32, dtype=torch.float16)}
    groups = (SchedulerGroup(0, GroupKind.FULL, "FullAttentionSpec", 16, 1, None, ("l0",)),)
    assert TRAILER_BYTES == 24 and planner.CHUNK_FORMAT_VERSION == 2  # bumped together
    now = planner.build_plan(caches, groups, 16).layout_fingerprint
    monkeypatch.setattr(planner, "CHUNK_FORMAT_VERSION", 1)
    assert planner.build_plan(caches, groups, 16).layout_fingerprint != now


# ---- the secret at startup ----------------------------------------------------


@pytest.fixture(scope="module")
def cfg_cls():
    register_config_keys()
    return LMCacheEngineConfig


@pytest.fixture
def announce_again(monkeypatch):
    monkeypatch.setattr(pool_secret, "_announced", False)


def _cfg(cfg_cls, path=None, **kw):
    cfg = cfg_cls.from_defaults(**kw)
    if path is not None:
        cfg.ascend_pool_secret_file = str(path)
    return cfg


def _secret_file(tmp_path, data: bytes) -> Path:
    path = tmp_path / "pool.secret"
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_secret_from_the_file_or_the_environment_gives_the_reference_key(cfg_cls, tmp_path, announce_again):
    path = _secret_file(tmp_path, SECRET + b"\n")  # one trailing newline is dropped
    assert pool_secret.load_mac_key(_cfg(cfg_cls, path), {}) == ref_key(SECRET)
    env = {pool_secret.SECRET_ENV: SECRET.decode()}
    assert pool_secret.load_mac_key(_cfg(cfg_cls), env) == ref_key(SECRET)
    assert pool_secret.load_mac_key(_cfg(cfg_cls), {}) is None
    # Only one newline: a secret ending in one keeps it.
    two = _secret_file(tmp_path, SECRET + b"\n\n")
    assert pool_secret.load_mac_key(_cfg(cfg_cls, two), {}) == ref_key(SECRET + b"\n")


def test_the_secret_file_key_is_a_config_key_and_the_secret_is_not(cfg_cls):
    from lmcache.v1 import config as lmc_config

    defs = lmc_config._CONFIG_DEFINITIONS
    assert "ascend_pool_secret_file" in defs
    assert "ascend_pool_secret" not in defs  # never settable through kv_connector_extra_config


BAD = [
    ("short-env", None, {"LMCACHE_ASCEND_POOL_SECRET": "0123456789abcde"}, "LMCACHE_ASCEND_POOL_SECRET", "too short"),
    ("empty-env", None, {"LMCACHE_ASCEND_POOL_SECRET": ""}, "LMCACHE_ASCEND_POOL_SECRET", "empty"),
    ("short-file", b"0123456789abcde\n", {}, "ascend_pool_secret_file", "too short"),
    ("empty-file", b"", {}, "ascend_pool_secret_file", "empty"),
    ("newline-file", b"\n", {}, "ascend_pool_secret_file", "empty"),
    ("both", SECRET, {"LMCACHE_ASCEND_POOL_SECRET": SECRET.decode()}, "LMCACHE_ASCEND_POOL_SECRET", "both"),
]


@pytest.mark.parametrize("name, data, env, setting, why", BAD, ids=[b[0] for b in BAD])
def test_bad_secrets_stop_startup_naming_the_setting_never_the_secret(
    cfg_cls, tmp_path, caplog, announce_again, name, data, env, setting, why
):
    caplog.set_level(logging.DEBUG)
    path = None if data is None else _secret_file(tmp_path, data)
    with pytest.raises(pool_secret.PoolSecretError) as err:
        pool_secret.load_mac_key(_cfg(cfg_cls, path), env)
    msg = str(err.value)
    assert setting in msg and why in msg
    if name == "both":
        assert "ascend_pool_secret_file" in msg
    for value in [*(v for v in env.values() if v), *([data.strip().decode()] if data and data.strip() else [])]:
        assert value not in msg and value not in caplog.text
    assert "15 bytes" not in msg and "(15)" not in msg  # nor its length


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_secret_file_stops_startup_naming_the_path(cfg_cls, tmp_path, kind):
    path = tmp_path / "nope.secret" if kind == "missing" else tmp_path
    with pytest.raises(pool_secret.PoolSecretError) as err:
        pool_secret.load_mac_key(_cfg(cfg_cls, path), {})
    assert "ascend_pool_secret_file" in str(err.value) and str(path) in str(err.value)


def test_startup_says_once_whether_entries_are_authenticated(cfg_cls, tmp_path, caplog, announce_again):
    caplog.set_level(logging.INFO, logger="lmcache_ascend")
    env = {pool_secret.SECRET_ENV: SECRET.decode()}
    pool_secret.load_mac_key(_cfg(cfg_cls), env)
    pool_secret.load_mac_key(_cfg(cfg_cls), env)
    assert caplog.text.count("pool entries are authenticated (keyed BLAKE3 MAC") == 1
    caplog.clear()
    pool_secret._announced = False
    pool_secret.load_mac_key(_cfg(cfg_cls), {})  # CPU only: nothing leaves the process
    assert "not authenticated" not in caplog.text
    pool_secret._announced = False
    pool_secret.load_mac_key(_cfg(cfg_cls, remote_url="redis://127.0.0.1:1", remote_serde="naive"), {})
    pool_secret.load_mac_key(_cfg(cfg_cls, remote_url="redis://127.0.0.1:1", remote_serde="naive"), {})
    assert caplog.text.count(
        "pool entries are not authenticated: anyone who can write to the pool can inject KV; "
        "set ascend_pool_secret_file or LMCACHE_ASCEND_POOL_SECRET"
    ) == 1


def test_a_world_readable_secret_file_is_warned_about(cfg_cls, tmp_path, caplog):
    path = _secret_file(tmp_path, SECRET)
    path.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="lmcache_ascend")
    assert pool_secret.read_secret(_cfg(cfg_cls, path), {})[0] == SECRET
    assert "can be read by other users" in caplog.text and SECRET.decode() not in caplog.text


def test_the_adapter_route_refuses_a_secret_it_cannot_honour(cfg_cls, monkeypatch):
    from lmcache_ascend.lmcache_bridge.patching.adapter_shim import AdapterChunkConnector

    monkeypatch.setenv(pool_secret.SECRET_ENV, SECRET.decode())
    with pytest.raises(pool_secret.PoolSecretError) as err:
        AdapterChunkConnector(_cfg(cfg_cls, chunk_size=16), metadata=None)
    assert "LMCACHE_ASCEND_POOL_SECRET" in str(err.value) and SECRET.decode() not in str(err.value)


# ---- a real engine over LMCache's disk backend ------------------------------------

CHUNK = 16
TOKENS = list(range(2000, 2000 + 4 * CHUNK))


def _pattern(start: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(start + 11)
    return torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=gen)


@pytest.fixture
def disk_engine_factory(tmp_path, cfg_cls):
    started = []

    def start(secret):
        disk = tmp_path / f"disk{len(started)}"
        disk.mkdir()
        config = cfg_cls.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, local_disk=f"file://{disk}/",
            max_local_disk_size=0.05, pre_caching_hash_algorithm="sha256_cbor", save_unfull_chunk=False,
        )
        env = {} if secret is None else {pool_secret.SECRET_ENV: secret.decode()}
        loaded: dict[int, bytes] = {}

        def store(buf, req: ChunkRequest):
            buf[:PAYLOAD].copy_(_pattern(req.start))

        def load(buf, req: ChunkRequest):
            loaded[req.start] = bytes(buf[:PAYLOAD].numpy())

        connector = PagedChunkConnector(PAYLOAD, CHUNK, store, load, checksums=True,
                                        mac_key=pool_secret.load_mac_key(config, env))
        spec = EngineSpec("mac-test", f"mac-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
        engine = WorkerEngine.start(config, spec, connector, PAYLOAD, 1, "fp")
        started.append(engine)
        return engine, disk, loaded

    yield start
    for engine in started:
        engine.close()


def _store_all(engine, disk) -> list[tuple[int, int, Path]]:
    tokens = torch.tensor(TOKENS)
    mask = torch.ones(len(TOKENS), dtype=torch.bool)
    engine.store(tokens, mask, TransferContext("s", ((0,),)))
    ids = engine.chunk_ids(tokens, mask)
    backend = engine.engine.storage_manager.storage_backends["LocalDiskBackend"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(backend.dict) < len(ids):
        time.sleep(0.05)
    assert len(backend.dict) == len(ids)
    files = [p for p in disk.rglob("*") if p.is_file()]
    out = []
    for start, ident in sorted(ids.items()):
        match = [p for p in files if f"@{ident:x}@" in p.name or f"@{ident}@" in p.name]
        assert len(match) == 1
        out.append((start, ident, match[0]))
    return out


def _scope_of(path: Path, ident: int) -> str:
    # The key's fields before the chunk hash, as LMCache spells them in the
    # file name (model@world@worker@hash@dtype).
    name = path.name
    cut = name.index(f"@{ident:x}@") if f"@{ident:x}@" in name else name.index(f"@{ident}@")
    return name[:cut]


def _hit(engine, lookup_id: str) -> int:
    return engine.engine.lookup(tokens=TOKENS, lookup_id=lookup_id, pin=True)


def _load(engine, lookup_id: str) -> int:
    claim = engine.claim(lookup_id)
    try:
        return engine.load_claim(claim, 0, len(TOKENS), TransferContext(lookup_id, ((0,),)))
    finally:
        engine.release_claim(claim)


def test_engine_round_trip_with_a_secret(disk_engine_factory, caplog):
    caplog.set_level(logging.DEBUG)
    engine, disk, loaded = disk_engine_factory(SECRET)
    entries = _store_all(engine, disk)
    for start, ident, path in entries:
        data = path.read_bytes()
        assert data[:PAYLOAD] == bytes(_pattern(start).numpy())
        scope = _scope_of(path, ident)
        assert "+fp" in scope  # the layout fingerprint is bound
        assert data[PAYLOAD:PAYLOAD + TRAILER_BYTES] == mac_trailer(SECRET, ident, scope, data[:PAYLOAD])
    assert _hit(engine, "r") == len(TOKENS)
    assert engine.take_counts().checksum_failures == 0
    assert _load(engine, "r") == len(TOKENS)
    assert all(loaded[s] == bytes(_pattern(s).numpy()) for s in range(0, len(TOKENS), CHUNK))
    assert SECRET.decode() not in caplog.text and SECRET.hex() not in caplog.text


# Every forgery against an engine with the secret; without one, those it
# can tell (a keyed crc under its own key is what such an engine accepts).
@pytest.mark.parametrize("secret,forgery", [
    pytest.param(SECRET, "unkeyed-crc", id="secret-unkeyed-crc"),
    pytest.param(SECRET, "other-secret", id="secret-other-secret"),
    pytest.param(SECRET, "no-secret", id="secret-no-secret"),
    pytest.param(None, "unkeyed-crc", id="no-secret-unkeyed-crc"),
    pytest.param(None, "other-secret", id="no-secret-other-secret"),
])
def test_engine_refuses_a_forged_entry_counted_quarantined_and_logged_with_its_key(
    disk_engine_factory, caplog, secret, forgery
):
    caplog.set_level(logging.INFO)
    engine, disk, loaded = disk_engine_factory(secret)
    entries = _store_all(engine, disk)
    start, ident, path = entries[2]
    # Another chunk's bytes (a valid prompt's KV) under this chunk's real key.
    payload = entries[1][2].read_bytes()[:PAYLOAD]
    if forgery == "unkeyed-crc":
        trailer = forged_unkeyed(payload)
    elif forgery == "other-secret":
        trailer = mac_trailer(OTHER_SECRET, ident, _scope_of(path, ident), payload)
    else:  # an engine without the secret wrote it: a keyed crc
        trailer = keyed_crc(payload, ident)
    data = bytearray(path.read_bytes())
    data[:PAYLOAD + TRAILER_BYTES] = payload + trailer
    path.write_bytes(bytes(data))

    assert _hit(engine, "r") == 2 * CHUNK  # the chunks before the forged one
    counts = engine.take_counts()
    assert counts.checksum_failures == 1 and counts.unreadable_chunks == 0
    refusals = [r.getMessage() for r in caplog.records if "refused at lookup" in r.getMessage()]
    assert len(refusals) == 1 and (f"{ident:x}" in refusals[0] or str(ident) in refusals[0])
    assert _load(engine, "r") == 2 * CHUNK and sorted(loaded) == [0, CHUNK]
    # Quarantined: the next lookup neither reads nor counts it again.
    assert _hit(engine, "r2") == 2 * CHUNK
    assert engine.take_counts().checksum_failures == 0
    engine.unpin("r2")
    assert SECRET.decode() not in caplog.text


def test_engines_with_and_without_the_secret_do_not_load_each_others_entries(disk_engine_factory):
    with_secret, disk_a, _ = disk_engine_factory(SECRET)
    without, disk_b, _ = disk_engine_factory(None)
    entries_a = _store_all(with_secret, disk_a)
    entries_b = _store_all(without, disk_b)
    # Same keys on both (the secret is not part of them): swap the entries.
    assert [(s, i) for s, i, _ in entries_a] == [(s, i) for s, i, _ in entries_b]
    for (_, _, a), (_, _, b) in zip(entries_a, entries_b):
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)
    assert _hit(with_secret, "x") == 0 and with_secret.take_counts().checksum_failures == 1
    assert _hit(without, "y") == 0 and without.take_counts().checksum_failures == 1
