"""cProfile of bench_e2e.py's warm phases, one profile per phase kind.

(c) (warm from LMCache) and (d*) (vLLM prefix hit, same engine, seconds
later) run the same forward; the per-function difference of their profiles
is what the load path adds, without the run-to-run noise of the forward
that a TTFT difference carries (split from bench_e2e.py for size).
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Callable, Optional

# Phase-name prefixes -> profile kinds (see bench_e2e.phases).
KINDS = ("lmcache", "vllm", "boundary")


class PhaseProfiler:
    """Turns one profiler per phase kind on and off at phase marks."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.profiles = {k: cProfile.Profile() for k in KINDS}
        self._on: Optional[cProfile.Profile] = None

    def mark(self, msg: str) -> None:
        if self._on is not None:
            self._on.disable()
            self._on = None
        if msg.startswith("phase "):
            kind = msg.split()[1].split("/")[0]
            if kind in self.profiles:
                self._on = self.profiles[kind]
                self._on.enable()

    def dump(self) -> None:
        self.mark("")
        for kind, prof in self.profiles.items():
            prof.dump_stats(str(path_for(self.base, kind)))


def path_for(base: Path, kind: str) -> Path:
    return base.with_name(f"{base.stem}.{kind}{base.suffix}")


def _per_function(path: Path) -> dict[str, tuple[float, int]]:
    out: dict[str, tuple[float, int]] = {}
    for (file, line, fn), (_, ncalls, tottime, _, _) in pstats.Stats(str(path)).stats.items():
        name = f"{file.split('site-packages/')[-1]}:{line}({fn})"
        out[name] = (tottime, ncalls)
    return out


def print_profiles(base: Path, top: int, requests: int, log: Callable[[str], None]) -> None:
    """Top functions of (c), then what (c) spends beyond (d*) per request."""
    c_path = path_for(base, "lmcache")
    st = pstats.Stats(str(c_path))
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats("lmcache", top)  # the connector's frames
    c = _per_function(c_path)
    d = _per_function(path_for(base, "vllm"))
    total_c = sum(t for t, _ in c.values()) / requests
    total_d = sum(t for t, _ in d.values()) / requests
    log(f"profiled time per request: (c) {total_c * 1e3:.1f} ms, (d*) {total_d * 1e3:.1f} ms, "
        f"difference {(total_c - total_d) * 1e3:+.1f} ms ({requests} requests each)")
    print(f"\nper-function (c) - (d*) self time, ms per request (top {top}):\n")
    print("| ms | (c) ms | (d*) ms | calls (c)/(d*) | function |")
    print("|---|---|---|---|---|")
    names = sorted(set(c) | set(d), key=lambda n: -(c.get(n, (0, 0))[0] - d.get(n, (0, 0))[0]))
    for name in names[:top]:
        (tc, nc), (td, nd) = c.get(name, (0.0, 0)), d.get(name, (0.0, 0))
        print(f"| {(tc - td) * 1e3 / requests:+.2f} | {tc * 1e3 / requests:.2f} | "
              f"{td * 1e3 / requests:.2f} | {nc}/{nd} | `{name[-100:]}` |")
