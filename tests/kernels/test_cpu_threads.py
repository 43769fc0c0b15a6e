# SPDX-License-Identifier: Apache-2.0
"""The CPU copy ops run on torch's intra-op threads, through the OpenMP
runtime torch ships, and split work across threads without changing a byte
(numpy references, jobs large enough to be split)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import plane_reference as ref
from plane_reference import Plane


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copies_follow_torch_thread_count(native, restore_threads, threads):
    # More threads than cores still forms a team of that size (OpenMP does
    # not cap it), so this holds on any machine.
    torch.set_num_threads(threads)
    assert native.cpu_copy_threads() == threads


def test_one_openmp_runtime_the_one_torch_ships():
    # A fresh interpreter: other wheels (sentencepiece) load private, renamed
    # copies of libgomp of their own, which are not ours to judge.
    probe = (
        "import sys, torch, lmcache_ascend.ops as o; torch.set_num_threads(2); "
        "assert o.cpu_copy_threads() == 2; "
        "print('\\n'.join(l.split()[-1] for l in open('/proc/self/maps') "
        "if 'gomp' in l.rsplit('/', 1)[-1]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    loaded = {Path(line).resolve() for line in out.split()}
    torch_lib = (Path(torch.__file__).parent / "lib").resolve()
    assert loaded, "no OpenMP runtime is loaded: the ops are built without OpenMP"
    assert {p.parent for p in loaded} == {torch_lib}, loaded


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_split_row_job_matches_reference(native, restore_threads, threads, to_chunk):
    torch.set_num_threads(threads)
    rng = np.random.default_rng(100 + threads + 10 * to_chunk)
    # ~3 MiB over 24 layers: many 256 KiB tasks, shuffled and skipped slots.
    planes = [Plane(64, 584, 8, 64 * 584 + 96), Plane(16, 132, 32, 16 * 132)]
    slots = [ref.plane_slots(p, n, rng) for p, n in zip(planes, [200, 300])]
    ref.check_multi_plane(native, planes, slots, 24, to_chunk, rng)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_split_block_pages_match_reference(native, restore_threads, threads, to_chunk):
    torch.set_num_threads(threads)
    rng = np.random.default_rng(200 + threads + 10 * to_chunk)
    # 240 odd-sized 64 KiB pages in 12 layers, shuffled: many tasks per thread.
    page, stride, nb, layers = 64 * 1024 + 3, 64 * 1024 + 64, 24, 12
    ids = rng.permutation(nb)[:20].astype(np.int64)
    ids[[3, 11]] = -1
    pools = [torch.from_numpy(rng.integers(0, 256, nb * stride, dtype=np.uint8))
             for _ in range(layers)]
    chunk = torch.from_numpy(rng.integers(0, 256, layers * len(ids) * page, dtype=np.uint8))
    ref.check_block_pages(native, pools, chunk, page, stride, nb, ids, to_chunk)


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_spans_any_size_and_alignment(native, restore_threads, threads):
    # Spans from 16 KiB up bypass the cache with aligned 16-byte stores:
    # every destination misalignment, sizes around the threshold and odd
    # tails must land byte-exact, and nothing next to a span may change.
    torch.set_num_threads(threads)
    rng = np.random.default_rng(300 + threads)
    sizes = [(16 << 10) - 1, 16 << 10, (16 << 10) + 1, (64 << 10) + 63, (1 << 20) + 17, 3 << 20]
    for size in sizes:
        for dst_off in (0, 1, 7, 15, 16, 33):
            src_off = int(rng.integers(0, 64))
            src = torch.from_numpy(rng.integers(0, 256, size + 64, dtype=np.uint8))
            dst = torch.from_numpy(rng.integers(0, 256, size + 128, dtype=np.uint8))
            want = dst.numpy().copy()
            want[dst_off:dst_off + size] = src.numpy()[src_off:src_off + size]
            native.batched_memcpy([src.data_ptr() + src_off], [dst.data_ptr() + dst_off], [size])
            np.testing.assert_array_equal(dst.numpy(), want, err_msg=f"{size} at +{dst_off}")
