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
import struct
import zlib
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


# Bytes after the payload: crc32 of the payload, then a magic tag that says
# the checksum was written (a chunk stored without checksums has zeros).
TRAILER_BYTES = 8
_MAGIC = b"LMCA"


def buffer_shape(chunk_bytes: int, chunk_size: int) -> torch.Size:
    """Shape of one chunk's MemoryObj.

    LMCache's default memory format reads the token count from dim 2, so the
    flat buffer (payload + trailer, padded up) is shaped
    ``[1, 1, chunk_size, row]``; only the first bytes are used.
    """
    total = chunk_bytes + TRAILER_BYTES
    return torch.Size([1, 1, chunk_size, -(-total // chunk_size)])


@dataclasses.dataclass
class ChunkBufferMetadata(LMCacheMetadata):
    """LMCache metadata whose chunk is one flat byte buffer of a fixed size."""

    chunk_bytes: int = 0

    def get_shapes(self, num_tokens: Optional[int] = None) -> list[torch.Size]:
        return [buffer_shape(self.chunk_bytes, self.chunk_size)]

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
        if config._config_definitions[key]["type"] is bool and not _is_bool_word(value):  # type: ignore[attr-defined]
            raise ExtraConfigError(
                f"kv_connector_extra_config {raw_key!r}={value!r} is not a boolean; "
                f"valid: true/false (also 1/0, yes/no, on/off)"
            )
        if not validate_and_set_config_value(config, key, value):
            raise ExtraConfigError(
                f"kv_connector_extra_config {raw_key!r}={value!r} could not be "
                f"applied: expected a value of type "
                f"{config._config_definitions[key]['type'].__name__}"  # type: ignore[attr-defined]
            )


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no", "on", "off")
VALID_HASHES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin")
VALID_SERDES = ("naive",)


def _is_bool_word(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return value in (0, 1)
    return str(value).strip().lower() in _BOOL_WORDS


def validate_engine_config(config: LMCacheEngineConfig, environ: Mapping[str, str]) -> None:
    """Refuse values LMCache 0.5.6 accepts silently or fails on obscurely
    (some of them after starting a thread that keeps the process alive)."""
    defs = config._config_definitions  # type: ignore[attr-defined]
    for key, spec in defs.items():
        env_name = "LMCACHE_" + key.upper()
        raw = environ.get(env_name)
        if raw is None or raw.strip() == "":
            continue
        if spec["type"] is bool and not _is_bool_word(raw):
            raise ValueError(
                f"{env_name}={raw!r} ({key}) is not a boolean; valid: true/false "
                "(also 1/0, yes/no, on/off)"
            )
        if getattr(config, key, None) is None:
            raise ValueError(
                f"{env_name}={raw!r} ({key}) could not be converted to "
                f"{getattr(spec['type'], '__name__', spec['type'])}"
            )
    if config.chunk_size is None or int(config.chunk_size) <= 0:
        raise ValueError(f"chunk_size={config.chunk_size!r} is not valid; it must be an integer > 0")
    size = config.max_local_cpu_size
    if size is None or float(size) <= 0:
        raise ValueError(
            f"max_local_cpu_size={size!r} GB is not valid; it must be > 0 "
            "(lmcache-ascend stages every chunk in LMCache's CPU memory, even with local_cpu: false)"
        )
    if config.local_disk and (config.max_local_disk_size is None or float(config.max_local_disk_size) <= 0):
        raise ValueError(
            f"max_local_disk_size={config.max_local_disk_size!r} GB is not valid with "
            f"local_disk={config.local_disk!r}; it must be > 0"
        )
    algo = str(config.pre_caching_hash_algorithm)
    if algo not in VALID_HASHES:
        raise ValueError(
            f"pre_caching_hash_algorithm={algo!r} is not valid; use one of {list(VALID_HASHES)} "
            "(LMCache 0.5.6 silently falls back to Python's per-process hash)"
        )
    if config.remote_url and str(config.remote_serde) not in VALID_SERDES:
        raise ValueError(
            f"remote_serde={config.remote_serde!r} is not valid; lmcache-ascend stores opaque "
            f"byte buffers, use one of {list(VALID_SERDES)}"
        )


def enforce_engine_requirements(
    config: LMCacheEngineConfig, num_groups: int, connector: str = "LMCacheAscendConnectorV1Dynamic"
) -> None:
    """Settings our chunk path relies on, applied with a log line each;
    ``connector`` names the route in the errors."""
    if config.use_layerwise:
        raise ValueError(
            f"use_layerwise=True is not supported by {connector} "
            "(chunks move whole, all kernel groups per chunk); set use_layerwise: false"
        )
    if config.enable_blending:
        raise ValueError(
            f"enable_blending=True is not supported by {connector}; "
            "set enable_blending: false"
        )
    if config.enable_async_loading:
        # The async lookup client answers "not yet" (None) and expects the
        # connector to ask again later; our loads complete inside the step.
        raise ValueError(
            f"enable_async_loading=True is not supported by {connector} "
            "(loads complete inside the step that schedules them); set "
            "enable_async_loading: false"
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
    """Counters, plus where the last retrieve stopped being usable."""

    chunks: int = 0
    bytes: int = 0
    checksum_failures: int = 0
    load_failures: int = 0
    # Token start of the first chunk of the current retrieve that could not
    # be loaded (bad checksum, copy error); later chunks are not loaded.
    failed_from: Optional[int] = None


class ChunkCorrupted(RuntimeError):
    """A chunk whose bytes do not match the checksum written at store time."""


def _crc(payload: torch.Tensor) -> int:
    # zlib releases the GIL on large buffers and runs at several GB/s.
    return zlib.crc32(memoryview(payload.numpy()))


class PagedChunkConnector(GPUConnectorInterface):
    """LMCache GPU-connector hook backed by a ``ChunkTransfer``.

    ``store``/``load`` are injected callables taking ``(chunk_tensor,
    ChunkRequest)`` so this class does not depend on the planner's types.
    """

    def __init__(
        self,
        chunk_bytes: int,
        chunk_size: int,
        store: Callable[[torch.Tensor, ChunkRequest], Any],
        load: Callable[[torch.Tensor, ChunkRequest], Any],
        checksums: bool = True,
        trailer: bool = True,
    ) -> None:
        """``trailer=False``: buffers have no room after the payload (LMCache
        sized them), so nothing is written there and only sizes are checked."""
        if checksums and not trailer:
            raise ValueError("checksums need the trailer")
        self.chunk_bytes = chunk_bytes
        self.chunk_size = chunk_size
        self._store = store
        self._load = load
        self.checksums = checksums
        self.trailer_bytes = TRAILER_BYTES if trailer else 0
        self.stats = ChunkIOStats()

    def get_shape(self, num_tokens: int) -> torch.Size:
        return buffer_shape(self.chunk_bytes, self.chunk_size)

    def _seal(self, buf: torch.Tensor) -> None:
        if not self.trailer_bytes:
            return
        trailer = buf[self.chunk_bytes : self.chunk_bytes + TRAILER_BYTES]
        if self.checksums:
            crc = _crc(buf[: self.chunk_bytes])
            trailer.copy_(torch.frombuffer(bytearray(struct.pack("<I", crc) + _MAGIC), dtype=torch.uint8))
        else:
            trailer.zero_()

    def _verify(self, buf: torch.Tensor, start: int) -> None:
        """Refuse a chunk whose size or checksum is wrong, before any byte
        of it reaches vLLM's KV cache."""
        if buf.numel() < self.chunk_bytes + self.trailer_bytes:
            raise ChunkCorrupted(
                f"chunk at token {start}: {buf.numel()} bytes, expected at least "
                f"{self.chunk_bytes + self.trailer_bytes} (truncated or from another layout)"
            )
        if not self.checksums:
            return
        trailer = bytes(buf[self.chunk_bytes : self.chunk_bytes + TRAILER_BYTES].numpy())
        if trailer[4:] != _MAGIC:
            raise ChunkCorrupted(f"chunk at token {start}: no checksum trailer")
        (want,) = struct.unpack("<I", trailer[:4])
        got = _crc(buf[: self.chunk_bytes])
        if got != want:
            raise ChunkCorrupted(
                f"chunk at token {start}: checksum {got:#010x} != stored {want:#010x}"
            )

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
        try:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                buf = self._buffer(obj)
                result = self._store(buf, ChunkRequest(start, end, ctx.block_ids))
                if getattr(result, "stored", True) is False:
                    # Never seal (and so validate) a buffer nothing was copied into.
                    raise RuntimeError(
                        f"request {ctx.req_id}: chunk at token {start} has groups without "
                        f"real blocks ({getattr(result, 'incomplete', ())}); not stored"
                    )
                self._seal(buf)
                self.stats.chunks += 1
                self.stats.bytes += self.chunk_bytes
        except BaseException:
            # LMCache's store() drops the batch without freeing it on an
            # exception: return the buffers to its allocator here.
            for obj in memory_objs:
                try:
                    obj.ref_count_down()
                except Exception:  # noqa: BLE001
                    logger.exception("lmcache-ascend: releasing a chunk buffer failed")
            raise

    def batched_to_gpu(
        self,
        memory_objs: Sequence[MemoryObj],
        starts: Sequence[int],
        ends: Sequence[int],
        **kwargs,
    ) -> None:
        ctx = self._ctx(kwargs)
        # LMCache hands chunks in token order; once one is unusable, later
        # ones are useless to vLLM (it recomputes from the first bad token).
        order = sorted(range(len(starts)), key=lambda i: starts[i])
        for i in order:
            obj, start, end = memory_objs[i], starts[i], ends[i]
            if self.stats.failed_from is not None and start >= self.stats.failed_from:
                continue
            try:
                buf = self._buffer(obj)
                self._verify(buf, start)
                self._load(buf, ChunkRequest(start, end, ctx.block_ids))
            except ChunkCorrupted as exc:
                self.stats.checksum_failures += 1
                self.stats.failed_from = start
                logger.warning("lmcache-ascend: request %s: %s; not loaded", ctx.req_id, exc)
                continue
            except Exception:  # noqa: BLE001 - reported as a load error
                self.stats.load_failures += 1
                self.stats.failed_from = start
                logger.exception(
                    "lmcache-ascend: request %s: loading chunk at token %d failed", ctx.req_id, start
                )
                continue
            self.stats.chunks += 1
            self.stats.bytes += self.chunk_bytes
