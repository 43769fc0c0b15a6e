# SPDX-License-Identifier: Apache-2.0
"""Throughput of lmcache_ascend.ops (CPU backend) vs LMCache's torch baseline.

Measured in one run on the same bytes:
  * Llama-like token rows: 32 layers, 8 KV heads x 128, bf16, 256 tokens,
    block 16, format NL_X_TWO_NB_BS_NH_HS; store (paged -> chunk) and load.
  * DeepSeek-V4-like multi-plane chunk (4 planes per layer, 584/132/1024-byte
    rows, heterogeneous block sizes); ours moves it in ONE call, the baseline
    needs one torch_ops call per plane (MLA format on uint8 rows).
  * Ceiling: torch.Tensor.copy_ of equally many contiguous bytes.

Usage: python bench/bench_kernels.py [--threads 2] [--repeat 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch
from lmcache.lmcache_native import EngineKVFormat, TransferDirection
from lmcache.v1.platform import torch_ops

import lmcache_ascend.ops as ops

CPU = torch.device("cpu")


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() after warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def shuffled_slots(num_tokens: int, block_size: int, num_blocks: int, gen) -> torch.Tensor:
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-num_tokens // block_size)]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots[:num_tokens].to(torch.int64)


def bench_token_rows(repeat: int, gen) -> tuple[int, dict[str, float]]:
    nl, nh, hs, bs, tokens, nb = 32, 8, 128, 16, 256, 128
    h = nh * hs
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    layers = [torch.randn(2, nb, bs, nh, hs).to(torch.bfloat16) for _ in range(nl)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    flat = [t.view(2, nb * bs, h) for t in layers]
    kv = torch.empty(2, nl, tokens, h, dtype=torch.bfloat16)
    slots = shuffled_slots(tokens, bs, nb, gen)
    nbytes = kv.numel() * kv.element_size()

    def ours(direction):
        return lambda: ops.multi_layer_kv_transfer(
            kv, ptrs, slots, CPU, nb * bs, direction, fmt, block_size=bs, head_size=hs)

    def base(direction):
        return lambda: torch_ops.multi_layer_kv_transfer(
            kv, flat, slots, CPU, nb * bs, direction, fmt, block_size=bs, head_size=hs)

    return nbytes, {
        "ours store": timed(ours(TransferDirection.D2H), repeat),
        "ours load": timed(ours(TransferDirection.H2D), repeat),
        "torch baseline store": timed(base(TransferDirection.D2H), max(3, repeat // 5)),
        "torch baseline load": timed(base(TransferDirection.H2D), max(3, repeat // 5)),
    }


# (block_size, row_bytes, rows in a 256-token chunk) per plane.
DSV4_PLANES = [(64, 584, 64), (64, 132, 64), (64, 1024, 128), (8, 584, 2)]


def bench_multi_plane(repeat: int, gen) -> tuple[int, dict[str, float]]:
    nl, nb = 43, 64
    pools = [[torch.randint(0, 255, (nb * bs * rb,), dtype=torch.uint8) for bs, rb, _ in DSV4_PLANES]
             for _ in range(nl)]
    slot_lists = [shuffled_slots(n, bs, nb, gen) for bs, _, n in DSV4_PLANES]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    offsets = [0]
    for s in slot_lists:
        offsets.append(offsets[-1] + s.numel())
    args = dict(
        plane_ptrs=t([p.data_ptr() for layer in pools for p in layer]),
        plane_block_sizes=t([bs for bs, _, _ in DSV4_PLANES]),
        plane_block_stride_bytes=t([bs * rb for bs, rb, _ in DSV4_PLANES]),
        plane_row_bytes=t([rb for _, rb, _ in DSV4_PLANES]),
        plane_num_blocks=t([nb] * len(DSV4_PLANES)),
        slot_mapping=torch.cat(slot_lists),
        plane_slot_offsets=t(offsets),
        num_layers=nl,
    )
    nbytes = nl * sum(rb * n for _, rb, n in DSV4_PLANES)
    chunk = torch.empty(nbytes, dtype=torch.uint8)
    # Baseline: one MLA-format call per plane, uint8 rows, own chunk per plane.
    base_chunks = [torch.empty(1, nl, n, rb, dtype=torch.uint8) for _, rb, n in DSV4_PLANES]
    base_layers = [[pools[l][p].view(nb * bs, rb) for l in range(nl)]
                   for p, (bs, rb, _) in enumerate(DSV4_PLANES)]

    def ours(to_chunk):
        return lambda: ops.multi_plane_kv_transfer(chunk, to_chunk=to_chunk, **args)

    def base(direction):
        def run():
            for p, (bs, rb, _) in enumerate(DSV4_PLANES):
                torch_ops.multi_layer_kv_transfer(
                    base_chunks[p], base_layers[p], slot_lists[p], CPU, nb * bs, direction,
                    EngineKVFormat.NL_X_NB_BS_HS, block_size=bs)
        return run

    return nbytes, {
        "ours store": timed(ours(True), repeat),
        "ours load": timed(ours(False), repeat),
        "torch baseline store": timed(base(TransferDirection.D2H), max(3, repeat // 5)),
        "torch baseline load": timed(base(TransferDirection.H2D), max(3, repeat // 5)),
    }


def bench_plain_copy(nbytes: int, repeat: int) -> tuple[float, float]:
    """(torch copy_, numpy copyto) seconds for nbytes contiguous bytes.

    copy_ is the ceiling the targets refer to; np.copyto (one libc memcpy on
    one thread) is printed too because copy_ is not always the fastest copy.
    """
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    a, b = src.numpy(), dst.numpy()
    return timed(lambda: dst.copy_(src), repeat), timed(lambda: np.copyto(b, a), repeat)


def machine() -> str:
    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def report(title: str, nbytes: int, times: dict[str, float], ceilings: tuple[float, float]) -> None:
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    copy_, memcpy = ceilings
    print(f"\n{title}: {nbytes / 2**20:.2f} MiB per transfer")
    print(f"  {'op':<26}{'GB/s':>8}{'us':>9}{'x copy_':>9}{'x memcpy':>10}")
    rows = {"plain copy_ (ceiling)": copy_, "np.copyto (1 memcpy)": memcpy, **times}
    for name, s in rows.items():
        print(f"  {name:<26}{gbps(s):>8.2f}{s * 1e6:>9.0f}{copy_ / s:>9.2f}{memcpy / s:>10.2f}")
    for d in ("store", "load"):
        ratio = times[f"torch baseline {d}"] / times[f"ours {d}"]
        print(f"  ours / torch baseline ({d}): {ratio:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {machine()}; torch {torch.__version__}, threads={torch.get_num_threads()}")
    print(f"lmcache_ascend.ops backends: {ops.built_backends()}")
    nbytes, times = bench_token_rows(a.repeat, gen)
    report("Llama-like token rows (32 layers, 8x128 bf16, 256 tokens, block 16)", nbytes, times,
           bench_plain_copy(nbytes, a.repeat))
    nbytes, times = bench_multi_plane(a.repeat, gen)
    report("DSv4-like multi-plane (43 layers, 4 planes, 256 tokens)", nbytes, times,
           bench_plain_copy(nbytes, a.repeat))


if __name__ == "__main__":
    main()
