"""Chunk I/O between our transfer plan and LMCache 0.5.6's engine.

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
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_ascend.lmcache_bridge import lmcache_modules
from lmcache_ascend.planning.groups import ChunkRequest

GPUConnectorInterface = lmcache_modules.load(lmcache_modules.GPU_CONNECTORS).GPUConnectorInterface

logger = logging.getLogger(__name__)

# Bytes after the payload: crc32 of the payload, then a magic tag that says
# the checksum was written (a chunk stored without checksums has zeros).
# "LMCK": the crc is seeded with the chunk's key (its prefix hash), so a
# well-formed chunk stored under another key (another prompt's chunk copied
# over, a foreign writer) is refused too; "LMCA": payload only (chunks
# stored without a known key, e.g. through LMCache's own adapter).
TRAILER_BYTES = 8
_MAGIC = b"LMCA"
_MAGIC_KEYED = b"LMCK"


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


@dataclasses.dataclass
class LoadOutcome:
    """What one retrieve did, written by the connector LMCache calls and read
    back by the caller after ``retrieve`` returns: per call, never shared."""

    loaded_chunks: int = 0
    state_pieces: int = 0  # Mamba state snapshot pieces loaded (see StatePieces)
    checksum_failures: int = 0
    load_failures: int = 0  # chunks whose copy raised
    # Token start of the first chunk that could not be loaded (bad checksum,
    # copy error); later chunks are not loaded (vLLM recomputes from there).
    failed_from: Optional[int] = None

    def fail(self, start: int) -> None:
        self.failed_from = start if self.failed_from is None else min(self.failed_from, start)


class StatePieces(Protocol):
    """A Mamba state snapshot travelling after a request's KV chunks: the
    chunks of the token sequence at and after ``position`` are its pieces
    (planning/state_align.py), not KV chunks."""

    position: int

    def store_piece(self, buf: torch.Tensor, piece: int) -> None: ...

    def load_piece(self, buf: torch.Tensor, piece: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class TransferContext:
    """Per-request data the LMCache engine passes through to our connector
    (``retrieve``/``store`` keyword ``lmcache_ascend_ctx``), and the outcome
    of the call it travels with."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    outcome: LoadOutcome = dataclasses.field(default_factory=LoadOutcome)
    state: Optional[StatePieces] = None
    # Token start -> the chunk's key identity (LMCache's chunk hash), which
    # seeds its checksum; starts missing here get a payload-only checksum.
    chunk_ids: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # The chunks were verified when the lookup staged them (staging.py):
    # their checksums are not computed a second time.
    verified: bool = False

    def state_piece(self, start: int, chunk_size: int) -> Optional[int]:
        """Index of the state piece at token ``start``, or None for a KV chunk."""
        if self.state is None or start < self.state.position:
            return None
        return (start - self.state.position) // chunk_size


class ChunkCorrupted(RuntimeError):
    """A chunk whose bytes do not match the checksum written at store time."""


def _crc(payload: torch.Tensor, ident: Optional[int] = None) -> int:
    # zlib releases the GIL on large buffers and runs at several GB/s.
    seed = 0 if ident is None else zlib.crc32(str(ident).encode())
    return zlib.crc32(memoryview(payload.numpy()), seed)


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

    def get_shape(self, num_tokens: int) -> torch.Size:
        return buffer_shape(self.chunk_bytes, self.chunk_size)

    def _seal(self, buf: torch.Tensor, ident: Optional[int] = None) -> None:
        if not self.trailer_bytes:
            return
        trailer = buf[self.chunk_bytes : self.chunk_bytes + TRAILER_BYTES]
        if self.checksums:
            crc = _crc(buf[: self.chunk_bytes], ident)
            magic = _MAGIC if ident is None else _MAGIC_KEYED
            trailer.copy_(torch.frombuffer(bytearray(struct.pack("<I", crc) + magic), dtype=torch.uint8))
        else:
            trailer.zero_()

    def verify(self, memory_obj: MemoryObj, start: int, ident: Optional[int] = None) -> None:
        """Raise ``ChunkCorrupted`` unless ``memory_obj`` holds a whole chunk
        sealed for the key ``ident`` (see ``_verify``)."""
        self._verify(self._buffer(memory_obj), start, ident)

    def _verify(self, buf: torch.Tensor, start: int, ident: Optional[int] = None) -> None:
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
        magic = trailer[4:]
        if magic not in (_MAGIC, _MAGIC_KEYED):
            raise ChunkCorrupted(f"chunk at token {start}: no checksum trailer")
        if magic == _MAGIC_KEYED and ident is None:
            raise ChunkCorrupted(f"chunk at token {start}: sealed for a key, loaded without one")
        (want,) = struct.unpack("<I", trailer[:4])
        got = _crc(buf[: self.chunk_bytes], ident if magic == _MAGIC_KEYED else None)
        if got != want:
            raise ChunkCorrupted(
                f"chunk at token {start}: checksum {got:#010x} != stored {want:#010x} "
                "(damaged, or another chunk's bytes under this key)"
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
                piece = ctx.state_piece(start, self.chunk_size)
                if piece is not None:
                    ctx.state.store_piece(buf[: self.chunk_bytes], piece)
                    self._seal(buf, ctx.chunk_ids.get(start))
                    continue
                result = self._store(buf, ChunkRequest(start, end, ctx.block_ids))
                if getattr(result, "stored", True) is False:
                    # Never seal (and so validate) a buffer nothing was copied into.
                    raise RuntimeError(
                        f"request {ctx.req_id}: chunk at token {start} has groups without "
                        f"real blocks ({getattr(result, 'incomplete', ())}); not stored"
                    )
                self._seal(buf, ctx.chunk_ids.get(start))
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
        outcome = ctx.outcome
        # LMCache hands chunks in token order; once one is unusable, later
        # ones are useless to vLLM (it recomputes from the first bad token).
        order = sorted(range(len(starts)), key=lambda i: starts[i])
        for i in order:
            obj, start, end = memory_objs[i], starts[i], ends[i]
            if outcome.failed_from is not None and start >= outcome.failed_from:
                continue
            try:
                buf = self._buffer(obj)
                if not ctx.verified:
                    self._verify(buf, start, ctx.chunk_ids.get(start))
                piece = ctx.state_piece(start, self.chunk_size)
                if piece is not None:
                    ctx.state.load_piece(buf[: self.chunk_bytes], piece)
                    outcome.state_pieces += 1
                    continue
                self._load(buf, ChunkRequest(start, end, ctx.block_ids))
            except ChunkCorrupted as exc:
                outcome.checksum_failures += 1
                outcome.fail(start)
                logger.warning("lmcache-ascend: request %s: %s; not loaded", ctx.req_id, exc)
                continue
            except Exception:  # noqa: BLE001 - reported as a load error
                outcome.load_failures += 1
                outcome.fail(start)
                logger.exception(
                    "lmcache-ascend: request %s: loading chunk at token %d failed", ctx.req_id, start
                )
                continue
            outcome.loaded_chunks += 1
