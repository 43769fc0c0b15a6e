# SPDX-License-Identifier: Apache-2.0
"""Byte-exact checks of the CPU copy ops on a given torch thread count, for
test_cpu_threads.py: it runs them in its own process and, for the streaming
threshold read once per process, in a fresh interpreter that imports this
module (tests/kernels on its PYTHONPATH)."""

from __future__ import annotations

import numpy as np
import torch

import plane_reference as ref
from plane_reference import Plane


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
