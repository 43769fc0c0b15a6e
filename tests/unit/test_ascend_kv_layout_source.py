"""Which K/V axis order the connector reads on vLLM-Ascend (issue 38, item 2).

vLLM-Ascend's attention backend shapes GQA K/V itself: in 0.30.0rc2
(``vllm_ascend/attention/attention_v1.py``, AscendAttentionBackend.
get_kv_cache_shape, l.108-118) they are per head (HND) only when the
VLLM_KV_CACHE_LAYOUT environment variable is "LBHNC" or "HND"; the layout
vLLM resolved and writes into the KV cache config is not consulted. vLLM 0.30
resolves LBHNC from a connector's preference when that variable is unset
(v1/attention/backends/utils.py resolve_kv_cache_layout l.308-316), so the
config can name LBHNC over token-major tensors.

Each case below builds the tensors as the source does for its environment
(fixtures/ascend_hybrid.py), lets the connector decide through
``layout_facts`` with a stand-in of that backend loaded, and checks the full
store/load path against the oracle, which reads each layer's raw bytes by
reshape and never looks at the connector's decision.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")

from vllm.v1.kv_cache_interface import KVCacheTensor  # noqa: E402

if "layers" not in inspect.signature(KVCacheTensor).parameters:
    pytest.skip("this vLLM's KVCacheTensor has no shared-backing descriptors (vLLM-Ascend 0.30.0rc2 "
                "runs on vLLM 0.30); the layout does not exist there", allow_module_level=True)

from fixtures import ascend_hybrid as H  # noqa: E402
from fixtures import layouts as L  # noqa: E402
from fixtures import oracle  # noqa: E402
from lmcache_ascend.integration.vllm import vllm_kv_layout  # noqa: E402
from lmcache_ascend.planning.groups import ChunkRequest  # noqa: E402
from lmcache_ascend.planning.planner import build_plan  # noqa: E402
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer  # noqa: E402
from fixtures.lmcache_objs import memory_obj as _obj  # noqa: E402
from fixtures.lmcache_objs import store_chunks  # noqa: E402

ENV = "VLLM_KV_CACHE_LAYOUT"
PACKAGE, MODULE, BACKEND = "vllm_ascend", "vllm_ascend.attention.attention_v1", "AscendAttentionBackend"


def _backend_030(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=""):
    """Transcribed from 0.30.0rc2 attention_v1.py l.108-118 (0.28.0rc1
    l.109-119 and 0.29.0rc1 the same test at l.109): the variable decides."""
    import vllm.envs as envs_vllm

    if envs_vllm.VLLM_KV_CACHE_LAYOUT in ("LBHNC", "HND"):
        return (2, num_blocks, num_kv_heads, block_size, head_size)
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def _backend_027(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=""):
    """0.27.1rc1 attention_v1.py l.110-117 (0.26.0rc1 l.100-107): always NHD."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def _install(monkeypatch, shape_fn) -> None:
    """Stand-ins for the modules vLLM-Ascend's worker has loaded by the time
    KV caches are registered (model_runner_v1.py imports attention_v1)."""
    module = types.ModuleType(MODULE)
    setattr(module, BACKEND, type(BACKEND, (), {"get_kv_cache_shape": staticmethod(shape_fn)}))
    monkeypatch.setitem(sys.modules, PACKAGE, types.ModuleType(PACKAGE))
    monkeypatch.setitem(sys.modules, MODULE, module)


def _roundtrip(layout, ops, allocator) -> None:
    """Store every chunk, load all of them into fresh caches: chunk bytes,
    whole allocations and every row a resumed forward reads match the oracle."""
    orig = layout.build(True)
    plan = build_plan(orig.kv_caches, layout.groups, layout.chunk_size, layout.config, layout.hints)
    assert plan.stored_groups == layout.stored_groups
    tables = L.block_tables(layout)
    objs = []
    try:
        objs = store_chunks(layout, ops, allocator, plan, orig, tables)
        fresh, expect = layout.build(False), layout.build(False)
        load = ChunkTransfer(build_plan(fresh.kv_caches, layout.groups, layout.chunk_size, layout.config,
                                        layout.hints), ops)
        for req, obj in objs:
            load.load(obj.tensor, req)
            oracle.apply_expected_load(orig, expect, layout, plan.stored_groups, tables, req.start, req.end)
        assert oracle.backing_equal(fresh, expect), oracle.first_difference(fresh, expect)
        got = {(e.layer, e.element): e for e in fresh.elements}
        for e in orig.elements:
            for pos in oracle.rows_read_at(e, tables[e.group], layout.num_tokens):
                assert np.array_equal(oracle.element_bytes(got[(e.layer, e.element)], pos), oracle.element_bytes(e, pos))
    finally:
        for _, obj in objs:
            obj.ref_count_down()


def _layouts(connector_preference: bool):
    return (H.qwen3_next("LBHNC", connector_preference=connector_preference),
            H.gqa("LBHNC", block_size=256, connector_preference=connector_preference))


def _k_view_shape(layout) -> tuple[int, ...]:
    built = layout.build(False)
    name = next(n for n in built.kv_caches if n.endswith("self_attn.attn"))
    return tuple(built.kv_caches[name][0].shape)


@pytest.mark.parametrize("which", [0, 1], ids=["qwen3-next", "gqa"])
def test_lbhnc_from_the_environment_variable_is_read_per_head(which, monkeypatch, ops, allocator):
    monkeypatch.setenv(ENV, "LBHNC")
    _install(monkeypatch, _backend_030)
    layout = _layouts(connector_preference=False)[which]  # hints: layout_facts under the stand-in
    assert layout.hints.kv_layout == "HND"
    # The fixture's tensors are the backend's shape: (kernel blocks, heads, 128, head).
    assert _k_view_shape(layout)[1:] == (H.HEADS, H.KERNEL_BLOCK, H.HEAD)
    _roundtrip(layout, ops, allocator)


@pytest.mark.parametrize("which", [0, 1], ids=["qwen3-next", "gqa"])
def test_lbhnc_from_a_connector_preference_is_read_token_major(which, monkeypatch, ops, allocator):
    monkeypatch.delenv(ENV, raising=False)
    _install(monkeypatch, _backend_030)
    layout = _layouts(connector_preference=True)[which]
    cfg_name = "LBHNC"
    assert vllm_kv_layout.token_row_layout(cfg_name) == "HND"  # what the config's name alone says
    assert layout.hints.kv_layout == "NHD"
    assert _k_view_shape(layout)[1:] == (H.KERNEL_BLOCK, H.HEADS, H.HEAD)
    _roundtrip(layout, ops, allocator)


def test_the_config_name_alone_would_misread_a_connector_preference(monkeypatch, allocator):
    """Guard: the planner accepts the config's name (HND) over the NHD
    tensors of a connector-preferred LBHNC, so only the connector's reading
    of the backend stands between it and a misread: the store then addresses
    rows past the tensors (reference ops check bounds; the native ones are
    not run on it) or stores other bytes than the oracle's."""
    from lmcache_ascend.transfer import reference_ops

    monkeypatch.delenv(ENV, raising=False)
    _install(monkeypatch, _backend_030)
    right = H.qwen3_next("LBHNC", connector_preference=True)
    wrong = dataclasses.replace(right, hints=dataclasses.replace(right.hints, kv_layout="HND"))
    orig = right.build(True)
    plan = build_plan(orig.kv_caches, wrong.groups, wrong.chunk_size, wrong.config, wrong.hints)
    good = build_plan(orig.kv_caches, right.groups, right.chunk_size, right.config, right.hints)
    tables = L.block_tables(right)
    want = oracle.expected_chunk(orig, right, good, tables, 0, right.chunk_size)
    obj = _obj(allocator, plan.chunk_bytes)
    try:
        try:
            ChunkTransfer(plan, reference_ops).store(obj.tensor, ChunkRequest(0, right.chunk_size, tables))
        except IndexError:
            return
        assert plan.chunk_bytes != good.chunk_bytes or not np.array_equal(obj.tensor[: plan.chunk_bytes].numpy(), want)
    finally:
        obj.ref_count_down()


def test_releases_without_the_variable_are_token_major_whatever_it_says(monkeypatch):
    """0.26.0rc1 / 0.27.1rc1 never read the variable: NHD even under HND."""
    monkeypatch.setenv(ENV, "HND")
    _install(monkeypatch, _backend_027)
    cfg, _ = H.qwen3_next_config("LBHNC")
    assert vllm_kv_layout.layout_facts(cfg).kv_layout == "NHD"


def test_without_vllm_ascend_the_resolved_layout_decides(monkeypatch):
    monkeypatch.delitem(sys.modules, PACKAGE, raising=False)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    for name, want in (("LBHNC", "HND"), ("LBNHC", "NHD"), ("BLHNC", None)):
        cfg, _ = H.qwen3_next_config(name)
        assert vllm_kv_layout.layout_facts(cfg).kv_layout == want


def test_an_unknown_backend_shape_stops_startup(monkeypatch):
    _install(monkeypatch, lambda n, b, h, d, c="": (n, b, h * d))
    cfg, _ = H.qwen3_next_config("LBNHC")
    with pytest.raises(ValueError, match="neither NHD nor HND"):
        vllm_kv_layout.layout_facts(cfg)
