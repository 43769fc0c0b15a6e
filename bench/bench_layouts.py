"""Per KV layout: bytes per chunk per group (planned vs naive sizing), op
calls per chunk (bundled vs exploded) and store / load GB/s of the whole
worker path (ChunkTransfer: addressing + op calls), on this machine.

The layouts are the test fixtures (tests/fixtures/layouts.py and
ascend_layouts.py: vLLM-Ascend 0.23.0 / 0.26.0rc1 DeepSeek-V4, DSA, GLM-5.2),
with their decoder layers replicated to a realistic depth. Prints markdown
tables.

    python bench/bench_layouts.py [--repeat N] [--ops native|reference] [--json]
    python bench/bench_layouts.py --explain  # the worker's plan text per fixture
    python bench/bench_layouts.py --bursts   # needs LMCA_BUILD_ASCEND_SIM=1

--bursts prints instead, per layout, the DMA bursts and copies one chunk's
store and load take on the AscendC simulation (40 vector cores, 192 KiB UB):
span by span (the kernels' former strategy) and gathered (what launchers
send now). Counts, not timings: no NPU here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fixtures import ascend_layouts as AL  # noqa: E402
from fixtures import layouts as L  # noqa: E402

from lmcache_ascend.planning.settings import AscendConfig  # noqa: E402
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer  # noqa: E402
from lmcache_ascend.planning.groups import ChunkRequest  # noqa: E402
from lmcache_ascend.planning.kv_format import LayoutHints  # noqa: E402
from lmcache_ascend.planning.planner import build_plan  # noqa: E402

# (fixture, copies of its layers): roughly the depth of the real model.
# DeepSeek-V4: 9 copies of the 7-decoder-layer fixture (63 layers), at the
# default chunk (128 tokens: vLLM-Ascend's finest exact hit) and at 1024.
CASES = (
    (AL.dsv4("0.23.0"), 9),
    (AL.dsv4("0.23.0", chunk_size=1024, tokens=2048), 9),
    (AL.dsv4("0.23.0", a5=True), 9),
    (AL.dsa("0.23.0", sfa=True, li=True), 20),  # DSv3.2 / GLM-5: ~60 layers
    (AL.dsa("0.23.0", li=True, shared=(1,), layers=4), 15),  # GLM-5.2 shared indexers
    (AL.dsa("0.26.0rc1", li=True), 20),
    (L.vllm_cpu(), 8),
    (L.generic(hnd=False), 8),
    (L.generic(hnd=True), 8),
)


def replicate(layout: L.Layout, copies: int) -> tuple[L.Layout, list]:
    """``layout`` with ``copies`` renamed copies of every layer."""

    def names(k: int, seq):
        return tuple(f"r{k}.{n}" for n in seq)

    groups = tuple(
        dataclasses.replace(g, layer_names=sum((names(k, g.layer_names) for k in range(copies)), ()))
        for g in layout.groups
    )
    h = layout.hints
    hints = LayoutHints(
        kv_layout=h.kv_layout,
        opaque_pages=h.opaque_pages,
        plane_groups={f"r{k}.{n}": v for k in range(copies) for n, v in h.plane_groups.items()},
        layer_compress_ratio={f"r{k}.{n}": v for k in range(copies) for n, v in h.layer_compress_ratio.items()},
    )
    keep = []  # builds own the memory

    def build(fill: bool) -> L.Built:
        out = L.Built({}, [])
        for k in range(copies):
            b = layout.build(fill)
            keep.append(b)
            out.backing += b.backing
            out.kv_caches.update({f"r{k}.{n}": e for n, e in b.kv_caches.items()})
        return out

    return dataclasses.replace(layout, groups=groups, hints=hints, build=build), keep


def measure(xfer: ChunkTransfer, reqs, buffers, repeat: int, store: bool) -> float:
    fn = xfer.store if store else xfer.load
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for req, buf in zip(reqs, buffers):
            fn(buf, req)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_case(layout: L.Layout, copies: int, ops, repeat: int) -> dict:
    big, _keep = replicate(layout, copies)
    built = big.build(True)
    tables = L.block_tables(big)
    reqs = [ChunkRequest(s, s + big.chunk_size, tables) for s in range(0, big.num_tokens, big.chunk_size)]
    out = {"layout": layout.name, "entries": len(built.kv_caches), "chunk_size": big.chunk_size}
    for mode, bundle in (("bundled", True), ("exploded", False)):
        config = dataclasses.replace(big.config, bundle_multi_spec=bundle)
        plan = build_plan(built.kv_caches, big.groups, big.chunk_size, config, big.hints)
        xfer = ChunkTransfer(plan, ops)
        buffers = [torch.empty(plan.chunk_bytes, dtype=torch.uint8) for _ in reqs]
        for req, buf in zip(reqs, buffers):  # warm-up and correctness of the store
            assert xfer.store(buf, req).stored
        total = plan.chunk_bytes * len(reqs)
        t_store = measure(xfer, reqs, buffers, repeat, store=True)
        t_load = measure(xfer, reqs, buffers, repeat, store=False)
        out[mode] = {
            "op_calls_per_chunk": plan.op_calls_per_chunk,
            "chunk_bytes": plan.chunk_bytes,
            "store_gbps": total / t_store / 1e9,
            "load_gbps": total / t_load / 1e9,
            "us_per_chunk_store": t_store / len(reqs) * 1e6,
        }
        if bundle:
            d = plan.describe()
            out["groups"] = [dataclasses.asdict(g) for g in d.groups]
            out["naive_bytes"] = sum(g.naive_bytes for g in d.groups)
    return out


def bursts_case(layout: L.Layout, copies: int) -> dict:
    """Per chunk: DMA bursts and copies of store and load, spans vs gathered."""
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    import sim_module

    sim = sim_module.load()
    big, _keep = replicate(layout, copies)
    built = big.build(True)
    tables = L.block_tables(big)
    reqs = [ChunkRequest(s, s + big.chunk_size, tables) for s in range(0, big.num_tokens, big.chunk_size)]
    plan = build_plan(built.kv_caches, big.groups, big.chunk_size, big.config, big.hints)
    buffers = [torch.empty(plan.chunk_bytes, dtype=torch.uint8) for _ in reqs]
    out = {"layout": layout.name, "entries": len(built.kv_caches), "chunks": len(reqs)}
    for mode, gather in (("spans", False), ("gathered", True)):
        for d in ("store", "load"):
            sim_ops = sim_module.SimOps(sim, gather=gather)
            xfer = ChunkTransfer(plan, sim_ops)
            for req, buf in zip(reqs, buffers):
                if d == "store":
                    assert xfer.store(buf, req).stored
                else:
                    xfer.load(buf, req)
            t = sim_ops.totals
            out[f"{mode} {d}"] = {
                "bursts": (t["bursts_in"] + t["bursts_out"]) / len(reqs),
                "copies": (t["copies_in"] + t["copies_out"]) / len(reqs),
            }
    return out


def print_bursts(results: list[dict]) -> None:
    print("DMA per chunk on the AscendC simulation (40 vector cores, 192 KiB UB): "
          "bursts (copies)\n")
    print("| layout | layer entries | store, spans | store, gathered | load, spans | load, gathered |")
    print("|---|---|---|---|---|---|")
    for r in results:
        cells = " | ".join(
            f"{r[k]['bursts']:.0f} ({r[k]['copies']:.0f})"
            for k in ("spans store", "gathered store", "spans load", "gathered load")
        )
        print(f"| {r['layout']} | {r['entries']} | {cells} |")


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def print_markdown(results: list[dict], ops_name: str) -> None:
    print(f"ops: {ops_name}; {cpu_name()}, {torch.get_num_threads()} torch threads\n")
    print("| layout | layer entries | chunk | bytes/chunk planned | naive | ratio | op calls bundled / exploded "
          "| store GB/s bundled / exploded | load GB/s bundled / exploded | store us/chunk (bundled) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b, e = r["bundled"], r["exploded"]
        print(
            f"| {r['layout']} | {r['entries']} | {r['chunk_size']} | {fmt_bytes(b['chunk_bytes'])} | "
            f"{fmt_bytes(r['naive_bytes'])} | {r['naive_bytes'] / b['chunk_bytes']:.2f}x | "
            f"{b['op_calls_per_chunk']} / {e['op_calls_per_chunk']} | "
            f"{b['store_gbps']:.2f} / {e['store_gbps']:.2f} | {b['load_gbps']:.2f} / {e['load_gbps']:.2f} | "
            f"{b['us_per_chunk_store']:.0f} |"
        )
    print("\nPer group, bytes per chunk (planned / naive):\n")
    for r in results:
        cells = ", ".join(
            f"g{g['group']} {g['kind']}{'' if g['stored'] else ' (not stored)'} "
            f"{fmt_bytes(g['planned_bytes'])} / {fmt_bytes(g['naive_bytes'])}"
            for g in r["groups"]
        )
        print(f"- {r['layout']}: {cells}")


def print_explain() -> None:
    """Per fixture (not replicated): what ``lmcache-ascend explain`` and the
    worker's startup log print for it, via the same ``plan_text``, and the
    bytes per chunk each rank writes and loads at TP 8 and 16."""
    from lmcache_ascend.integration.vllm.wiring import plan_text
    from lmcache_ascend.planning.replication import per_rank_table

    for layout in [AL.dsv4("0.23.0"), *(c for c, _ in CASES[2:6]), *AL.all_layouts()[1:]]:
        plan = build_plan(layout.build(False).kv_caches, layout.groups, layout.chunk_size, layout.config, layout.hints)
        tp = per_rank_table(layout.groups, dict(plan.group_bytes()), (8, 16))
        print(f"### {layout.name}\n\n```\n{plan_text(layout.groups, plan)}\n{tp}\n```\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ops", choices=("native", "reference"), default="native")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bursts", action="store_true", help="DMA bursts per chunk on the AscendC simulation")
    ap.add_argument("--explain", action="store_true", help="the plan text the worker logs, per fixture")
    args = ap.parse_args()
    if args.explain:
        print_explain()
        return
    if args.bursts:
        print_bursts([bursts_case(layout, copies) for layout, copies in CASES])
        return
    if args.ops == "native":
        ops = importlib.import_module("lmcache_ascend.ops")
    else:
        ops = importlib.import_module("lmcache_ascend.transfer.reference_ops")
    results = [bench_case(layout, copies, ops, args.repeat) for layout, copies in CASES]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_markdown(results, args.ops)
    AscendConfig()  # keep the import honest: defaults are what was measured


if __name__ == "__main__":
    main()
