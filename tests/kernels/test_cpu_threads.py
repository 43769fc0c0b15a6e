# SPDX-License-Identifier: Apache-2.0
"""The CPU copy ops run on torch's intra-op threads, through the OpenMP
runtime torch ships, and split work across threads without changing a byte
(numpy references, jobs large enough to be split)."""

from __future__ import annotations

import os
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


# The threshold (bytes per job) from which the CPU copies use non-temporal
# stores; a fresh interpreter reads it once, so streaming tests set it there.
STREAM_ENV = "LMCA_CPU_STREAM_MIN_BYTES"


def check_spans_any_size_and_alignment(native, threads, sizes, seed):
    # Streamed spans are written as aligned whole cache lines, the partial
    # lines at both ends with memcpy: every destination misalignment, sizes
    # around the thresholds and odd tails must land byte-exact, and nothing
    # next to a span may change.
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    for size in sizes:
        for dst_off in (0, 1, 7, 15, 16, 33, 63):
            src_off = int(rng.integers(0, 64))
            src = torch.from_numpy(rng.integers(0, 256, size + 64, dtype=np.uint8))
            dst = torch.from_numpy(rng.integers(0, 256, size + 128, dtype=np.uint8))
            want = dst.numpy().copy()
            want[dst_off:dst_off + size] = src.numpy()[src_off:src_off + size]
            native.batched_memcpy([src.data_ptr() + src_off], [dst.data_ptr() + dst_off], [size])
            np.testing.assert_array_equal(dst.numpy(), want, err_msg=f"{size} at +{dst_off}")


def check_streamed_rows(native, threads, seed):
    # Multi-plane rows of 132..1030 bytes (runs of one to many rows) at odd
    # chunk offsets and padded strides, both directions, every span streamed.
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    planes = [Plane(64, 584, 8, 64 * 584 + 96), Plane(16, 132, 32, 16 * 132 + 5),
              Plane(4, 1030, 16, 4 * 1030 + 3), Plane(1, 255, 40, 257)]
    slots = [ref.plane_slots(p, n, rng) for p, n in zip(planes, [200, 300, 50, 30])]
    for to_chunk in (True, False):
        ref.check_multi_plane(native, planes, slots, 6, to_chunk, rng)


def run_with_stream_threshold(threshold: int, call: str) -> None:
    code = ("import sys; sys.path.insert(0, %r); import lmcache_ascend.ops as o; "
            "import test_cpu_threads as t; t.%s" % (str(Path(__file__).parent), call))
    env = {**os.environ, STREAM_ENV: str(threshold)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("threads", [1, 2])
def test_spans_any_size_and_alignment(native, restore_threads, threads):
    # Default threshold (every job streams, spans below 256 bytes memcpy'd).
    sizes = [255, 256, 257, (16 << 10) + 1, (64 << 10) + 63, (1 << 20) + 17, 3 << 20]
    check_spans_any_size_and_alignment(native, threads, sizes, 300 + threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_spans_any_size_and_alignment(threads):
    # Every job streams: spans around the 256-byte span minimum and around
    # whole lines, then long ones split over threads.
    sizes = [63, 64, 65, 127, 255, 256, 257, 319, 320, 321, (16 << 10) + 1, (1 << 20) + 17]
    run_with_stream_threshold(
        0, f"check_spans_any_size_and_alignment(o, {threads}, {sizes}, {310 + threads})")


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_rows_match_reference(threads):
    run_with_stream_threshold(0, f"check_streamed_rows(o, {threads}, {320 + threads})")


def test_stream_threshold_is_per_job():
    # A job of threshold - 1 bytes is memcpy'd, one of threshold bytes
    # streams: both byte-exact, with unaligned ends.
    threshold = (256 << 10) + 3
    sizes = [threshold - 1, threshold, threshold + 1]
    run_with_stream_threshold(
        threshold, f"check_spans_any_size_and_alignment(o, 2, {sizes}, 330)")
