"""Supported versions: declared once (lmcache_ascend.compat), refused clearly
otherwise, and nothing of LMCache patched on a release the patches were not
verified on. The native extension refuses a torch it was not built for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmcache_ascend import compat


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("version", ["0.23.0", "0.23.1.dev3+gabc", "0.26.0", "0.32.0", "0.32.1rc1"])
def test_supported_series_are_recognised(version):
    assert compat.features_for(version).series[:2] == tuple(int(x) for x in version.split(".")[:2])


@pytest.mark.parametrize("version", ["0.18.1", "0.30.0", "1.0.0"])
def test_other_vllm_versions_get_one_error_naming_the_supported_ones(version):
    with pytest.raises(compat.UnsupportedVersionError) as err:
        compat.features_for(version)
    text = str(err.value)
    assert version in text
    for series in ("0.23.x", "0.26.x", "0.32.x", "0.5.6"):
        assert series in text


def test_a_dev_build_of_vllm_is_told_to_set_vllm_version():
    with pytest.raises(compat.UnsupportedVersionError, match="VLLM_VERSION"):
        compat.features_for("dev")


def test_vllm_version_override_is_honoured(monkeypatch):
    # vLLM-Ascend images build vLLM from source and name its release this way.
    monkeypatch.setenv("VLLM_VERSION", "0.26.0")
    assert compat.vllm_features().series == (0, 26)
    monkeypatch.setenv("VLLM_VERSION", "0.31.0")
    with pytest.raises(compat.UnsupportedVersionError, match="0.31.0"):
        compat.require_supported()


def test_installed_stack_is_supported():
    features = compat.require_supported()
    assert features is compat.VLLM_SERIES[features.series]
    assert compat.installed_lmcache_version() in compat.LMCACHE_VERSIONS


def test_unverified_lmcache_release_is_left_unpatched():
    """On an LMCache release the patches were not verified on, importing
    LMCache's patched modules changes nothing and one warning says so."""
    code = (
        "import lmcache_ascend.lmcache_bridge.patches as p\n"
        "p.installed_lmcache_version = lambda: '0.0.1'  # as if another LMCache were installed\n"
        "import lmcache.v1.config as cfg\n"
        "import lmcache.v1.storage_backend.job_executor.pq_executor as pq\n"
        "print('KEYS', 'ascend_bundle_multi_spec' in cfg._CONFIG_DEFINITIONS)\n"
        "print('SHIELD', getattr(pq.AsyncPQExecutor, '_lmcache_ascend_shielded', False))\n"
    )
    out = _fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KEYS False" in out.stdout and "SHIELD False" in out.stdout
    assert out.stderr.count("is not a release its patches were verified on") == 1
    # The same import on the verified release patches both.
    code_ok = code.replace("p.installed_lmcache_version = lambda: '0.0.1'  # as if another LMCache were installed\n", "")
    ok = _fresh(code_ok)
    assert "KEYS True" in ok.stdout and "SHIELD True" in ok.stdout, ok.stderr[-3000:]


def test_extension_refuses_another_torch_naming_both_versions():
    code = (
        "import torch\n"
        "real = torch.__version__\n"
        "torch.__version__ = '2.0.0+other'\n"
        "try:\n"
        "    import lmcache_ascend.ops\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
        "else:\n"
        "    print('LOADED')\n"
    )
    out = _fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    import torch

    assert "ERR" in out.stdout, out.stdout
    assert "2.0.0+other" in out.stdout and torch.__version__ in out.stdout
    assert "rebuild" in out.stdout
