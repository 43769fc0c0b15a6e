"""Redis with a password and TLS (remote_pool.redis_refusal, credentials.py),
against a real ``redis-server`` started here with ``--requirepass`` and
``--tls-port`` (a CA and server certificate made with ``openssl``):

* the right credentials over TLS pass the startup check, and LMCache's own
  Redis connector (redis-py, the same URL) stores and reads through them;
* a wrong or missing password, or a CA that did not sign the server's
  certificate, stops startup naming ``remote_url``, the password masked;
  with ``ascend_require_remote`` false too (a misconfiguration, not an
  outage);
* a stopped server is still an outage: logged, counted, startup goes on;
* the password appears in no log line: LMCache's configuration dump and
  connector creation, this package's messages, vLLM's logger.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from lmcache_configs import lmcache_config

from lmcache_ascend.lmcache_bridge.backends import credentials, remote_pool
from redis_server import RedisServer, ensure_redis_server

PASSWORD = "pw-Zq81-not-in-any-log"


_config = lmcache_config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path_factory.mktemp("redis_tls"), password=PASSWORD, tls=True) as s:
        yield s


@pytest.fixture
def log_text(caplog):
    """Everything logged at INFO and above, as the handler formats it, with
    the redacting record factory installed as a connector installs it."""
    credentials.install()
    caplog.set_level(logging.INFO)
    return lambda: "\n".join(r.getMessage() for r in caplog.records)


def test_right_credentials_over_tls_pass_and_lmcaches_connector_uses_them(server, log_text):
    assert server.url.startswith("rediss://default:")
    remote_pool.check_at_startup(_config(remote_url=server.url), {}, require_remote=True)
    assert remote_pool.redis_refusal(server.url) is None

    # LMCache's own connector class connects with the same URL (redis-py's
    # asyncio client): what the engine will do.
    import redis.asyncio as aioredis

    async def roundtrip() -> bytes:
        client = aioredis.Redis.from_pool(aioredis.ConnectionPool.from_url(server.url))
        await client.set("lmca-probe", b"x" * 100)
        got = await client.get("lmca-probe")
        await client.aclose()
        return got

    assert asyncio.run(roundtrip()) == b"x" * 100
    with server.client() as c:
        assert c.get(b"lmca-probe") == b"x" * 100


def test_an_acl_user_in_the_url_is_what_redis_authenticates(server, log_text):
    with server.client() as c:
        c.command("ACL", "SETUSER", "lmca", "on", ">acl-pw-Hh31", "~*", "+@all")
    good = server.url.replace(f"default:{PASSWORD}@", "lmca:acl-pw-Hh31@")
    remote_pool.check_at_startup(_config(remote_url=good), {}, require_remote=True)
    with pytest.raises(ValueError, match="refused the credentials") as e:
        remote_pool.check_at_startup(_config(remote_url=good.replace("lmca:", "nobody:")), {}, require_remote=False)
    assert "acl-pw-Hh31" not in str(e.value) and "nobody:***@" in str(e.value)


@pytest.mark.parametrize("require_remote", [False, True])
@pytest.mark.parametrize("case", ["wrong_password", "no_password"])
def test_refused_credentials_stop_startup_naming_the_setting(server, log_text, case, require_remote):
    url = server.url.replace(PASSWORD, "not-the-password") if case == "wrong_password" \
        else server.url.replace(f"default:{PASSWORD}@", "")
    with pytest.raises(ValueError) as e:
        remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=require_remote)
    text = str(e.value)
    assert "remote_url=" in text and "refused the credentials" in text and "USER:PASSWORD@" in text
    assert "not-the-password" not in text and PASSWORD not in text
    if case == "wrong_password":
        assert "default:***@" in text


def test_untrusted_certificate_stops_startup(server, tmp_path, log_text):
    from redis_server import make_tls_files

    other_ca = make_tls_files(tmp_path / "other").ca_cert
    url = server.url.replace(str(server.tls.ca_cert), str(other_ca))
    with pytest.raises(ValueError, match="TLS handshake with Redis failed.*ssl_ca_certs") as e:
        remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=False)
    assert PASSWORD not in str(e.value)


def test_a_stopped_server_is_an_outage_not_a_misconfiguration(tmp_path, caplog):
    credentials.install()
    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with RedisServer(tmp_path, password=PASSWORD, tls=True) as s:
        url = s.url
    before = remote_pool.unavailable_count()
    with caplog.at_level(logging.ERROR):
        remote_pool.check_at_startup(_config(remote_url=url), {}, require_remote=False)
    assert remote_pool.unavailable_count() == before + 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "unavailable at startup" in errors[0]
    assert PASSWORD not in errors[0] and "default:***@" in errors[0]


def test_no_log_line_shows_the_password(server, log_text):
    """LMCache's config dump and connector creation print remote_url and
    extra_config; a vLLM logger and ours may print either."""
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_ascend.lmcache_bridge.engine.config import apply_extra_config, validate_engine_config

    cfg = _config(remote_url=server.url, remote_serde="naive",
                  extra_config={"password": PASSWORD, "username": "default"})
    validate_engine_config(cfg, {"LMCACHE_RESP_PASSWORD": PASSWORD})
    cfg.log_config()  # LMCache's own "LMCache Configuration: {...}"
    assert isinstance(cfg, LMCacheEngineConfig)
    # LMCache's Redis adapter logs the URL it connects to (its logger does
    # not propagate: read what reaches its own handlers).
    from lmcache.v1.storage_backend.connector import redis_adapter

    seen: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = seen.append  # type: ignore[method-assign]
    redis_adapter.logger.addHandler(catch)
    try:
        redis_adapter.logger.info("Creating Redis connector for URL: %s", server.url)
    finally:
        redis_adapter.logger.removeHandler(catch)
    assert [r.getMessage() for r in seen] == [
        "Creating Redis connector for URL: " + server.url.replace(PASSWORD, "***")]
    logging.getLogger("vllm.test").info("kv_transfer_config=%s", {"remote_url": server.url})
    apply_extra_config(_config(), {"lmcache.remote_url": server.url})
    text = log_text()
    assert "LMCache Configuration" in text
    assert "kv_connector_extra_config 'lmcache.remote_url' carries a password" in text
    assert PASSWORD not in text
    assert text.count("default:***@127.0.0.1") >= 2


@pytest.mark.parametrize(
    "line, shown",
    [
        ("url rediss://u:p4ss-word@h:1/0", "url rediss://u:***@h:1/0"),
        ("url redis://:p4ss-word@h", "url redis://:***@h"),
        ("{'password': 'p4ss-word', 'username': 'u'}", "{'password': '***', 'username': 'u'}"),
        ('{"password": "p4ss-word"}', '{"password": "***"}'),
        ("password=p4ss-word rest", "password=*** rest"),
        ("user@example.com and redis://h:1 stay", "user@example.com and redis://h:1 stay"),
    ],
)
def test_redaction_patterns(line, shown):
    assert credentials.redact(line) == shown


def test_a_record_made_while_this_thread_holds_the_lock_does_not_hang():
    """The garbage collector can run a finalizer that logs (asyncio's "Task
    was destroyed but it is pending") while this thread is inside the record
    factory's secret match: the factory must not wait on itself. It hung a
    unit-test run with a plain Lock."""
    import threading

    credentials.install()
    credentials.register(["hunter2-secret-value"])
    done = threading.Event()

    def log_inside_the_lock():
        with credentials._lock:  # as if a finalizer logged in the middle of a match
            logging.getLogger("lmcache_ascend.test").warning("reentrant record hunter2-secret-value")
        done.set()

    threading.Thread(target=log_inside_the_lock, daemon=True).start()
    assert done.wait(10), "a record made inside the secret match hung its thread"
