"""The prefix-hash memo against LMCache's own ChunkedTokenDatabase: the
same keys as unmemoized hashing, from any token container, bounded, and
safe to share between threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lmcache_ascend.lmcache_bridge.engine import hash_memo

CHUNK = 16


def _db(save_unfull: bool = False):
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, pre_caching_hash_algorithm="sha256_cbor",
        save_unfull_chunk=save_unfull,
    )
    return lmcache_modules.load(lmcache_modules.TOKEN_DATABASE).ChunkedTokenDatabase(cfg, None)


def _keys(db, tokens, mask=None):
    return [tuple(r) for r in db.process_tokens(tokens, mask=mask, make_key=False)]


def test_memoized_keys_equal_lmcache_keys():
    rng = np.random.default_rng(0)
    ref, memo_db = _db(save_unfull=True), _db(save_unfull=True)
    memo = hash_memo.install(memo_db, CHUNK)
    base = rng.integers(0, 50_000, 200)
    prompts = [base, base[:100], np.concatenate([base[:64], rng.integers(0, 50_000, 90)]),
               rng.integers(0, 50_000, 7), base]
    for p in prompts:
        tokens = torch.from_numpy(p)
        assert _keys(memo_db, tokens) == _keys(ref, tokens)
        # Store-style call: a mask whose False prefix is whole chunks.
        mask = torch.ones(len(p), dtype=torch.bool)
        mask[: (len(p) // 2) // CHUNK * CHUNK] = False
        assert _keys(memo_db, tokens, mask) == _keys(ref, tokens, mask)
    # The repeated prompt and the shared prefixes came from the memo.
    assert memo.hits > 0 and memo.misses > 0
    before = memo.misses
    _keys(memo_db, torch.from_numpy(base))
    assert memo.misses == before


def test_same_ids_in_any_container_share_entries():
    db = _db()
    memo = hash_memo.install(db, CHUNK)
    ids = list(range(1000, 1000 + 4 * CHUNK))
    first = _keys(db, torch.tensor(ids, dtype=torch.int64))
    misses = memo.misses
    assert _keys(db, torch.tensor(ids, dtype=torch.int32)) == first
    assert _keys(db, ids) == first
    assert memo.misses == misses and memo.hits == 2 * 4
    # One id changed in chunk 2: chunks 0-1 hit, 2-3 are new (chained).
    ids[2 * CHUNK + 3] += 1
    changed = _keys(db, ids)
    assert changed[:2] == first[:2] and changed[2][2] != first[2][2]
    assert changed[3][2] != first[3][2] and memo.misses == misses + 2


def test_bounded_lru():
    db = _db()
    memo = hash_memo.install(db, CHUNK, capacity=8)
    tokens = torch.arange(20 * CHUNK)
    ref = _keys(_db(), tokens)
    assert _keys(db, tokens) == ref and len(memo) == 8
    # Oldest entries went first: the chain's start is hashed again.
    misses = memo.misses
    assert _keys(db, tokens[: 2 * CHUNK]) == ref[:2] and memo.misses == misses + 2
    with pytest.raises(ValueError, match="capacity"):
        hash_memo.PrefixHashMemo(lambda c, p: 0, 0)


def test_threads_share_one_memo():
    db = _db()
    memo = hash_memo.install(db, CHUNK, capacity=64)
    rng = np.random.default_rng(1)
    prompts = [torch.from_numpy(rng.integers(0, 9, 12 * CHUNK)) for _ in range(6)]
    ref_db = _db()
    want = [_keys(ref_db, p) for p in prompts]
    errors: list[str] = []

    def work(k: int) -> None:
        for it in range(30):
            i = (k + it) % len(prompts)
            if _keys(db, prompts[i]) != want[i]:
                errors.append(f"thread {k} prompt {i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(memo) <= 64


def test_install_refuses_unknown_databases():
    with pytest.raises(TypeError, match="ChunkedTokenDatabase"):
        hash_memo.install(object(), CHUNK)
    with pytest.raises(TypeError, match="integers"):
        hash_memo.install(_db(), CHUNK).next_hash(0, [1.5, 2.0])
