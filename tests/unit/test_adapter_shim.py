"""The LMCache adapter shim against a real LMCache engine.

``adapter_route.install()`` (what the vLLM plugin and the connector module
call) patches LMCache's in-process vLLM adapter when that module is imported. Here the engine is LMCache's own ``LMCacheEngine`` with
its local CPU backend; the KV tensors have vLLM-CPU's shape (opaque block
pages); the slot mappings are the per-token ones LMCache's adapter passes.
Expected bytes come from the source pages themselves (numpy), not from the
code under test.
"""

from __future__ import annotations

import logging
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the adapter module and KV cache specs are vLLM's")

from lmcache_ascend.integration.vllm import adapter_route

adapter_route.install()  # as the vLLM plugin does, before LMCache loads the adapter
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from lmcache_ascend.lmcache_bridge.patching import adapter_shim as shim  # noqa: E402
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules, route_registry  # noqa: E402

# Where the installed LMCache keeps them (0.5.7rc2 moved them under lmcache.inprocess).
adapter_module = lmcache_modules.load(lmcache_modules.VLLM_ADAPTER)
gpu_connector = lmcache_modules.load(lmcache_modules.GPU_CONNECTOR_FACTORY)
LMCacheEngineBuilder = lmcache_modules.load(lmcache_modules.CACHE_ENGINE).LMCacheEngineBuilder

CHUNK, BS, LAYERS, HEADS, HEAD = 256, 128, 3, 2, 32
NUM_BLOCKS = 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)]
    )


def _metadata(layers: int = LAYERS) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(layers, 2, CHUNK, HEADS, HEAD),
        role="worker",
        chunk_size=CHUNK,
        engine_id=f"shim-{uuid.uuid4().hex}",
        kv_connector_extra_config={},
    )


def _config() -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        pre_caching_hash_algorithm="sha256_cbor",
        save_unfull_chunk=False,
    )


def _slots(blocks: list[int], n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(blocks, dtype=torch.int64)[pos // BS] * BS + pos % BS


@pytest.fixture
def engine_and_kv():
    gen = torch.Generator().manual_seed(7)
    kv = {n: torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=gen) for n in NAMES}
    config, metadata = _config(), _metadata()
    connector = gpu_connector.CreateGPUConnector(config, metadata, EngineType.VLLM)
    name = f"shim-test-{uuid.uuid4().hex}"
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector, lambda t, s: t, lambda o, s: o)
    engine.post_init()
    adapter_route.bind_engine(engine, kv, _kv_cache_config(), config)
    try:
        yield engine, kv
    finally:
        LMCacheEngineBuilder.destroy(name)


def _pages(kv, blocks) -> list[np.ndarray]:
    return [kv[n][blocks].numpy().copy() for n in NAMES]


SRC = [3, 5, 7, 9, 11]
DST = [2, 4, 6, 8, 10]
TOKENS = torch.arange(1000, 1000 + 600)


def test_import_patches_the_adapter_and_the_connector_factory():
    assert adapter_module.LMCacheConnectorV1Impl._lmcache_ascend_patched
    assert gpu_connector.CreateGPUConnector._lmcache_ascend
    assert shim.shim_active()  # this machine: torch_device_type 'cpu'
    # What LMCache (0.5.6, 0.5.7rc2) does here without the shim:
    with pytest.raises(RuntimeError, match="No supported cpu connector"):
        gpu_connector.CreateGPUConnector.__wrapped__(_config(), _metadata(), EngineType.VLLM)
    assert isinstance(
        gpu_connector.CreateGPUConnector(_config(), _metadata(), EngineType.VLLM), shim.AdapterChunkConnector
    )


class _Bound(Exception):
    """Stops the patched register_kv_caches before LMCache's own runs."""


def test_patched_adapter_hands_vllm_steps_to_the_registered_route(monkeypatch):
    # adapter_route.install() registered the vLLM integration's steps.
    assert route_registry.registered() is adapter_route.STEPS
    calls = []

    def bind(*args):
        calls.append(args)
        raise _Bound

    monkeypatch.setattr(
        route_registry, "_route", route_registry.AdapterRoute(prepare=None, install_shutdown=None, bind=bind)
    )
    impl = adapter_module.LMCacheConnectorV1Impl.__new__(adapter_module.LMCacheConnectorV1Impl)
    parent, engine, config, kv = object(), object(), object(), {"layer": object()}
    impl._parent, impl.config = parent, config
    impl._manager = SimpleNamespace(lmcache_engine=engine)  # LMCache's engine owner
    with pytest.raises(_Bound):
        impl.register_kv_caches(kv)
    assert calls == [(parent, engine, config, kv)]


def test_patched_adapter_without_registered_steps_stops_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(route_registry, "_route", None)
    impl = adapter_module.LMCacheConnectorV1Impl.__new__(adapter_module.LMCacheConnectorV1Impl)
    with pytest.raises(route_registry.RouteNotRegistered, match=r"adapter_route\.install\(\)"):
        impl.register_kv_caches({})


def test_store_then_retrieve_into_other_blocks_is_byte_exact(engine_and_kv):
    engine, kv = engine_and_kv
    caches = list(kv.values())
    engine.store(TOKENS, kvcaches=caches, slot_mapping=_slots(SRC, 600), req_id="a")
    for n in NAMES:
        kv[n][DST] = 0
    ret = engine.retrieve(TOKENS[:512], None, kvcaches=caches, slot_mapping=_slots(DST, 512), req_id="b")
    assert ret.tolist() == [True] * 512
    for src, dst in zip(_pages(kv, SRC[:4]), _pages(kv, DST[:4])):
        np.testing.assert_array_equal(dst, src)
    # Whole chunks only: the fifth block (tokens 512..599) was never stored,
    # and the destination's fifth block was not touched.
    for n in NAMES:
        assert not kv[n][DST[4]].any()
    # Chunk keys carry the layout fingerprint, apart from LMCache's own layouts.
    assert engine.metadata.model_name.startswith("tiny+")


def test_failed_chunk_load_is_not_reported_as_loaded(engine_and_kv, caplog):
    engine, kv = engine_and_kv
    caches = list(kv.values())
    engine.store(TOKENS, kvcaches=caches, slot_mapping=_slots(SRC, 600), req_id="a")
    connector = engine.gpu_connector
    load = connector._load

    def failing_second_chunk(buf, req):
        if req.start == CHUNK:
            raise RuntimeError("injected copy failure")
        return load(buf, req)

    connector._load = failing_second_chunk
    for n in NAMES:
        kv[n][DST] = 0
    with caplog.at_level(logging.WARNING):
        ret = engine.retrieve(TOKENS[:512], None, kvcaches=caches, slot_mapping=_slots(DST, 512), req_id="b")
    # The adapter reports blocks of False positions to vLLM for recomputation.
    assert ret.tolist() == [True] * CHUNK + [False] * CHUNK
    for src, dst in zip(_pages(kv, SRC[:2]), _pages(kv, DST[:2])):
        np.testing.assert_array_equal(dst, src)
    assert all(not kv[n][DST[2:4]].any() for n in NAMES)
    assert any("tokens from 256 not loaded" in r.getMessage() for r in caplog.records)


def test_failed_store_does_not_raise_into_vllm(engine_and_kv, caplog):
    engine, kv = engine_and_kv

    def failing(buf, req):
        raise RuntimeError("injected store failure")

    engine.gpu_connector._store = failing
    with caplog.at_level(logging.ERROR):
        assert engine.store(TOKENS, kvcaches=list(kv.values()), slot_mapping=_slots(SRC, 600), req_id="a") is None
    assert any("storing request a failed" in r.getMessage() for r in caplog.records)
    # Nothing half-written became visible.
    assert engine.lookup(TOKENS[:512]) == 0


def test_misaligned_slot_mapping_is_refused(engine_and_kv):
    engine, kv = engine_and_kv
    bad = _slots(SRC, 600) + 1  # every block starts at offset 1
    with pytest.raises(ValueError, match="not block aligned for block size 128"):
        engine.gpu_connector._ctx({"slot_mapping": bad})


def test_chunk_larger_than_lmcache_buffer_is_refused():
    # LMCache sized its buffers for 2 layers; vLLM hands over 3.
    connector = gpu_connector.CreateGPUConnector(_config(), _metadata(layers=2), EngineType.VLLM)
    per_layer = 2 * CHUNK * HEADS * HEAD * 4  # K and V rows of a chunk, fp32
    with pytest.raises(
        ValueError, match=f"needs {3 * per_layer} bytes but LMCache's adapter allocates {2 * per_layer}"
    ):
        connector.bind(3 * per_layer, None, None, BS)


def _fresh(code: str, **env: str):
    import os

    import fresh_python

    out = fresh_python.run(code, capture_output=True, text=True,
                           env=dict(os.environ, **env), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_is_light_and_install_registers_keys_when_lmcache_config_loads():
    """In a fresh interpreter: ``import lmcache_ascend`` imports neither
    LMCache nor vLLM and installs nothing; ``adapter_route.install()`` (what
    the entry points call) imports neither either, and an LMCache config
    loaded afterwards knows our keys (from the environment too)."""
    code = (
        "import sys, logging\n"
        "before = list(sys.meta_path)\n"
        "import lmcache_ascend\n"
        "assert sys.meta_path == before  # no hook\n"
        "assert 'lmcache' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "assert not logging.getLogger('lmcache_ascend').handlers  # no handler of its own\n"
        "from lmcache_ascend.integration.vllm import adapter_route\n"
        "adapter_route.install()\n"
        "assert len(sys.meta_path) == len(before) + 1  # the hook\n"
        "assert 'lmcache' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "from lmcache.v1.config import LMCacheEngineConfig\n"
        "cfg = LMCacheEngineConfig.from_env()\n"
        "print('VALUE', cfg.ascend_bundle_multi_spec)\n"
    )
    out = _fresh(code, LMCACHE_ASCEND_BUNDLE_MULTI_SPEC="off")
    assert "VALUE False" in out


_INSTALLED = (
    "from lmcache_ascend.lmcache_bridge.patching import hook, patches, route_registry\n"
    "from lmcache_ascend.integration.vllm import adapter_route\n"
    "assert hook._installed and route_registry.registered() is adapter_route.STEPS\n"
    "import importlib\n"
    "from lmcache_ascend.lmcache_bridge.patching import lmcache_modules\n"
    "importlib.import_module(lmcache_modules.resolve(lmcache_modules.VLLM_ADAPTER))\n"
    "print('APPLIED', sorted(patches.applied()))\n"
)
_ALL = "APPLIED ['config_keys', 'pq_executor_shield', 'vllm_adapter_shim']"


def test_vllm_plugin_loading_installs_the_patches_for_routes_that_only_import_the_package():
    """vLLM's own LMCacheConnectorV1 and vLLM-Ascend's LMCacheAscendConnector
    only ``import lmcache_ascend``: in every vLLM process the package's
    ``vllm.general_plugins`` entry point has installed the patches by then."""
    from importlib.metadata import entry_points

    if not any(ep.value == "lmcache_ascend.integration.vllm.plugin:register"
               for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("lmcache_ascend is not installed with its entry points here")
    code = (
        "import sys, lmcache_ascend\n"
        "assert 'lmcache_ascend.lmcache_bridge.patching.hook' not in sys.modules\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()  # what vLLM does in each process before building a connector\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "assert 'LMCacheAscendConnectorV1Dynamic' in KVConnectorFactory._registry\n"
    ) + _INSTALLED
    assert _ALL in _fresh(code)


def test_importing_the_dynamic_connector_installs_the_patches():
    """Named by ``kv_connector_module_path`` alone (no plugin), the dynamic
    connector's module installs them at import."""
    code = (
        "import lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1\n"
    ) + _INSTALLED
    assert _ALL in _fresh(code, VLLM_PLUGINS="")
