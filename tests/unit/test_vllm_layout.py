"""vllm_layout: vLLM's own KVCacheConfig / SchedulerOutput / Request objects
read into our typed records. Everything here is a real vLLM object."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm", reason="vllm_layout reads vLLM's own types")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
import vllm.v1.kv_cache_interface as kv_interface
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm.vllm_layout import (
    ScheduledRequest,
    request_view,
    scheduler_groups,
    step_view,
)
from lmcache_ascend.compat import vllm_features
from lmcache_ascend.planning.groups import GroupKind

# tokens_per_state and CircularBufferSpec exist from vLLM 0.32 on; the older
# series express compression as the MLA specs' compress_ratio (tested above).
only_vllm_032 = pytest.mark.skipif(
    not vllm_features().spec_reuse_attributes,
    reason="vLLM 0.32 spec attributes (tokens_per_state, CircularBufferSpec)",
)

ATTN = dict(num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
MLA = dict(num_kv_heads=1, head_size=512, dtype=torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class AscendCompressedMLASpec(MLAAttentionSpec):
    """Stand-in for vLLM-Ascend's DSv4 specs, which carry ``compress_ratio``."""

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


def test_ascend_compress_ratio_subclass():
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
    assert gs[1].spec_name == "AscendCompressedMLASpec"
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


# ---- request_view ---------------------------------------------------------------


def test_request_view_is_live_over_generated_tokens():
    req = make_request("r", 10)
    view = request_view(req)
    assert view.req_id == "r" and view.num_tokens == 10 and view.num_prompt_tokens == 10
    assert list(view.token_ids) == list(range(1000, 1010))
    req.append_output_token_ids([5, 6])
    assert list(view.token_ids[-3:]) == [1009, 5, 6]
    assert request_view(req).num_tokens == 12 and request_view(req).num_prompt_tokens == 10


@pytest.mark.parametrize("n", [1, 257])
def test_request_view_counts(n):
    v = request_view(make_request("x", n))
    assert v.num_tokens == n == len(v.token_ids)
