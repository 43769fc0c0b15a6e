"""vLLM-Ascend 0.30.0rc2: GQA K/V interleaved per kernel block and the
hybrid attention + GDN/Mamba layout (fixtures/ascend_hybrid.py,
provenance there) are served exactly.

* KV: the full worker path (build_plan -> LMCache chunk buffers ->
  ChunkTransfer.store -> fresh caches -> ChunkTransfer.load) against the
  oracle, whose accessor views are reshapes of each layer's raw bytes
  (kernel block k = K rows then V rows), not the as_strided views handed
  to the planner. Whole allocations are compared after a load, so the GDN
  pages sharing an attention layer's bytes are shown untouched.
* Mamba state: the align-mode snapshot (StateTransfer) of every GDN layer,
  read and written at the page offsets the source gives (conv at 0, SSM
  right after, padding never), everything else in the backing unchanged.

The groups are in the real runner's order: the full-attention group first,
then 3 Mamba groups, all of one block size (the fixture's provenance says
why); a permuted order stores the same bytes (test_group_order_...).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

# vLLM-Ascend 0.30.0rc2 runs on vLLM 0.30, whose KVCacheTensor describes a
# shared backing (layers, offset, strides); the vLLM releases older
# vLLM-Ascend releases pin (0.23-0.29) cannot describe that layout at all.
import inspect  # noqa: E402

from vllm.v1.kv_cache_interface import KVCacheTensor  # noqa: E402

if "layers" not in inspect.signature(KVCacheTensor).parameters:
    pytest.skip("this vLLM's KVCacheTensor has no shared-backing descriptors (vLLM-Ascend 0.30.0rc2 "
                "runs on vLLM 0.30); the layout does not exist there", allow_module_level=True)

from fixtures import ascend_hybrid as H
from fixtures import layouts as L
from fixtures import oracle
from lmcache_ascend.integration.vllm.vllm_engine_config import state_align_facts
from lmcache_ascend.planning.groups import ChunkRequest, GroupKind
from lmcache_ascend.planning.kv_format import LayerFormat
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.planning.state_align import decide, snapshot_layout
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
from lmcache_ascend.transfer.state_transfer import StateTransfer
from fixtures.lmcache_objs import memory_obj as _obj
from fixtures.lmcache_objs import store_chunks as _store

LAYOUTS = {lay.name: lay for lay in H.all_layouts()}
HYBRID = [n for n in LAYOUTS if n.startswith("qwen3-next")]


def _plan(layout, built, bundle=True):
    cfg = dataclasses.replace(layout.config, bundle_multi_spec=bundle)
    return build_plan(built.kv_caches, layout.groups, layout.chunk_size, cfg, layout.hints)


# ---- the fixture against facts transcribed from the source ----------------


def _kernel_stride_bytes(name: str, hidden: int) -> int:
    """Bytes from one kernel block to the next: [K | V] (v1 runner), or the
    padded page split into its kernel blocks (v2 runner, attn_utils.py
    l.704-705), from the pad and block size in the layout's name."""
    if "-v2-runner-" not in name:
        return 2 * hidden
    pad, bs = int(name.split("-pad")[1].split("-")[0]), int(name.rsplit("-bs", 1)[1])
    split = bs // H.KERNEL_BLOCK
    return (2 * hidden * split + pad) // split


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_views_are_the_sources_interleaved_kv_and_packed_state(name):
    layout = LAYOUTS[name]
    built = layout.build(True)
    hidden = H.KERNEL_BLOCK * H.HEADS * H.HEAD * 2  # one kernel block of K (bf16)
    for e in built.elements:
        k, v = built.kv_caches[e.layer]
        mine = k if e.element == 0 else v
        # The as_strided views (model_runner_v1.py l.5722-5744) read the
        # same bytes as the oracle's reshape of the raw tensor.
        logical = mine.permute(0, 2, 1, 3) if "LBHNC" in name else mine
        assert logical.data_ptr() == e.view.data_ptr() and logical.stride() == e.view.stride()
        assert torch.equal(logical.view(torch.int16), e.view.view(torch.int16))  # bits: random bf16 has NaNs
        if "-padded-page-" in name:  # (all K, all V) after the padding (gqa_padded's provenance)
            assert k.is_contiguous() and v.is_contiguous() and v.data_ptr() - k.data_ptr() == k.numel() * 2
            raw = next(b for b in built.backing if b.data_ptr() <= k.data_ptr() < b.data_ptr() + b.numel())
            assert v.data_ptr() + v.numel() * 2 == raw.data_ptr() + raw.numel()  # V ends it: padding in front
            continue
        assert v.data_ptr() - k.data_ptr() == hidden and k.stride(0) * 2 == _kernel_stride_bytes(name, hidden)
    if name.startswith("qwen3-next"):
        page = 2 * hidden * (H.hybrid_block_size() // H.KERNEL_BLOCK)
        conv, ssm = built.kv_caches[H.gdn_name(0)]
        assert conv.stride(0) * 2 == page and ssm.stride(0) * 4 == page
        assert ssm.data_ptr() - conv.data_ptr() == math.prod(H.CONV) * 2
        shared = built.kv_caches[H.attn_name(3)][0].data_ptr() == conv.data_ptr()
        # Layer-outermost layouts: attention layer 3 and GDN layers 0-2 share
        # region 0 (l.5102-5140); block-outermost: private tensors (l.5159-5189).
        assert shared == name.endswith(("LBNHC", "LBHNC"))
        assert len(built.backing) == (1 if shared else H.QWEN3_NEXT_LAYERS)


@pytest.mark.parametrize("name", HYBRID)
def test_groups_hints_and_plan(name):
    layout = LAYOUTS[name]
    kinds = [g.kind for g in layout.groups]
    assert kinds == [GroupKind.FULL] + [GroupKind.STATE] * 3
    # vLLM's grouping of the runner's dict: attention bucket first, Mamba
    # layers dealt out as layers[i::3] (kv_cache_utils.py l.1573-1574).
    assert [g.layer_names for g in layout.groups] == [
        (H.attn_name(3), H.attn_name(7)), (H.gdn_name(0), H.gdn_name(4)),
        (H.gdn_name(1), H.gdn_name(5)), (H.gdn_name(2), H.gdn_name(6)),
    ]
    assert {g.block_size for g in layout.groups} == {256}
    # LBHNC is the only one whose K/V are per-head (the env's name, read by
    # attention_v1.py get_kv_cache_shape and vllm_kv_layout.token_row_layout).
    assert layout.hints.kv_layout == ("HND" if name.endswith("LBHNC") else "NHD" if name.endswith("LBNHC") else None)
    plan = _plan(layout, layout.build(True))
    assert plan.stored_groups == frozenset({0}) and plan.unrestorable_groups == frozenset({1, 2, 3})
    planes = [p for kg in plan.kernel_groups for entry in kg.planes for p in entry]
    assert {p.layer_name for p in planes} == {H.attn_name(3), H.attn_name(7)}
    # 256-token blocks of two 128-row kernel blocks, K/V 2 x 8 KiB apart.
    assert {(p.block_rows, p.block_tokens, p.block_stride_bytes) for p in planes} == {(128, 128, 2 * 8192)}


# ---- KV: store / load round trip and exact resumes ------------------------


@pytest.mark.parametrize("bundle", [True, False], ids=["bundled", "exploded"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_roundtrip_is_exact_and_touches_nothing_else(name, bundle, ops, allocator):
    layout = LAYOUTS[name]
    orig = layout.build(True)
    plan = _plan(layout, orig, bundle)
    assert plan.stored_groups == layout.stored_groups and plan.unrestorable_groups == layout.unrestorable_groups
    if bundle:
        assert len(plan.kernel_groups) == layout.kernel_groups_bundled
    tables = L.block_tables(layout)
    objs = _store(layout, ops, allocator, plan, orig, tables)
    try:
        for hit in range(layout.chunk_size, layout.num_tokens + 1, layout.chunk_size):
            fresh, expect = layout.build(False), layout.build(False)
            load = ChunkTransfer(_plan(layout, fresh, bundle), ops)
            for req, obj in objs:
                if req.end > hit:
                    break
                load.load(obj.tensor, ChunkRequest(req.start, req.end, tables))
                oracle.apply_expected_load(orig, expect, layout, plan.stored_groups, tables, req.start, req.end)
            assert oracle.backing_equal(fresh, expect), oracle.first_difference(fresh, expect)
            got = {(e.layer, e.element): e for e in fresh.elements}
            checked = 0
            for e in orig.elements:  # every row a forward resuming at ``hit`` reads
                for pos in oracle.rows_read_at(e, tables[e.group], hit):
                    checked += 1
                    assert np.array_equal(oracle.element_bytes(got[(e.layer, e.element)], pos), oracle.element_bytes(e, pos))
            assert checked == len(orig.elements) * hit
        assert any(bool(t.any()) for t in fresh.backing)
    finally:
        for _, obj in objs:
            obj.ref_count_down()


def test_a_wrong_kv_order_is_caught_by_the_oracle(ops, allocator):
    """Guard: reading the hybrid layer as NHD K-then-V pairs of whole blocks
    (0.29.0rc1's combined form) stores other bytes than the oracle's."""
    layout = LAYOUTS[f"qwen3-next-ascend-{H.RELEASE.version}-LBNHC"]
    orig = layout.build(True)
    wrong = dict(orig.kv_caches)
    for name in (H.attn_name(3), H.attn_name(7)):
        k, _ = orig.kv_caches[name]
        flat = torch.as_strided(k, (k.shape[0] * 2, *k.shape[1:]), (k.stride(0) // 2, *k.stride()[1:]))
        wrong[name] = (flat[: k.shape[0]], flat[k.shape[0] :])
    plan = build_plan(wrong, layout.groups, layout.chunk_size, layout.config, layout.hints)
    tables = L.block_tables(layout)
    obj = _obj(allocator, plan.chunk_bytes)
    try:
        ChunkTransfer(plan, ops).store(obj.tensor, ChunkRequest(0, layout.chunk_size, tables))
        want = oracle.expected_chunk(orig, layout, plan, tables, 0, layout.chunk_size)
        assert not np.array_equal(obj.tensor[: plan.chunk_bytes].numpy(), want)
    finally:
        obj.ref_count_down()


# ---- Mamba state: align-mode snapshots ------------------------------------


def _facts(cfg):
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_match_unit=None),
        speculative_config=None,
        scheduler_config=SimpleNamespace(watermark=0.0),
    )
    return state_align_facts(vcfg, cfg)


def _state_regions(cfg, specs, built):
    """Byte range of every GDN layer's raw tensor inside built.backing,
    from the descriptors (layer-outermost) or the allocation order."""
    nb, out = cfg.num_blocks, {}
    if cfg.kv_cache_layout.startswith("L"):
        for d in cfg.kv_cache_tensors:
            for i, name in enumerate(d.layers):
                start = d.offset + i * d.layer_stride
                out[name] = built.backing[0][start : start + nb * specs[name].page_size_bytes]
    else:
        out = {name: buf for name, buf in zip(specs, built.backing)}
    return {n: r for n, r in out.items() if n.endswith("linear_attn")}


@pytest.mark.parametrize("layout_name", H.LAYOUTS)
def test_state_snapshot_reads_and_writes_the_page_offsets_only(layout_name):
    cfg, specs = H.qwen3_next_config(layout_name)
    layout = LAYOUTS[f"qwen3-next-ascend-{H.RELEASE.version}-{layout_name}"]
    facts = _facts(cfg)
    gate = decide(facts, layout.groups, layout.chunk_size)
    assert gate is not None and gate.enabled, gate and gate.reason
    snap = snapshot_layout(facts, layout.groups, layout.chunk_size)
    state_bytes = math.prod(H.CONV) * 2 + math.prod(H.SSM) * 4
    assert snap.snapshot_bytes == 6 * state_bytes  # no page padding stored
    built = H.build(cfg, specs)
    regions = _state_regions(cfg, specs, built)
    page = next(iter(s.page_size_bytes for s in specs.values()))
    xfer = StateTransfer(snap, built.kv_caches)
    src = {1: 3, 2: 4, 3: 5}  # Mamba groups 1-3 (group 0 is attention)

    def block_state(name: str, b: int) -> bytes:
        return bytes(regions[name][b * page : b * page + state_bytes].numpy())

    bufs = [torch.full((snap.piece_bytes,), 0xAB, dtype=torch.uint8) for _ in range(snap.pieces)]
    for k, buf in enumerate(bufs):
        xfer.gather(buf, k, src)
    got = b"".join(bytes(buf[: hi - lo].numpy()) for buf, (lo, hi) in zip(bufs, map(snap.piece_range, range(snap.pieces))))
    want = {seg.layer: block_state(seg.layer, src[seg.group]) for seg in snap.segments()}
    assert got == b"".join(want[seg.layer] for seg in snap.segments())
    before = [b.clone() for b in built.backing]
    hit, running = {1: 7, 2: 8, 3: 9}, {1: 10, 2: 11, 3: 12}
    for k, buf in enumerate(bufs):
        xfer.scatter(buf, k, (hit, running))
    expect = [b.clone() for b in before]
    fake = dataclasses.replace(built, backing=expect)
    regions_e = _state_regions(cfg, specs, fake)
    for seg in snap.segments():
        for b in (hit[seg.group], running[seg.group]):
            regions_e[seg.layer][b * page : b * page + state_bytes] = torch.frombuffer(bytearray(want[seg.layer]), dtype=torch.uint8)
    assert all(torch.equal(a, b) for a, b in zip(built.backing, expect))
    assert not all(torch.equal(a, b) for a, b in zip(built.backing, before))


# ---- group order: nothing depends on it ------------------------------------


@pytest.mark.parametrize("order", [(1, 2, 3, 0), (2, 0, 3, 1)], ids=["mamba-first", "shuffled"])
def test_group_order_changes_nothing_but_the_indices(order, ops, allocator):
    """The real order puts the attention group first (the fixture's
    provenance); with the groups permuted (group i = real group order[i],
    its block table with it) every chunk holds the same bytes, the plan the
    same planes, and the state snapshot the same bytes, group ids mapped."""
    real, perm = H.qwen3_next("LBNHC"), H.qwen3_next("LBNHC", group_order=order)
    assert [g.layer_names for g in perm.groups] == [real.groups[i].layer_names for i in order]
    built_r, built_p = real.build(True), perm.build(True)
    assert all(torch.equal(a, b) for a, b in zip(built_r.backing, built_p.backing))
    plan_r, plan_p = _plan(real, built_r), _plan(perm, built_p)
    new = {old: i for i, old in enumerate(order)}
    assert plan_p.stored_groups == {new[g] for g in plan_r.stored_groups}
    assert plan_p.unrestorable_groups == {new[g] for g in plan_r.unrestorable_groups}
    assert plan_r.chunk_bytes == plan_p.chunk_bytes

    def planes(plan):
        return [(p.layer_name, p.plane_index, p.row_bytes, p.block_rows, p.block_stride_bytes)
                for kg in plan.kernel_groups for entry in kg.planes for p in entry]

    assert planes(plan_r) == planes(plan_p)
    tables_r = L.block_tables(real)
    tables_p = tuple(tables_r[i] for i in order)
    objs = []
    try:
        for start in range(0, real.num_tokens, real.chunk_size):
            got = []
            for layout, plan, tables in ((real, plan_r, tables_r), (perm, plan_p, tables_p)):
                obj = _obj(allocator, plan.chunk_bytes)
                objs.append(obj)
                assert ChunkTransfer(plan, ops).store(obj.tensor, ChunkRequest(start, start + layout.chunk_size, tables)).stored
                got.append(obj.tensor[: plan.chunk_bytes].numpy().copy())
            want = oracle.expected_chunk(built_r, real, plan_r, tables_r, start, start + real.chunk_size)
            assert np.array_equal(got[0], want) and np.array_equal(got[1], want), f"chunk at {start}"
    finally:
        for obj in objs:
            obj.ref_count_down()
    # State: the same snapshot bytes from the same blocks, group ids mapped.
    snaps = []
    for layout, grp in ((real, None), (perm, order)):
        cfg, specs = H.qwen3_next_config("LBNHC", group_order=grp)
        facts = _facts(cfg)
        snap = snapshot_layout(facts, layout.groups, layout.chunk_size)
        xfer = StateTransfer(snap, H.build(cfg, specs).kv_caches)
        src = {(new[g] if grp else g): b for g, b in {1: 3, 2: 4, 3: 5}.items()}
        bufs = [torch.zeros(snap.piece_bytes, dtype=torch.uint8) for _ in range(snap.pieces)]
        for k, buf in enumerate(bufs):
            xfer.gather(buf, k, src)
        whole = b"".join(bytes(b[: hi - lo].numpy()) for b, (lo, hi) in zip(bufs, map(snap.piece_range, range(snap.pieces))))
        # The snapshot lists Mamba groups in group order (state_align.py
        # SnapshotLayout): compared per layer, i.e. up to that permutation.
        snaps.append({s.layer: whole[s.offset : s.offset + s.nbytes] for s in snap.segments()})
    assert snaps[0] == snaps[1] and len(snaps[0]) == 6
