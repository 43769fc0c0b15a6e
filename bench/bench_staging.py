"""What verifying at lookup costs: one hit read from Redis, two ways, in one run.

* staged (what the connector does): the lookup reads every chunk it reports
  from the store, verifies its checksum and holds it; the load copies the
  held chunks (lmcache_bridge/integrity/staging.py);
* LMCache's path (what it did before): the lookup asks the store whether
  the chunks exist; the load reads them (LMCache's retrieve) and verifies
  them while copying.

Both read the same bytes from a real redis-server on 127.0.0.1 (started and
stopped here) through LMCache's remote backend with no CPU cache, into the
same chunk connector; the copy into "vLLM's KV" is a memcpy of the payload.
Prints per-hit milliseconds (median of the repeats), split into lookup and
load, and the ratio of the totals.

A third engine on the same Redis stages its hits with a pool secret: its
entries carry a keyed BLAKE3 MAC instead of the keyed crc32, verified at
lookup (lmcache_bridge/engine/chunk_io.py). The staged hits of both engines run
interleaved in one loop, and the verification alone is timed on the chunks
in memory (fastest of 5 passes per repeat); printed: MAC / crc for both.

    python bench/bench_staging.py [--chunks 8] [--chunk-mib 2] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector, TransferContext  # noqa: E402
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, WorkerEngine  # noqa: E402
from lmcache_ascend.lmcache_bridge.integrity.pool_secret import derive_mac_key  # noqa: E402
from redis_server import RedisServer, ensure_redis_server  # noqa: E402

CHUNK = 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks per hit")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per chunk (MiB)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    if ensure_redis_server() is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    sink = torch.empty(chunk_bytes, dtype=torch.uint8)

    def store(buf, req):
        buf[:chunk_bytes].fill_(req.start // CHUNK % 251)

    def load(buf, req):
        sink.copy_(buf[:chunk_bytes])

    with tempfile.TemporaryDirectory() as work, RedisServer(Path(work)) as server:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,  # every hit is read from Redis
            max_local_cpu_size=max(0.5, 4 * args.chunks * chunk_bytes / (1 << 30)),
            remote_url=server.url,
            remote_serde="naive",
            pre_caching_hash_algorithm="sha256_cbor",
            save_unfull_chunk=False,
        )
        spec = EngineSpec("bench-staging", f"bench-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
        connector = PagedChunkConnector(chunk_bytes, CHUNK, store, load, checksums=True)
        engine = WorkerEngine.start(config, spec, connector, chunk_bytes, 1, "bench")
        # Another layout fingerprint: its keys differ, so neither engine
        # reads (and refuses) the other's entries.
        mac_spec = EngineSpec("bench-staging", f"bench-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
        mac_connector = PagedChunkConnector(chunk_bytes, CHUNK, store, load, checksums=True,
                                            mac_key=derive_mac_key(b"bench pool secret, 32 bytes long"))
        mac_engine = WorkerEngine.start(config, mac_spec, mac_connector, chunk_bytes, 1, "bench-mac")
        try:
            n = args.chunks * CHUNK
            tokens = torch.arange(7, 7 + n)
            mask = torch.ones(n, dtype=torch.bool)
            engine.store(tokens, mask, TransferContext("s", ((0,),)))
            mac_engine.store(tokens, mask, TransferContext("s", ((0,),)))
            deadline = time.monotonic() + 60
            while server.client().dbsize() < 4 * args.chunks:  # puts are asynchronous
                if time.monotonic() > deadline:
                    raise TimeoutError("the chunks never reached Redis")
                time.sleep(0.05)
            ids = tokens.tolist()
            staged_lookup, staged_load, plain_lookup, plain_load = [], [], [], []
            mac_lookup, mac_load = [], []
            verify_crc, verify_mac = [], []

            def staged(eng, lookup_id):
                t0 = time.perf_counter()
                hit = eng.engine.lookup(tokens=ids, lookup_id=lookup_id, pin=True)
                t1 = time.perf_counter()
                claim = eng.claim(lookup_id)
                end = eng.load_claim(claim, 0, n, TransferContext(lookup_id, ((0,),)))
                t2 = time.perf_counter()
                assert hit == n and end == n, (hit, end)
                assert eng.take_counts().checksum_failures == 0
                return t1 - t0, t2 - t1, claim

            def verify_all(conn, claim, passes=5):
                # Fastest of a few passes: the in-memory figure should not
                # carry what else the machine was doing.
                best = float("inf")
                for _ in range(passes):
                    t0 = time.perf_counter()
                    for chunk in claim.chunks:
                        conn.verify(chunk.obj, chunk.start, chunk.ident)
                    best = min(best, time.perf_counter() - t0)
                return best

            for i in range(args.repeat):
                # Alternate which engine goes first: neither always gets the warmer caches.
                order = [(engine, "a", staged_lookup, staged_load), (mac_engine, "m", mac_lookup, mac_load)]
                for eng, tag, lookups, loads in order if i % 2 == 0 else order[::-1]:
                    lookup_s, load_s, claim = staged(eng, f"{tag}{i}")
                    lookups.append(lookup_s)
                    loads.append(load_s)
                    (verify_crc if eng is engine else verify_mac).append(verify_all(eng.connector, claim))
                    eng.release_claim(claim)

                t0 = time.perf_counter()
                hit = engine.staging._original_lookup(tokens=ids, lookup_id=f"b{i}", pin=True)
                t1 = time.perf_counter()
                ctx = TransferContext(f"b{i}", ((0,),))
                ret = engine.retrieve(tokens, mask, ctx)
                engine.engine.lookup_unpin(f"b{i}")
                t2 = time.perf_counter()
                assert hit == n and int(ret.sum()) == n and ctx.outcome.loaded_chunks == args.chunks
                plain_lookup.append(t1 - t0)
                plain_load.append(t2 - t1)
        finally:
            mac_engine.close()
            engine.close()

    def ms(xs):
        return statistics.median(xs) * 1e3

    total_staged = ms([a + b for a, b in zip(staged_lookup, staged_load)])
    total_mac = ms([a + b for a, b in zip(mac_lookup, mac_load)])
    total_plain = ms([a + b for a, b in zip(plain_lookup, plain_load)])
    print(f"hit of {args.chunks} chunks x {args.chunk_mib:g} MiB from Redis, median of {args.repeat}")
    print("| path | lookup ms | load ms | lookup + load ms |")
    print("|---|---|---|---|")
    print(f"| staged (verify at lookup) | {ms(staged_lookup):.1f} | {ms(staged_load):.1f} | {total_staged:.1f} |")
    print(f"| staged, pool secret (MAC at lookup) | {ms(mac_lookup):.1f} | {ms(mac_load):.1f} | {total_mac:.1f} |")
    print(f"| LMCache's (read at load) | {ms(plain_lookup):.1f} | {ms(plain_load):.1f} | {total_plain:.1f} |")
    print(f"staged / LMCache's, lookup + load: {total_staged / total_plain:.2f}")
    print(f"verify of {args.chunks} chunks in memory: crc32 {ms(verify_crc):.2f} ms, "
          f"BLAKE3 MAC {ms(verify_mac):.2f} ms")
    print(f"MAC / crc, staged lookup + load: {total_mac / total_staged:.2f}")
    print(f"MAC / crc, verification alone: {ms(verify_mac) / ms(verify_crc):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
