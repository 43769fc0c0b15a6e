# SPDX-License-Identifier: Apache-2.0
"""Throughput of lmcache_ascend.ops (CPU backend) vs LMCache's torch baseline.

Measured in one run on the same bytes:
  * Llama-like token rows: 32 layers, 8 KV heads x 128, bf16, 256 tokens,
    block 16, format NL_X_TWO_NB_BS_NH_HS; store (paged -> chunk) and load.
  * DeepSeek-V4-like multi-plane chunk (4 planes per layer, 584/132/1024-byte
    rows, heterogeneous block sizes); ours moves it in ONE call, the baseline
    needs one torch_ops call per plane (MLA format on uint8 rows).  Measured
    at 256 tokens (7.3 MiB, fits in a 32 MiB L3) and at a token count whose
    chunk is at least twice the last-level cache and 64 MiB (or --mp-tokens),
    where the copies stream from and to memory as in a real offload.
  * Ceiling: torch.Tensor.copy_ of equally many contiguous bytes.

Then, when the test-only AscendC simulation is built (LMCA_BUILD_ASCEND_SIM=1,
`make build`), the DMA bursts per chunk the AscendC kernels issue for the same
two cases, gathered (what launchers send) versus span by span (the kernels'
former strategy): counts, not timings (no NPU here).

Usage: python bench/bench_kernels.py [--threads 2] [--repeat 15] [--mp-tokens 256,4096]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import sys
from pathlib import Path

import numpy as np
import torch
from lmcache.lmcache_native import EngineKVFormat, TransferDirection
from lmcache.v1.platform import torch_ops

import lmcache_ascend.ops as ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
import sim_module  # noqa: E402

CPU = torch.device("cpu")


def timed_interleaved(fns: dict[str, object], repeat: int) -> dict[str, float]:
    """Median seconds per fn; rounds run every fn once, so load from other
    processes on a shared machine hits all candidates alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def plain_copies(nbytes: int) -> dict[str, object]:
    """Ceilings on nbytes contiguous bytes: torch copy_ (the reference the
    targets use) and np.copyto (one libc memcpy on one thread)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    a, b = src.numpy(), dst.numpy()
    return {"plain copy_ (ceiling)": lambda: dst.copy_(src),
            "np.copyto (1 memcpy)": lambda: np.copyto(b, a)}


def shuffled_slots(num_tokens: int, block_size: int, num_blocks: int, gen) -> torch.Tensor:
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-num_tokens // block_size)]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots[:num_tokens].to(torch.int64)


def token_rows_case(gen, native=ops) -> tuple[int, dict[str, object]]:
    nl, nh, hs, bs, tokens, nb = 32, 8, 128, 16, 256, 128
    h = nh * hs
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    layers = [torch.randn(2, nb, bs, nh, hs).to(torch.bfloat16) for _ in range(nl)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    flat = [t.view(2, nb * bs, h) for t in layers]
    kv = torch.empty(2, nl, tokens, h, dtype=torch.bfloat16)
    slots = shuffled_slots(tokens, bs, nb, gen)
    nbytes = kv.numel() * kv.element_size()

    # `keep` holds the pools: the op only sees their raw addresses.
    def ours(direction):
        return lambda _keep=layers: native.multi_layer_kv_transfer(
            kv, ptrs, slots, CPU, nb * bs, direction, fmt, block_size=bs, head_size=hs)

    def base(direction):
        return lambda: torch_ops.multi_layer_kv_transfer(
            kv, flat, slots, CPU, nb * bs, direction, fmt, block_size=bs, head_size=hs)

    return nbytes, {
        **plain_copies(nbytes),
        "ours store": ours(TransferDirection.D2H),
        "ours load": ours(TransferDirection.H2D),
        "torch baseline store": base(TransferDirection.D2H),
        "torch baseline load": base(TransferDirection.H2D),
    }


# (block_size, row_bytes, rows in a 256-token chunk) per plane.
DSV4_PLANES = [(64, 584, 64), (64, 132, 64), (64, 1024, 128), (8, 584, 2)]


def multi_plane_case(gen, native=ops, tokens: int = 256,
                     baseline: bool = True) -> tuple[int, dict[str, object]]:
    nl = 43
    planes = [(bs, rb, n * tokens // 256) for bs, rb, n in DSV4_PLANES]
    # At least 64 blocks per plane; more when a long chunk needs them.
    nb = max([64] + [-(-n // bs) for bs, _, n in planes])
    pools = [[torch.randint(0, 255, (nb * bs * rb,), dtype=torch.uint8) for bs, rb, _ in planes]
             for _ in range(nl)]
    slot_lists = [shuffled_slots(n, bs, nb, gen) for bs, _, n in planes]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    offsets = [0]
    for s in slot_lists:
        offsets.append(offsets[-1] + s.numel())
    args = dict(
        plane_ptrs=t([p.data_ptr() for layer in pools for p in layer]),
        plane_block_sizes=t([bs for bs, _, _ in planes]),
        plane_block_stride_bytes=t([bs * rb for bs, rb, _ in planes]),
        plane_row_bytes=t([rb for _, rb, _ in planes]),
        plane_num_blocks=t([nb] * len(planes)),
        slot_mapping=torch.cat(slot_lists),
        plane_slot_offsets=t(offsets),
        num_layers=nl,
    )
    nbytes = nl * sum(rb * n for _, rb, n in planes)
    chunk = torch.empty(nbytes, dtype=torch.uint8)
    # Baseline: one MLA-format call per plane, uint8 rows, own chunk per plane.
    base_chunks = [torch.empty(1, nl, n, rb, dtype=torch.uint8) for _, rb, n in planes]
    base_layers = [[pools[l][p].view(nb * bs, rb) for l in range(nl)]
                   for p, (bs, rb, _) in enumerate(planes)]

    # `keep` holds the pools: the op only sees their raw addresses.
    def ours(to_chunk):
        return lambda _keep=pools: native.multi_plane_kv_transfer(chunk, to_chunk=to_chunk, **args)

    def base(direction):
        def run():
            for p, (bs, rb, _) in enumerate(planes):
                torch_ops.multi_layer_kv_transfer(
                    base_chunks[p], base_layers[p], slot_lists[p], CPU, nb * bs, direction,
                    EngineKVFormat.NL_X_NB_BS_HS, block_size=bs)
        return run

    fns = {**plain_copies(nbytes), "ours store": ours(True), "ours load": ours(False)}
    if baseline:
        fns["torch baseline store"] = base(TransferDirection.D2H)
        fns["torch baseline load"] = base(TransferDirection.H2D)
    return nbytes, fns


# CPU features that decide which copy loops can run (x86 and Arm names).
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16",
                     "erms", "fsrm", "asimd", "sve")


def lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (l.partition(":") for l in out.splitlines())}


def cache_bytes(level: int) -> int:
    """Size of one instance of the level's data/unified cache (0 if unknown)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        try:
            if int((idx / "level").read_text()) != level:
                continue
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            size = (idx / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        return int(size.rstrip("KMG")) * unit
    return 0


def machine(threads: int) -> list[str]:
    info = lscpu()
    model = info.get("Model name") or platform.processor() or "unknown"
    flags = set(info.get("Flags", "").split())
    if not flags:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
    have = [f for f in FLAGS_OF_INTEREST if f in flags]
    missing = [f for f in FLAGS_OF_INTEREST if f not in flags]
    mib = lambda b: f"{b / 2**20:g} MiB" if b else "unknown"  # noqa: E731
    return [
        f"cpu: {model} ({platform.machine()}), {os.cpu_count()} logical CPUs, "
        f"{info.get('Socket(s)', '?')} socket(s), {info.get('NUMA node(s)', '?')} NUMA node(s), "
        f"{info.get('Hypervisor vendor', 'no') + ' guest' if 'Hypervisor vendor' in info else 'bare metal'}",
        f"flags: {' '.join(have) or '-'}; absent: {' '.join(missing) or '-'}",
        f"caches: L2 {mib(cache_bytes(2))} per instance, L3 {mib(cache_bytes(3))} per instance "
        f"(lscpu: L2 {info.get('L2 cache', '?')}, L3 {info.get('L3 cache', '?')})",
        f"torch {torch.__version__}, threads={threads} "
        f"(ops copy threads: {ops.cpu_copy_threads()})",
    ]


def report(title: str, nbytes: int, times: dict[str, float]) -> None:
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    copy_ = times["plain copy_ (ceiling)"]
    memcpy = times["np.copyto (1 memcpy)"]
    print(f"\n{title}: {nbytes / 2**20:.2f} MiB per transfer")
    print(f"  {'op':<26}{'GB/s':>8}{'us':>9}{'x copy_':>9}{'x memcpy':>10}")
    for name, s in times.items():
        print(f"  {name:<26}{gbps(s):>8.2f}{s * 1e6:>9.0f}{copy_ / s:>9.2f}{memcpy / s:>10.2f}")
    for d in ("store", "load"):
        if f"torch baseline {d}" in times:
            ratio = times[f"torch baseline {d}"] / times[f"ours {d}"]
            print(f"  ours / torch baseline ({d}): {ratio:.1f}x")
    print(f"  ours / plain copy_ (store, load): {copy_ / times['ours store']:.2f}x, "
          f"{copy_ / times['ours load']:.2f}x")


def bursts_per_chunk(case, seed: int) -> dict[str, dict[str, int]]:
    """DMA bursts and copies of one chunk's store and load on the simulated
    NPU (40 vector cores, 192 KiB UB), gathered and span by span."""
    sim = sim_module.load()
    out: dict[str, dict[str, int]] = {}
    for mode, gather in (("spans", False), ("gathered", True)):
        for d in ("store", "load"):
            sim_ops = sim_module.SimOps(sim, gather=gather)
            _, fns = case(torch.Generator().manual_seed(seed), sim_ops)
            fns[f"ours {d}"]()
            out[f"{mode} {d}"] = dict(sim_ops.totals)
    return out


def report_bursts(title: str, counts: dict[str, dict[str, int]]) -> None:
    print(f"\n{title}: DMA per chunk on the AscendC simulation (40 cores, 192 KiB UB)")
    print(f"  {'kernel strategy':<24}{'bursts':>8}{'copies':>8}")
    for name, c in counts.items():
        print(f"  {name:<24}{c['bursts_in'] + c['bursts_out']:>8}"
              f"{c['copies_in'] + c['copies_out']:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--mp-tokens", default="",
                    help="comma-separated token counts of the multi-plane chunk (multiples "
                         "of 256); default: 256 and the smallest 256 x 2^k whose chunk is "
                         ">= 2x the last-level cache")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    for line in machine(torch.get_num_threads()):
        print(line)
    llc = cache_bytes(3) or cache_bytes(2)
    print(f"lmcache_ascend.ops backends: {ops.built_backends()}; "
          f"median of {a.repeat} interleaved rounds")
    if a.mp_tokens:
        mp_tokens = [int(t) for t in a.mp_tokens.split(",")]
    else:
        per_256 = 43 * sum(rb * n for _, rb, n in DSV4_PLANES)
        big = 256
        while big * per_256 // 256 < 2 * max(llc, 32 << 20):
            big *= 2
        mp_tokens = [256, big]
    nbytes, fns = token_rows_case(gen)
    report("Llama-like token rows (32 layers, 8x128 bf16, 256 tokens, block 16)", nbytes,
           timed_interleaved(fns, a.repeat))
    for tokens in mp_tokens:
        # The torch baseline takes seconds per call beyond the cache, so it
        # runs on the 256-token chunk only.
        nbytes, fns = multi_plane_case(gen, tokens=tokens, baseline=tokens <= 256)
        where = f"{nbytes / llc:.1f}x the last-level cache" if llc else "cache size unknown"
        report(f"DSv4-like multi-plane (43 layers, 4 planes, {tokens} tokens; {where})", nbytes,
               timed_interleaved(fns, a.repeat))
        del fns
    if not sim_module.built():
        print(f"\nDMA bursts: skipped, {sim_module.HOW_TO_BUILD}")
        return
    report_bursts("Llama-like token rows", bursts_per_chunk(token_rows_case, 0))
    report_bursts("DSv4-like multi-plane", bursts_per_chunk(multi_plane_case, 0))


if __name__ == "__main__":
    main()
