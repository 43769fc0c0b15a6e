# SPDX-License-Identifier: Apache-2.0
"""Figures, tables, goal checks and the plot of bench_serving.py (split from
it for size). Works on plain dicts so that ``--report`` can re-print a saved
``--json`` run."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

# vLLM 0.32 /metrics counters (tokens) and ours (LMCacheAscendConnectorV1Dynamic only).
METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:lmcache_ascend_hit_tokens_total",
    "vllm:lmcache_ascend_loaded_tokens_total",
    "vllm:lmcache_ascend_stored_tokens_total",
    "vllm:lmcache_ascend_load_errors_total",
)
GOALS = {  # (max mean-TTFT ratio, min output-tokens/s ratio), connector / vLLM alone
    "pressure": (0.5, 1.5),
    "fit": (1.03, 0.97),
}
CONNECTOR_NAMES = {
    "none": "vLLM alone",
    "ascend": "LMCacheAscendConnectorV1Dynamic",
    "lmcache": "LMCacheConnectorV1 (adapter route)",
    "noop": "a connector that does nothing (control)",
}


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def figures(records: list[dict], wall_s: float, before: dict, after: dict) -> dict[str, Any]:
    """Per-run figures from the request records and two /metrics scrapes."""
    ttft = [r["ttft"] for r in records]
    itl = [g for r in records for g in r["itls"]]
    out_tokens = sum(r["output_tokens"] for r in records)
    delta = {k.removeprefix("vllm:").removesuffix("_total"): after.get(k, 0.0) - before.get(k, 0.0)
             for k in METRICS}
    queries = delta["prefix_cache_queries"]
    rounds = sorted({r["round"] for r in records})
    return {
        "requests": len(records),
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "itl_mean_ms": mean(itl) * 1e3,
        "itl_p90_ms": pct(itl, 90) * 1e3,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "requests_s": len(records) / wall_s if wall_s > 0 else float("nan"),
        "wall_s": wall_s,
        "vllm_prefix_hit_rate": delta["prefix_cache_hits"] / queries if queries else float("nan"),
        "lmcache_hit_tokens": delta["external_prefix_cache_hits"],
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "cached_tokens": sum(max(0, r["cached_tokens"]) for r in records),
        "metrics_delta": delta,
        "ttft_per_round_s": [mean([r["ttft"] for r in records if r["round"] == k]) for k in rounds],
    }


def compare(got: list[dict], ref: list[dict], tol: float) -> dict[str, Any]:
    """Greedy outputs (tokens exactly, logprobs within ``tol``) of the same
    (user, round) requests. A conversation whose answer differs also differs
    in its later prompts, so only its first difference is a finding."""
    refs = {(r["user"], r["round"]): r for r in ref}
    equal, worst, bad = 0, 0.0, []
    n = 0
    for g in got:
        r = refs.get((g["user"], g["round"]))
        if r is None:
            continue
        n += 1
        if g["tokens"] != r["tokens"]:
            bad.append(f"user {g['user']} round {g['round']}: tokens differ")
            continue
        d = max((abs(a - b) for a, b in zip(g["logprobs"], r["logprobs"])), default=0.0)
        worst = max(worst, d)
        if d > tol:
            bad.append(f"user {g['user']} round {g['round']}: logprobs differ by {d:.3g}")
        else:
            equal += 1
    return {"compared": n, "equal": equal, "max_abs_logprob_diff": worst, "tolerance": tol,
            "differences": bad[:10]}


def _pooled(key: str, servers: dict[int, dict]) -> float:
    return mean([r["figures"][key] for r in servers.values()])


def ratios(runs: list[dict]) -> list[dict]:
    """Connector / vLLM alone, per model and KV setting (same run of the bench).

    With several servers per configuration (``--repeats``) the ratio is of the
    means over the servers; ``*_range`` is the lowest and highest ratio of one
    repeat's connector server to the same repeat's vLLM-alone server, i.e. the
    spread a single pair of servers shows on this machine."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["kv"], r["connector"]), {})[r.get("repeat", 0)] = r
    out = []
    for (model, kv, conn), reps in groups.items():
        base = groups.get((model, kv, "none"))
        if conn == "none" or not base:
            continue
        tt = _pooled("ttft_mean_s", reps) / _pooled("ttft_mean_s", base)
        tps = _pooled("output_tok_s", reps) / _pooled("output_tok_s", base)
        pairs = [(r["figures"], base[k]["figures"]) for k, r in sorted(reps.items()) if k in base]
        tt_pairs = [f["ttft_mean_s"] / fb["ttft_mean_s"] for f, fb in pairs]
        tps_pairs = [f["output_tok_s"] / fb["output_tok_s"] for f, fb in pairs]
        max_tt, min_tps = GOALS[kv]
        out.append({"model": model, "kv": kv, "connector": conn,
                    "servers": len(reps), "reference_servers": len(base),
                    "ttft_ratio": tt, "tok_s_ratio": tps,
                    "ttft_ratio_range": [min(tt_pairs), max(tt_pairs)] if tt_pairs else None,
                    "tok_s_ratio_range": [min(tps_pairs), max(tps_pairs)] if tps_pairs else None,
                    "goal_ttft": max_tt, "goal_tok_s": min_tps,
                    "ttft_goal_held": tt <= max_tt, "tok_s_goal_held": tps >= min_tps})
    return out


def _config(r: dict) -> str:
    rep = r.get("repeat", 0)
    return CONNECTOR_NAMES[r["connector"]] + (f" #{rep + 1}" if rep else "")


def _range(q: dict, key: str) -> str:
    rng = q.get(key)
    if not rng or q.get("servers", 1) < 2:
        return "-"
    return f"{rng[0]:.3f}-{rng[1]:.3f}"


def print_report(data: dict, out: Callable[[str], None] = print) -> None:
    out(f"machine: {data['machine']}")
    out(f"code: {data['code']}")
    wl = data["workload"]
    out(f"workload: {wl['users']} users x {wl['rounds']} rounds, {wl['concurrency']} in flight; "
        f"system prompt {wl['system_tokens']}, user history {wl['history_tokens']}, question "
        f"{wl['question_tokens']}, answer {wl['answer_tokens']} tokens (greedy, ignore_eos); "
        f"last prompt + answer {data['max_context']} tokens; working set "
        f"{data['working_set_tokens']} tokens; LMCache chunk {data['chunk_size']}")
    out("")
    out("| model | KV | vLLM KV tokens | configuration | TTFT mean / p50 / p90 s | ITL mean / p90 ms "
        "| output tok/s | req/s | vLLM prefix hit rate | LMCache hit tokens | preempt. | wall s |")
    out("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in data["runs"]:
        f = r["figures"]
        out(f"| {r['model']} | {r['kv']} | {r['kv_tokens']} | {_config(r)} | "
            f"{f['ttft_mean_s']:.3f} / {f['ttft_p50_s']:.3f} / {f['ttft_p90_s']:.3f} | "
            f"{f['itl_mean_ms']:.1f} / {f['itl_p90_ms']:.1f} | {f['output_tok_s']:.2f} | "
            f"{f['requests_s']:.3f} | {f['vllm_prefix_hit_rate']:.3f} | "
            f"{f['lmcache_hit_tokens']:.0f} | {f['metrics_delta']['num_preemptions']:.0f} | "
            f"{f['wall_s']:.0f}" + (" (cut by the time limit)" if r["truncated"] else "") + " |")
    out("")
    out("Mean TTFT per round (s):")
    out("")
    nr = max(len(r["figures"]["ttft_per_round_s"]) for r in data["runs"])
    out("| model | KV | configuration | " + " | ".join(f"round {k + 1}" for k in range(nr)) + " |")
    out("|---|---|---|" + "---|" * nr)
    for r in data["runs"]:
        pr = r["figures"]["ttft_per_round_s"]
        out(f"| {r['model']} | {r['kv']} | {_config(r)} | "
            + " | ".join(f"{x:.3f}" for x in pr) + " |")
    out("")
    out("Ratios to vLLM alone (same run; of the means over the servers when there are "
        "several, with the range over single pairs) and goals:")
    out("")
    out("| model | KV | configuration | servers | mean TTFT ratio | pairs | goal "
        "| output tok/s ratio | pairs | goal |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    for q in data["ratios"]:
        out(f"| {q['model']} | {q['kv']} | {q['connector']} | {q.get('servers', 1)} | "
            f"{q['ttft_ratio']:.3f} | {_range(q, 'ttft_ratio_range')} | "
            f"<= {q['goal_ttft']} {'held' if q['ttft_goal_held'] else 'MISSED'} | "
            f"{q['tok_s_ratio']:.3f} | {_range(q, 'tok_s_ratio_range')} | >= {q['goal_tok_s']} "
            f"{'held' if q['tok_s_goal_held'] else 'MISSED'} |")
    out("")
    out(f"Output equality (every request, greedy; tokens exact, logprobs within "
        f"{data['logprob_tol']:g}) against vLLM alone with the same KV space:")
    out("")
    for e in data["equality"]:
        c = e["result"]
        rep = e.get("repeat", 0)
        out(f"* {e['model']} {e['kv']} {e['connector']}{f' #{rep + 1}' if rep else ''}: "
            f"{c['equal']}/{c['compared']} equal, "
            f"max |logprob diff| {c['max_abs_logprob_diff']:.2g}"
            + (f"; {'; '.join(c['differences'])}" if c["differences"] else ""))
    if data.get("skipped"):
        out(f"\nskipped (--deadline): {', '.join(data['skipped'])}")
    for x in data.get("failed", []):
        out(f"FAILED: {x}")


def plot(data: dict, path: Path, log: Callable[[str], None]) -> bool:
    """Mean TTFT per round, one panel per model, one line per configuration."""
    try:
        import matplotlib
    except ImportError:
        extra = Path(__file__).resolve().parents[1] / "build" / "bench-plot"
        if extra.is_dir():
            sys.path.append(str(extra))  # after the stack's own packages (numpy)
        try:
            import matplotlib
        except ImportError:
            log("plot skipped: matplotlib is not importable; install it outside the stack with\n"
                "  .venv/bin/python -m pip install --no-deps --target build/bench-plot matplotlib "
                "contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil\n"
                "and re-plot with: python bench/bench_serving.py --report RUN.json --plot PNG")
            return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in data["runs"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    styles = {"none": ("black", "o"), "ascend": ("tab:blue", "s"), "lmcache": ("tab:orange", "^"),
              "noop": ("tab:gray", "x")}
    for ax, m in zip(axes[0], models):
        per_config: dict[tuple, list[list[float]]] = {}
        for r in data["runs"]:  # repeats: one line, the mean over the servers
            if r["model"] == m:
                per_config.setdefault((r["kv"], r["connector"]), []).append(
                    r["figures"]["ttft_per_round_s"])
        for (kv, conn), series in per_config.items():
            ys = [mean(list(col)) for col in zip(*series)]
            color, marker = styles[conn]
            n = len(series)
            ax.plot(range(1, len(ys) + 1), ys, color=color, marker=marker,
                    linestyle="-" if kv == "pressure" else "--",
                    label=f"{CONNECTOR_NAMES[conn]}, {kv}" + (f" (mean of {n})" if n > 1 else ""))
        ax.set_title(f"{m}: mean TTFT per round")
        ax.set_xlabel("round")
        ax.set_xticks(range(1, 1 + max(len(r["figures"]["ttft_per_round_s"]) for r in data["runs"])))
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    wl = data["workload"]
    fig.suptitle(f"{wl['users']} users x {wl['rounds']} rounds, {wl['concurrency']} in flight; "
                 f"solid: KV space < working set, dashed: it fits", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=110)
    log(f"plot written to {path}")
    return True


def check(data: dict) -> list[str]:
    """Correctness of a run (never timings): what --check asserts."""
    bad = []
    for r in data["runs"]:
        tag = f"{r['model']} {r['kv']} {r['connector']}"
        if r["truncated"]:
            bad.append(f"{tag}: cut by the time limit")
        f = r["figures"]
        for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_ms", "output_tok_s", "requests_s"):
            if not math.isfinite(f[k]) or f[k] <= 0:
                bad.append(f"{tag}: {k} = {f[k]}")
        if not math.isfinite(f["vllm_prefix_hit_rate"]):
            bad.append(f"{tag}: no vLLM prefix-cache queries in /metrics")
        if (r["connector"] in ("ascend", "lmcache") and r["kv"] == "pressure"
                and f["lmcache_hit_tokens"] <= 0):
            bad.append(f"{tag}: no LMCache hit tokens under pressure")
        if r["connector"] == "ascend" and f["metrics_delta"]["lmcache_ascend_load_errors"]:
            bad.append(f"{tag}: load errors")
    for e in data["equality"]:
        c = e["result"]
        if c["compared"] == 0 or c["equal"] != c["compared"]:
            bad.append(f"{e['model']} {e['kv']} {e['connector']}: outputs differ: {c['differences']}")
    by = {(r["model"], r["kv"], r["connector"]): r["figures"] for r in data["runs"]}
    for m in {r["model"] for r in data["runs"]}:
        p, f = by.get((m, "pressure", "none")), by.get((m, "fit", "none"))
        if p and f and not p["vllm_prefix_hit_rate"] < f["vllm_prefix_hit_rate"]:
            bad.append(f"{m}: vLLM alone hits as often under pressure "
                       f"({p['vllm_prefix_hit_rate']:.3f}) as when the working set fits "
                       f"({f['vllm_prefix_hit_rate']:.3f}): no pressure")
    return bad


def lookup(runs: list[dict], model: str, kv: str, connector: str) -> Optional[dict]:
    for r in runs:
        if (r["model"], r["kv"], r["connector"]) == (model, kv, connector):
            return r
    return None
