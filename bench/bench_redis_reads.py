"""A staged hit read from a redis:// pool, three ways, against a plain client, in one run.

What the staged lookup's reads cost (issue 36's fetch-rate goal: at least
0.7x a plain client reading the same bytes from the same server):

* sync     the connector's reads (``ascend_redis_sync_reads``, the default):
           redis-py's synchronous client on the lookup's threads
           (lmcache_bridge/backends/redis_reads.py);
* lmcache  LMCache's own reads of the same entries (``false``): its asyncio
           ``RedisConnector`` on the storage manager's loop;
* resp     LMCache's native client (``resp://``), which writes keys of its
           own (one value per chunk) on the same server;
* zlib     the sync staged hit again with the checksums on the standard
           library's zlib.crc32 (what ran before zlib-ng: the same values);
* plain    redis-py ``GET``s of the same values, one at a time, into bytes
           (what the goal compares with), with each reply parser this
           environment has (its pure-Python one; hiredis's where installed).

Three engines on one real redis-server on 127.0.0.1 (started
and stopped here), no LMCache CPU cache: one hit of ``--chunks`` chunks,
staged end to end (contains, read, checksum, hold) and released, and the
reads alone (the backend's read of every chunk, no check). One untimed round
first (connections opened, every code path run once). Rounds alternate the order;
prints medians in GB/s and the ratios to the fastest plain client.

    python bench/bench_redis_reads.py [--chunks 64] [--chunk-mib 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from lmcache_ascend.integration.vllm import adapter_route  # noqa: E402

adapter_route.install()  # our config keys registered before LMCache loads its config, as the entry points do
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_ascend.lmcache_bridge.backends import redis_reads  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine import chunk_io  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine  # noqa: E402
from lmcache_ascend.lmcache_bridge.integrity import staging  # noqa: E402
from redis_server import RedisServer, ensure_redis_server  # noqa: E402

CHUNK = 256
REMOTE = "RemoteBackend"
ZLIB_ROW = "staged hit, sync reads, zlib's crc32"


def _engine(url: str, model: str, chunk_bytes: int, chunks: int, name: str) -> WorkerEngine:
    def store(buf, req):
        buf[:chunk_bytes].fill_(req.start // CHUNK % 251)

    def load(buf, req):
        pass

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=max(0.5, 3 * chunks * chunk_bytes / (1 << 30)),
        remote_url=url, remote_serde="naive", pre_caching_hash_algorithm="sha256_cbor", save_unfull_chunk=False,
        **{redis_reads.SWITCH: name == "sync"})
    spec = EngineSpec(model, f"{model}-{name}", 0, 1, CHUNK, {})  # one model: one set of keys per scheme
    connector = PagedChunkConnector(chunk_bytes, CHUNK, store, load, checksums=True)
    return WorkerEngine.start(config, spec, connector, chunk_bytes, 1, "bench")


def _plain(url: str) -> dict:
    """name -> a function reading every value key once (bytes read)."""
    import redis
    from redis.connection import _RESP2Parser

    parsers = {"python": _RESP2Parser}
    try:
        import hiredis  # noqa: F401
        from redis.connection import _HiredisParser

        parsers["hiredis"] = _HiredisParser
    except ImportError:
        pass
    out = {}
    for name, parser in parsers.items():
        client = redis.Redis.from_url(url, parser_class=parser)
        keys = sorted(k for k in client.keys("*") if k.endswith(b"kv_bytes"))
        out[name] = lambda client=client, keys=keys: sum(len(client.get(k)) for k in keys)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64, help="chunks per hit")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per chunk (MiB)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if ensure_redis_server() is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    tokens = list(range(10, 10 + args.chunks * CHUNK))
    nbytes = args.chunks * chunk_bytes
    with tempfile.TemporaryDirectory() as work, RedisServer(Path(work)) as server:
        model = f"bench-{uuid.uuid4().hex[:8]}"
        resp_url = server.url.replace("redis://", "resp://", 1)
        engines = {name: _engine(resp_url if name == "resp" else server.url, model, chunk_bytes, args.chunks, name)
                   for name in ("sync", "lmcache", "resp")}
        try:
            writer = engines["lmcache"]
            for name in ("lmcache", "resp"):  # resp:// writes keys of its own (one value per chunk)
                engines[name].store(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool),
                                    TransferContext("s", ((0,),)))
            deadline = time.monotonic() + 120
            while server.client().dbsize() < 3 * args.chunks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.client().dbsize() == 3 * args.chunks, "the puts did not all arrive"
            plain = _plain(server.url)
            keys = [k for s, e, k in writer.engine.token_database.process_tokens(tokens=tokens) if e > s]

            def staged(engine: WorkerEngine, n: list) -> None:
                lid = f"l{n[0]}"
                n[0] += 1
                assert engine.engine.lookup(tokens=tokens, lookup_id=lid, pin=True) == len(tokens)
                engine.unpin(lid)

            def reads(name: str) -> None:
                backend = engines[name].engine.storage_manager.storage_backends[REMOTE]
                reader = engines[name].staging._readers.get(REMOTE)
                for i in range(0, len(keys), staging.FETCH_WINDOW):
                    window = keys[i : i + staging.FETCH_WINDOW]
                    objs = reader.read(window) if reader is not None else backend.batched_get_blocking(window)
                    assert all(o is not None for o in objs) and len(objs) == len(window)
                    for o in objs:
                        o.ref_count_down()

            counter = [0]
            cases = {f"staged hit, {name} reads": (lambda name=name: staged(engines[name], counter))
                     for name in engines}  # resp: LMCache's native client (resp://)

            def zlib_crc(fn):
                def run() -> None:
                    fast, chunk_io._crc32 = chunk_io._crc32, zlib.crc32
                    try:
                        fn()
                    finally:
                        chunk_io._crc32 = fast
                return run

            cases[ZLIB_ROW] = zlib_crc(cases["staged hit, sync reads"])
            cases.update({f"reads alone, {name}": (lambda name=name: reads(name)) for name in ("sync", "lmcache")})
            remote = writer.engine.storage_manager.storage_backends[REMOTE]
            cases["contains alone (LMCache's, per key)"] = lambda: remote.batched_contains(keys)
            cases.update({f"plain client ({name})": fn for name, fn in plain.items()})
            for fn in cases.values():  # untimed: connections opened, every path run once
                fn()
            assert isinstance(engines["sync"].staging._readers.get(REMOTE), redis_reads.SyncRedisReader)
            assert engines["lmcache"].staging._readers.get(REMOTE) is None
            rates: dict[str, list[float]] = {name: [] for name in cases}
            for r in range(args.repeat):
                order = list(cases) if r % 2 == 0 else list(reversed(cases))
                for name in order:
                    t0 = time.perf_counter()
                    cases[name]()
                    rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
        finally:
            for engine in engines.values():
                engine.close()
    med = {name: statistics.median(v) for name, v in rates.items()}
    ref_name = max((n for n in med if n.startswith("plain")), key=med.get)
    print(f"{args.chunks} chunks of {args.chunk_mib:g} MiB ({nbytes / 1e6:.0f} MB) from a redis-server on 127.0.0.1; "
          f"medians of {args.repeat}; reference: {ref_name}")
    print("| read | ms | GB/s | / reference (goal >= 0.7 for a staged hit) |")
    print("|---|---|---|---|")
    for name, rate in med.items():
        print(f"| {name} | {nbytes / rate / 1e6:.1f} | {rate:.2f} | {rate / med[ref_name]:.2f} |")
    print(f"sync / lmcache, staged hit: {med['staged hit, sync reads'] / med['staged hit, lmcache reads']:.2f}; "
          f"reads alone: {med['reads alone, sync'] / med['reads alone, lmcache']:.2f}; "
          f"checksums on {chunk_io.CRC32_IMPL} / on zlib: "
          f"{med['staged hit, sync reads'] / med[ZLIB_ROW]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
