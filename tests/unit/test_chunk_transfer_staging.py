"""The device staging path (used when vLLM's KV lives on an NPU) moves the
same bytes as the direct CPU path; exercised on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
from lmcache_ascend.planning.groups import ChunkRequest, GroupKind, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayoutHints
from lmcache_ascend.planning.planner import build_plan

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

CHUNK = 256


def _caches(seed: int, zero: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("l0", "l1", "l2"):
        t = torch.zeros(12, 2, 64, 64) if zero else torch.randn(12, 2, 64, 64, generator=g)
        out[name] = t
    return out


def _groups() -> tuple[SchedulerGroup, ...]:
    return (
        SchedulerGroup(0, GroupKind.FULL, "FullAttentionSpec", 64, layer_names=("l0", "l2")),
        SchedulerGroup(1, GroupKind.SLIDING, "SlidingWindowSpec", 64, sliding_window=96,
                       layer_names=("l1",)),
    )


@pytest.mark.parametrize("start", [0, CHUNK])
def test_staged_equals_direct(start):
    src = _caches(1)
    plan = build_plan(src, _groups(), CHUNK, AscendConfig(), LayoutHints(opaque_pages=True))
    tables = ((1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 0, 0, 0, 8, 7))
    req = ChunkRequest(start, start + CHUNK, tables)
    direct = ChunkTransfer(plan)
    staged = ChunkTransfer(plan, staging=True)
    a = torch.full((plan.chunk_bytes,), 7, dtype=torch.uint8)
    b = torch.full((plan.chunk_bytes,), 9, dtype=torch.uint8)
    ra, rb = direct.store(a, req), staged.store(b, req)
    assert ra.stored == rb.stored
    if not ra.stored:  # sliding blocks of the first chunk are null here
        assert start == 0
        return
    assert torch.equal(a, b)
    # Load both into fresh caches: identical, and equal to the source pages.
    dst_a, dst_b = _caches(0, zero=True), _caches(0, zero=True)
    plan_a = build_plan(dst_a, _groups(), CHUNK, AscendConfig(), LayoutHints(opaque_pages=True))
    plan_b = build_plan(dst_b, _groups(), CHUNK, AscendConfig(), LayoutHints(opaque_pages=True))
    ChunkTransfer(plan_a).load(a, req)
    ChunkTransfer(plan_b, staging=True).load(b, req)
    for name in src:
        assert torch.equal(dst_a[name], dst_b[name]), name
    blocks = [tables[0][i] for i in range(start // 64, start // 64 + 4)]
    for name in ("l0", "l2"):
        assert torch.equal(dst_a[name][blocks], src[name][blocks])
    assert np.count_nonzero(dst_a["l1"].numpy()) > 0
