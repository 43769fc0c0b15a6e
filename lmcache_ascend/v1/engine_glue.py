"""Glue between our transfer plan and LMCache 0.5.6's engine.

LMCache keeps doing what it is good at (chunk hashing, storage backends,
eviction, lookup client/server); we plug in through its two hooks:

* ``LMCacheMetadata.get_shapes``/``get_dtypes``: one flat uint8 buffer per
  chunk holding every kernel group at its planned offset;
* ``GPUConnectorInterface``: ``batched_from_gpu``/``batched_to_gpu`` move a
  chunk between vLLM's paged KV and that buffer through our native ops.

Imports LMCache, never vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.config_base import validate_and_set_config_value
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_ascend.v1.groups import ChunkRequest

logger = logging.getLogger(__name__)

# Non-cryptographic LMCache hash algorithms seed their chain randomly per
# process unless PYTHONHASHSEED is set; the scheduler and the worker are
# different processes, so their chunk keys would never meet.
_NON_CRYPTO_HASHES = ("builtin", "xxhash", "xxhash_cbor")
DETERMINISTIC_HASH = "sha256_cbor"


@dataclasses.dataclass
class ChunkBufferMetadata(LMCacheMetadata):
    """LMCache metadata whose chunk is one flat byte buffer of a fixed size."""

    chunk_bytes: int = 0

    def get_shapes(self, num_tokens: Optional[int] = None) -> list[torch.Size]:
        return [torch.Size([self.chunk_bytes])]

    def get_dtypes(self) -> list[torch.dtype]:
        return [torch.uint8]

    def get_num_groups(self) -> int:
        return 1


class ExtraConfigError(ValueError):
    """A kv_connector_extra_config entry that cannot be applied."""


def apply_extra_config(config: LMCacheEngineConfig, extra: Mapping[str, Any] | None) -> None:
    """Apply ``kv_connector_extra_config`` to an LMCache config.

    Keys are LMCache config keys, optionally prefixed with ``lmcache.`` (the
    convention of LMCache's own vLLM adapter). Unknown keys and values that
    do not convert are errors: a typo must not silently run with defaults.
    """
    if not extra:
        return
    known = set(config._config_definitions)  # type: ignore[attr-defined]
    for raw_key, value in extra.items():
        key = raw_key[len("lmcache.") :] if raw_key.startswith("lmcache.") else raw_key
        if key not in known:
            close = sorted(k for k in known if k.split("_")[0] == key.split("_")[0])
            raise ExtraConfigError(
                f"kv_connector_extra_config key {raw_key!r} is not an LMCache or "
                f"lmcache-ascend config key"
                + (f"; did you mean one of {close[:8]}?" if close else "")
            )
        if not validate_and_set_config_value(config, key, value):
            raise ExtraConfigError(
                f"kv_connector_extra_config {raw_key!r}={value!r} could not be "
                f"applied: expected a value of type "
                f"{config._config_definitions[key]['type'].__name__}"  # type: ignore[attr-defined]
            )


def enforce_engine_requirements(config: LMCacheEngineConfig, num_groups: int) -> None:
    """Settings this connector relies on, applied with a log line each."""
    if config.use_layerwise:
        raise ValueError(
            "use_layerwise=True is not supported by LMCacheAscendConnectorV1Dynamic "
            "(chunks move whole, all kernel groups per chunk); set use_layerwise: false"
        )
    if config.enable_blending:
        raise ValueError(
            "enable_blending=True is not supported by LMCacheAscendConnectorV1Dynamic; "
            "set enable_blending: false"
        )
    if config.save_unfull_chunk:
        # Every chunk buffer has one fixed geometry; a partial tail chunk of a
        # multi-group model cannot be restored exactly in every group.
        logger.info(
            "lmcache-ascend: storing whole chunks only (save_unfull_chunk -> False, "
            "%d KV cache group(s))",
            num_groups,
        )
        config.save_unfull_chunk = False
    algo = str(config.pre_caching_hash_algorithm)
    import os

    if algo in _NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        logger.warning(
            "lmcache-ascend: pre_caching_hash_algorithm=%r seeds chunk hashes randomly "
            "per process (PYTHONHASHSEED unset), so vLLM's scheduler and worker "
            "processes could never agree on chunk keys; using %r instead. Set "
            "PYTHONHASHSEED or pre_caching_hash_algorithm explicitly to silence this.",
            algo,
            DETERMINISTIC_HASH,
        )
        config.pre_caching_hash_algorithm = DETERMINISTIC_HASH


@dataclasses.dataclass(frozen=True)
class TransferContext:
    """Per-request data the LMCache engine passes through to our connector."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class ChunkIOStats:
    """Per-call counters, read and reset by the worker after each call."""

    chunks: int = 0
    bytes: int = 0
    incomplete: int = 0
    failed: int = 0


class PagedChunkConnector(GPUConnectorInterface):
    """LMCache GPU-connector hook backed by a ``ChunkTransfer``.

    ``store``/``load`` are injected callables taking ``(chunk_tensor,
    ChunkRequest)`` so this class does not depend on the planner's types.
    """

    def __init__(
        self,
        chunk_bytes: int,
        store: Callable[[torch.Tensor, ChunkRequest], Any],
        load: Callable[[torch.Tensor, ChunkRequest], Any],
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self._store = store
        self._load = load
        self.stats = ChunkIOStats()

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.chunk_bytes])

    @staticmethod
    def _buffer(memory_obj: MemoryObj) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise RuntimeError("LMCache MemoryObj has no tensor to copy into/from")
        return tensor.view(torch.uint8).reshape(-1)

    @staticmethod
    def _ctx(kwargs: Mapping[str, Any]) -> TransferContext:
        ctx = kwargs.get("lmcache_ascend_ctx")
        if not isinstance(ctx, TransferContext):
            raise RuntimeError(
                "lmcache-ascend connector called without a TransferContext "
                "(kwarg 'lmcache_ascend_ctx'); was the engine shared with another connector?"
            )
        return ctx

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(
        self,
        memory_objs: Sequence[MemoryObj],
        starts: Sequence[int],
        ends: Sequence[int],
        **kwargs,
    ) -> None:
        ctx = self._ctx(kwargs)
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self._store(self._buffer(obj), ChunkRequest(start, end, ctx.block_ids))
            self.stats.chunks += 1
            self.stats.bytes += self.chunk_bytes

    def batched_to_gpu(
        self,
        memory_objs: Sequence[MemoryObj],
        starts: Sequence[int],
        ends: Sequence[int],
        **kwargs,
    ) -> None:
        ctx = self._ctx(kwargs)
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self._load(self._buffer(obj), ChunkRequest(start, end, ctx.block_ids))
            self.stats.chunks += 1
            self.stats.bytes += self.chunk_bytes
