"""What the Redis engine tests share: the engines' environment for LMCache's
Redis remote backend, and how to find and rewrite a stored chunk's entries
(LMCache keeps two Redis keys per chunk: ``<key>metadata`` and
``<key>kv_bytes``)."""

from __future__ import annotations

import struct

from faults import CHUNK


def redis_engine_env(url: str, **extra: str) -> dict[str, str]:
    """LMCache settings of an engine that shares ``url`` (plus ``extra``)."""
    return {
        "LMCACHE_REMOTE_URL": url,
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        # A slow lookup on a loaded machine must not become a miss here; a
        # lookup LMCache never answers costs this much.
        "LMCACHE_LOOKUP_TIMEOUT_MS": "10000",
        **extra,
    }


def chunk_base(keys: list[bytes], hex_hash: str) -> bytes:
    """The Redis key prefix of the one stored chunk whose hash is ``hex_hash``."""
    suffix = b"metadata"
    hits = [k[: -len(suffix)] for k in keys if k.endswith(suffix) and f"@{hex_hash}@".encode() in k]
    assert len(hits) == 1, f"chunk {hex_hash}: expected one metadata key, found {hits}"
    return hits[0]


def rewrite_metadata_smaller(raw: bytes, new_length: int) -> tuple[bytes, int]:
    """LMCache's RemoteMetadata (int32s: length, format, then dtype and a 4-D
    shape per buffer; one buffer here) with the length and the last shape
    dim shrunk, as a writer with a smaller chunk layout would produce."""
    fields = list(struct.unpack_from("7i", raw))
    rows = fields[3] * fields[4] * fields[5]
    fields[6] = new_length // rows
    fields[0] = rows * fields[6]
    return struct.pack("7i", *fields) + raw[struct.calcsize("7i") :], fields[0]
