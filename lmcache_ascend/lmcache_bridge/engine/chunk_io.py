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
import hmac
import logging
import struct
import zlib
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import blake3
import torch

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_ascend.lmcache_bridge.engine.step_puts import DeferredSeals
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules
from lmcache_ascend.planning.groups import ChunkRequest

GPUConnectorInterface = lmcache_modules.load(lmcache_modules.GPU_CONNECTORS).GPUConnectorInterface

logger = logging.getLogger(__name__)

# zlib-ng's crc32 is the same CRC-32 as zlib's (equal values, so entries of
# either stay readable by the other) with SIMD folding (PCLMULQDQ/VPCLMULQDQ
# on x86, the CRC32 instructions on Arm): about 5x zlib's on large buffers,
# and every byte of a stored or fetched chunk goes through it. Both release
# the GIL. Without zlib-ng, zlib's (logged once by the first connector).
try:
    from zlib_ng.zlib_ng import crc32 as _crc32
    CRC32_IMPL = "zlib-ng"
except ImportError:  # pragma: no cover - zlib-ng is a dependency; kept for bare installs
    _crc32 = zlib.crc32
    CRC32_IMPL = "zlib"
_slow_crc_logged = False

# Bytes after the payload (format 2; planning/planner.py CHUNK_FORMAT_VERSION
# is part of the layout fingerprint, so entries of another format have other
# keys): [tag 16][crc32 4][magic 4]. The magic says how the chunk was sealed
# (a chunk stored without checksums has zeros):
# "LMCM": tag = keyed BLAKE3 MAC (the pool secret, integrity/pool_secret.py) over the
#   chunk's key identity (its prefix hash), the key's other fields (model,
#   weights, layout, rank: ``key_scope``) and the payload; crc unused (0);
# "LMCK": no tag, crc32 of the payload seeded with the chunk's key identity,
#   so a well-formed chunk stored under another key is refused too;
# "LMCA": no tag, crc32 of the payload only (a chunk sealed where its key is
#   not known); accepted only by a load that does not know the key either.
TAG_BYTES = 16
TRAILER_BYTES = TAG_BYTES + 8
_MAGIC = b"LMCA"
_MAGIC_KEYED = b"LMCK"
_MAGIC_MAC = b"LMCM"
MAC_KEY_BYTES = 32
_U64 = (1 << 64) - 1


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
class DeferredChunk:
    """A verified chunk whose copy into vLLM's KV cache runs later, layer by
    layer (integration/vllm/layerwise.py); the claim that staged it holds
    its buffer until then."""

    req_id: str
    start: int
    buf: torch.Tensor
    request: ChunkRequest


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
    # seeds its checksum or MAC. With checksums on, a chunk whose start is
    # missing here is not stored, and a load that misses it accepts only a
    # payload-only checksum.
    chunk_ids: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # The chunks were verified when the lookup staged them (integrity/staging.py):
    # their checksums are not computed a second time.
    verified: bool = False
    # Where a verified load puts its KV chunks instead of copying them now
    # (layer-by-layer loads); None: copy now. Chunks LMCache retrieves are
    # always copied now: LMCache frees their buffers when the call returns.
    deferred: Optional[list[DeferredChunk]] = None

    def state_piece(self, start: int, chunk_size: int) -> Optional[int]:
        """Index of the state piece at token ``start``, or None for a KV chunk."""
        if self.state is None or start < self.state.position:
            return None
        return (start - self.state.position) // chunk_size


class ChunkCorrupted(RuntimeError):
    """A chunk whose bytes do not match the checksum written at store time."""


def _crc(payload: torch.Tensor, ident: Optional[int] = None) -> int:
    seed = 0 if ident is None else _crc32(str(ident).encode())
    return _crc32(payload.numpy().data, seed)  # .data: a memoryview of the array


def _log_slow_crc_once() -> None:
    global _slow_crc_logged
    if CRC32_IMPL == "zlib" and not _slow_crc_logged:
        _slow_crc_logged = True
        logger.warning("chunk checksums run on zlib's crc32: zlib-ng is not installed (pip install zlib-ng: "
                       "the same checksums, about 5x faster on large chunks, so stores and fetches verify sooner)")


def _ident_bytes(ident: Optional[int]) -> bytes:
    # LMCache chunk hashes are uint64-compatible ints (Python's builtin hash:
    # signed); 8 bytes little-endian, nothing for an unknown key.
    return b"" if ident is None else (int(ident) & _U64).to_bytes(8, "little")


def entry_mac(payload: torch.Tensor, ident: Optional[int], key_scope: str, mac_key: bytes) -> bytes:
    """The tag of an ``LMCM`` trailer: keyed BLAKE3 over ident (8 bytes LE,
    or nothing), the key scope (UTF-8) and the payload, first ``TAG_BYTES``
    bytes. Reads the payload in place."""
    h = blake3.blake3(key=mac_key)
    h.update(_ident_bytes(ident))
    h.update(key_scope.encode())
    h.update(payload.numpy().data)
    return h.digest(length=TAG_BYTES)


def key_scope_of(token_database: Any) -> str:
    """Every field of the chunk keys ``token_database`` makes except the
    chunk hash (model name with weights and layout fingerprint, world size,
    worker): with the chunk hash, what a MAC binds an entry to, so a valid
    entry copied under another model's, layout's or rank's key is refused."""
    meta = token_database.metadata
    world = 1 if getattr(token_database, "save_only_first_rank", False) else meta.world_size
    return f"{meta.model_name}@{world}@{meta.worker_id}"


# GPUConnectorInterface: LMCache's class, found by module path (untyped).
class PagedChunkConnector(GPUConnectorInterface):  # type: ignore[misc,valid-type]
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
        mac_key: Optional[bytes] = None,
        key_scope: str = "",
    ) -> None:
        """``trailer=False``: buffers have no room after the payload (LMCache
        sized them), so nothing is written there and only sizes are checked.

        ``mac_key`` (``pool_secret.load_mac_key``): every chunk is sealed
        with a keyed MAC and only chunks whose MAC verifies are accepted;
        ``key_scope``: the key fields it binds besides the chunk hash
        (``WorkerEngine.start`` sets them from its chunk keys)."""
        if mac_key is not None:
            if len(mac_key) != MAC_KEY_BYTES:
                raise ValueError(f"the pool MAC key must be {MAC_KEY_BYTES} bytes")
            checksums = True
        if checksums and not trailer:
            raise ValueError("checksums need the trailer")
        self.chunk_bytes = chunk_bytes
        self.chunk_size = chunk_size
        self._store = store
        self._load = load
        self.checksums = checksums
        if checksums and mac_key is None:
            _log_slow_crc_once()
        self.trailer_bytes = TRAILER_BYTES if trailer else 0
        self._mac_key = mac_key
        self.key_scope = key_scope
        # Inside a step whose puts are held (step_puts.py) a chunk's seal
        # runs on the hand-off thread, before its puts; elsewhere, at once.
        self.seals = DeferredSeals(self._seal_beside)

    @property
    def authenticated(self) -> bool:
        """Whether chunks are sealed and checked with the pool secret."""
        return self._mac_key is not None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return buffer_shape(self.chunk_bytes, self.chunk_size)

    def _seal(self, buf: torch.Tensor, ident: Optional[int] = None) -> None:
        if not self.trailer_bytes:
            return
        trailer = buf[self.chunk_bytes : self.chunk_bytes + TRAILER_BYTES]
        if not self.checksums:
            trailer.zero_()
            return
        payload = buf[: self.chunk_bytes]
        if self._mac_key is not None:
            raw = entry_mac(payload, ident, self.key_scope, self._mac_key) + bytes(4) + _MAGIC_MAC
        else:
            crc = _crc(payload, ident)
            tag = bytes(TAG_BYTES)
            raw = tag + struct.pack("<I", crc) + (_MAGIC if ident is None else _MAGIC_KEYED)
        trailer.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def _seal_beside(self, buf: torch.Tensor, ident: Optional[int]) -> None:
        # LMCache's store runs in torch.inference_mode, so its buffers are
        # inference tensors, and that mode is per thread: the hand-off
        # thread enters it to write the trailer.
        with torch.inference_mode():
            self._seal(buf, ident)

    def _seal_stored(self, obj: MemoryObj, buf: torch.Tensor, ident: Optional[int]) -> None:
        # Without checksums the trailer is only zeroed: not worth a hand-off.
        if not (self.checksums and self.seals.hold(obj, buf, ident)):
            self._seal(buf, ident)

    def verify(self, memory_obj: MemoryObj, start: int, ident: Optional[int] = None) -> None:
        """Raise ``ChunkCorrupted`` unless ``memory_obj`` holds a whole chunk
        sealed for the key ``ident`` (see ``_verify``)."""
        self._verify(self._buffer(memory_obj), start, ident)

    def _verify(self, buf: torch.Tensor, start: int, ident: Optional[int] = None) -> None:
        """Refuse a chunk whose size, checksum or MAC is wrong, before any
        byte of it reaches vLLM's KV cache.

        With the pool secret only a MAC that verifies is accepted. Without
        it, a chunk sealed with a secret is refused, and a load that knows
        the chunk's key accepts only a checksum seeded with that key (an
        unkeyed one would let any chunk's bytes pass under this key)."""
        if buf.numel() < self.chunk_bytes + self.trailer_bytes:
            raise ChunkCorrupted(
                f"chunk at token {start}: {buf.numel()} bytes, expected at least "
                f"{self.chunk_bytes + self.trailer_bytes} (truncated or from another layout)"
            )
        if not self.checksums:
            return
        trailer = bytes(buf[self.chunk_bytes : self.chunk_bytes + TRAILER_BYTES].numpy())
        tag, stored_crc, magic = trailer[:TAG_BYTES], trailer[TAG_BYTES:-4], trailer[-4:]
        payload = buf[: self.chunk_bytes]
        if magic not in (_MAGIC, _MAGIC_KEYED, _MAGIC_MAC):
            raise ChunkCorrupted(f"chunk at token {start}: no checksum trailer")
        if self._mac_key is not None:
            if magic != _MAGIC_MAC:
                raise ChunkCorrupted(
                    f"chunk at token {start}: written without the pool secret (no MAC); "
                    "this engine accepts only authenticated entries"
                )
            want = entry_mac(payload, ident, self.key_scope, self._mac_key)
            if not hmac.compare_digest(tag, want):
                raise ChunkCorrupted(
                    f"chunk at token {start}: MAC does not verify (forged, damaged, another "
                    "chunk's bytes under this key, or written under another pool secret)"
                )
            return
        if magic == _MAGIC_MAC:
            raise ChunkCorrupted(
                f"chunk at token {start}: sealed with a pool secret this engine does not have"
            )
        if magic == _MAGIC_KEYED and ident is None:
            raise ChunkCorrupted(f"chunk at token {start}: sealed for a key, loaded without one")
        if magic == _MAGIC and ident is not None:
            raise ChunkCorrupted(
                f"chunk at token {start}: sealed without its key (an unkeyed checksum), "
                "loaded for a known key"
            )
        (want_crc,) = struct.unpack("<I", stored_crc)
        got = _crc(payload, ident)
        if got != want_crc:
            raise ChunkCorrupted(
                f"chunk at token {start}: checksum {got:#010x} != stored {want_crc:#010x} "
                "(damaged, or another chunk's bytes under this key)"
            )

    @staticmethod
    def _buffer(memory_obj: MemoryObj) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise RuntimeError("LMCache MemoryObj has no tensor to copy into/from")
        return tensor.view(torch.uint8).reshape(-1)

    def _ctx(self, kwargs: Mapping[str, Any]) -> TransferContext:  # not static: AdapterChunkConnector's needs self
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
                ident = ctx.chunk_ids.get(start)
                if ident is None and self.checksums:
                    # Every lookup of ours knows the key and refuses an
                    # unkeyed seal: never write one.
                    raise RuntimeError(
                        f"request {ctx.req_id}: chunk at token {start} has no key identity; not stored"
                    )
                piece = ctx.state_piece(start, self.chunk_size)
                if piece is not None:
                    assert ctx.state is not None  # a piece index needs a state
                    ctx.state.store_piece(buf[: self.chunk_bytes], piece)
                    self._seal_stored(obj, buf, ident)
                    continue
                result = self._store(buf, ChunkRequest(start, end, ctx.block_ids))
                if getattr(result, "stored", True) is False:
                    # Never seal (and so validate) a buffer nothing was copied into.
                    raise RuntimeError(
                        f"request {ctx.req_id}: chunk at token {start} has groups without "
                        f"real blocks ({getattr(result, 'incomplete', ())}); not stored"
                    )
                self._seal_stored(obj, buf, ident)
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
                    assert ctx.state is not None  # a piece index needs a state
                    ctx.state.load_piece(buf[: self.chunk_bytes], piece)
                    outcome.state_pieces += 1
                    continue
                if ctx.verified and ctx.deferred is not None:
                    ctx.deferred.append(DeferredChunk(ctx.req_id, start, buf, ChunkRequest(start, end, ctx.block_ids)))
                else:
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
