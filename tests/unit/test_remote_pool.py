"""A remote store that is down at startup (remote_pool.py): an ERROR and a
count, and the engine starts, unless ``ascend_require_remote``; a
misconfiguration stops startup either way. Uses LMCache's real config and
its real RemoteBackend with a real Redis started here; the engine-level
reconnect is in tests/integration/test_remote_outage.py."""

from __future__ import annotations

import logging
import socket

import pytest

from lmcache_configs import lmcache_config
from ports import free_port as unused_port

from lmcache_ascend.lmcache_bridge.backends import remote_pool


_config = lmcache_config


def test_tcp_targets_of_remote_urls():
    assert remote_pool.tcp_target("redis://10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert remote_pool.tcp_target("redis://cache") == ("cache", 6379)
    assert remote_pool.tcp_target("rediss://cache") == ("cache", 6380)
    assert remote_pool.tcp_target("resp://10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert remote_pool.tcp_target("mooncakestore://127.0.0.1:50051/") is None  # its master is in extra_config
    assert remote_pool.tcp_target("fs:///tmp/x") is None


def test_a_redis_url_is_told_once_of_resp(caplog, monkeypatch):
    monkeypatch.setattr(remote_pool, "_HINTED", set())
    with caplog.at_level(logging.INFO, logger=remote_pool.__name__):
        for url in ("resp://127.0.0.1:1", "rediss://cache:6380", "redis://u:secret@127.0.0.1:1", "redis://h:2"):
            remote_pool.hint_scheme(url)
    hints = [r.getMessage() for r in caplog.records if "resp://" in r.getMessage()]
    assert len(hints) == 1 and "redis://u:***@127.0.0.1:1" in hints[0] and "secret" not in hints[0], hints


def test_redis_down_at_startup_is_one_error_and_a_count(caplog):
    url = f"redis://127.0.0.1:{unused_port()}"
    before = remote_pool.unavailable_count()
    with caplog.at_level(logging.ERROR, logger=remote_pool.__name__):
        remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=False)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and url in errors[0].getMessage() and "ascend_require_remote" in errors[0].getMessage()
    assert remote_pool.unavailable_count() == before + 1


def test_require_remote_stops_startup_naming_the_key():
    url = f"redis://127.0.0.1:{unused_port()}"
    with pytest.raises(ValueError, match="nothing accepts connections.*ascend_require_remote: true"):
        remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=True)


def test_the_key_is_read_from_lmcaches_config(monkeypatch):
    from lmcache_ascend.lmcache_bridge.engine.config import validate_engine_config

    url = f"redis://127.0.0.1:{unused_port()}"
    cfg = _config(remote_url=url, remote_serde="naive", ascend_require_remote=True)
    with pytest.raises(ValueError, match="ascend_require_remote"):
        validate_engine_config(cfg, {})
    cfg.ascend_require_remote = False
    validate_engine_config(cfg, {})  # starts: the ERROR is the test above


def test_a_reachable_store_passes_silently(caplog, tmp_path):
    from redis_server import RedisServer, ensure_redis_server

    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path) as server:
        before = remote_pool.unavailable_count()
        with caplog.at_level(logging.ERROR, logger=remote_pool.__name__):
            remote_pool.check_at_startup(_config(remote_url=server.url), {}, require_remote=True)
    assert not caplog.records and remote_pool.unavailable_count() == before


def test_a_port_that_accepts_but_does_not_speak_redis_is_an_outage(caplog):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"redis://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ValueError, match="Redis does not answer.*ascend_require_remote: true"):
            remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=True)


def test_mooncake_misconfiguration_still_stops_startup():
    from lmcache_ascend.lmcache_bridge.backends.mooncake import MooncakeConfigError

    cfg = _config(remote_url="mooncakestore://127.0.0.1:1/",
                  extra_config={"master_server_address": "127.0.0.1:1", "mooncake_metadata_server": "P2PHANDSHAKE",
                                "mooncake_local_hostname": "127.0.0.1"})
    pytest.importorskip("mooncake.store")
    with pytest.raises(MooncakeConfigError, match="'master_server_address'"):
        remote_pool.check_at_startup(cfg, {}, require_remote=False)
