# SPDX-License-Identifier: Apache-2.0
"""End-to-end time to first token on a real vLLM engine (CPU), one run.

For a random-weight Llama-like model, a Gemma-3-like hybrid (5:1
sliding/full) model and, with ``--models qwen3_next``, a Qwen3-Next-like
hybrid (Gated DeltaNet + full attention, Mamba state restored in vLLM's
align mode; see bench/e2e_state.py for what differs: prompt lengths of
k * B + 64 tokens, B read from the connector's plan), at each prompt length
(2k, 4k, 8k tokens by default),
with ``max_tokens=1`` and the median over ``--rounds`` x ``--repeats``
requests:

  (a) cold, engine without the connector;
  (b) cold, engine with the connector (includes storing every chunk);
  (c) warm from LMCache: vLLM's prefix cache reset, then the (b) prompt again;
  (d) warm from vLLM's own prefix cache (the no-transfer limit), engine
      without the connector;
  plus two diagnostics from the connector engine:
  (d*) the (d) measurement on the connector engine (what a vLLM hit costs
       with the connector on);
  (e)  vLLM prefix hit that ends exactly at the LMCache hit boundary (a
       prompt sharing the first floor((n-1)/chunk)*chunk tokens with a (c)
       prompt): the same forward as (c) without any transfer, so
       (c) - (e) is the load path alone.

Bytes loaded = the worker's planned ``chunk_bytes`` (from the plan file
it writes, ``LMCACHE_ASCEND_PLAN_FILE``) x loaded chunks. For sliding-window
groups vLLM hands out the null block for positions outside the window, and
the load skips them; "written" bytes count only what lands in real blocks.
The plain-copy reference is ``torch.Tensor.copy_`` of the same number of
bytes, measured in this process right after the engines.

Each connector setting runs in its own engine process (this file re-invoked
with ``--engine-run``, which calls ``lmcache_ascend.cli.engine_run.run``
and marks phase boundaries in the log). A round is one engine without the
connector followed by one with it; rounds alternate so that drift in the
machine's load hits both alike. Both engines get the same cores
(VLLM_CPU_NUM_OF_RESERVED_CPU is pinned: vLLM-CPU otherwise reserves one
more core when a KV connector is configured). Cold measurements use
distinct prompts, so nothing is cached. Since (b)/(a) compares two
processes, the connector's store time (LMCache's own per-call log line) is
also reported as a share of (a), which does not depend on run-to-run noise;
on a shared machine the minimum of each cell's samples is printed as well.

``--profile`` instead runs the connector engine in one process and thread
(VLLM_ENABLE_V1_MULTIPROCESSING=0, uniproc executor) under cProfile, one
profile per warm phase kind (bench/e2e_profile.py), and prints the top
functions of (c) and, per function, what (c) spends beyond (d*): the load
path's cost without the forward's run-to-run noise.

Startup: building a model takes a few seconds (once; cached), each engine
process 35-70 s before its first request on a 2-core machine; a full run
starts 12 engines.

Usage:
  python bench/bench_e2e.py                      # full run (about 30 min on 2 cores)
  python bench/bench_e2e.py --quick              # 1k/2k tokens, one round
  python bench/bench_e2e.py --lengths 2048,4096 --rounds 2 --models llama
  python bench/bench_e2e.py --profile --models llama --lengths 8192 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

# Log parsing and machine facts live beside this script (split for size).
from e2e_logs import (  # noqa: E402
    PhaseLog,
    copy_seconds,
    git_rev,
    machine,
    med,
    parse_log,
    ttfts,
    written_bytes,
)
from e2e_profile import PhaseProfiler, print_profiles  # noqa: E402
from e2e_report import Row, print_report  # noqa: E402
import e2e_state  # noqa: E402
from lmcache_ascend.cli.plan_file import plan_env, read_plan  # noqa: E402

PHASE_MARK = "BENCH_E2E_PHASE"
RESERVED_CPUS = 0  # --reserved-cpus
PROFILE_ENV = "BENCH_E2E_CPROFILE"
# LMCache chunk size in tokens. Unless --chunk-size is given the connector
# picks it (vLLM-CPU's 128-token block); CHUNK_SET says whether to pass it.
CHUNK = 128
CHUNK_SET = False


# ---------------------------------------------------------------- models --


def model_specs() -> dict[str, Any]:
    from lmcache_ascend.cli.tiny_models import TinyModelSpec

    common = dict(
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
    )
    return {
        # ~76M parameters; KV 24 KiB/token fp32 (192 MiB at 8k tokens).
        "llama": TinyModelSpec("llama", **common),
        # Gemma-3 text: 5 sliding (window 1024) : 1 full layer -> 6 KV groups.
        "gemma3": TinyModelSpec("gemma3", sliding_window=1024, **common),
        # Qwen3-Next: 9 GDN : 3 full-attention layers, MoE, bf16.
        e2e_state.STATE_MODEL: e2e_state.spec(),
    }


def kv_bytes_per_token(spec) -> int:
    if spec.arch == "qwen3_next":
        return e2e_state.kv_bytes_per_token(spec)
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


# ----------------------------------------------------------- scenarios --


def prompt(length: int, rep: int) -> list[int]:
    from lmcache_ascend.cli.tiny_models import token_prompt

    return token_prompt(length, seed=1_000 * (rep + 1) + length)


def boundary(length: int) -> int:
    """Tokens the connector can serve for a prompt of ``length``."""
    return ((length - 1) // CHUNK) * CHUNK


def boundary_prompt(length: int, rep: int) -> list[int]:
    from lmcache_ascend.cli.tiny_models import token_prompt

    b = boundary(length)
    return prompt(length, rep)[:b] + token_prompt(length - b, seed=900_000 + 1_000 * rep + length)


WARMUP = ("warmup", 1024, 7)


def phases(lengths: list[int], reps: range, connector: bool, warm: int = 1, profile: bool = False):
    """Warm-up, the cold prompts, then per cold prompt ``warm`` times:
    reset vLLM's prefix cache and (c) load it from LMCache, (d) hit vLLM's
    prefix cache, (e) a prompt that hits vLLM's prefix cache up to the
    LMCache boundary (connector engine only; (d) alone otherwise)."""
    from lmcache_ascend.cli.engine_run import Phase
    from lmcache_ascend.cli.tiny_models import token_prompt

    def one(name, p, reset=False):
        return Phase(name, [p], max_tokens=1, reset_prefix_cache=reset, sequential=True)

    out = [one(WARMUP[0], token_prompt(WARMUP[1], seed=WARMUP[2]))]
    kind = "fill" if profile else "cold"  # profile: stores only, nothing timed
    out += [one(f"{kind}/{n}/{r}", prompt(n, r)) for r in reps for n in lengths]
    for r in reps:
        for n in lengths:
            for k in range(warm):
                tag = f"{n}/{r}/{k}"
                if connector:
                    out.append(one(f"lmcache/{tag}", prompt(n, r), reset=True))
                out.append(one(f"vllm/{tag}", prompt(n, r)))
                if connector:
                    out.append(one(f"boundary/{tag}", boundary_prompt(n, r)))
    if profile:
        # Ends the last profiled phase before the engine shuts down.
        out.append(one("tail", token_prompt(WARMUP[1], seed=WARMUP[2])))
    return out


def scenario(model: str, spec, lengths, reps: range, connector: bool, warm: int = 1,
             profile: bool = False):
    from lmcache_ascend.cli.engine_run import Scenario

    per_tok = kv_bytes_per_token(spec)
    # Everything stored: cold prompts, re-stores after vLLM hits, boundary tails.
    stored_tokens = 2 * sum(lengths) * len(reps) + 2 * WARMUP[1] + CHUNK * len(reps) * len(lengths)
    lmc_gb = max(1.0, round(stored_tokens * per_tok * 1.25 / 1e9 + 0.5, 1))
    # vLLM's prefix cache keeps every prompt of a repeat (nothing evicted
    # between (c), (d) and (e)).
    kv_gib = max(1, math.ceil(2 * max(lengths) * per_tok * 2 / 2**30))
    engine_kwargs: dict[str, Any] = {"distributed_executor_backend": "uni"} if profile else {}
    if spec.arch == "qwen3_next":
        kv_gib = max(kv_gib, e2e_state.min_kv_gib(spec, max(lengths)))
        engine_kwargs.update(e2e_state.ENGINE_KWARGS)
    return Scenario(
        model=model,
        phases=phases(lengths, reps, connector, warm, profile),
        connector="ascend" if connector else "none",
        kv_extra=(
            {"lmcache.max_local_cpu_size": lmc_gb}
            | ({"lmcache.chunk_size": CHUNK} if CHUNK_SET else {})
        )
        if connector
        else {},
        max_model_len=max(lengths) + 64,
        kv_cache_gib=kv_gib,
        dtype=spec.dtype,
        # Profile: scheduler, worker and forward in one thread, one process.
        engine_kwargs=engine_kwargs,
        logprobs=0,
    )


# ------------------------------------------------------- engine process --


def engine_main(scenario_path: str, out_path: str) -> int:
    """Runs in the child: engine_run.run with phase marks (and cProfile)."""
    from lmcache_ascend.cli import engine_run

    with open(scenario_path) as f:
        sc = engine_run.Scenario.from_json(json.load(f))
    prof_path = os.environ.get(PROFILE_ENV)
    prof = PhaseProfiler(Path(prof_path)) if prof_path else None

    def progress(msg: str) -> None:
        if prof is not None:
            prof.mark(msg)
        print(f"{PHASE_MARK} {time.time():.3f} {msg}", flush=True)

    results = engine_run.run(sc, progress=progress)
    if prof is not None:
        prof.dump()
    print(f"{PHASE_MARK} {time.time():.3f} done", flush=True)
    with open(out_path, "w") as f:
        json.dump([asdict(r) for r in results], f)
    return 0


@dataclass
class EngineRun:
    results: list[dict[str, Any]]
    log: str
    wall_s: float
    startup_s: float  # process start -> first phase (model load, KV alloc, warm-up of vLLM)
    # The ascend_plan_file of the run: read_plan(plan_file) is worker 0's
    # plan (none without the connector).
    plan_file: Path


def run_engine(sc, workdir: Path, tag: str, timeout: int, env_extra=None) -> EngineRun:
    sc_path = workdir / f"{tag}.scenario.json"
    out_path = workdir / f"{tag}.out.json"
    log_path = workdir / f"{tag}.log"
    plan_file = (workdir / f"{tag}.plan.json").absolute()
    sc_path.write_text(json.dumps(asdict(sc)))
    env = dict(os.environ)
    env.update(env_extra or {})
    env.update(plan_env(plan_file))  # the bench reads the plan from there
    env["VLLM_CPU_KVCACHE_SPACE"] = str(sc.kv_cache_gib)
    # vLLM-CPU reserves one core for its scheduler process and, when a KV
    # connector is configured, one more; on a machine with few cores the
    # engine without a connector would then compute on fewer cores than the
    # one with it. Pin the reservation so both settings get the same cores.
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(RESERVED_CPUS)
    env.setdefault("LMCACHE_LOG_LEVEL", "INFO")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    t0 = time.time()
    with open(log_path, "w") as lf:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--engine-run", str(sc_path), str(out_path)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=str(workdir),
            env=env,
        )
    wall = time.time() - t0
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-60:])
        raise RuntimeError(f"engine run {tag} failed (rc={proc.returncode}); log tail:\n{tail}")
    marks = [float(m.group(1)) for m in re.finditer(rf"^{PHASE_MARK} (\S+) phase ", text, re.M)]
    startup = (marks[0] - t0) if marks else float("nan")
    return EngineRun(json.loads(out_path.read_text()), text, wall, startup, plan_file)


@dataclass
class Samples:
    ttft: dict[str, list[float]] = field(default_factory=dict)
    cached: dict[str, list[int]] = field(default_factory=dict)
    logs: dict[str, list[PhaseLog]] = field(default_factory=dict)

    def add(self, key: str, run_ttfts: dict, name: str, plog: Optional[dict] = None) -> None:
        self.ttft.setdefault(key, []).append(run_ttfts[name]["ttft"])
        self.cached.setdefault(key, []).append(run_ttfts[name]["cached"])
        if plog is not None:
            self.logs.setdefault(key, []).append(plog.get(name, PhaseLog()))


def measure_model(name: str, spec, args, workdir: Path, log):
    """``args.rounds`` rounds, each: an engine without the connector, then
    one with it (``args.repeats`` prompts per length each), so slow drift of
    the machine's load hits both settings alike."""
    from lmcache_ascend.cli.tiny_models import build_tiny_model

    global CHUNK
    chunk_before = CHUNK
    t0 = time.time()
    path = str(build_tiny_model(spec, cache_dir=args.model_cache))
    log(f"[{name}] model {Path(path).name} ready in {time.time() - t0:.1f} s")
    plan = None
    state = None
    lengths = args.lengths
    if e2e_state.is_state_model(name):
        from lmcache_ascend.cli.engine_run import Scenario

        record = e2e_state.read_state_plan(path, Scenario, run_engine, workdir, args.timeout)
        state = record["state"]
        if not CHUNK_SET:
            CHUNK = state["block_size"]
        lengths = e2e_state.lengths_for(args.lengths, state["block_size"], args.state_tail)
        log(f"[{name}] {e2e_state.describe(state, record['plan'])}; prompt lengths {lengths}")
    walls: dict[str, list[tuple[float, float]]] = {"none": [], "ascend": []}
    per_len: dict[int, Samples] = {n: Samples() for n in lengths}
    for rnd in range(args.rounds):
        reps = range(rnd * args.repeats, (rnd + 1) * args.repeats)
        runs = {}
        for connector in (False, True):
            tag = f"{name}-r{rnd}-{'ascend' if connector else 'none'}"
            sc = scenario(path, spec, lengths, reps, connector, args.warm_repeats)
            log(f"[{name}] round {rnd + 1}/{args.rounds}: engine "
                f"{'with' if connector else 'without'} connector, {len(sc.phases)} phases, "
                f"KV {sc.kv_cache_gib} GiB")
            run = run_engine(sc, workdir, tag, args.timeout)
            walls["ascend" if connector else "none"].append((run.wall_s, run.startup_s))
            log(f"[{name}]   done in {run.wall_s:.0f} s (startup to first phase "
                f"{run.startup_s:.0f} s)")
            runs[connector] = (run, [p.name for p in sc.phases])
        base = ttfts(runs[False][0])
        conn = ttfts(runs[True][0])
        plog = parse_log(runs[True][0].log, runs[True][1])
        # The record is {text, plan, groups, agreement, state, ...}: the
        # figures read its plan (chunk size, bytes, per-group sizing).
        plan = plan or read_plan(runs[True][0].plan_file)["plan"]
        for n in lengths:
            smp = per_len[n]
            for r in reps:
                smp.add("a", base, f"cold/{n}/{r}")
                smp.add("b", conn, f"cold/{n}/{r}", plog)
                for k in range(args.warm_repeats):
                    smp.add("d", base, f"vllm/{n}/{r}/{k}")
                    smp.add("c", conn, f"lmcache/{n}/{r}/{k}", plog)
                    smp.add("d_conn", conn, f"vllm/{n}/{r}/{k}", plog)
                    smp.add("e", conn, f"boundary/{n}/{r}/{k}", plog)
    rows = []
    for n in lengths:
        smp = per_len[n]
        if any(smp.cached["a"]) or any(smp.cached["b"]):
            raise RuntimeError(f"{name}: a cold {n}-token request found cached tokens")
        hit = int(med([float(h) for h in smp.cached["c"]]))
        if hit == 0:
            log(f"[{name}] WARNING: no LMCache hit at {n} tokens (cached {smp.cached['c']})")
        loaded = int(med([float(p.retrieved_tokens) for p in smp.logs["c"]])) or hit
        nbytes = loaded // plan["chunk_size"] * plan["chunk_bytes"]
        if state is not None:
            # LMCache's retrieve also counts the state pieces' tokens.
            loaded = hit
            nbytes = e2e_state.bytes_loaded(plan, state, hit)
        rows.append(
            Row(
                model=name,
                length=n,
                a=med(smp.ttft["a"]),
                b=med(smp.ttft["b"]),
                c=med(smp.ttft["c"]),
                d=med(smp.ttft["d"]),
                d_conn=med(smp.ttft["d_conn"]),
                e=med(smp.ttft["e"]),
                hit_tokens=hit,
                retrieve_s=med([p.retrieve_ms / 1e3 for p in smp.logs["c"]]),
                store_s_cold=med([p.store_ms / 1e3 for p in smp.logs["b"]]),
                restored_tokens_vllm_hit=int(med([float(p.stored_tokens) for p in smp.logs["d_conn"]])),
                store_s_vllm_hit=med([p.store_ms / 1e3 for p in smp.logs["d_conn"]]),
                chunk_bytes=plan["chunk_bytes"],
                bytes_loaded=nbytes,
                bytes_written=written_bytes(plan, loaded, spec.sliding_window),
                copy_s=copy_seconds(nbytes) if nbytes else float("nan"),
                samples=smp.ttft,
            )
        )
    if state is not None:
        plan = dict(plan, state=state)
        CHUNK = chunk_before  # the next model chunks at its own size
    return rows, plan, walls


def profile_model(name: str, spec, args, workdir: Path, log) -> None:
    from lmcache_ascend.cli.tiny_models import build_tiny_model

    path = str(build_tiny_model(spec, cache_dir=args.model_cache))
    sc = scenario(path, spec, args.lengths, range(args.repeats), True, args.warm_repeats,
                  profile=True)
    prof = workdir / f"{name}.prof"
    env = {PROFILE_ENV: str(prof), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = run_engine(sc, workdir, f"{name}-profile", args.timeout, env)
    t = ttfts(run)
    plog = parse_log(run.log, [p.name for p in sc.phases])
    for key, v in t.items():
        pl = plog.get(key, PhaseLog())
        log(f"[{name}] {key}: ttft {v['ttft']:.3f} s, cached {v['cached']}, LMCache retrieve "
            f"{pl.retrieve_ms:.1f} ms, store {pl.store_ms:.1f} ms"
            + (" (profiled)" if not key.startswith(("fill/", "warmup", "tail")) else ""))
    print_profiles(prof, args.profile_top, args.repeats * args.warm_repeats, log)


def main(argv: list[str]) -> int:
    global CHUNK, CHUNK_SET, RESERVED_CPUS
    if len(argv) >= 1 and argv[0] == "--engine-run":
        return engine_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,gemma3")
    ap.add_argument("--lengths", default="2048,4096,8192", help="prompt tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=3,
                    help="engine pairs (without, with connector) per model")
    ap.add_argument("--repeats", type=int, default=1,
                    help="cold prompts per length per engine")
    ap.add_argument("--warm-repeats", type=int, default=3,
                    help="(c), (d), (e) measurements per cold prompt")
    ap.add_argument("--quick", action="store_true", help="1024,2048 tokens, one round")
    ap.add_argument("--state-tail", type=int, default=e2e_state.TAIL,
                    help="state models: tokens past the last block boundary of each prompt")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="LMCache chunk size in tokens (a multiple of vLLM's block size); "
                         "default: the connector's (vLLM's block granularity)")
    ap.add_argument("--reserved-cpus", type=int, default=RESERVED_CPUS,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for both engines (same cores for both)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine process")
    ap.add_argument("--model-cache", type=Path, default=None,
                    help="where the random-weight models are built (default: a bench-e2e "
                         "folder in lmcache-ascend's model cache)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep scenarios and engine logs here")
    ap.add_argument("--json", type=Path, default=None, help="write figures as JSON")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the tables of a --json file again (no engines run)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the warm-from-LMCache phases (in-process engine) instead")
    ap.add_argument("--profile-top", type=int, default=40)
    args = ap.parse_args(argv)
    if args.chunk_size is not None:
        CHUNK, CHUNK_SET = args.chunk_size, True
    RESERVED_CPUS = args.reserved_cpus
    if args.quick:
        args.lengths, args.rounds = "1024,2048", 1
    args.lengths = sorted(int(x) for x in str(args.lengths).split(","))
    for n in args.lengths:
        if n <= CHUNK:
            ap.error(f"prompt length {n} must exceed the chunk size {CHUNK}")
    if args.model_cache is None:
        from lmcache_ascend.cli.tiny_models import default_cache_dir

        # Own folder: TinyModelSpec.name does not encode every size we set.
        args.model_cache = default_cache_dir() / "bench-e2e"
    specs = model_specs()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for n in names:
        if n not in specs:
            ap.error(f"unknown model {n!r}; valid: {sorted(specs)}")
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_e2e_")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.report is not None:
        saved = json.loads(args.report.read_text())
        print(f"machine: {saved['machine']}\ncode: {saved['code']}")
        print_report([Row.from_json(r) for r in saved["rows"]])
        return 0
    code = git_rev()  # before the run: others may commit while it goes
    log(f"machine: {machine()}; code: {code}")
    if args.profile:
        for n in names:
            profile_model(n, specs[n], args, workdir, log)
        return 0
    all_rows: list[Row] = []
    info = {}
    t_start = time.time()
    for n in names:
        rows, plan, walls = measure_model(n, specs[n], args, workdir, log)
        all_rows += rows
        info[n] = {
            "spec": asdict(specs[n]),
            "plan": {k: plan[k] for k in ("chunk_size", "chunk_bytes", "groups", "state") if k in plan},
            "engine_wall_s": {k: [w for w, _ in v] for k, v in walls.items()},
            "engine_startup_s": {k: [st for _, st in v] for k, v in walls.items()},
        }
        expected = plan["state"]["block_size"] if "state" in plan and not CHUNK_SET else CHUNK
        if plan["chunk_size"] != expected:
            raise SystemExit(
                f"[{n}] the connector chunks at {plan['chunk_size']} tokens, the bench's "
                f"figures assume {expected}; pass --chunk-size"
            )
        groups = ", ".join(
            f"g{g['group']} {g['kind']} {g['planned_bytes']} B" for g in plan["groups"]
        )
        startup = med([st for v in walls.values() for _, st in v])
        log(f"[{n}] plan: chunk {plan['chunk_size']} tokens = {plan['chunk_bytes']} bytes "
            f"({groups}); engine startup median {startup:.0f} s")
    cold = args.rounds * args.repeats
    chunks = ", ".join(f"{m} {i['plan']['chunk_size']}" for m, i in info.items())
    print(f"\nmachine: {machine()}")
    print(f"code: {code}")
    print(f"lengths {args.lengths}; medians of {cold} cold and {cold * args.warm_repeats} warm "
          f"requests per cell ({args.rounds} round(s)); max_tokens=1; LMCache chunk "
          f"{chunks}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={RESERVED_CPUS}; total {time.time() - t_start:.0f} s")
    print_report(all_rows)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "code": code,
                    "lengths": args.lengths,
                    "rounds": args.rounds,
                    "repeats": args.repeats,
                    "warm_repeats": args.warm_repeats,
                    "models": info,
                    "rows": [
                        dict(asdict(r), b_over_a=r.b_over_a, c_over_a=r.c_over_a,
                             c_over_d=r.c_over_d, eff_bw=r.eff_bw, copy_bw=r.copy_bw,
                             c_minus_e=r.paired("c", "e"), c_minus_d_conn=r.paired("c", "d_conn"))
                        for r in all_rows
                    ],
                },
                indent=2,
            )
        )
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
