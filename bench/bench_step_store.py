"""What a step's stores cost the step: seals inside it or beside it, in one run.

A chunk stored to a disk or remote backend is sealed with a checksum (crc32
seeded with its key) or, with a pool secret, a keyed BLAKE3 MAC
(lmcache_bridge/engine/chunk_io.py). Both read the whole payload. Four engines on
one real redis-server (127.0.0.1, started and stopped here), each behind
LMCache's local CPU cache, store the same kind of step, interleaved:

* no checksums: the copy out alone (the floor a step can reach);
* sealed inside the step (what the connector did before): copy, then seal,
  on the storing thread;
* sealed beside the step (what it does now, crc and MAC): copy on the
  storing thread; seal and puts on the hand-off thread
  (lmcache_bridge/engine/step_puts.py).

A step is ``--chunks`` chunks of ``--chunk-mib`` MiB, copied from a source
tensor (a memcpy standing for the native gather out of vLLM's KV cache),
with fresh tokens each time so LMCache stores every chunk. Printed per
engine: the storing thread's time per step (median), its ratio to the
no-checksum floor, and the time until the step's chunks were handed off
(sealed and given to Redis): the work that moved, not work saved. With a
``--compute-ms`` busy loop after each step (the next forward), also the step
plus compute time: whether the seals really run on the idle core (the crc32 and
BLAKE3 release the GIL).

    python bench/bench_step_store.py [--chunks 8] [--chunk-mib 2] [--repeat 12] [--compute-ms 0]
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
POOL_STEPS = 4  # each engine's CPU cache holds this many steps' chunks
WARM = POOL_STEPS + 2  # rounds not counted: the cache wraps round once, connections open


class SealInStep(PagedChunkConnector):
    """The connector as it was: every chunk sealed on the storing thread."""

    def _seal_stored(self, obj, buf, ident):
        self._seal(buf, ident)


def _busy(ms: float) -> None:
    # Stands for the next forward: Python holding the GIL, as vLLM's
    # scheduler and model runner do between kernels.
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks per step")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per chunk (MiB)")
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--compute-ms", type=float, default=0.0, help="busy time after each step")
    args = ap.parse_args()
    if ensure_redis_server() is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    source = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)

    def store(buf, req):
        buf[:chunk_bytes].copy_(source)

    def load(buf, req):
        raise AssertionError("nothing is loaded here")

    mac_key = derive_mac_key(b"bench pool secret, 32 bytes long")
    kinds = {
        "no checksums": lambda: PagedChunkConnector(chunk_bytes, CHUNK, store, load, checksums=False),
        "crc, inside the step": lambda: SealInStep(chunk_bytes, CHUNK, store, load, checksums=True),
        "crc, beside the step": lambda: PagedChunkConnector(chunk_bytes, CHUNK, store, load, checksums=True),
        "MAC, inside the step": lambda: SealInStep(chunk_bytes, CHUNK, store, load, mac_key=mac_key),
        "MAC, beside the step": lambda: PagedChunkConnector(chunk_bytes, CHUNK, store, load, mac_key=mac_key),
    }
    step_s: dict[str, list[float]] = {k: [] for k in kinds}
    drained_s: dict[str, list[float]] = {k: [] for k in kinds}
    total_s: dict[str, list[float]] = {k: [] for k in kinds}
    per_step = args.chunks * chunk_bytes
    with tempfile.TemporaryDirectory() as work, RedisServer(Path(work)) as server:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            # A few steps' worth, so that after the warm-up rounds every copy
            # lands in memory already touched: LMCache's CPU cache is
            # allocated lazily, and a first touch costs more than the copy.
            max_local_cpu_size=POOL_STEPS * per_step / (1 << 30),
            remote_url=server.url,
            remote_serde="naive",
            pre_caching_hash_algorithm="sha256_cbor",
            save_unfull_chunk=False,
        )
        engines = {}
        try:
            for name, make in kinds.items():
                spec = EngineSpec("bench-step-store", f"bench-{uuid.uuid4().hex[:8]}", 0, 1, CHUNK, {})
                engines[name] = WorkerEngine.start(config, spec, make(), chunk_bytes, 1, name.replace(" ", "-"))
            n = args.chunks * CHUNK
            mask = torch.ones(n, dtype=torch.bool)
            for i in range(WARM + args.repeat):
                names = list(kinds) if i % 2 == 0 else list(kinds)[::-1]
                for name in names:
                    eng = engines[name]
                    tokens = torch.arange(n) + (i * len(kinds) + list(kinds).index(name)) * n + 11
                    t0 = time.perf_counter()
                    with eng.step():
                        eng.store(tokens, mask, TransferContext(f"{name}{i}", ((0,),)))
                    t1 = time.perf_counter()
                    _busy(args.compute_ms)
                    t2 = time.perf_counter()
                    assert eng.drain_puts(60), "the step's puts were never handed off"
                    t3 = time.perf_counter()
                    if i >= WARM:
                        step_s[name].append(t1 - t0)
                        total_s[name].append(t2 - t0)
                        drained_s[name].append(t3 - t0)
        finally:
            for eng in engines.values():
                eng.close()

    def ms(xs):
        return statistics.median(xs) * 1e3

    floor = ms(step_s["no checksums"])
    print(f"a step storing {args.chunks} chunks x {args.chunk_mib:g} MiB to Redis behind LMCache's CPU cache, "
          f"median of {args.repeat}; compute after the step: {args.compute_ms:g} ms")
    print("| stores | storing thread per step, ms | / no checksums | step + compute, ms | until handed off, ms |")
    print("|---|---|---|---|---|")
    for name in kinds:
        print(f"| {name} | {ms(step_s[name]):.1f} | {ms(step_s[name]) / floor:.2f} | "
              f"{ms(total_s[name]):.1f} | {ms(drained_s[name]):.1f} |")
    for seal in ("crc", "MAC"):
        inside, beside = ms(step_s[f"{seal}, inside the step"]), ms(step_s[f"{seal}, beside the step"])
        print(f"{seal}: storing thread beside / inside the step: {beside / inside:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
