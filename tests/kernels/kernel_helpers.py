# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the native kernel tests (imported as a plain module).

Buffers are filled with random BYTES and compared as bytes, so any dtype
(including NaN bit patterns of floats) must come back bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch

# Every dtype the ops must move as opaque bytes.
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
]

# Same-width integer dtypes: the torch baseline runs on these views so its
# indexing copies bytes without float semantics (e.g. NaN canonicalisation,
# missing fp8 kernels).
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def rand_tensor(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Tensor of `dtype` whose bytes are uniformly random."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """Bytes of a (possibly strided) tensor's underlying storage span."""
    return t.contiguous().view(torch.uint8).numpy().copy()


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a = actual.contiguous().view(torch.uint8)
    e = expected.contiguous().view(torch.uint8)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}")


def random_slots(
    n: int, num_blocks: int, block_size: int, gen: torch.Generator, neg_frac: float = 0.15
) -> torch.Tensor:
    """Distinct slots: runs of consecutive slots in shuffled blocks, plus -1s."""
    order = torch.randperm(num_blocks, generator=gen)
    slots = (order[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    # Start mid-block so runs do not always align with blocks.
    start = int(torch.randint(0, max(1, min(block_size, slots.numel() - n + 1)), (1,), generator=gen))
    slots = slots[start : start + n].clone()
    assert slots.numel() == n, "not enough slots for the requested geometry"
    mask = torch.rand(n, generator=gen) < neg_frac
    slots[mask] = -1
    return slots.to(torch.int64)
