"""Planning rules: kernel grouping, group assignment, chunk-size validation,
state skip, sizing and the explain record."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fixtures import ascend_layouts as L_ASCEND
from fixtures import layouts as L
from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.groups import CompressorState, GroupKind, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayoutHints
from lmcache_ascend.planning.planner import KernelOp, build_plan, unrestorable_groups
from lmcache_ascend.planning.state_skip import SkipReason, skipped_groups

FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE
NHD = LayoutHints(kv_layout="NHD")


def grp(i, names, kind=FULL, bs=16, ratio=1, window=None, spec="FullAttentionSpec"):
    return SchedulerGroup(i, kind, spec, bs, ratio, window, tuple(names))


def kv(nb=8, bs=16, row=32, dtype=torch.float16):
    return torch.zeros(nb, bs, row, dtype=dtype)


def test_identical_shapes_in_different_groups_are_not_merged():
    caches = {n: kv() for n in "abcd"}
    groups = (grp(0, "ab"), grp(1, "cd", SLIDING, window=32, spec="SlidingWindowSpec"))
    plan = build_plan(caches, groups, 64)
    assert [kg.sched_groups for kg in plan.kernel_groups] == [(0,), (1,)]
    assert [kg.layer_names for kg in plan.kernel_groups] == [("a", "b"), ("c", "d")]
    # Same group, same geometry: one kernel group.
    plan = build_plan(caches, (grp(0, "abcd"),), 64)
    assert len(plan.kernel_groups) == 1 and plan.kernel_groups[0].num_layers == 4


def test_differing_geometry_splits_kernel_groups():
    caches = {"a": kv(), "b": kv(row=64), "c": kv(dtype=torch.bfloat16), "d": kv(nb=9)}
    plan = build_plan(caches, (grp(0, "abcd"),), 64)
    assert len(plan.kernel_groups) == 4


def test_single_plane_layer_in_two_groups_is_refused():
    with pytest.raises(ValueError, match="only\\s+as a multi-plane layer"):
        build_plan({"a": kv()}, (grp(0, "a"), grp(1, "a")), 64)


def test_multi_plane_layer_maps_planes_to_groups():
    entry = (kv(row=64), kv(row=8))
    groups = (grp(0, ["x"]), grp(1, ["x"], SLIDING, window=32, spec="SlidingWindowSpec"))
    plan = build_plan({"x": entry}, groups, 64)
    kg = plan.kernel_groups[0]
    assert kg.sched_groups == (0, 1) and kg.rows_per_chunk == (64, 32)
    # Explicit mapping reverses it.
    plan = build_plan({"x": entry}, groups, 64, hints=LayoutHints(plane_groups={"x": (1, 0)}))
    assert plan.kernel_groups[0].sched_groups == (1, 0)
    with pytest.raises(ValueError, match="plane_groups"):
        build_plan({"x": entry}, groups, 64, hints=LayoutHints(plane_groups={"x": (0, 0)}))
    three = entry + (kv(row=4),)
    with pytest.raises(ValueError, match="pass LayoutHints.plane_groups"):
        build_plan({"x": three}, groups, 64)
    with pytest.raises(ValueError, match="ascend_flatten_multi_spec"):
        build_plan({"x": entry}, groups, 64, AscendConfig(flatten_multi_spec=False))


def test_bundled_vs_exploded_op_calls():
    caches = {f"l{i}": (kv(row=64), kv(row=8, dtype=torch.int8), kv(row=2)) for i in range(3)}
    groups = (grp(0, caches),)
    bundled = build_plan(caches, groups, 64)
    exploded = build_plan(caches, groups, 64, AscendConfig(bundle_multi_spec=False))
    assert bundled.op_calls_per_chunk == 1 and bundled.kernel_groups[0].num_planes == 3
    assert exploded.op_calls_per_chunk == 3
    assert all(kg.num_layers == 3 and kg.num_planes == 1 for kg in exploded.kernel_groups)
    assert bundled.chunk_bytes == exploded.chunk_bytes == 3 * 64 * (128 + 8 + 4)
    # Same bytes, different order: never interchangeable.
    assert bundled.layout_fingerprint != exploded.layout_fingerprint
    other_memory = {k: tuple(t.clone() for t in v) for k, v in caches.items()}
    assert build_plan(other_memory, groups, 64).layout_fingerprint == bundled.layout_fingerprint


def test_chunk_size_validation_names_group_value_and_valid_values():
    pages = {"a": torch.zeros(8, 2, 16, 64)}
    with pytest.raises(ValueError) as err:
        build_plan(pages, (grp(0, "a"),), 40, hints=LayoutHints(opaque_pages=True))
    msg = str(err.value)
    assert "chunk_size 40" in msg and "group 0" in msg and "multiple of its block_size 16" in msg and "32, 48" in msg
    comp = {"c": torch.zeros(8, 4, 584, dtype=torch.uint8)}
    with pytest.raises(ValueError) as err:
        build_plan(comp, (grp(0, "c", bs=512, ratio=128, spec="C128"),), 192)
    assert "compress ratio 128" in str(err.value) and "group 0 (C128" in str(err.value)
    assert build_plan(comp, (grp(0, "c", bs=512, ratio=128),), 256).chunk_bytes == 2 * 584
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        build_plan({"a": kv()}, (grp(0, "a"),), 0)


def test_rows_per_block_must_match_the_group():
    with pytest.raises(ValueError, match="rows per block"):
        build_plan({"a": kv(bs=12)}, (grp(0, "a", bs=16),), 64)
    # vLLM kernel-block splitting: 8-row kernel blocks inside 16-token blocks.
    plan = build_plan({"a": kv(nb=16, bs=8)}, (grp(0, "a", bs=16),), 64)
    a = plan.kernel_groups[0].addressing[0]
    assert (a.manager_rows, a.kernel_split, a.rows_per_chunk) == (16, 2, 64)


def test_per_layer_compress_ratio_hint():
    caches = {"c4": torch.zeros(5, 64, 584, dtype=torch.uint8), "c128": torch.zeros(5, 2, 584, dtype=torch.uint8)}
    groups = (grp(0, ["c4", "c128"], bs=256),)
    hints = LayoutHints(layer_compress_ratio={"c4": 4, "c128": 128})
    plan = build_plan(caches, groups, 256, hints=hints)
    assert sorted(kg.rows_per_chunk for kg in plan.kernel_groups) == [(2,), (64,)]
    assert plan.chunk_bytes == (64 + 2) * 584
    two = (grp(0, ["m"], bs=256), grp(1, ["m"], bs=256))
    with pytest.raises(ValueError, match="layers of one group"):
        build_plan({"m": (caches["c4"], caches["c4"].clone())}, two, 256, hints=LayoutHints(layer_compress_ratio={"m": 4}))


USER_SKIP = AscendConfig(skip_state_spec_allowlist=("FooState",), skip_state_layer_suffixes=(".foo.state_cache",))


def test_state_skip_and_unrestorable():
    names = {0: ["attn"], 1: ["state"], 2: ["mamba"], 3: ["x.foo.state_cache"], 4: []}
    groups = (
        grp(0, names[0]),
        grp(1, names[1], STATE, spec="FooState"),
        grp(2, names[2], STATE, spec="MambaSpec"),
        grp(3, names[3], SLIDING, bs=4, window=8, spec="SlidingWindowMLASpec"),
        grp(4, names[4]),
    )
    skipped = {s.index: s.reason for s in skipped_groups(groups, USER_SKIP)}
    assert skipped == {1: SkipReason.SPEC_ALLOWLIST, 3: SkipReason.LAYER_SUFFIX, 4: SkipReason.NO_LAYERS}
    assert [g.index for g in unrestorable_groups(groups, USER_SKIP)] == [2]
    off = dataclasses.replace(USER_SKIP, skip_state_groups=False)
    assert [g.index for g in unrestorable_groups(groups, off)] == [1, 2]
    # Nothing is skipped on the user's behalf by default: state is refused.
    assert {s.index for s in skipped_groups(groups, AscendConfig())} == {4}
    assert [g.index for g in unrestorable_groups(groups, AscendConfig())] == [1, 2]
    caches = {
        "attn": kv(),
        "state": torch.zeros(8, 4096, dtype=torch.int8),
        "mamba": torch.zeros(8, 1, 1, 4096, dtype=torch.int8),
        "x.foo.state_cache": torch.zeros(8, 4, 64),
    }
    plan = build_plan(caches, groups, 64, USER_SKIP)
    assert plan.stored_groups == {0} and plan.unrestorable_groups == {2}
    assert plan.chunk_bytes == 64 * 64 and not plan.exact_hits
    # Skipped groups need not have their layers registered at all.
    plan = build_plan({"attn": kv(), "mamba": caches["mamba"]}, groups, 64, USER_SKIP)
    assert plan.stored_groups == {0}


def test_partial_suffix_match_is_refused():
    g = grp(0, ["a.foo.state_cache", "b.attn"], SLIDING, window=8, spec="SlidingWindowMLASpec")
    with pytest.raises(ValueError, match="match only some"):
        skipped_groups((g,), USER_SKIP)


def _state(i, names, ratio, overlap, bs=8, window=None):
    window = window or ratio * (2 if overlap else 1)
    return SchedulerGroup(
        i, SLIDING, "AscendSlidingWindowMLASpec", bs, 1, window, tuple(names),
        compressor=CompressorState(ratio, overlap),
    )


def test_compressor_state_keeps_only_what_its_compressor_reads():
    """C4 (overlap): the 4 rows of tokens end-4..end-1 of each chunk, not
    vLLM's window of 8; C128 (no overlap): nothing, the group is skipped."""
    c4 = _state(1, ["a.compressor.state_cache"], 4, True)
    c128 = _state(2, ["b.compressor.state_cache"], 128, False, bs=32)
    groups = (grp(0, ["a.attn"], bs=512, ratio=4), c4, c128)
    caches = {
        "a.attn": torch.zeros(6, 128, 1, 64, dtype=torch.bfloat16),
        "a.compressor.state_cache": torch.zeros(40, 8, 1, 256),
        "b.compressor.state_cache": torch.zeros(40, 32, 1, 128),
    }
    plan = build_plan(caches, groups, 128)
    assert [(s.index, s.reason) for s in plan.skipped_groups] == [(2, SkipReason.UNREAD_STATE)]
    by_group = {kg.sched_groups: kg.rows_per_chunk for kg in plan.kernel_groups}
    assert by_group == {(0,): (32,), (1,): (4,)}
    assert plan.group_bytes() == {0: 32 * 128, 1: 4 * 1024}
    naive = plan.naive_group_bytes()
    assert naive[1] == 128 * 1024 and naive[2] == 128 * 512  # every token's state row
    d = plan.describe()
    assert "skipped g2" in str(d) and "unread_state" in str(d)
    with pytest.raises(ValueError) as err:
        build_plan(caches, groups, 64)  # boundaries at 64: the C128 state would be read
    assert "chunk_size 64" in str(err.value) and "group 2" in str(err.value) and "128, 256" in str(err.value)


def test_compressor_state_must_fit_the_window():
    with pytest.raises(ValueError, match="more than the sliding window"):
        _state(0, ["s"], 4, True, window=2)
    with pytest.raises(ValueError, match="sliding group"):
        SchedulerGroup(0, FULL, "X", 8, compressor=CompressorState(4, True))
    with pytest.raises(ValueError, match="ratio must be > 1"):
        CompressorState(1, False)


def test_unlisted_and_missing_layers():
    plan = build_plan({"a": kv(), "shared": kv()}, (grp(0, "a"),), 64)
    assert [u.layer_name for u in plan.unlisted_layers] == ["shared"]
    with pytest.raises(ValueError, match="not registered"):
        build_plan({"a": kv()}, (grp(0, ["a", "b"]),), 64)
    with pytest.raises(ValueError, match="vLLM group order"):
        build_plan({"a": kv()}, (grp(1, "a"),), 64)


def test_cpu_pages_use_block_page_op():
    layout = L.vllm_cpu()
    plan = build_plan(layout.build(False).kv_caches, layout.groups, 32, hints=layout.hints)
    assert [kg.op for kg in plan.kernel_groups] == [KernelOp.BLOCK_PAGE] * 2
    assert plan.kernel_groups[1].rows_per_chunk == (2,)  # window 32 = 2 pages of 16


def test_describe_is_json_and_text():
    layout = L_ASCEND.dsv4("0.23.0")
    plan = build_plan(layout.build(False).kv_caches, layout.groups, 128, layout.config, layout.hints)
    d = plan.describe()
    data = json.loads(d.to_json())
    assert data["op_calls_per_chunk"] == 8 and data["chunk_bytes"] == plan.chunk_bytes
    assert len(data["groups"]) == len(layout.groups) and data["exact_hits"] is True
    assert {s["index"] for s in data["skipped"]} == layout.skipped_groups
    assert sum(g["planned_bytes"] for g in data["groups"]) == plan.chunk_bytes
    text = str(d)
    assert "kernel groups:" in text and "hit granularity: 128 tokens" in text
    skipped = min(layout.skipped_groups)
    assert f"skipped g{skipped} (AscendSlidingWindowMLASpec): unread_state" in text
