"""LMCache's module paths per release, and every patch applied on the
installed one.

The expected paths are written out here from each release's wheel (0.5.7rc2
moved the in-process engine under ``lmcache.inprocess``), not derived from
``lmcache_modules``; each check runs in a fresh interpreter so the import
hook sees LMCache load. CI runs this file on every stack; run it with
LMCache 0.5.7rc2 installed to check that release.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import subprocess
from pathlib import Path

import fresh_python
import pytest

from lmcache_ascend.compat import installed_lmcache_version
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules, patches

# Read in the wheels: lmcache-0.5.6 and lmcache-0.5.7rc2 (cp311, manylinux).
PATHS = {
    "0.5.6": {
        lmcache_modules.VLLM_ADAPTER: "lmcache.integration.vllm.vllm_v1_adapter",
        lmcache_modules.CACHE_ENGINE: "lmcache.v1.cache_engine",
        lmcache_modules.TOKEN_DATABASE: "lmcache.v1.token_database",
        lmcache_modules.LOOKUP_CLIENT_FACTORY: "lmcache.v1.lookup_client.factory",
        lmcache_modules.GPU_CONNECTOR_FACTORY: "lmcache.v1.gpu_connector",
        lmcache_modules.GPU_CONNECTORS: "lmcache.v1.gpu_connector.gpu_connectors",
        lmcache_modules.PROTOCOL: "lmcache.v1.protocol",
    },
    "0.5.7rc2": {
        lmcache_modules.VLLM_ADAPTER: "lmcache.inprocess.integration.vllm.vllm_v1_adapter",
        lmcache_modules.CACHE_ENGINE: "lmcache.inprocess.v1.cache_engine",
        lmcache_modules.TOKEN_DATABASE: "lmcache.inprocess.v1.token_database",
        lmcache_modules.LOOKUP_CLIENT_FACTORY: "lmcache.inprocess.v1.lookup_client.factory",
        lmcache_modules.GPU_CONNECTOR_FACTORY: "lmcache.inprocess.v1.gpu_connector",
        lmcache_modules.GPU_CONNECTORS: "lmcache.inprocess.v1.gpu_connector.gpu_connectors",
        lmcache_modules.PROTOCOL: "lmcache.inprocess.v1.protocol",
    },
}
# What each module is used for here (defined in it).
DEFINES = {
    lmcache_modules.VLLM_ADAPTER: "LMCacheConnectorV1Impl",
    lmcache_modules.CACHE_ENGINE: "LMCacheEngineBuilder",
    lmcache_modules.TOKEN_DATABASE: "ChunkedTokenDatabase",
    lmcache_modules.LOOKUP_CLIENT_FACTORY: "LookupClientFactory",
    lmcache_modules.GPU_CONNECTOR_FACTORY: "CreateGPUConnector",
    lmcache_modules.GPU_CONNECTORS: "GPUConnectorInterface",
    lmcache_modules.PROTOCOL: "RemoteMetadata",
}
# Patched modules that did not move.
UNMOVED = ("lmcache.v1.storage_backend.job_executor.pq_executor", "lmcache.v1.config",
           "lmcache.v1.storage_backend.native_clients.connector_client_base")
RELEASE = installed_lmcache_version()


def _fresh(code: str) -> subprocess.CompletedProcess:
    return fresh_python.run(code, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def _defines(name: str, what: str) -> bool:
    """Whether the installed files hold module ``name`` and it defines
    ``what`` (the path finder and the source text alone: no import, no
    import hook)."""
    parts, path, spec = name.split("."), None, None
    for i in range(1, len(parts) + 1):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i]), path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    source = Path(spec.origin).read_text()
    return re.search(rf"^(class|def) {what}\b", source, re.MULTILINE) is not None


def _last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_listed_release_has_every_module():
    assert {lay.release for lay in lmcache_modules.LAYOUTS} == set(PATHS)
    for lay in lmcache_modules.LAYOUTS:
        assert {name: lay.resolve(name) for name in PATHS[lay.release]} == PATHS[lay.release]
        for name in UNMOVED:
            assert lay.resolve(name) == name


def test_installed_release_paths_exist_and_moved_ones_are_gone():
    if RELEASE not in PATHS:
        pytest.skip(f"LMCache {RELEASE}: no paths read for it")
    assert lmcache_modules.release() == RELEASE
    for old, path in PATHS[RELEASE].items():
        assert lmcache_modules.resolve(old) == path
        assert _defines(path, DEFINES[old]), (path, DEFINES[old])
        assert _defines(old, DEFINES[old]) == (path == old), old


def test_unlisted_releases_take_the_nearest_older_layout():
    assert lmcache_modules.layout_for("0.5.6") == (lmcache_modules.LAYOUTS[0], True)
    assert lmcache_modules.layout_for("0.5.7rc2")[1]
    assert lmcache_modules.layout_for("0.5.8")[0].release == "0.5.7rc2"
    assert lmcache_modules.layout_for("0.5.7rc1")[0].release == "0.5.6"
    assert lmcache_modules.layout_for("0.4.0") == (lmcache_modules.LAYOUTS[0], False)
    assert lmcache_modules.layout_for("not-a-version") == (lmcache_modules.LAYOUTS[0], False)


def test_every_patch_applies_once_its_module_is_imported():
    """Importing each patched module (where the installed release has it)
    applies every patch, and each patch's change is in place."""
    if RELEASE not in PATHS:
        pytest.skip(f"LMCache {RELEASE}: no paths read for it")
    pytest.importorskip("vllm", reason="LMCache's vLLM adapter imports vLLM")
    targets = [PATHS[RELEASE].get(p.module, p.module) for p in patches.PATCHES]
    code = (
        "import importlib, json\n"
        "from lmcache_ascend.integration.vllm import adapter_route\n"
        "adapter_route.install()  # as the entry points do\n"
        "from lmcache_ascend.lmcache_bridge.patching import patches\n"
        f"targets = {targets!r}\n"
        "before = sorted(patches.applied())\n"
        "mods = [importlib.import_module(t) for t in targets]\n"
        f"factory = importlib.import_module({PATHS[RELEASE][lmcache_modules.GPU_CONNECTOR_FACTORY]!r})\n"
        "adapter = mods[2]\n"
        "print(json.dumps({'before': before, 'after': sorted(patches.applied()),\n"
        "    'shield': getattr(mods[0].AsyncPQExecutor, '_lmcache_ascend_shielded', False),\n"
        "    'keys': 'ascend_bundle_multi_spec' in mods[1]._CONFIG_DEFINITIONS,\n"
        "    'adapter': getattr(adapter.LMCacheConnectorV1Impl, '_lmcache_ascend_patched', False),\n"
        "    'factory': getattr(factory.CreateGPUConnector, '_lmcache_ascend', False),\n"
        "    'native': mods[3].ConnectorClientBase.batch_exists_sync.__module__ == patches.__name__}))\n"
    )
    assert [p.name for p in patches.PATCHES] == [
        "pq_executor_shield", "config_keys", "vllm_adapter_shim", "native_client_sync_on_loop"]
    got = _last_json(_fresh(code))
    assert got == {
        "before": [],
        "after": ["config_keys", "native_client_sync_on_loop", "pq_executor_shield", "vllm_adapter_shim"],
        "shield": True,
        "keys": True,
        "adapter": True,
        "factory": True,
        "native": True,
    }


def test_vllm_import_of_the_adapter_gets_the_patched_class():
    """vLLM's LMCacheConnectorV1 imports LMCacheConnectorV1Impl from the
    0.5.6 path. On 0.5.7rc2 that name is served with the moved module (one
    INFO line says so); on 0.5.6 it is the module itself."""
    if RELEASE not in PATHS:
        pytest.skip(f"LMCache {RELEASE}: no paths read for it")
    pytest.importorskip("vllm", reason="LMCache's vLLM adapter imports vLLM")
    code = (
        "import json, sys\n"
        "from lmcache_ascend.integration.vllm import adapter_route\n"
        "adapter_route.install()  # the vLLM plugin did, before vLLM builds LMCacheConnectorV1\n"
        "from lmcache_ascend.lmcache_bridge.patching import hook\n"
        "from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl as Impl\n"
        "mod = sys.modules['lmcache.integration.vllm.vllm_v1_adapter']\n"
        "print(json.dumps({'module': Impl.__module__, 'same': sys.modules[Impl.__module__] is mod,\n"
        "    'spec': mod.__spec__.name, 'patched': getattr(Impl, '_lmcache_ascend_patched', False),\n"
        "    'aliased': sorted(hook.aliased())}))\n"
    )
    out = _fresh(code)
    got = _last_json(out)
    moved = PATHS[RELEASE][lmcache_modules.VLLM_ADAPTER]
    assert got == {
        "module": moved,
        "same": True,
        "spec": moved,
        "patched": True,
        "aliased": [lmcache_modules.VLLM_ADAPTER] if moved != lmcache_modules.VLLM_ADAPTER else [],
    }
    said = (out.stdout + out.stderr).count("without an alias; lmcache-ascend serves that name")
    assert said == (1 if moved != lmcache_modules.VLLM_ADAPTER else 0)


def test_import_lmcache_ascend_and_installing_the_hook_read_no_version():
    """The release is read on LMCache's first import, not by ``import
    lmcache_ascend`` nor by installing the hook (both must stay cheap)."""
    code = (
        "import json, lmcache_ascend\n"
        "from lmcache_ascend.integration.vllm import adapter_route\n"
        "adapter_route.install()\n"
        "from lmcache_ascend.lmcache_bridge.patching import lmcache_modules\n"
        "before = lmcache_modules.release.cache_info().currsize\n"
        "import lmcache.v1.config\n"
        "print(json.dumps([before, lmcache_modules.release.cache_info().currsize]))\n"
    )
    assert _last_json(_fresh(code)) == [0, 1]
