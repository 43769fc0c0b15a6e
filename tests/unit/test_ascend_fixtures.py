"""The vLLM-Ascend fixtures against facts transcribed separately from the
wheels, and the plan each one gets (what ``bench_layouts.py --explain``
prints) against sizes computed from the fixture's own elements.

* The mirrored spec classes' page sizes equal vLLM-Ascend's DeepSeek-V4 pad
  table (``get_dsv4_block_sizes``): two transcriptions of the same release
  that must agree.
* Every view's block stride is its layer's page, views of one raw tensor
  never overlap across groups' block ids, entries are lists as vLLM-Ascend
  hands them over.
* Per fixture: exact hits, hit granularity = chunk, op calls per chunk, and
  bytes per chunk per group (planned and naive) recomputed from the
  elements (rows kept x row bytes), not from the planner's records.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

from fixtures import ascend_layouts as AL
from fixtures import ascend_specs as A
from lmcache_ascend.planning.planner import build_plan

LAYOUTS = {lay.name: lay for lay in AL.all_layouts()}


@pytest.mark.parametrize("release", A.RELEASES)
@pytest.mark.parametrize("a5", [False, True])
@pytest.mark.parametrize("bs", [128, 64, 32])
def test_mirrored_page_sizes_match_the_pad_table(release, a5, bs):
    mod = A.specs_module(release, a5)
    specs = AL.dsv4_specs(mod, bs)
    _, pads = (A.DSV4_BLOCK_SIZES_A5 if a5 else A.DSV4_BLOCK_SIZES)[bs]
    groups = A.group_dsv4(specs)
    assert sorted({s.page_size_bytes for s in groups[0].kv_cache_spec.kv_cache_specs.values()}) == sorted(pads)
    assert {s.page_size_bytes for s in specs.values()} == set(pads)  # every layer pads to one of the two
    for page, shared in A.allocate_dsv4(groups):
        owners = [next(i for i, g in enumerate(groups) if n in g.layer_names) for n in shared]
        assert len(owners) == len(set(owners)), "a raw tensor is shared by layers of different groups only"


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("dsv4")])
def test_dsv4_entries_are_lists_of_padded_page_views(name):
    layout = LAYOUTS[name]
    built = layout.build(False)
    for layer, entry in built.kv_caches.items():
        assert isinstance(entry, list)
        pages = {t.stride(0) * t.element_size() for t in entry}
        assert len(pages) == 1 and pages.pop() in (16640, 131072, 16896, 81920, 8320, 65536)
        assert len(entry) == (1 if not layer.endswith(".indexer.k_cache") else (3 if "-a5" in name else 2))
    # compressor state: fp32 rows of 2*coff*head_dim, table[2] / table[3] rows per block
    bs = 64 if name.endswith("-bs64") else 128
    table = A.DSV4_BLOCK_SIZES_A5 if "-a5" in name else A.DSV4_BLOCK_SIZES
    if "-bf16kv" in name:  # A5 with a bf16 KV cache: the states' second pad is 131072
        from fixtures.ascend_specs_030 import DSV4_BLOCK_SIZES_A5_BF16 as table
    (_, _, c4s, c128s), pads = table[bs]
    for layer, entry in built.kv_caches.items():
        if layer.endswith("self_attn.compressor.state_cache"):
            (t,) = entry
            c4 = t.shape[-1] == 2 * 2 * AL.HEAD
            assert t.dtype == torch.float32 and t.shape[1:] in ((c4s, 1, 4 * AL.HEAD), (c128s, 1, 2 * AL.HEAD))
            assert t.shape[1] == (c4s if c4 else c128s) and t.stride(0) * 4 == pads[1]


def _rows_per_chunk(e, chunk: int, kept: bool) -> int:
    logical = math.ceil(chunk / e.ratio)
    if not kept or e.keep is None:
        return logical
    return 0 if e.keep == 0 else min(logical, max(1, e.keep // e.ratio))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_explain_of_every_fixture(name):
    layout = LAYOUTS[name]
    built = layout.build(False)
    plan = build_plan(built.kv_caches, layout.groups, layout.chunk_size, layout.config, layout.hints)
    d = plan.describe()
    assert d.exact_hits and d.op_calls_per_chunk == layout.kernel_groups_bundled
    assert f"hit granularity: {layout.chunk_size} tokens" in str(d)
    planned, naive = {}, {}
    for e in built.elements:
        row = e.view[0, 0].numel() * e.view.element_size()
        stored = e.group in layout.stored_groups
        planned[e.group] = planned.get(e.group, 0) + (_rows_per_chunk(e, layout.chunk_size, True) * row if stored else 0)
        naive[e.group] = naive.get(e.group, 0) + _rows_per_chunk(e, layout.chunk_size, False) * row
    assert {g.group: g.planned_bytes for g in d.groups} == planned
    assert {g.group: g.naive_bytes for g in d.groups} == naive
    assert d.chunk_bytes == sum(planned.values())
