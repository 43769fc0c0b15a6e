"""Every layout vLLM-Ascend 0.27.1rc1-0.30.0rc2 added that the connector
cannot serve exactly (``ascend_releases.RELEASES``; the served ones are
checked in test_ascend_fixtures) is either refused at startup naming the
layer, or kept out of the store and of hits (per-request rings).

Facts transcribed for the checks (sdist vllm_ascend 0.30.0rc2):
* turboquant/__init__.py l.4-7: "turboquant_4bit_nc", SLOT_BYTES 258;
* attention/attention_c8_mxfp.py mxfp_paged_cache_views l.194-233: K and V
  views (kernel_blocks, heads, head_dim // 32, block_size, 32) fp8;
* worker/kvpp_cache.py allocate_kvpp_cache l.30-56: layers a rank does not
  own get ``scratch[target_index % 2]``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

from fixtures import ascend_layouts as AL
from fixtures import ascend_releases as R
from fixtures import ascend_specs as S
from lmcache_ascend.integration.vllm.vllm_specs import scheduler_groups
from lmcache_ascend.planning.groups import GroupKind
from lmcache_ascend.planning.kv_format import LayoutError
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.state_skip import unrestorable_groups

needs_029 = pytest.mark.skipif(not R.HAS_TOKENS_PER_STATE, reason="vLLM-Ascend 0.29.0rc1+ runs on vLLM >= 0.29")


@needs_029
def test_turboquant_deepseek_v4_is_refused_naming_the_layer():
    mod, cfg = AL.dsv4_turboquant_config()
    with S.installed(mod), pytest.raises(ValueError, match=r"layer 'model\.layers\.\d+\.self_attn\..*turboquant_4bit_nc"):
        scheduler_groups(cfg)


@needs_029
@pytest.mark.parametrize("flag, cls", [
    ("cache_sparse_sfa_turboquant", "AscendMLAAttentionSpec"),
    ("cache_sparse_li_c4", "AscendSFAIndexerCacheSpec"),
])
def test_turboquant_sfa_and_li_c4_are_refused_naming_the_layer(flag, cls):
    mod = S.specs_module("0.30.0rc2")
    name = "model.layers.0.self_attn." + ("attn" if cls == "AscendMLAAttentionSpec" else "indexer.k_cache")
    spec = getattr(mod, cls)(block_size=128, num_kv_heads=1, head_size=656, dtype=torch.int8, **{flag: True})
    with S.installed(mod), pytest.raises(ValueError, match=rf"layer '{name}' \({cls}\): {flag}=True.*valid: {flag}=False"):
        scheduler_groups(AL.single_group_config(mod, {name: spec}))


@pytest.mark.parametrize("row", R.params([r for r in R.RELEASES if r.kpool_tail]))
def test_rings_are_state_never_stored_and_block_hits(row):
    """GLM-5-Next's indexer K-pool tail (0.28.0rc1 on) and DeepSeek-V4.1's
    compressor ring (AscendCircularBufferSpec, 0.30.0rc2) are per-request
    rings (prefix_cacheable False, is_circular): never stored, and hits are
    refused while they exist."""
    mod = S.specs_module(row)
    # glm5next/kv_cache.py: the K pool (0.28.0rc1 l.89-105, compress_ratio on
    # vLLM 0.28.0; 0.30.0rc2 l.105-116, tokens_per_state) and its tail ring of
    # compress_ratio rows (0.28.0rc1 l.150-158; 0.30.0rc2 l.162-170).
    kpool = mod.AscendMLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16, **S.ratio_kwargs(mod, 4),
        model_version="glm5_next", indexes_kv_by_block_stride=True,
    )
    tail = mod.AscendIndexerKPoolTailSpec(
        block_size=4, num_kv_heads=1, head_size=128, dtype=torch.float32, sliding_window=4, compress_ratio=4,
    )
    groups = [AL.KVCacheGroupSpec(["l0.kpool"], kpool), AL.KVCacheGroupSpec(["l0.tail"], tail)]
    kv = {
        "l0.kpool": torch.zeros(16, 32, 1, 128, dtype=torch.bfloat16),
        "l0.tail": torch.zeros(16, 2, 4, 128, dtype=torch.float32),
    }
    assert hasattr(mod, "AscendCircularBufferSpec") == row.circular_buffer
    if row.circular_buffer:
        ring = mod.AscendCircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
        groups.append(AL.KVCacheGroupSpec(["l1.ring"], ring))
        kv["l1.ring"] = torch.zeros(16, 8, 1, 512, dtype=torch.bfloat16)
    rings = frozenset(range(1, len(groups)))
    with S.installed(mod):
        gs = scheduler_groups(AL.kv_config(groups, 16))
    assert [g.kind for g in gs] == [GroupKind.FULL] + [GroupKind.STATE] * len(rings)
    assert gs[0].block_size == 128 and gs[0].rows_per_block == 32
    assert [g.index for g in unrestorable_groups(gs, AscendConfig())] == sorted(rings)
    plan = build_plan(kv, gs, 128)
    assert plan.stored_groups == frozenset({0}) and plan.unrestorable_groups == rings
    # The scheduler half, given those groups as hit blockers (wiring.hit_blockers),
    # never reports a hit, even where LMCache holds every chunk.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
    from lmcache_ascend.integration.vllm.vllm_keys import request_view

    half = SchedulerHalf(gs, 128, lambda tokens, req_id: len(tokens) // 128 * 128,
                         hit_blockers=unrestorable_groups(gs, AscendConfig()))
    req = Request("r", list(range(1, 1001)), SamplingParams(max_tokens=1), None)
    assert half.get_num_new_matched_tokens(request_view(req), 0) == (0, False)


def test_kvpp_scratch_buffers_shared_by_layers_are_refused():
    """Layers a KVPP rank does not own share two scratch buffers: storing
    them would store another layer's bytes as this one's KV."""
    mod = S.specs_module("0.26.0rc1")
    spec = mod.AscendMLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    with S.installed(mod):
        gs = scheduler_groups(AL.kv_config([AL.KVCacheGroupSpec(names, spec)], 8))
    own = torch.zeros(8, 128, 1, 576, dtype=torch.bfloat16)
    scratch = [torch.zeros(8, 128, 1, 576, dtype=torch.bfloat16) for _ in range(2)]
    kv = {names[0]: own, names[1]: scratch[0], names[2]: own.clone(), names[3]: scratch[0]}
    with pytest.raises(LayoutError, match=r"layers 'model\.layers\.1\.self_attn\.attn'.*'model\.layers\.3\.self_attn\.attn'.*same memory"):
        build_plan(kv, gs, 128)
    kv[names[3]] = scratch[1]  # each layer its own buffer: planned
    assert build_plan(kv, gs, 128).stored_groups == frozenset({0})


def test_c8_mxfp_gqa_views_are_refused_naming_the_layer():
    """C8-MXFP GQA (0.30.0rc2): a plain FullAttentionSpec, so only the
    tensors tell; its PA_NZ views are 5-D and refused at startup."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    gs = scheduler_groups(AL.kv_config([AL.KVCacheGroupSpec(["m.attn"], spec)], 8))
    nb, heads, bs, k = 8, 2, 128, 128
    page = heads * bs * k * 2 + heads * bs * k // 32 * 2  # K, V fp8 + their E8M0 scales
    raw = torch.zeros(nb * page, dtype=torch.uint8)
    shape = (nb, heads, k // 32, bs, 32)
    inner = (k // 32 * bs * 32, bs * 32, 32, 1)
    kv_k = torch.as_strided(raw.view(torch.float8_e4m3fn), shape, (page, *inner), 0)
    kv_v = torch.as_strided(raw.view(torch.float8_e4m3fn), shape, (page, *inner), heads * bs * k * 17 // 16)
    with pytest.raises(LayoutError, match=r"layer 'm\.attn': element 0: 5-D tensor is not a known row layout"):
        build_plan({"m.attn": (kv_k, kv_v)}, gs, 128)


@needs_029
def test_explain_names_the_refused_layer():
    """``lmcache-ascend explain`` on a refused layout prints the engine's
    refusal (layer and reason) instead of "no plan"."""
    from lmcache_ascend.cli.explain import startup_refusal

    mod, cfg = AL.dsv4_turboquant_config()
    with S.installed(mod), pytest.raises(ValueError) as err:
        scheduler_groups(cfg)
    log = f"INFO starting\nERROR worker failed\nValueError: {err.value}\nINFO shutdown\n"
    assert startup_refusal(log) == str(err.value) and "turboquant_4bit_nc" in startup_refusal(log)
    assert startup_refusal("INFO nothing\n") == ""


def test_kvpp_is_refused_at_startup_from_the_engine_config():
    """Scratch buffers may be shared across groups too (DeepSeek-V4's SWA
    subgroups), where addresses alias legitimately: KVPP itself is refused
    from vLLM-Ascend's switch (ascend_config.py KVPPConfig.from_vllm_config:
    additional_config enable_kvpp, size TP x PCP)."""
    from types import SimpleNamespace

    from lmcache_ascend.integration.vllm.vllm_engine_config import engine_identity

    def cfg(enable: bool, tp: int):
        return SimpleNamespace(
            additional_config={"enable_kvpp": enable},
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, rank=0, world_size=tp),
            kv_transfer_config=SimpleNamespace(engine_id="e"),
            model_config=SimpleNamespace(model="m"),
        )

    with pytest.raises(ValueError, match=r"enable_kvpp=True \(KV layer parallelism over 2 ranks\).*valid: enable_kvpp false"):
        engine_identity(cfg(True, 2))
    assert engine_identity(cfg(True, 1)) == ("m", "e", 0, 1)  # size 1: KVPPConfig() (off)
    assert engine_identity(cfg(False, 2)) == ("m", "e", 0, 2)
