"""Full worker path per layout: build_plan -> LMCache MemoryObj chunk buffers
-> ChunkTransfer.store -> fresh zeroed caches -> ChunkTransfer.load.

Checked against the oracle (tests/fixtures/oracle.py): every stored row comes
back byte-exact, nothing else in the fresh caches is written (whole
allocations compared, padding and aliasing layers included), skipped and
state groups are left alone, the chunk buffer holds exactly the declared
rows in the declared order, and bundled mode makes one op call per kernel
group and chunk. Exactness: for a hit at every chunk end, with the block
tables vLLM hands such a hit, every row the resumed forward reads (per the
fixture's provenance, e.g. DeepSeek-V4's compressor state) is restored.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
from lmcache_ascend.planning.groups import ChunkRequest
from lmcache_ascend.planning.planner import build_plan
from fixtures import layouts as L
from fixtures import oracle
from fixtures.lmcache_objs import memory_obj as _memory_obj

LAYOUTS = {lay.name: lay for lay in L.all_layouts()}


def _plan(layout: L.Layout, built: L.Built, bundle: bool):
    config = dataclasses.replace(layout.config, bundle_multi_spec=bundle)
    return build_plan(built.kv_caches, layout.groups, layout.chunk_size, config, layout.hints)


def _store_all(layout, ops, allocator, plan, orig, tables):
    store = ChunkTransfer(plan, ops)
    objs = []
    for start in range(0, layout.num_tokens, layout.chunk_size):
        req = ChunkRequest(start, start + layout.chunk_size, tables)
        obj = _memory_obj(allocator, plan.chunk_bytes)
        objs.append((req, obj))
        before = store.op_calls
        res = store.store(obj.tensor, req)
        assert res.stored, f"chunk [{req.start}, {req.end}) not stored: {res.incomplete}"
        assert res.op_calls == len(plan.kernel_groups) == store.op_calls - before
        want = oracle.expected_chunk(orig, layout, plan, tables, req.start, req.end)
        got = obj.tensor[: plan.chunk_bytes].numpy()
        assert np.array_equal(got, want), f"chunk [{req.start}, {req.end}) differs from the oracle"
    return objs


def _load_upto(layout, ops, plan, objs, orig, hit: int, tables, bundle: bool):
    """Fresh caches after loading the chunks of a hit at ``hit``."""
    fresh, expect = layout.build(False), layout.build(False)
    plan_f = _plan(layout, fresh, bundle)
    assert plan_f.chunk_bytes == plan.chunk_bytes
    assert plan_f.layout_fingerprint == plan.layout_fingerprint  # other memory, same chunk layout
    load = ChunkTransfer(plan_f, ops)
    ltables = L.load_tables(layout, tables, hit)
    for req, obj in objs:
        if req.end > hit:
            break
        res = load.load(obj.tensor, ChunkRequest(req.start, req.end, ltables))
        assert res.op_calls == len(plan.kernel_groups)
        oracle.apply_expected_load(orig, expect, layout, plan.stored_groups, ltables, req.start, req.end)
    assert oracle.backing_equal(fresh, expect), oracle.first_difference(fresh, expect)
    return fresh, ltables


def _roundtrip(layout: L.Layout, ops, allocator, bundle: bool):
    orig = layout.build(True)
    plan = _plan(layout, orig, bundle)
    assert plan.stored_groups == layout.stored_groups
    assert {s.index for s in plan.skipped_groups} == layout.skipped_groups
    assert plan.unrestorable_groups == layout.unrestorable_groups
    if bundle:
        assert len(plan.kernel_groups) == layout.kernel_groups_bundled
    tables = L.block_tables(layout)
    objs = _store_all(layout, ops, allocator, plan, orig, tables)
    try:
        fresh, _ = _load_upto(layout, ops, plan, objs, orig, layout.num_tokens, tables, bundle)
    finally:
        for _, obj in objs:
            obj.ref_count_down()
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


ASCEND = [n for n in LAYOUTS if "ascend" in n]


def _unrestored_reads(layout: L.Layout, ops, allocator) -> tuple[list[str], int]:
    """For a hit at every chunk end: rows the resumed forward reads that the
    load did not restore, and how many rows were checked."""
    orig = layout.build(True)
    plan = _plan(layout, orig, bundle=True)
    tables = L.block_tables(layout)
    objs = _store_all(layout, ops, allocator, plan, orig, tables)
    bad, checked = [], 0
    try:
        for hit in range(layout.chunk_size, layout.num_tokens + 1, layout.chunk_size):
            fresh, ltables = _load_upto(layout, ops, plan, objs, orig, hit, tables, bundle=True)
            got = {(e.layer, e.element): e for e in fresh.elements}
            for e in orig.elements:
                f = got[(e.layer, e.element)]
                for pos in oracle.rows_read_at(e, ltables[e.group], hit):
                    checked += 1
                    if not np.array_equal(oracle.element_bytes(f, pos), oracle.element_bytes(e, pos)):
                        bad.append(f"{e.layer}[{e.element}] at hit {hit}")
    finally:
        for _, obj in objs:
            obj.ref_count_down()
    return bad, checked


@pytest.mark.parametrize("name", ASCEND)
def test_every_row_a_resumed_forward_reads_is_restored(name, ops, allocator):
    """Hits at every chunk end: what the model reads when it resumes there
    (compressed rows before the hit, the SWA window, the C4 compressor
    state of tokens hit-4..hit-1) equals the original, in every layer."""
    bad, checked = _unrestored_reads(LAYOUTS[name], ops, allocator)
    assert checked > 0 and bad == []


def test_skipping_the_compressor_state_loses_what_c4_layers_read(allocator):
    """The former default (skip every ``.compressor.state_cache`` group)
    leaves the C4 compressors' state of tokens hit-4..hit-1 stale, in the
    attention and the indexer compressor alike; nothing else is lost."""
    from lmcache_ascend.planning.settings import AscendConfig
    from lmcache_ascend.transfer import reference_ops

    old = AscendConfig(skip_state_layer_suffixes=(".compressor.state_cache",))
    layout = LAYOUTS["dsv4-ascend-0.23.0"]
    skipped = frozenset(i for i, g in enumerate(layout.groups) if g.layer_names[0].endswith(".compressor.state_cache"))
    layout = dataclasses.replace(layout, config=old, stored_groups=layout.stored_groups - skipped)
    bad, _ = _unrestored_reads(layout, reference_ops, allocator)
    assert bad and all(".compressor.state_cache" in b for b in bad)
    assert any(".indexer.compressor" in b for b in bad) and any(".self_attn.compressor" in b for b in bad)
