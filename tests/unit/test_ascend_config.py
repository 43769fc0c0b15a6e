"""Our LMCache config keys: registration, every way of setting them, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys
from lmcache_ascend.planning.settings import (
    KEY_NAMES,
    AscendConfig,
    ConfigValueError,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg_cls():
    from lmcache.v1 import config as lmc_config

    before = lmc_config.LMCacheEngineConfig
    register_config_keys()
    register_config_keys()  # idempotent
    assert lmc_config.LMCacheEngineConfig is before  # widened in place, not replaced
    return before


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in KEY_NAMES:
        monkeypatch.delenv(f"LMCACHE_{key.upper()}", raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)


def test_defaults(cfg_cls):
    cfg = cfg_cls.from_defaults()
    a = AscendConfig.from_lmcache(cfg)
    assert a == AscendConfig()
    assert a.bundle_multi_spec and a.flatten_multi_spec and a.skip_state_groups
    # Nothing is skipped unless asked: the former defaults named spec
    # classes no release has and state that compress-4 layers read.
    assert a.skip_state_spec_allowlist == () and a.skip_state_layer_suffixes == ()
    assert all(k in cfg.to_dict() for k in KEY_NAMES)


def test_env(cfg_cls, monkeypatch):
    monkeypatch.setenv("LMCACHE_ASCEND_BUNDLE_MULTI_SPEC", "0")
    monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", "FooState, BarState")
    monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_LAYER_SUFFIXES", "")
    a = AscendConfig.from_lmcache(cfg_cls.from_env())
    assert not a.bundle_multi_spec
    assert a.skip_state_spec_allowlist == ("FooState", "BarState")
    assert a.skip_state_layer_suffixes == ()


def test_yaml_then_env_override(cfg_cls, monkeypatch, tmp_path):
    path = tmp_path / "lmc.yaml"
    path.write_text(
        "chunk_size: 128\nascend_skip_state_groups: false\n"
        "ascend_skip_state_spec_allowlist: [A, B]\nascend_flatten_multi_spec: false\n"
    )
    monkeypatch.setenv("LMCACHE_ASCEND_FLATTEN_MULTI_SPEC", "true")
    cfg = cfg_cls.from_file(str(path))
    cfg.update_config_from_env()
    a = AscendConfig.from_lmcache(cfg)
    assert cfg.chunk_size == 128
    assert not a.skip_state_groups and a.skip_state_spec_allowlist == ("A", "B")
    assert a.flatten_multi_spec  # env wins over the file


def test_singleton_loader_sees_keys(cfg_cls, monkeypatch, tmp_path):
    from lmcache.v1.config import load_engine_config_with_overrides

    path = tmp_path / "lmc.yaml"
    path.write_text("ascend_bundle_multi_spec: false\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    cfg = load_engine_config_with_overrides(overrides={"ascend_skip_state_groups": "no"})
    a = AscendConfig.from_lmcache(cfg)
    assert not a.bundle_multi_spec and not a.skip_state_groups


def test_validate_and_set(cfg_cls):
    from lmcache.v1.config_base import validate_and_set_config_value

    cfg = cfg_cls.from_defaults()
    assert validate_and_set_config_value(cfg, "ascend_bundle_multi_spec", "false")
    assert cfg.ascend_bundle_multi_spec is False
    assert validate_and_set_config_value(cfg, "ascend_skip_state_layer_suffixes", '[".x"]')
    assert cfg.ascend_skip_state_layer_suffixes == (".x",)
    # A bad value is refused (LMCache logs our message) and the old one kept.
    assert not validate_and_set_config_value(cfg, "ascend_bundle_multi_spec", "perhaps")
    assert cfg.ascend_bundle_multi_spec is False


@pytest.mark.parametrize(
    "key, value",
    [
        ("ascend_skip_state_groups", "perhaps"),
        ("ascend_bundle_multi_spec", "2"),
        ("ascend_skip_state_spec_allowlist", "[1, 2]"),
        ("ascend_skip_state_layer_suffixes", "[broken"),
    ],
)
def test_bad_env_value_stops_loading(cfg_cls, monkeypatch, key, value):
    monkeypatch.setenv(f"LMCACHE_{key.upper()}", value)
    with pytest.raises(ConfigValueError) as err:
        cfg_cls.from_env()
    assert key in str(err.value)


def test_bad_yaml_value_names_key_value_and_options(cfg_cls, tmp_path):
    path = tmp_path / "lmc.yaml"
    path.write_text("ascend_bundle_multi_spec: sometimes\n")
    with pytest.raises(ConfigValueError) as err:
        cfg_cls.from_file(str(path))
    msg = str(err.value)
    assert "ascend_bundle_multi_spec" in msg and "'sometimes'" in msg and "true/false" in msg


def test_ascend_config_validates_direct_values(cfg_cls):
    with pytest.raises(ConfigValueError, match="ascend_skip_state_groups"):
        AscendConfig(skip_state_groups="maybe")  # type: ignore[arg-type]
    cfg = cfg_cls.from_defaults()
    cfg.ascend_flatten_multi_spec = "nope"  # bypasses LMCache's converter
    with pytest.raises(ConfigValueError, match="ascend_flatten_multi_spec"):
        AscendConfig.from_lmcache(cfg)
    assert AscendConfig(skip_state_spec_allowlist=["X"]).skip_state_spec_allowlist == ("X",)


def test_keys_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in KEY_NAMES:
        assert f"`{key}`" in text and f"LMCACHE_{key.upper()}" in text
