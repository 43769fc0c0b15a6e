"""vllm_specs, vllm_kv_layout and vllm_step_view: vLLM's own KVCacheConfig /
SchedulerOutput / Request objects read into our typed records. Everything here is a real vLLM object."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm_* modules read vLLM's own types")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
import vllm.v1.kv_cache_interface as kv_interface
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm import vllm_kv_layout
from lmcache_ascend.integration.vllm.vllm_kv_layout import layout_facts
from lmcache_ascend.integration.vllm.vllm_specs import scheduler_groups
from lmcache_ascend.integration.vllm.vllm_step_view import ScheduledRequest, step_view
from lmcache_ascend.planning.agreement import HalfAgreement
from lmcache_ascend.planning.chunking import finest_chunk_size
from lmcache_ascend.planning.groups import CompressorState, GroupKind
from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.state_skip import unrestorable_groups
from fixtures import ascend_layouts as AL
from fixtures import ascend_releases as R
from fixtures import ascend_specs as A

# tokens_per_state and CircularBufferSpec exist from vLLM 0.29 on; the older
# series express compression as the MLA specs' compress_ratio (tested above).
only_vllm_032 = pytest.mark.skipif(
    not hasattr(AttentionSpec, "tokens_per_state"),
    reason="vLLM >= 0.29 spec attributes (tokens_per_state, CircularBufferSpec)",
)

ATTN = dict(num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
MLA = dict(num_kv_heads=1, head_size=512, dtype=torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class AscendCompressedMLASpec(MLAAttentionSpec):
    """An MLA spec with ``compress_ratio`` and vLLM's own semantics (block_size
    in tokens): vLLM 0.23/0.26's MLAAttentionSpec has the field; 0.32 not."""

    compress_ratio: int = 1


@dataclass(frozen=True, kw_only=True)
class AscendCompressedSWASpec(SlidingWindowMLASpec):
    compress_ratio: int = 1


def kv_config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups],
    )


# ---- scheduler_groups -------------------------------------------------------


def test_full_sliding_mamba_groups():
    cfg = kv_config(
        (
            ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
            FullAttentionSpec(block_size=16, **ATTN),
        ),
        (
            ["model.layers.1.self_attn.attn"],
            SlidingWindowSpec(block_size=32, sliding_window=96, **ATTN),
        ),
        (
            ["model.layers.3.linear_attn"],
            MambaSpec(
                block_size=640,
                shapes=((4, 8), (2, 16, 16)),
                dtypes=(torch.bfloat16, torch.float32),
            ),
        ),
    )
    gs = scheduler_groups(cfg)
    assert [g.index for g in gs] == [0, 1, 2]
    assert [g.kind for g in gs] == [GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE]
    assert [g.block_size for g in gs] == [16, 32, 640]
    assert [g.sliding_window for g in gs] == [None, 96, None]
    assert [g.compress_ratio for g in gs] == [1, 1, 1]
    assert [g.spec_name for g in gs] == ["FullAttentionSpec", "SlidingWindowSpec", "MambaSpec"]
    assert gs[0].layer_names == ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
    assert gs[1].layer_names == ("model.layers.1.self_attn.attn",)
    assert gs[2].layer_names == ("model.layers.3.linear_attn",)


def test_gemma3_like_six_groups():
    window = 512
    swa = SlidingWindowSpec(block_size=128, sliding_window=window, **ATTN)
    groups = [([f"l{g}.{i}" for i in range(2)], swa) for g in range(5)]
    groups.append((["full.0", "full.1"], FullAttentionSpec(block_size=128, **ATTN)))
    gs = scheduler_groups(kv_config(*groups))
    assert len(gs) == 6
    assert [g.kind for g in gs] == [GroupKind.SLIDING] * 5 + [GroupKind.FULL]
    assert {g.block_size for g in gs} == {128}
    assert [g.sliding_window for g in gs] == [window] * 5 + [None]
    assert gs[3].layer_names == ("l3.0", "l3.1")


def test_full_spec_with_sliding_window_keeps_every_block():
    # HMA off: vLLM records the window on a FullAttentionSpec but allocates
    # blocks for every token, so the group is FULL.
    spec = FullAttentionSpec(block_size=16, sliding_window=64, **ATTN)
    gs = scheduler_groups(kv_config((["a"], spec)))
    assert gs[0].kind is GroupKind.FULL and gs[0].sliding_window is None


def test_chunked_local_attention_is_sliding_with_chunk_window():
    spec = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=8192, **ATTN)
    gs = scheduler_groups(kv_config((["a"], spec)))
    assert gs[0].kind is GroupKind.SLIDING and gs[0].sliding_window == 8192


def test_upstream_compress_ratio_counts_tokens():
    """vLLM 0.23/0.26's own MLA specs carry ``compress_ratio`` with block_size
    in tokens (storage_block_size = block_size // compress_ratio)."""
    cfg = kv_config(
        (["swa"], SlidingWindowMLASpec(block_size=64, sliding_window=128, **MLA)),
        (["c4"], AscendCompressedMLASpec(block_size=256, compress_ratio=4, **MLA)),
        (["c128"], AscendCompressedMLASpec(block_size=256, compress_ratio=128, **MLA)),
        (
            ["c128_swa"],
            AscendCompressedSWASpec(block_size=8, sliding_window=128, compress_ratio=128, **MLA),
        ),
    )
    gs = scheduler_groups(cfg)
    assert [g.compress_ratio for g in gs] == [1, 4, 128, 128]
    S, F = GroupKind.SLIDING, GroupKind.FULL
    assert [g.kind for g in gs] == [S, F, F, S]
    assert [g.block_size for g in gs] == [64, 256, 256, 8]  # not converted: these count tokens
    assert gs[1].physical_rows(256) == 64 and gs[2].physical_rows(256) == 2
    assert gs[3].physical_rows(256) == 1  # SW 128 // CR 128


@only_vllm_032
def test_vllm_native_tokens_per_state_is_the_compress_ratio():
    """vLLM 0.32's own DSv4 specs (models/deepseek_v4/attention.py) carry the
    compression as ``AttentionSpec.tokens_per_state`` (block_size stays in
    tokens, ``num_states = block_size // tokens_per_state``)."""
    cfg = kv_config(
        (["c4"], MLAAttentionSpec(block_size=256, tokens_per_state=4, **MLA)),
        (["c128"], MLAAttentionSpec(block_size=256, tokens_per_state=128, **MLA)),
    )
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    assert [s.num_states for s in specs] == [64, 2]
    gs = scheduler_groups(cfg)
    assert [g.compress_ratio for g in gs] == [4, 128]
    assert [g.rows_per_block for g in gs] == [s.num_states for s in specs]


@only_vllm_032
def test_circular_buffer_ring_is_not_a_full_group():
    """CircularBufferSpec (vLLM 0.32: DSv4.1 / GLM5-next compressor ring) is
    one block per request that is rewritten in place and not prefix
    cacheable: it cannot be addressed by token position like FULL KV."""
    spec = kv_interface.CircularBufferSpec(block_size=8, **MLA)
    assert spec.prefix_cacheable is False
    gs = scheduler_groups(kv_config((["ring"], spec)))
    assert gs[0].kind is GroupKind.STATE


# ---- vLLM-Ascend's DeepSeek-V4 and DSA groups (tests/fixtures/ascend_*) ------------


def _dsv4_configs(release="0.23.0", a5=False, block_size=128):
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    mod = A.specs_module(release, a5)
    groups = A.group_dsv4(mod, AL.dsv4_specs(mod, block_size))
    worker = AL.kv_config(groups, 64)
    return mod, worker, generate_scheduler_kv_cache_config([worker])


@pytest.mark.parametrize("release, a5, bs", [("0.23.0", False, 128), ("0.26.0rc1", False, 64), ("0.23.0", True, 128)])
def test_dsv4_groups_unwrapped_rows_counted_and_alike_on_both_halves(release, a5, bs):
    mod, worker, sched = _dsv4_configs(release, a5, bs)
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in worker.kv_cache_groups)
    assert not any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in sched.kv_cache_groups)
    with A.installed(mod):
        gw, gs = scheduler_groups(worker), scheduler_groups(sched)
    assert gw == gs  # the scheduler sees each group's first layer only
    cfg = AscendConfig()
    assert HalfAgreement.of(gw, 128, cfg) == HalfAgreement.of(gs, 128, cfg)
    (mla, swa, c4s, c128s), _ = (A.DSV4_BLOCK_SIZES_A5 if a5 else A.DSV4_BLOCK_SIZES)[bs]
    c4, c128 = gw[0], gw[1]
    # CompressAttentionManager blocks hold block_size ROWS of ratio tokens each.
    assert (c4.kind, c4.compress_ratio, c4.block_size, c4.rows_per_block) == (GroupKind.FULL, 4, mla * 4, mla)
    assert (c128.compress_ratio, c128.block_size, c128.rows_per_block) == (128, mla * 128, mla)
    assert all(n.endswith((".attn", ".indexer.k_cache")) for n in c4.layer_names)
    rest = gw[2:]
    assert all(g.kind is GroupKind.SLIDING and g.compress_ratio == 1 for g in rest)
    swa_groups = [g for g in rest if g.layer_names[0].endswith(".swa_cache")]
    assert {(g.block_size, g.sliding_window, g.compressor) for g in swa_groups} == {(swa, AL.WINDOW, None)}
    states = {g.block_size: g for g in rest if g.layer_names[0].endswith(".state_cache")}
    assert states[c4s].sliding_window == 8 and states[c4s].compressor == CompressorState(4, overlap=True)
    assert states[c128s].sliding_window == 128 and states[c128s].compressor == CompressorState(128, overlap=False)
    assert states[c4s].kept_window == 4 and states[c128s].kept_window == 0
    assert sum(len(g.layer_names) for g in gw) == len(AL.dsv4_specs(mod, bs))
    assert finest_chunk_size(gw) == 128  # rows of 4 and 128 tokens, 128-token SWA blocks


def test_without_vllm_ascend_loaded_block_size_is_tokens_and_the_plan_refuses():
    """Were the spec module not vLLM-Ascend's, block_size would count tokens
    and the C4 tensors' 128 rows per block would not match: startup stops."""
    from lmcache_ascend.planning.planner import build_plan

    mod, worker, _ = _dsv4_configs()
    gs = scheduler_groups(worker)  # mirror module not installed
    assert gs[0].block_size == 128 and gs[0].rows_per_block == 32
    layout = AL.dsv4("0.23.0")
    with pytest.raises(ValueError, match="rows per block"):
        build_plan(layout.build(False).kv_caches, gs, 128)


def test_vllm_ascend_0271_and_later_specs_count_tokens_not_rows():
    """vLLM-Ascend 0.27.1rc1 changed AscendMLAAttentionSpec's block_size to
    tokens (sdist core/kv_cache_interface.py ``get_storage_block_size``,
    0.27.1rc1 l.22-30, 0.30.0rc2 l.31-44; fixtures: ascend_specs, rows with
    ``token_blocks``). The
    module-level helper tells which unit the release uses; the page each
    spec sizes tells how many rows a block holds. Where the two disagree (a
    4x mis-read: 512 and 16384 are multiples of 128, so no rows check in
    the planner would catch it) the group is refused at startup, naming
    the layer."""
    mod, worker, _ = _dsv4_configs()
    with A.installed(mod):
        rows = scheduler_groups(worker)
    # 0.23 specs (rows) under a module that says tokens: refused.
    tok = types.ModuleType(mod.__name__)
    tok.__dict__.update(mod.__dict__)  # a copy: specs_module is cached
    tok.get_storage_block_size = lambda spec: spec.block_size // getattr(spec, "compress_ratio", 1)
    with A.installed(tok), pytest.raises(ValueError, match=r"layer .model.layers.1.self_attn.*page holds 128 rows.*needs 32"):
        scheduler_groups(worker)
    # 0.30.0rc2 specs (tokens): the same scheduler groups as 0.23's.
    if not R.HAS_TOKENS_PER_STATE:
        return
    mod30 = A.specs_module("0.30.0rc2")
    cfg30 = AL.kv_config(A.group_dsv4(mod30, AL.dsv4_specs(mod30)), 64)
    with A.installed(mod30):
        tokens = scheduler_groups(cfg30)
    assert [(g.block_size, g.compress_ratio, g.sliding_window) for g in tokens] == [
        (g.block_size, g.compress_ratio, g.sliding_window) for g in rows
    ]
    assert tokens[0].block_size == cfg30.kv_cache_groups[0].kv_cache_spec.block_size == 512
    # ...and under a module without the helper (read as rows): refused.
    old = types.ModuleType(mod30.__name__)
    old.__dict__.update({k: v for k, v in mod30.__dict__.items() if k != "get_storage_block_size"})
    with A.installed(old), pytest.raises(ValueError, match=r"page holds 128 rows, but block_size 512 read as 2048"):
        scheduler_groups(cfg30)


def _vllm_layout_enum():
    return pytest.importorskip("vllm.v1.kv_cache_layout", reason="vLLM >= 0.29 names layouts LBNHC / LBHNC")


def test_layout_names_of_every_vllm_series_map_to_the_per_layer_block_order():
    """Old names pass through; vLLM >= 0.29's names map by the per-layer
    physical order vLLM itself derives (KVCacheLayout.layer_view_order of
    the logical [B, H, N, C]): (B, N, H, C) is NHD, (B, H, N, C) HND, and
    layer- or block-interleaved layouts are left unnamed (refused later)."""
    assert [vllm_kv_layout.token_row_layout(n) for n in ("NHD", "HND", None, "")] == ["NHD", "HND", None, None]
    layouts = _vllm_layout_enum().KVCacheLayout
    by_order = {(0, 2, 1, 3): "NHD", (0, 1, 2, 3): "HND"}
    for member in layouts:
        expected = by_order.get(member.layer_view_order) if member.is_layer_compact else None
        assert vllm_kv_layout.token_row_layout(member.name) == expected, member


def test_layout_facts_read_the_resolved_layout_from_vllms_config():
    _vllm_layout_enum()
    cfg = kv_config((["a"], FullAttentionSpec(block_size=16, **ATTN)))
    for name, expected in (("LBNHC", "NHD"), ("LBHNC", "HND"), ("BLNHC", None)):
        cfg.kv_cache_layout = name
        assert layout_facts(cfg).kv_layout == expected


def test_compressor_state_without_its_layer_keeps_the_whole_window():
    mod, worker, _ = _dsv4_configs()
    state = next(g for g in worker.kv_cache_groups if g.layer_names[0].endswith("compressor.state_cache"))
    with A.installed(mod):
        (g,) = scheduler_groups(kv_config((state.layer_names, state.kv_cache_spec)))
    assert g.compressor is None and g.kept_window == g.sliding_window  # exact, just larger


def test_dsa_026_one_group_indexer_first():
    mod = A.specs_module("0.26.0rc1")
    layout = AL.dsa("0.26.0rc1", li=True)
    (g,) = layout.groups
    assert (g.kind, g.block_size, g.compress_ratio) == (GroupKind.FULL, 128, 1)
    assert g.spec_name == "AscendSFAIndexerCacheSpec" and g.layer_names[0].endswith(".indexer.k_cache")
    assert mod.AscendSFAIndexerCacheSpec.__name__ == g.spec_name


def test_mixed_kinds_in_one_group_are_refused_naming_layers():
    mixed = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "a": FullAttentionSpec(block_size=16, **ATTN),
            "b": SlidingWindowSpec(block_size=16, sliding_window=32, **ATTN),
        },
    )
    with pytest.raises(ValueError) as err:
        scheduler_groups(kv_config((["a", "b"], mixed)))
    msg = str(err.value)
    assert "group 0" in msg and "'b'" in msg and "'a'" in msg and "sliding" in msg


def test_unknown_spec_makes_state_and_hits_refused():
    @dataclass(frozen=True)
    class FutureSpec(kv_interface.KVCacheSpec):
        pass

    cfg = kv_config((["x"], FutureSpec(block_size=16)), (["y"], FullAttentionSpec(block_size=16, **ATTN)))
    gs = scheduler_groups(cfg)
    assert gs[0].kind is GroupKind.STATE
    assert [g.index for g in unrestorable_groups(gs, AscendConfig())] == [0]


def test_dcp_replicated_indexer_is_refused():
    mod = A.specs_module("0.26.0rc1")
    spec = mod.AscendSFAIndexerCacheSpec(
        block_size=128, num_kv_heads=1, head_size=128, dtype=torch.int8, sfa_dcp_replicated_indexer_size=2
    )
    with A.installed(mod), pytest.raises(ValueError, match="sfa_dcp_replicated_indexer_size=2"):
        scheduler_groups(kv_config((["l.indexer.k_cache"], spec)))


def test_layout_facts_ratios_only_for_groups_that_mix_them(monkeypatch):
    # vLLM < 0.32 resolves the NHD/HND layout from the running engine's config.
    monkeypatch.setattr(vllm_kv_layout, "_kv_cache_layout", lambda cfg: "NHD")
    mod, worker, _ = _dsv4_configs()
    with A.installed(mod):
        assert layout_facts(worker).layer_compress_ratio == {}
    mixed = UniformTypeKVCacheSpecs(
        block_size=256,
        kv_cache_specs={
            "c4": AscendCompressedMLASpec(block_size=256, compress_ratio=4, **MLA),
            "c128": AscendCompressedMLASpec(block_size=256, compress_ratio=128, **MLA),
        },
    )
    assert layout_facts(kv_config((["c4", "c128"], mixed))).layer_compress_ratio == {"c4": 4, "c128": 128}


# ---- step_view ----------------------------------------------------------------


def make_request(req_id: str, n: int, num_computed: int = 0) -> Request:
    req = Request(req_id, list(range(1000, 1000 + n)), SamplingParams(max_tokens=8), None)
    req.num_computed_tokens = num_computed
    return req


def test_step_view_new_cached_resumed_preempted_finished():
    r_new = make_request("new", 300, num_computed=256)
    new_blocks = ([11, 12, 13], [0, 21, 22, 23])
    r_new2 = make_request("new2", 50)
    cached = CachedRequestData(
        req_ids=["run_none", "run_app", "resumed"],
        resumed_req_ids={"resumed"},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None, ([], [31]), ([41, 42], [51, 52, 53])],
        num_computed_tokens=[400, 511, 128],
        num_output_tokens=[3, 0, 0],
    )
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData.from_request(r_new, new_blocks),
            NewRequestData.from_request(r_new2, ([1], [2])),
        ],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"new": 44, "new2": 50, "run_none": 1, "run_app": 1, "resumed": 172},
        total_num_scheduled_tokens=268,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids={"gone1", "gone2"},
        free_encoder_mm_hashes=[],
        preempted_req_ids={"victim"},
        num_common_prefix_blocks=[],  # required before vLLM 0.32
    )
    view = step_view(out)
    by_id = {s.req_id: s for s in view.scheduled}
    assert [s.req_id for s in view.scheduled] == ["new", "new2", "run_none", "run_app", "resumed"]
    assert by_id["new"] == ScheduledRequest(
        "new", True, False, ([11, 12, 13], [0, 21, 22, 23]), 256, 44
    )
    assert by_id["new2"] == ScheduledRequest("new2", True, False, ([1], [2]), 0, 50)
    assert by_id["run_none"] == ScheduledRequest("run_none", False, False, None, 400, 1)
    assert by_id["run_app"] == ScheduledRequest("run_app", False, False, ([], [31]), 511, 1)
    assert by_id["resumed"] == ScheduledRequest(
        "resumed", False, True, ([41, 42], [51, 52, 53]), 128, 172
    )
    assert view.finished_req_ids == frozenset({"gone1", "gone2"})
    assert view.preempted_req_ids == frozenset({"victim"})
    # block lists are fresh copies: later changes to vLLM's lists do not leak
    new_blocks[0].append(99)
    cached.new_block_ids[1][1].append(98)
    assert by_id["new"].block_ids[0] == [11, 12, 13]
    assert by_id["run_app"].block_ids[1] == [31]


def test_step_view_empty_and_none_preempted():
    out = SchedulerOutput.make_empty()
    assert out.preempted_req_ids is None
    view = step_view(out)
    assert view.scheduled == () and view.finished_req_ids == frozenset()
    assert view.preempted_req_ids == frozenset()


def test_step_view_unscheduled_counts_default_to_zero():
    cached = CachedRequestData.make_empty()
    cached.req_ids.append("a")
    cached.new_block_ids.append(None)
    cached.num_computed_tokens.append(7)
    cached.num_output_tokens.append(1)
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = cached
    (s,) = step_view(out).scheduled
    assert s.num_scheduled_tokens == 0 and s.num_computed_tokens == 7 and s.block_ids is None
