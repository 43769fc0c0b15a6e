"""Supported versions: declared once (lmcache_ascend.compat), refused clearly
otherwise, and nothing of LMCache patched on a release the patches were not
verified on. The native extension refuses a torch it was not built for."""

from __future__ import annotations

import os
import subprocess

import fresh_python
import pytest

from lmcache_ascend import compat


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return fresh_python.run(code, env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "version", ["0.23.0", "0.23.1.dev3+gabc", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.32.0", "0.32.1rc1"]
)
def test_supported_series_are_recognised(version):
    features = compat.features_for(version)
    assert features.series[:2] == tuple(int(x) for x in version.split(".")[:2])
    assert features.tested


@pytest.mark.parametrize("version", ["0.24.0", "0.31.0", "0.33.0", "1.0.0"])
def test_untested_vllm_versions_get_one_error_naming_the_tested_ones_and_the_opt_in(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedVersionError) as err:
        compat.features_for(version)
    text = str(err.value)
    assert version in text and compat.ALLOW_UNTESTED_ENV + "=1" in text
    for series in ("0.23.x", "0.26.x", "0.27.x", "0.29.x", "0.30.x", "0.32.x", "0.5.6"):
        assert series in text
    assert ("newer than the newest" in text) == (version in ("0.33.0", "1.0.0"))


@pytest.mark.parametrize("version", ["0.18.1", "0.22.1"])
def test_older_vllm_is_refused_even_when_untested_versions_are_allowed(version, monkeypatch):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    with pytest.raises(compat.UnsupportedVersionError, match="older than the oldest"):
        compat.features_for(version)


@pytest.mark.parametrize("version, base", [("0.33.0", (0, 32)), ("0.31.2", (0, 30)), ("0.24.0", (0, 23))])
def test_opted_in_untested_vllm_takes_the_nearest_older_tested_behaviour(version, base, monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "yes")
    compat._features_for.cache_clear()
    with caplog.at_level("WARNING", logger="lmcache_ascend.compat"):
        first = compat.features_for(version)
        again = compat.features_for(version)
    assert first is again and not first.tested
    ref = compat.VLLM_SERIES[base]
    assert (first.inproc_engine_shuts_down, first.scheduler_stats_need_worker_stats) == (
        ref.inproc_engine_shuts_down,
        ref.scheduler_stats_need_worker_stats,
    )
    warned = [r.getMessage() for r in caplog.records if version in r.getMessage()]
    assert len(warned) == 1 and compat.ALLOW_UNTESTED_ENV in warned[0], warned


def test_lmcache_policy(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    newest = max(compat.LMCACHE_VERSIONS, key=compat.Version)
    newer = f"{compat.Version(newest).major}.{compat.Version(newest).minor}.{compat.Version(newest).micro + 1}"
    for version, allowed in ((newest, True), (newer, False), ("0.3.0", False), (None, False)):
        compat._check_lmcache.cache_clear()
        if allowed:
            compat._check_lmcache(version, False)
            continue
        with pytest.raises(compat.UnsupportedVersionError) as err:
            compat._check_lmcache(version, False)
        assert str(version or "(not installed)") in str(err.value)
    compat._check_lmcache.cache_clear()
    compat._check_lmcache(newer, True)  # opted in: runs
    with pytest.raises(compat.UnsupportedVersionError):
        compat._check_lmcache("0.3.0", True)  # older: never


def test_a_dev_build_of_vllm_is_told_to_set_vllm_version():
    with pytest.raises(compat.UnsupportedVersionError, match="VLLM_VERSION"):
        compat.features_for("dev")


def test_vllm_version_override_is_honoured(monkeypatch):
    # vLLM-Ascend images build vLLM from source and name its release this way.
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setenv("VLLM_VERSION", "0.26.0")
    assert compat.vllm_features().series == (0, 26)
    monkeypatch.setenv("VLLM_VERSION", "0.31.0")
    with pytest.raises(compat.UnsupportedVersionError, match="0.31.0"):
        compat.require_supported()


def test_installed_stack_is_supported():
    features = compat.require_supported()
    assert features is compat.VLLM_SERIES[features.series] and features.ci_stack
    assert compat.installed_lmcache_version() in compat.LMCACHE_VERSIONS


@pytest.mark.compat("lmcache")  # LMCache's modules, in fresh processes
def test_unverified_lmcache_release_is_left_unpatched_unless_opted_in():
    """On an LMCache release the patches were not verified on, importing
    LMCache's patched modules changes nothing and one warning says so,
    unless the user opted into untested releases."""
    code = (
        "import lmcache_ascend.lmcache_bridge.patching.lmcache_modules as m  # reads the release once\n"
        "m.installed_lmcache_version = lambda: '0.0.1'  # as if another LMCache were installed\n"
        "from lmcache_ascend.integration.vllm import adapter_route\n"
        "adapter_route.install()  # as the entry points do\n"
        "import lmcache.v1.config as cfg\n"
        "import lmcache.v1.storage_backend.job_executor.pq_executor as pq\n"
        "print('KEYS', 'ascend_bundle_multi_spec' in cfg._CONFIG_DEFINITIONS)\n"
        "print('SHIELD', getattr(pq.AsyncPQExecutor, '_lmcache_ascend_shielded', False))\n"
    )
    out = _fresh(code, **{compat.ALLOW_UNTESTED_ENV: ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KEYS False" in out.stdout and "SHIELD False" in out.stdout
    assert out.stderr.count("is not a release its patches were verified on") == 1
    # Opted into untested releases: the connector relies on the patches, so
    # they are applied (compat has logged the one warning at startup).
    opted = _fresh(code, **{compat.ALLOW_UNTESTED_ENV: "1"})
    assert "KEYS True" in opted.stdout and "SHIELD True" in opted.stdout, opted.stderr[-3000:]
    assert "is not a release its patches were verified on" not in opted.stderr
    # The same import on the verified release patches both.
    code_ok = code.replace("m.installed_lmcache_version = lambda: '0.0.1'  # as if another LMCache were installed\n", "")
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


def test_the_package_pins_admit_the_lmcache_releases_compat_supports():
    """pyproject.toml's LMCache requirement and compat.LMCACHE_VERSIONS agree:
    pip installs no release the connector refuses at startup, and refuses
    none it supports."""
    import re
    from pathlib import Path

    from packaging.requirements import Requirement

    text = (Path(compat.__file__).resolve().parents[1] / "pyproject.toml").read_text()
    req = Requirement(re.search(r'"(lmcache[<>=!][^"]*)"', text).group(1))
    for version in compat.LMCACHE_VERSIONS:
        assert req.specifier.contains(version, prereleases=True), (str(req), version)
    for outside in ("0.5.5", "0.5.7", "0.5.8", "0.6.0"):
        assert not req.specifier.contains(outside, prereleases=True), (str(req), outside)
