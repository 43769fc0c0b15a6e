"""LMCache's log lines that do not apply under this connector are dropped
and replaced once by ours (lmcache_bridge/patching/log_filters.py). Each case runs
LMCache's own code that emits the line, in a fresh interpreter (logging
filters are process-wide), with and without the filters: without them the
line must appear (so the check can fail), with them it must not, and our
line must appear exactly once however often LMCache repeats its own."""

from __future__ import annotations

import os
import textwrap

import fresh_python
import pytest

SCRIPT = textwrap.dedent('''
    import asyncio, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="OURS %(name)s %(message)s")
    if sys.argv[1] == "filtered":
        from lmcache_ascend.lmcache_bridge.patching import log_filters
        log_filters.install()
    from lmcache_ascend.lmcache_bridge.patching import lmcache_modules
    from lmcache.v1.config import LMCacheEngineConfig
    td = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE)
    # The hash this connector's config enforces (config.enforce_engine_requirements).
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, remote_url="redis://127.0.0.1:1",
                                               pre_caching_hash_algorithm="sha256_cbor")
    for _ in range(2):
        td.ChunkedTokenDatabase(config)
    import lmcache.v1.storage_backend.connector.mooncakestore_connector as mc
    connector = object.__new__(mc.MooncakestoreConnector)  # get() touches no state
    for _ in range(3):
        try:
            asyncio.run(connector.get(None))
        except NotImplementedError:
            pass
    print("DONE", file=sys.stderr)
''')

LMCACHE_ADVICE = "export PYTHONHASHSEED=0"
LMCACHE_SINGLE_GET = "Single get operation is not supported"
OUR_SEED_LINE = "LMCache's advice to export PYTHONHASHSEED=0 does not apply"
OUR_GET_LINE = "LMCache read one key from Mooncake with its single-key get"


def _run(mode: str) -> str:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)  # the condition LMCache advises on
    env["LMCACHE_LOG_LEVEL"] = "INFO"
    proc = fresh_python.run(SCRIPT, mode, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "DONE" in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    return {mode: _run(mode) for mode in ("plain", "filtered")}


@pytest.mark.compat("lmcache")  # LMCache's own loggers and messages
def test_without_the_filters_lmcache_prints_both_lines(outputs):
    text = outputs["plain"]
    assert text.count(LMCACHE_ADVICE) == 2
    assert text.count(LMCACHE_SINGLE_GET) == 3
    assert OUR_SEED_LINE not in text and OUR_GET_LINE not in text


@pytest.mark.compat("lmcache")  # LMCache's own loggers and messages
def test_the_filters_drop_them_and_say_once_what_happened(outputs):
    text = outputs["filtered"]
    assert LMCACHE_ADVICE not in text.replace(OUR_SEED_LINE, "")
    assert LMCACHE_SINGLE_GET not in text.replace("'Single get operation is not supported'", "")
    assert text.count(OUR_SEED_LINE) == 1
    assert text.count(OUR_GET_LINE) == 1
    # Other LMCache lines of the same loggers still pass.
    assert "Using hash algorithm" in text or "Loaded" in text
