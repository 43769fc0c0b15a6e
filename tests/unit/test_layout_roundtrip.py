"""Full worker path per layout: build_plan -> LMCache MemoryObj chunk buffers
-> ChunkTransfer.store -> fresh zeroed caches -> ChunkTransfer.load.

Checked against the oracle (tests/fixtures/oracle.py): every stored row comes
back byte-exact, nothing else in the fresh caches is written (whole
allocations compared, padding included), skipped and state groups are left
alone, the chunk buffer holds exactly the declared rows in the declared
order, and bundled mode makes one op call per kernel group and chunk.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, ChunkRequest, GroupKind
from lmcache_ascend.planning.planner import build_plan
from fixtures import layouts as L
from fixtures import oracle

LAYOUTS = {lay.name: lay for lay in L.all_layouts()}


@pytest.fixture(scope="module")
def allocator():
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator

    return TensorMemoryAllocator(torch.empty(64 << 20, dtype=torch.uint8))


def _memory_obj(allocator, nbytes: int):
    from lmcache.v1.memory_management import MemoryFormat

    obj = allocator.allocate(torch.Size([nbytes]), torch.uint8, MemoryFormat.BINARY)
    assert obj is not None
    obj.tensor.fill_(0xAB)  # stale bytes a store must overwrite
    return obj


def _load_tables(layout: L.Layout, tables):
    """After a hit vLLM points sliding-window positions that left the
    window at the null block; loads must skip them."""
    out = []
    for g, table in zip(layout.groups, tables):
        if g.kind is GroupKind.SLIDING and g.sliding_window:
            keep_from = (layout.num_tokens - g.sliding_window) // g.block_size
            table = tuple(NULL_BLOCK_ID if i < keep_from else b for i, b in enumerate(table))
        out.append(table)
    return tuple(out)


def _roundtrip(layout: L.Layout, ops, allocator, bundle: bool):
    config = dataclasses.replace(layout.config, bundle_multi_spec=bundle)
    orig, fresh, expect = layout.build(True), layout.build(False), layout.build(False)
    plan = build_plan(orig.kv_caches, layout.groups, layout.chunk_size, config, layout.hints)
    assert plan.stored_groups == layout.stored_groups
    assert {s.index for s in plan.skipped_groups} == layout.skipped_groups
    assert plan.unrestorable_groups == layout.unrestorable_groups
    if bundle:
        assert len(plan.kernel_groups) == layout.kernel_groups_bundled
    tables = L.block_tables(layout)
    store = ChunkTransfer(plan, ops)
    objs = []
    try:
        return _store_then_load(layout, ops, plan, orig, fresh, expect, config, tables, store, objs, allocator)
    finally:
        for _, obj in objs:
            obj.ref_count_down()


def _store_then_load(layout, ops, plan, orig, fresh, expect, config, tables, store, objs, allocator):
    for start in range(0, layout.num_tokens, layout.chunk_size):
        req = ChunkRequest(start, start + layout.chunk_size, tables)
        obj = _memory_obj(allocator, plan.chunk_bytes)
        before = store.op_calls
        res = store.store(obj.tensor, req)
        assert res.stored and res.op_calls == len(plan.kernel_groups)
        assert store.op_calls - before == len(plan.kernel_groups)
        want = oracle.expected_chunk(orig, layout, plan, tables, req.start, req.end)
        got = obj.tensor[: plan.chunk_bytes].numpy()
        assert np.array_equal(got, want), f"chunk [{req.start}, {req.end}) differs from the oracle"
        objs.append((req, obj))
    # Load into fresh caches (a different allocation: a new plan).
    load_tables = _load_tables(layout, tables)
    plan_f = build_plan(fresh.kv_caches, layout.groups, layout.chunk_size, config, layout.hints)
    assert plan_f.chunk_bytes == plan.chunk_bytes
    load = ChunkTransfer(plan_f, ops)
    for req, obj in objs:
        req = ChunkRequest(req.start, req.end, load_tables)
        res = load.load(obj.tensor, req)
        assert res.op_calls == len(plan.kernel_groups)
        oracle.apply_expected_load(orig, expect, layout, plan.stored_groups, load_tables, req.start, req.end)
    assert oracle.backing_equal(fresh, expect), oracle.first_difference(fresh, expect)
    return plan, fresh


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_roundtrip_bundled_and_exploded(name, ops, allocator):
    layout = LAYOUTS[name]
    plan_b, fresh_b = _roundtrip(layout, ops, allocator, bundle=True)
    plan_e, fresh_e = _roundtrip(layout, ops, allocator, bundle=False)
    # Same bytes per chunk; identical paged side after a load.
    assert plan_e.chunk_bytes == plan_b.chunk_bytes
    assert len(plan_e.kernel_groups) >= len(plan_b.kernel_groups)
    assert oracle.backing_equal(fresh_b, fresh_e)
    # Something was actually moved (guards against an empty oracle).
    assert any(bool(t.any()) for t in fresh_b.backing)


def test_v018_structure():
    layout = LAYOUTS["dsv4-ascend-v0.18"]
    plan = build_plan(layout.build(False).kv_caches, layout.groups, 256, layout.config, layout.hints)
    cr4 = plan.kernel_groups[0]
    assert cr4.sched_groups == (0, 1, 3, 3)  # 4 planes after the state skip
    assert cr4.num_layers == 2
    assert [p.row_bytes for p in cr4.planes[0]] == [128, 128, 128, 2]
    assert cr4.rows_per_chunk == (64, 128, 64, 64)
    cr128 = plan.kernel_groups[1]
    assert cr128.sched_groups == (8, 9) and cr128.rows_per_chunk == (1, 128)
    # Identically shaped SWA layers of sg1 and sg2 are separate kernel groups.
    assert [kg.sched_groups for kg in plan.kernel_groups[2:]] == [(1,), (2,)]
    by_layer = {lp.layer_name: lp for lp in plan.layers}
    cr4_layer = by_layer[L.V018_CR4[0]]
    assert cr4_layer.format.value == "multi_plane"
    assert len(cr4_layer.unstored) == 3  # the three state planes


def test_v020_sizes_and_sliding_window_savings():
    layout = LAYOUTS["dsv4-vllm-v0.20"]
    plan = build_plan(layout.build(False).kv_caches, layout.groups, 256, layout.config, layout.hints)
    rows = {(kg.sched_groups, p.row_bytes): kg.rows_per_chunk for kg in plan.kernel_groups for p in kg.planes[0]}
    assert rows[((0,), 584)] in ((64,), (2,))
    assert rows[((0,), 132)] == (64,)
    assert rows[((1,), 584)] == (128,)  # window 128 of a 256-token chunk
    by_group = plan.group_bytes()
    assert by_group[0] == 2 * 64 * 584 + 2 * 64 * 132 + 1 * 2 * 584
    naive = plan.naive_group_bytes()
    assert naive[1] == 2 * by_group[1]  # sliding group: half of the chunk kept
    assert 3 not in by_group and 4 not in by_group  # compressor state skipped
