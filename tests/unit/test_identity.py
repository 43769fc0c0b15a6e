"""Model and adapter fingerprints (planning/identity.py): other weights or
settings give another fingerprint, the same checkpoint in another place the
same one, and an unreadable checkpoint an error, never a guess."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lmcache_ascend.planning import identity
from lmcache_ascend.planning.identity import IdentityError, ModelFacts, files_fingerprint, model_fingerprint

pytestmark = pytest.mark.pure

SETTINGS = {"dtype": "torch.bfloat16", "kv_cache_dtype": "auto", "quantization": "None"}


def _checkpoint(root: Path, seed: int, files: int = 2, size: int = 1 << 20) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 64}')
    rng = np.random.default_rng(seed)
    for i in range(files):
        (root / f"model-{i:05d}.safetensors").write_bytes(rng.integers(0, 255, size, dtype=np.uint8).tobytes())
    return root


def _facts(path: Path, **settings) -> ModelFacts:
    return ModelFacts(name="tiny", path=str(path), revision=None, settings={**SETTINGS, **settings})


def test_same_checkpoint_elsewhere_same_fingerprint(tmp_path):
    a = _checkpoint(tmp_path / "a", seed=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert model_fingerprint(_facts(a)) == model_fingerprint(_facts(b))


def test_other_weights_with_the_same_shapes_differ(tmp_path):
    a = _checkpoint(tmp_path / "a", seed=1)
    b = _checkpoint(tmp_path / "b", seed=2)
    assert model_fingerprint(_facts(a)) != model_fingerprint(_facts(b))


def test_a_fine_tune_touching_one_tenth_of_a_large_file_is_seen(tmp_path, monkeypatch):
    # Files larger than the sample budget are sampled, not read whole: a
    # change to a tenth of the bytes (one tensor of ten) must still show.
    monkeypatch.setattr(identity, "SAMPLE_BUDGET", 64 * identity.SAMPLE_BYTES)
    size = 8 << 20
    a = _checkpoint(tmp_path / "a", seed=1, files=1, size=size)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    f = b / "model-00000.safetensors"
    data = bytearray(f.read_bytes())
    lo = size // 2
    data[lo : lo + size // 10] = bytes(size // 10)
    f.write_bytes(bytes(data))
    assert files_fingerprint(a) != files_fingerprint(b)


@pytest.mark.parametrize("setting", [{"dtype": "torch.float16"}, {"kv_cache_dtype": "fp8"},
                                     {"quantization": "w8a8"}])
def test_settings_that_change_the_kv_change_the_fingerprint(tmp_path, setting):
    a = _checkpoint(tmp_path / "a", seed=1)
    assert model_fingerprint(_facts(a)) != model_fingerprint(_facts(a, **setting))


def test_config_change_alone_changes_the_fingerprint(tmp_path):
    a = _checkpoint(tmp_path / "a", seed=1)
    before = model_fingerprint(_facts(a))
    (a / "config.json").write_text('{"hidden_size": 64, "rope_theta": 5}')
    assert model_fingerprint(_facts(a)) != before


def test_explicit_identity_replaces_the_files(tmp_path):
    facts = ModelFacts(name="org/model", path=None, revision=None, settings=SETTINGS, explicit="sha256:abc")
    other = ModelFacts(name="org/model", path=None, revision=None, settings=SETTINGS, explicit="sha256:abd")
    assert model_fingerprint(facts) != model_fingerprint(other)


def test_unreadable_weights_are_an_error_not_a_name_only_key(tmp_path):
    with pytest.raises(IdentityError, match="org/model"):
        model_fingerprint(ModelFacts(name="org/model", path=None, revision=None, settings=SETTINGS))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IdentityError, match="no weight file"):
        model_fingerprint(_facts(empty))


def test_lora_fingerprint_reads_every_byte_of_small_adapters(tmp_path):
    d = tmp_path / "ad"
    d.mkdir()
    payload = bytearray(np.random.default_rng(3).integers(0, 255, 300_001, dtype=np.uint8).tobytes())
    (d / "adapter_model.safetensors").write_bytes(bytes(payload))
    first = identity.lora_fingerprint(str(d))
    e = tmp_path / "ad2"
    e.mkdir()
    payload[123_457] ^= 1  # one bit anywhere
    (e / "adapter_model.safetensors").write_bytes(bytes(payload))
    assert identity.lora_fingerprint(str(e)) != first
    with pytest.raises(IdentityError):
        identity.lora_fingerprint(str(tmp_path / "nope"))
