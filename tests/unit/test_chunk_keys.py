"""Chunk keys agree across processes without PYTHONHASHSEED, on every
supported vLLM.

vLLM's scheduler and worker are different processes. LMCache seeds its chunk
hash chain with vLLM's NONE_HASH, which vLLM < 0.32 draws from os.urandom
per process when PYTHONHASHSEED is unset; the connector pins the seed
(runtime.pin_init_hash). Each case runs LMCache's real ChunkedTokenDatabase
in fresh interpreters, as the scheduler and the worker would.
"""

from __future__ import annotations

import json
import os

import fresh_python
import pytest

pytest.importorskip("vllm", reason="LMCache seeds chunk hashes from vLLM")


# One fresh interpreter answers for both halves' cases: LMCache's own
# database first, then one the connector pinned (the pin is per instance, so
# the first is untouched). Three interpreters serve the module's tests (each
# imports torch and LMCache: seconds on every stack that runs them).
_PROBE = r"""
import json, sys, torch
from types import SimpleNamespace
from lmcache.v1.config import LMCacheEngineConfig
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules
from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import prepare_token_database
token_database = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE)
cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, pre_caching_hash_algorithm="sha256_cbor")
tokens = torch.arange(1000, 1064)
out = {}
for mode in ("lmcache", "pinned"):
    db = token_database.ChunkedTokenDatabase(cfg, None)
    if mode == "pinned":  # what both halves do with their engine / lookup client
        assert prepare_token_database(SimpleNamespace(token_database=db), 16, "test") is not None
    keys = [int(r[2]) for r in db.process_tokens(tokens, make_key=False)]
    out[mode] = {"init": int(db._get_init_hash()), "keys": keys}
print(json.dumps(out))
"""


def _run(seed: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = fresh_python.run(_PROBE, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """Two interpreters without PYTHONHASHSEED (a scheduler and a worker)
    and one with it set."""
    return {"a": _run(), "b": _run(), "seed0": _run(seed="0")}


# Marked with the vLLM fact too: whether NONE_HASH is random per process
# without PYTHONHASHSEED (vLLM < 0.29) is what the pin exists for.
@pytest.mark.compat("lmcache", "none_hash_seed")  # LMCache's hashing, in fresh processes
def test_pinned_chunk_keys_agree_across_processes_without_pythonhashseed(runs):
    a, b = runs["a"]["pinned"], runs["b"]["pinned"]
    assert len(a["keys"]) == 4
    assert a == b


@pytest.mark.compat("lmcache", "none_hash_seed")  # LMCache's hashing, in fresh processes
def test_unpinned_keys_show_the_hazard_the_pin_removes(runs):
    """What LMCache does by itself: per-process seeds on vLLM < 0.29 (every
    lookup would miss), one fixed seed from 0.29 on, which the pin
    reproduces, so engines of all supported vLLMs share chunks."""
    a, b, pinned = runs["a"]["lmcache"], runs["b"]["lmcache"], runs["a"]["pinned"]
    # vLLM >= 0.29 seeds NONE_HASH with a fixed string when PYTHONHASHSEED
    # is unset (kv_cache_utils.DEFAULT_NONE_HASH_SEED); older ones with
    # os.urandom per process.
    from vllm.v1.core import kv_cache_utils

    if not hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED"):
        assert a["init"] != b["init"] and a["keys"] != b["keys"]
        assert pinned["keys"] == runs["b"]["pinned"]["keys"]
    else:
        assert a == b == pinned


@pytest.mark.compat("lmcache", "none_hash_seed")  # LMCache's hashing, in fresh processes
def test_pin_follows_pythonhashseed_like_lmcache_does(runs):
    """With PYTHONHASHSEED set, LMCache itself is deterministic on every vLLM;
    the pinned seed is then the same value, not a second convention."""
    assert runs["seed0"]["pinned"] == runs["seed0"]["lmcache"]
