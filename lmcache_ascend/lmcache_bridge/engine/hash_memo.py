"""A memo of LMCache's chunk prefix hashes.

LMCache keys a chunk by a hash chained over every chunk before it, and
recomputes the chain for each lookup, retrieve and store of a request:
three times per warm request, about 2 ms per 8k tokens each with the
deterministic ``sha256_cbor``. The chain of a prompt seen before is the same
every time, so a bounded LRU keyed by (previous hash, the chunk's tokens)
answers it without hashing. Keys hold the tokens themselves, so a hit is
exact, never a guess.

Pure: imports neither vLLM, LMCache nor the compiled ops. ``install`` works
on any token database with LMCache 0.5.6's ``_prefix_hash``/``_hash_tokens``/
``_get_init_hash`` methods.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from lmcache_ascend.lmcache_bridge.patching import overrides

# History the memo covers, in tokens: ~1.3 KB per 128-token chunk entry,
# so about 20 MB whatever the chunk size.
MEMO_TOKENS = 1 << 21


def _token_bytes(chunk: Any) -> bytes:
    if hasattr(chunk, "detach"):  # a torch tensor (any int dtype, any device)
        arr = chunk.detach().cpu().numpy()
    else:
        arr = np.asarray(chunk)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    # One canonical width: the same ids as int32 or a list give one key.
    return arr.astype(np.int64, copy=False).tobytes()


class PrefixHashMemo:
    """LRU of ``hash_chunk(chunk, prefix_hash)`` results. Thread-safe: the
    worker's lookup server thread and its model thread share one."""

    def __init__(self, hash_chunk: Callable[[Any, int], int], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 chunk, got {capacity}")
        self._hash_chunk = hash_chunk
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def next_hash(self, prefix_hash: int, chunk: Any) -> int:
        key = (prefix_hash, _token_bytes(chunk))
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
        value = self._hash_chunk(chunk, prefix_hash)  # outside the lock: the slow part
        with self._lock:
            self.misses += 1
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value

    def chain(self, token_chunks: Iterable[Any], init_hash: int) -> Iterator[int]:
        prefix = init_hash
        for chunk in token_chunks:
            prefix = self.next_hash(prefix, chunk)
            yield prefix


def install(token_database: Any, chunk_size: int, capacity: int = 0) -> PrefixHashMemo:
    """Routes ``token_database``'s prefix hashing (this instance only)
    through a new memo and returns it. ``capacity`` in chunks; 0 means
    ``MEMO_TOKENS`` worth of chunks."""
    for name in ("_prefix_hash", "_hash_tokens", "_get_init_hash"):
        if not callable(getattr(token_database, name, None)):
            raise TypeError(
                f"{type(token_database).__name__} has no {name}(); the prefix-hash memo "
                "needs LMCache 0.5.6's ChunkedTokenDatabase"
            )
    memo = PrefixHashMemo(
        token_database._hash_tokens, capacity or max(1, MEMO_TOKENS // max(1, chunk_size))
    )
    init = token_database._get_init_hash

    def prefix_hash(token_chunks: Iterable[Any]) -> Iterator[int]:
        return memo.chain(token_chunks, init())

    overrides.apply(overrides.PREFIX_HASH_MEMO, token_database, "_prefix_hash", prefix_hash)
    overrides.apply(overrides.PREFIX_HASH_MEMO, token_database, "lmcache_ascend_hash_memo", memo)
    return memo
