"""The chunk checksums' crc32 (lmcache_bridge/engine/chunk_io.py) runs on
zlib-ng: the values must be zlib's CRC-32, bit for bit, so entries sealed by
an instance on either implementation verify on the other (a pool shared with
an older instance, or one installed without zlib-ng). Every expected value
is computed here with the standard library's zlib; the connector's trailers
are compared with the ``LMCK``/``LMCA`` trailers rebuilt from it."""

from __future__ import annotations

import logging
import struct
import zlib

import pytest
import torch

from fixtures.lmcache_objs import memory_obj
from lmcache_ascend.lmcache_bridge.engine import chunk_io
from lmcache_ascend.lmcache_bridge.engine.chunk_io import (
    TRAILER_BYTES,
    ChunkCorrupted,
    PagedChunkConnector,
)

PAYLOAD = 2 * 4096 + 3  # not a multiple of any SIMD width: the tail path runs too
IDENT = 0x1234_5678_9ABC_DEF0


def ref_crc(payload: bytes, ident=None) -> int:
    seed = 0 if ident is None else zlib.crc32(str(ident).encode())
    return zlib.crc32(payload, seed)


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_zlib_ng_is_what_runs():
    # A dependency of the package and of every test stack: without it the
    # checksums run about 5x slower (and say so once).
    assert chunk_io.CRC32_IMPL == "zlib-ng"
    assert chunk_io._crc32 is not zlib.crc32


@pytest.mark.parametrize("size", [0, 1, 15, 64, 4095, 65536 + 7, (2 << 20) + 5])
@pytest.mark.parametrize("ident", [None, IDENT, -7], ids=["unkeyed", "keyed", "negative-hash"])
def test_crc_is_zlibs_crc32(size, ident):
    data = _random(size, size)
    assert chunk_io._crc(data, ident) == ref_crc(bytes(data.numpy()), ident)


def _conn() -> PagedChunkConnector:
    return PagedChunkConnector(PAYLOAD, 16, store=lambda b, r: None, load=lambda b, r: None, checksums=True)


def _chunk(allocator, seed: int):
    obj = memory_obj(allocator, PAYLOAD + TRAILER_BYTES)
    obj.tensor[:PAYLOAD].copy_(_random(PAYLOAD, seed))
    return obj


def _trailer(obj) -> bytes:
    return bytes(obj.tensor[PAYLOAD:PAYLOAD + TRAILER_BYTES].numpy())


@pytest.mark.parametrize("ident", [None, IDENT], ids=["unkeyed", "keyed"])
def test_sealed_trailer_is_the_zlib_reference_and_verifies_across_implementations(allocator, monkeypatch, ident):
    conn = _conn()
    obj = _chunk(allocator, 3)
    conn._seal(conn._buffer(obj), ident)
    payload = bytes(obj.tensor[:PAYLOAD].numpy())
    magic = b"LMCA" if ident is None else b"LMCK"
    assert _trailer(obj) == bytes(16) + struct.pack("<I", ref_crc(payload, ident)) + magic
    # Sealed on zlib-ng, verified on zlib's crc32 (an instance without zlib-ng).
    monkeypatch.setattr(chunk_io, "_crc32", zlib.crc32)
    conn.verify(obj, 0, ident)
    # Sealed on zlib, verified on zlib-ng.
    other = _chunk(allocator, 4)
    conn._seal(conn._buffer(other), ident)
    monkeypatch.undo()
    assert chunk_io._crc32 is not zlib.crc32
    conn.verify(other, 0, ident)
    other.tensor[PAYLOAD - 1] ^= 0x80  # the last byte: outside every full SIMD block
    with pytest.raises(ChunkCorrupted, match="checksum"):
        conn.verify(other, 0, ident)


def test_without_zlib_ng_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(chunk_io, "CRC32_IMPL", "zlib")
    monkeypatch.setattr(chunk_io, "_crc32", zlib.crc32)
    monkeypatch.setattr(chunk_io, "_slow_crc_logged", False)
    with caplog.at_level(logging.WARNING, logger=chunk_io.__name__):
        _conn()
        _conn()
        PagedChunkConnector(PAYLOAD, 16, store=lambda b, r: None, load=lambda b, r: None, checksums=False)
    warned = [r for r in caplog.records if "zlib-ng is not installed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "pip install zlib-ng" in warned[0].getMessage()


def test_with_zlib_ng_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=chunk_io.__name__):
        _conn()
    assert not [r for r in caplog.records if "zlib-ng" in r.getMessage()]
