# SPDX-License-Identifier: Apache-2.0
"""Storage backends side by side: local CPU, Redis and Mooncake, in one run.

Two measurements, both against real servers started here on 127.0.0.1
(``redis-server``; a Mooncake master plus a segment holder, the engines
being pure clients) and stopped by PID:

1. **Per chunk**, the calls LMCache 0.5.6 makes for one chunk, timed from
   Python, for several chunk sizes: local CPU = a copy into a preallocated
   buffer (what LMCache's CPU backend does); Redis = ``SET``/``GET`` of the
   value plus its metadata key through redis-py (LMCache's Redis connector
   stores two keys with it);
   Mooncake = ``put_parts(key, metadata, value)`` / ``batch_get_buffer``
   (LMCache's Mooncake connector with ``save_chunk_meta``, its default).
   Reported: median MB/s and ms per chunk.
2. **Warm TTFT** through the connector: one engine per backend serves the
   same prompts cold, then (vLLM's prefix cache reset) warm; for Redis and
   Mooncake LMCache's local CPU cache is off, so every warm hit comes from
   the backend. Reported: mean TTFT cold/warm, tokens hit from the
   backend, and whether warm tokens equal cold ones (a sanity check; the
   exactness tests are tests/integration/test_mooncake.py).

``--hold mooncake`` (or ``redis``) instead starts that backend, prints the
``LMCACHE_*`` variables to export, and waits for Ctrl-C: bench_serving.py
passes them to its servers (they inherit the environment), so the serving
benchmark runs with that remote backend behind LMCache's CPU cache.

Usage:
  python bench/bench_backends.py [--json out.json] [--sizes 0.5,4,32] [--model llama]
  python bench/bench_backends.py --hold mooncake
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from mooncake_server import MooncakeStore  # noqa: E402
from redis_server import RedisServer  # noqa: E402

META_BYTES = 28  # LMCache's RemoteMetadata for one buffer


def _median_rate(times: list[float], nbytes: int) -> tuple[float, float]:
    t = statistics.median(times)
    return nbytes / t / 1e6, t * 1e3


def per_chunk(redis: RedisServer, mc: MooncakeStore, sizes_mb: list[float], reps: int) -> list[dict]:
    import numpy as np
    import redis as redis_py  # LMCache's own Redis client library
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    setup = {k[len("mooncake_"):]: str(v) for k, v in mc.extra_config(mooncake_local_buffer_size=256 << 20).items()}
    assert store.setup(setup) == 0, "Mooncake setup failed"
    rc = redis_py.Redis(host="127.0.0.1", port=redis.port)
    rows = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20))
        value = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        data, meta = value.tobytes(), b"m" * META_BYTES
        dst = np.empty_like(value)
        res: dict[str, list[float]] = {k: [] for k in ("cpu_put", "cpu_get", "redis_put", "redis_get",
                                                      "mooncake_put", "mooncake_get")}
        for i in range(reps):
            t = time.perf_counter(); np.copyto(dst, value); res["cpu_put"].append(time.perf_counter() - t)
            t = time.perf_counter(); np.copyto(value, dst); res["cpu_get"].append(time.perf_counter() - t)
            key = f"bench-{mb}-{i}"
            t = time.perf_counter()
            rc.set(f"{key}kv_bytes", data); rc.set(f"{key}metadata", meta)
            res["redis_put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            got = rc.get(f"{key}kv_bytes"); rc.get(f"{key}metadata")
            res["redis_get"].append(time.perf_counter() - t)
            assert got == data
            rc.delete(f"{key}kv_bytes", f"{key}metadata")
            t = time.perf_counter(); code = store.put_parts(key, meta, data)
            res["mooncake_put"].append(time.perf_counter() - t)
            assert code == 0, f"Mooncake put_parts failed: {code}"
            t = time.perf_counter(); got = store.batch_get_buffer([key])[0]
            res["mooncake_get"].append(time.perf_counter() - t)
            assert got is not None and bytes(memoryview(got))[META_BYTES:] == data
            store.remove(key)
        row = {"chunk_mb": mb}
        for k, v in res.items():
            row[f"{k}_MBps"], row[f"{k}_ms"] = _median_rate(v, n)
        rows.append(row)
    store.close()
    rc.close()
    return rows


def _engine(model: str, prompts: list[list[int]], env: dict[str, str], work: Path, tag: str) -> dict:
    from lmcache_ascend.cli.engine_run import Phase, PhaseResult, Scenario

    scenario = Scenario(model=model, phases=[
        Phase("cold", prompts, sequential=True),
        Phase("warm", prompts, reset_prefix_cache=True, sequential=True),
    ])
    sc, out, log = work / f"{tag}.json", work / f"{tag}.out.json", work / f"{tag}.log"
    sc.write_text(json.dumps(asdict(scenario)))
    full = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", LMCACHE_MAX_LOCAL_CPU_SIZE="1",
                LMCACHE_LOOKUP_TIMEOUT_MS="10000", **env)
    with open(log, "w") as lf:
        rc = subprocess.run([sys.executable, "-m", "lmcache_ascend.cli.engine_run", str(sc), str(out)],
                            stdout=lf, stderr=subprocess.STDOUT, env=full, cwd=str(work), timeout=900).returncode
    if rc != 0:
        raise SystemExit(f"engine {tag} failed (rc={rc}); see {log}")
    cold, warm = [PhaseResult.from_json(r) for r in json.loads(out.read_text())]
    return {
        "backend": tag,
        "ttft_cold_s": statistics.mean(x.ttft for x in cold.completions),
        "ttft_warm_s": statistics.mean(x.ttft for x in warm.completions),
        "warm_hit_tokens": sum(x.num_cached_tokens for x in warm.completions),
        "warm_equals_cold": all(a.tokens == b.tokens for a, b in zip(cold.completions, warm.completions)),
    }


def warm_ttft(model_name: str, redis: RedisServer, mc: MooncakeStore, prompt_tokens: int, n: int,
              work: Path) -> list[dict]:
    from lmcache_ascend.cli.tiny_models import build_tiny_model, token_prompt

    model = str(build_tiny_model(model_name))
    prompts = [token_prompt(prompt_tokens, seed=500 + i) for i in range(n)]
    remote = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_SERDE": "naive"}
    return [
        _engine(model, prompts, {"LMCACHE_LOCAL_CPU": "True"}, work, "local_cpu"),
        _engine(model, prompts, dict(remote, LMCACHE_REMOTE_URL=redis.url), work, "redis"),
        _engine(model, prompts, dict(remote, **mc.engine_env()), work, "mooncake"),
    ]


def _table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def hold(kind: str, work: Path) -> int:
    server = MooncakeStore(work, segment="4GB") if kind == "mooncake" else RedisServer(work)
    with server as s:
        env = s.engine_env() if kind == "mooncake" else {"LMCACHE_REMOTE_URL": s.url, "LMCACHE_REMOTE_SERDE": "naive"}
        for k, v in env.items():
            print(f"export {k}='{v}'")
        print(f"# {kind} is up; run bench/bench_serving.py in a shell with these exported. Ctrl-C stops it.",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5,4,32", help="chunk sizes in MiB")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default="llama", help="tiny model for the TTFT part (none: skip it)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--hold", choices=["redis", "mooncake"], default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-backends-"))
    if args.hold:
        return hold(args.hold, work)
    with RedisServer(work / "redis") as redis, MooncakeStore(work / "mooncake", segment="2GB") as mc:
        chunks = per_chunk(redis, mc, [float(s) for s in args.sizes.split(",")], args.reps)
        print("Per chunk (median of %d):" % args.reps)
        print(_table(chunks, ["chunk_mb"] + [f"{b}_{op}_MBps" for b in ("cpu", "redis", "mooncake")
                                             for op in ("put", "get")]))
        ttft = [] if args.model == "none" else warm_ttft(args.model, redis, mc, args.prompt_tokens,
                                                        args.prompts, work)
    if ttft:
        print(f"\nWarm TTFT ({args.model}, {args.prompts} prompts of {args.prompt_tokens} tokens):")
        print(_table(ttft, ["backend", "ttft_cold_s", "ttft_warm_s", "warm_hit_tokens", "warm_equals_cold"]))
    if args.json:
        args.json.write_text(json.dumps({"per_chunk": chunks, "warm_ttft": ttft}, indent=1))
    print(f"\nlogs: {work}")
    return 0 if all(r["warm_equals_cold"] for r in ttft) else 1


if __name__ == "__main__":
    sys.exit(main())
