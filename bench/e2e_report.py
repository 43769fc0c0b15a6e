"""Tables and target checks of bench_e2e.py (split from it for size)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from e2e_logs import med


@dataclass
class Row:
    model: str
    length: int
    a: float
    b: float
    c: float
    d: float
    d_conn: float
    e: float
    hit_tokens: int
    retrieve_s: float  # LMCache retrieve() in (c)
    store_s_cold: float  # LMCache store() in (b)
    restored_tokens_vllm_hit: int  # stored again in (d*)
    store_s_vllm_hit: float
    chunk_bytes: int
    bytes_loaded: int
    bytes_written: int
    copy_s: float
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def b_over_a(self) -> float:
        return self.b / self.a

    @property
    def c_over_a(self) -> float:
        return self.c / self.a

    @property
    def c_over_d(self) -> float:
        return self.c / self.d

    @staticmethod
    def bw(nbytes: int, seconds: float) -> float:
        # A non-positive difference means the load hid in run-to-run noise:
        # no bandwidth can be read from it (nan prints as "n/a").
        return nbytes / seconds / 1e9 if seconds > 0 else float("nan")

    @property
    def eff_bw(self) -> float:  # the definition: bytes / ((c) - (d))
        return self.bw(self.bytes_loaded, self.c - self.d)

    @property
    def paired_bw(self) -> float:  # bytes / paired (c) - (d*), one engine
        return self.bw(self.bytes_loaded, self.paired("c", "d_conn"))

    @property
    def retrieve_bw(self) -> float:  # bytes / LMCache's own retrieve() time in (c)
        return self.bw(self.bytes_loaded, self.retrieve_s)

    @property
    def copy_bw(self) -> float:
        return self.bw(self.bytes_loaded, self.copy_s)

    def paired(self, x: str, y: str) -> float:
        """Median of per-iteration differences x - y (same engine, seconds apart)."""
        return med([a - b for a, b in zip(self.samples[x], self.samples[y])])

    @classmethod
    def from_json(cls, data: dict) -> "Row":
        """A row of bench_e2e.py's --json output (derived figures dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def best(self) -> "Row":
        """The same row with every TTFT the minimum of its samples: on a
        shared machine contention only ever adds time."""
        m = {k: min(v) for k, v in self.samples.items() if v}
        return dataclasses.replace(self, **m)


def fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.2f}"


def fmt_x(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _print_header(head: str) -> None:
    print(head)
    print("|" + "---|" * (head.count("|") - 1))


def print_table(rows: list[Row], what: str = "median") -> None:
    head = (
        "| model | tokens | (a) cold | (b) cold, conn | (c) LMCache hit | (d) vLLM hit | "
        "(b)/(a) | (c)/(a) | (c)/(d) | bytes loaded | load GB/s = bytes/((c)-(d)) | "
        "copy GB/s | load / copy |"
    )
    _print_header(head)
    for r in rows:
        r = r.best() if what == "min" else r
        print(
            f"| {r.model} | {r.length} | {fmt_s(r.a)} | {fmt_s(r.b)} | {fmt_s(r.c)} | "
            f"{fmt_s(r.d)} | {r.b_over_a:.3f} | {r.c_over_a:.3f} | {r.c_over_d:.2f} | "
            f"{r.bytes_loaded / 2**20:.0f} MiB | {fmt_x(r.eff_bw)} | {r.copy_bw:.2f} | "
            f"{fmt_x(r.eff_bw / r.copy_bw)} |"
        )


def print_diagnostics(rows: list[Row]) -> None:
    head = (
        "| model | tokens | hit tokens | store in (b) | store / (a) | retrieve in (c) | "
        "(e) boundary hit | (c)-(e) | load GB/s = written/((c)-(e)) | (d*) vLLM hit, conn | "
        "(c)-(d*) | bytes/((c)-(d*)) / copy | bytes/retrieve / copy | re-stored in (d*) |"
    )
    _print_header(head)
    for r in rows:
        written = f"{r.bytes_written / 2**20:.0f} MiB"
        ce, cd = r.paired("c", "e"), r.paired("c", "d_conn")
        print(
            f"| {r.model} | {r.length} | {r.hit_tokens} | {r.store_s_cold * 1e3:.1f} ms | "
            f"{r.store_s_cold / r.a:.4f} | {r.retrieve_s * 1e3:.1f} ms | {fmt_s(r.e)} | "
            f"{ce * 1e3:+.0f} ms | {fmt_x(r.bw(r.bytes_written, ce))} ({written}) | "
            f"{fmt_s(r.d_conn)} | {cd * 1e3:+.0f} ms | {fmt_x(r.paired_bw / r.copy_bw)} | "
            f"{fmt_x(r.retrieve_bw / r.copy_bw)} | "
            f"{r.restored_tokens_vllm_hit} tok, "
            f"{r.store_s_vllm_hit * 1e3:.1f} ms |"
        )


def targets(rows: list[Row]) -> list[str]:
    out = []
    longest = max(r.length for r in rows)
    for med_row in rows:
        r = med_row
        checks = [("(b)/(a) <= 1.03", r.b_over_a <= 1.03)]
        if r.length == longest:
            checks.append((f"(c)/(a) <= 0.05 at {r.length}", r.c_over_a <= 0.05))
        checks.append(("(c)/(d) <= 1.5", r.c_over_d <= 1.5))
        checks.append(("load >= 0.5x copy", _ratio_ok(r.eff_bw, r.copy_bw)))
        # The same from one engine: (c) and (d*) seconds apart, paired.
        checks.append(("paired load >= 0.5x copy", _ratio_ok(r.paired_bw, r.copy_bw)))
        # Direct: the load call itself (LMCache's retrieve() timing), which no
        # forward noise blurs; it leaves out the lookup RPC (~1.5 ms).
        checks.append(("retrieve >= 0.5x copy", _ratio_ok(r.retrieve_bw, r.copy_bw)))
        out.append(
            f"{r.model} {r.length}: "
            + ", ".join(f"{what} {_verdict(ok)}" for what, ok in checks)
        )
    return out


def _ratio_ok(bw: float, copy_bw: float):
    """None when the bandwidth is not measurable (load within noise)."""
    return None if bw != bw else bw >= 0.5 * copy_bw


def _verdict(ok) -> str:
    return "n/a (load within noise)" if ok is None else ("ok" if ok else "MISS")


def print_report(rows: list[Row]) -> None:
    print("TTFT in seconds (vLLM first_token_latency), medians:\n")
    print_table(rows)
    print("\nthe same with the minimum of each cell's samples:\n")
    print_table(rows, "min")
    print("\nconnector costs (medians; (e) and (d*) are measured seconds apart from (c) in "
          "the same engine, and (c)-(e), (c)-(d*) are medians of those paired differences):\n")
    print_diagnostics(rows)
    print("\ntargets (medians):")
    for line in targets(rows):
        print(line)
    print("targets (minimums):")
    for line in targets([r.best() for r in rows]):
        print(line)
