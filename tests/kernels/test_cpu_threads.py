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
from cpu_copy_checks import check_spans_any_size_and_alignment
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


def run_with_stream_threshold(threshold: int, call: str) -> None:
    # `call` is one of cpu_copy_checks' functions; the fresh interpreter finds
    # that module (and plane_reference) through PYTHONPATH.
    code = "import lmcache_ascend.ops as o; import cpu_copy_checks as t; t.%s" % call
    paths = [str(Path(__file__).parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, STREAM_ENV: str(threshold), "PYTHONPATH": os.pathsep.join(paths)}
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
