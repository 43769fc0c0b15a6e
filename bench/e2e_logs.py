"""Helpers of bench_e2e.py: parsing LMCache's and our per-request log lines
(the plan is read from its file, lmcache_ascend.cli.plan_file), figures from
an engine run, a plain-copy reference and the machine description."""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


# ---------------------------------------------------------- log parsing --

# LMCache 0.5.6's own per-call lines and our per-request summary line. vLLM
# request ids start with the engine's request counter; every phase submits
# one prompt, so the counter is the phase index.
STORED_RE = re.compile(
    r"\[req_id=(\d+)-\S*\] Stored (\d+) out of total \d+ tokens\. size: [\d.]+ GB, "
    r"cost ([\d.]+) ms"
)
RETRIEVED_RE = re.compile(
    r"\[req_id=(\d+)-\S*\] Retrieved (\d+) out of \d+ required tokens.*?cost ([\d.]+) ms"
)
SUMMARY_RE = re.compile(
    r"lmcache-ascend: request (\d+)-\S*: hit (\d+) tokens \(vLLM had (\d+)\), loaded (\d+) "
    r"tokens.*?, ([\d.]+) s in transfers"
)


@dataclass
class PhaseLog:
    stored_tokens: int = 0
    store_ms: float = 0.0  # LMCache store() calls
    retrieved_tokens: int = 0
    retrieve_ms: float = 0.0  # LMCache retrieve() calls
    transfer_s: float = float("nan")  # worker: loads + stores of the request


def parse_log(text: str, phase_names: list[str]) -> dict[str, PhaseLog]:
    """Per phase: what LMCache stored and retrieved, and the connector's
    transfer time."""
    per_phase: dict[str, PhaseLog] = {}

    def at(idx: str) -> Optional[PhaseLog]:
        i = int(idx)
        return per_phase.setdefault(phase_names[i], PhaseLog()) if i < len(phase_names) else None

    for line in text.splitlines():
        m = STORED_RE.search(line)
        if m and (pl := at(m.group(1))) is not None:
            pl.stored_tokens += int(m.group(2))
            pl.store_ms += float(m.group(3))
            continue
        m = RETRIEVED_RE.search(line)
        if m and (pl := at(m.group(1))) is not None:
            pl.retrieved_tokens += int(m.group(2))
            pl.retrieve_ms += float(m.group(3))
            continue
        m = SUMMARY_RE.search(line)
        if m and (pl := at(m.group(1))) is not None:
            pl.transfer_s = float(m.group(5))
    return per_phase


# -------------------------------------------------------------- figures --


def ttfts(run: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for r in run.results:
        c = r["completions"][0]
        t = c["ttft"]
        if t is None or (isinstance(t, float) and math.isnan(t)):
            t = c["seconds"]
        out[r["name"]] = {"ttft": float(t), "cached": int(c["num_cached_tokens"])}
    return out


def med(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def written_bytes(plan: dict[str, Any], loaded_tokens: int, window: int) -> int:
    """Bytes the load actually writes: every stored group's bytes per chunk
    times chunks, except sliding-window groups, whose out-of-window blocks
    vLLM gives as the null block (skipped): those write at most ``window``
    tokens (rounded up to chunks) before the hit end."""
    chunks = loaded_tokens // plan["chunk_size"]
    total = 0
    for g in plan["groups"]:
        if not g["stored"]:
            continue
        n = chunks
        if g["kind"] == "sliding":
            n = min(chunks, -(-window // plan["chunk_size"]) + 1)
        total += g["planned_bytes"] * n
    return total


def copy_seconds(nbytes: int, repeat: int = 7) -> float:
    """Median torch copy_ of nbytes between two pre-touched buffers."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if m:
            model = m.group(1).strip()
    except OSError:
        pass
    import torch

    try:
        import vllm

        vv = vllm.__version__
    except Exception:  # noqa: BLE001
        vv = "?"
    import lmcache

    lv = getattr(lmcache, "__version__", "?")
    return (
        f"{model}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), vllm {vv}, lmcache {lv}"
    )


def git_rev() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return rev + (" (+ uncommitted changes)" if dirty else "")
    except OSError:
        return "?"
