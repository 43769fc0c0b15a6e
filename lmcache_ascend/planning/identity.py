"""Fingerprints of what determines a model's KV: its checkpoint files and
settings, and a LoRA adapter's files.

Chunk keys carry the served model name; two instances serving other weights
under one name (a W8A8 and a bf16 checkpoint, two fine-tunes at one path)
must still never share entries. Reading every byte of a checkpoint at
startup is out of the question (hundreds of GB for DeepSeek-V3), so a model
fingerprint covers every weight file's name and size plus samples of its
bytes spread over the whole file: a fine-tune changes most tensors, and
thousands of samples across the checkpoint all missing them is not a
practical risk. An operator who knows better (a registry digest, say) sets
the identity explicitly instead (``ascend_model_identity``).

A LoRA adapter is small: its files are hashed whole, once per path and
(size, mtime).

Pure: imports neither vLLM, LMCache nor the compiled ops; reads files only.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
# Small text files that shape the KV: architecture, quantization, rope.
CONFIG_NAMES = ("config.json", "quantization_config.json", "quant_config.json", "hf_quant_config.json",
                "params.json")
SAMPLE_BYTES = 4096
# Bytes read per process for the samples of all weight files together.
SAMPLE_BUDGET = 16 << 20
MIN_SAMPLES_PER_FILE = 16
# LoRA adapter files above this are hashed by samples too.
LORA_WHOLE_LIMIT = 1 << 30


class IdentityError(Exception):
    """A model or adapter whose files cannot be read."""


def _weight_files(root: Path) -> list[Path]:
    out = [p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return out


def _sample_file(h: "hashlib._Hash", path: Path, samples: int) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    if size <= samples * SAMPLE_BYTES:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return
    span = size - SAMPLE_BYTES
    with open(path, "rb") as f:
        for i in range(samples):
            f.seek(span * i // max(1, samples - 1))
            h.update(f.read(SAMPLE_BYTES))


def files_fingerprint(root: Path, budget: int = SAMPLE_BUDGET) -> str:
    """Config files whole, weight files by name, size and evenly spread
    samples (``budget`` bytes in all, at least ``MIN_SAMPLES_PER_FILE`` per
    file). Raises IdentityError where ``root`` holds no weight file."""
    if not root.is_dir():
        raise IdentityError(f"{str(root)!r} is not a directory")
    weights = _weight_files(root)
    if not weights:
        raise IdentityError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) under {str(root)!r}")
    h = hashlib.sha256(b"lmca-files-v1")
    for name in CONFIG_NAMES:
        p = root / name
        if p.is_file():
            h.update(name.encode())
            h.update(p.read_bytes())
    per_file = max(MIN_SAMPLES_PER_FILE, budget // SAMPLE_BYTES // len(weights))
    for p in weights:
        h.update(str(p.relative_to(root)).encode())
        _sample_file(h, p, per_file)
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class ModelFacts:
    """What a model fingerprint covers, as read from vLLM's config."""

    name: str
    path: Optional[str]  # local checkpoint directory, None where unknown
    revision: Optional[str]
    settings: Mapping[str, str]  # dtype, kv cache dtype, quantization, hf config digest...
    explicit: Optional[str] = None  # ascend_model_identity, when set


def model_fingerprint(facts: ModelFacts) -> str:
    """A short, stable fingerprint of the weights and settings behind the
    KV. Raises IdentityError where the weights cannot be read and no
    explicit identity is set."""
    h = hashlib.sha256(b"lmca-model-v1")
    for key in sorted(facts.settings):
        h.update(f"{key}={facts.settings[key]}\n".encode())
    if facts.explicit:
        h.update(b"explicit:" + facts.explicit.encode())
    elif facts.path is not None and Path(facts.path).is_dir():
        h.update(b"files:" + files_fingerprint(Path(facts.path)).encode())
    else:
        raise IdentityError(
            f"model {facts.name!r}: its weights are not in a local directory this process can read "
            f"(path {facts.path!r}, revision {facts.revision!r})"
        )
    return h.hexdigest()[:16]


_lora_lock = threading.Lock()
_StatKey = tuple[tuple[str, int, int], ...]  # (path, size, mtime_ns) per file
_lora_memo: dict[tuple[str, _StatKey], str] = {}


def _stat_key(paths: Iterable[Path]) -> _StatKey:
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)


def lora_fingerprint(path: str) -> str:
    """Hash of every file of the adapter at ``path`` (a directory or one
    file), memoized per (path, sizes, mtimes). Raises IdentityError where it
    cannot be read."""
    root = Path(path)
    try:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        if not files:
            raise IdentityError(f"LoRA adapter path {path!r} holds no file")
        key = (str(root), _stat_key(files))
    except OSError as e:
        raise IdentityError(f"LoRA adapter path {path!r} cannot be read: {e}") from e
    with _lora_lock:
        found = _lora_memo.get(key)
    if found is not None:
        return found
    h = hashlib.sha256(b"lmca-lora-v1")
    try:
        for p in files:
            h.update(str(p.relative_to(root) if p != root else p.name).encode())
            size = p.stat().st_size
            # Whole files up to the limit (more samples than the file holds).
            samples = size // SAMPLE_BYTES + 1 if size <= LORA_WHOLE_LIMIT else SAMPLE_BUDGET // SAMPLE_BYTES
            _sample_file(h, p, samples)
    except OSError as e:
        raise IdentityError(f"LoRA adapter path {path!r} cannot be read: {e}") from e
    value = h.hexdigest()[:32]
    with _lora_lock:
        _lora_memo[key] = value
    return value
