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
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="LMCache seeds chunk hashes from vLLM")


_PROBE = r"""
import json, sys, torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules
token_database = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE)
cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, pre_caching_hash_algorithm="sha256_cbor")
db = token_database.ChunkedTokenDatabase(cfg, None)
if sys.argv[1] == "pinned":  # what both halves do with their engine / lookup client
    from types import SimpleNamespace
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import prepare_token_database
    assert prepare_token_database(SimpleNamespace(token_database=db), 16, "test") is not None
tokens = torch.arange(1000, 1064)
keys = [int(r[2]) for r in db.process_tokens(tokens, make_key=False)]
print(json.dumps({"init": int(db._get_init_hash()), "keys": keys}))
"""


def _run(mode: str, seed: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.compat("lmcache")  # LMCache's hashing, in fresh processes
def test_pinned_chunk_keys_agree_across_processes_without_pythonhashseed():
    a, b = _run("pinned"), _run("pinned")
    assert len(a["keys"]) == 4
    assert a == b


@pytest.mark.compat("lmcache")  # LMCache's hashing, in fresh processes
def test_unpinned_keys_show_the_hazard_the_pin_removes():
    """What LMCache does by itself: per-process seeds on vLLM < 0.32 (every
    lookup would miss), one fixed seed on 0.32, which the pin reproduces, so
    engines of all supported vLLMs share chunks."""
    a, b = _run("lmcache"), _run("lmcache")
    pinned = _run("pinned")
    # vLLM >= 0.29 seeds NONE_HASH with a fixed string when PYTHONHASHSEED
    # is unset (kv_cache_utils.DEFAULT_NONE_HASH_SEED); older ones with
    # os.urandom per process.
    from vllm.v1.core import kv_cache_utils

    if not hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED"):
        assert a["init"] != b["init"] and a["keys"] != b["keys"]
    else:
        assert a == b == pinned


@pytest.mark.compat("lmcache")  # LMCache's hashing, in fresh processes
def test_pin_follows_pythonhashseed_like_lmcache_does():
    """With PYTHONHASHSEED set, LMCache itself is deterministic on every vLLM;
    the pinned seed is then the same value, not a second convention."""
    assert _run("pinned", seed="0") == _run("lmcache", seed="0")
