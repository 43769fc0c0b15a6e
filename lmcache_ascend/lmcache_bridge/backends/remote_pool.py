"""A remote store (``remote_url``) that is down is an outage, not a fault of
the engine: it starts and serves without the store, and uses the store as
soon as it is back.

What happens where:

* At startup (``check_at_startup``, from ``config.validate_engine_config``):
  a misconfiguration (keys Mooncake would ignore, an address that does not
  parse, holders on another metadata server) still stops startup with its
  message. An unreachable or empty pool (no Redis or Mooncake master
  accepting connections, no segment to write to) raises
  :class:`PoolUnavailableError` in the backend's check; here it becomes one
  ERROR naming the backend and the reason, counted (``remote_unavailable``),
  and the engine starts, unless ``ascend_require_remote`` is true, which
  keeps the strict behaviour (startup stops, naming the key).
* Redis (``redis://``, ``rediss://``) is also asked for a PING with the
  URL's credentials and TLS settings, as LMCache's connector will connect
  (redis-py, :func:`redis_refusal`): a wrong or missing password, or a
  server certificate the client does not trust, is a misconfiguration and
  stops startup naming ``remote_url`` (its password masked); it would
  otherwise fail every lookup and store for the engine's life, each time
  only as a miss.
* While it runs (:class:`Reconnector`): LMCache's ``RemoteBackend`` keeps no
  connection when creating its connector raised (Mooncake with its master
  down), and only LMCache's health monitor, which this connector does not
  run, would try again. A daemon thread calls LMCache's own
  ``RemoteBackend.init_connection`` for such a backend once the store
  accepts TCP connections again, at most every ``RECONNECT_S``, and logs
  when it is connected. (LMCache's Redis connector connects lazily: it
  exists while Redis is down and reconnects by itself; the thread only
  says when the store is back.) Until then lookups miss and stores stay
  local: speed, never an output.

Redis and Mooncake behave alike; the README has the table.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import Any, Optional
from urllib.parse import urlparse

from lmcache_ascend.lmcache_bridge.backends.credentials import redact_url
from lmcache_ascend.lmcache_bridge.patching import overrides

logger = logging.getLogger(__name__)

RECONNECT_S = 10.0  # LMCache's RemoteBackend.min_reconnect_interval
CONNECT_TIMEOUT_S = 2.0
# Default ports of the URL schemes a TCP check can read (LMCache's remote
# connectors; mooncakestore:// names its master in extra_config instead).
# resp: LMCache's native Redis client (same server, same port).
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6380, "resp": 6379, "lm": 65432, "valkey": 6379}


class PoolUnavailableError(RuntimeError):
    """The remote store is configured right but cannot serve now."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason


_lock = threading.Lock()
_COUNTS: Counter = Counter()
_REPORTED: set = set()
# remote_url of the stores found down at startup, until seen back: a
# connector that connects lazily (LMCache's Redis) is created anyway, so
# the Reconnector watches these too, to say when the store is back.
_DOWN_AT_START: set = set()


def unavailable_count() -> int:
    """Times a remote store was found unavailable in this process (at
    startup, and each failed reconnection): cumulative."""
    with _lock:
        return sum(_COUNTS.values())


def _count(backend: str) -> int:
    with _lock:
        _COUNTS[backend] += 1
        return _COUNTS[backend]


def tcp_target(remote_url: str) -> Optional[tuple[str, int]]:
    """host, port of a ``scheme://host:port`` remote URL; None where it names
    no TCP address (``mooncakestore://``: its master is in extra_config)."""
    url = urlparse(str(remote_url))
    if url.scheme not in _DEFAULT_PORTS or not url.hostname:
        return None
    return url.hostname, url.port or _DEFAULT_PORTS[url.scheme]


def unreachable(host: str, port: int) -> Optional[str]:
    """Why nothing accepts a TCP connection at host:port, None if something does."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


_REDIS_SCHEMES = ("redis", "rediss")


def _ssl_failure(error: BaseException) -> Optional[BaseException]:
    import ssl

    seen = 0
    e: Optional[BaseException] = error
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def redis_refusal(remote_url: str) -> Optional[str]:
    """Connect to Redis as LMCache's connector will (redis-py, the URL's
    credentials and TLS options) and PING. Returns None when it answers;
    raises ``ValueError`` where the server refuses the credentials or the
    TLS handshake fails (misconfiguration); returns the reason where nothing
    answers (the caller treats that as an outage)."""
    import redis

    url = redact_url(remote_url)
    try:
        client = redis.Redis.from_url(
            remote_url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    except ValueError as e:
        raise ValueError(f"remote_url={url!r} is not a valid Redis URL: {redact_url(e)}") from None
    try:
        client.ping()
        return None
    except redis.exceptions.AuthenticationError as e:
        why = redact_url(e) or type(e).__name__
    except redis.exceptions.ResponseError as e:
        # Older redis-py raises NOAUTH/WRONGPASS as a plain ResponseError.
        if not any(w in str(e) for w in ("NOAUTH", "WRONGPASS", "invalid password", "invalid username")):
            raise ValueError(f"remote_url={url!r}: Redis answered PING with an error: {redact_url(e)}") from None
        why = redact_url(e)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        tls = _ssl_failure(e)
        if tls is not None:
            raise ValueError(
                f"remote_url={url!r}: the TLS handshake with Redis failed ({redact_url(tls)}). Check that the "
                "server's certificate is signed by the CA the URL names (rediss://...?ssl_ca_certs=/path/ca.crt) "
                "and issued for the host in the URL"
            ) from None
        return f"{type(e).__name__}: {redact_url(e)}"
    finally:
        client.close()
    raise ValueError(
        f"remote_url={url!r}: Redis refused the credentials ({why}). Give the user and password in "
        "remote_url as redis://USER:PASSWORD@host:port (rediss:// for TLS; USER 'default' with "
        "requirepass), in LMCache's config file or the LMCACHE_REMOTE_URL environment variable"
    )


_HINTED: set = set()


def hint_scheme(remote_url: str) -> None:
    """Once per process: a redis:// pool could be read faster as resp://
    (the same server through LMCache's native client). Not for rediss://:
    resp:// has no TLS."""
    if urlparse(remote_url).scheme != "redis":
        return
    with _lock:
        if "redis" in _HINTED:
            return
        _HINTED.add("redis")
    logger.info(
        "lmcache-ascend: remote_url %s reads the pool through redis-py; resp:// reads the same "
        "redis-server through LMCache's native client, a staged hit about as fast as the connector's own "
        "redis:// reads (ascend_redis_sync_reads with hiredis) and 2-3x LMCache's redis-py reads in "
        "docs/benchmarks.md (every instance sharing the pool must use the same scheme: their keys differ)",
        redact_url(remote_url),
    )


def check_at_startup(config: Any, environ: Any, require_remote: bool) -> None:
    """The remote store's startup check: misconfiguration raises (from the
    backend's check); an unavailable store raises only with
    ``require_remote``, else it is logged as one ERROR and counted."""
    from lmcache_ascend.lmcache_bridge.backends import mooncake

    if not getattr(config, "remote_url", None):
        return
    hint_scheme(str(config.remote_url))
    try:
        if mooncake.uses_mooncake(config):
            mooncake.check_config(config, environ)
        else:
            target = tcp_target(config.remote_url)
            why = unreachable(*target) if target is not None else None
            if target is not None and why:
                raise PoolUnavailableError(
                    f"remote_url={redact_url(config.remote_url)!r}",
                    f"nothing accepts connections at {target[0]}:{target[1]} ({why})")
            if urlparse(str(config.remote_url)).scheme in _REDIS_SCHEMES:
                why = redis_refusal(str(config.remote_url))
                if why:
                    raise PoolUnavailableError(
                        f"remote_url={redact_url(config.remote_url)!r}", f"Redis does not answer ({why})")
    except PoolUnavailableError as e:
        if require_remote:
            raise ValueError(
                f"{e} (ascend_require_remote: true stops startup; with false the engine starts without the "
                "remote store and connects when it is back)"
            ) from e
        # Both halves of an in-process engine validate the same config: one
        # ERROR (and one count) per process and store.
        with _lock:
            if str(e) in _REPORTED:
                return
            _REPORTED.add(str(e))
        _count(e.backend)
        with _lock:
            _DOWN_AT_START.add(str(config.remote_url))
        logger.error(
            "lmcache-ascend: remote store unavailable at startup, %s. The engine starts without it: lookups "
            "miss it and stores stay in the local cache until it is back (checked every %.0f s; counted in "
            "remote_unavailable). Set ascend_require_remote: true to stop startup instead.",
            e, RECONNECT_S,
        )


class Reconnector:
    """Re-creates the connector of every LMCache ``RemoteBackend`` left
    without one, once its store accepts connections again."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._stop = threading.Event()
        self._down_since: dict[int, float] = {}
        self._started = time.monotonic()
        self._thread: Optional[threading.Thread] = None

    def _backends(self) -> list:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        backends = getattr(getattr(self._engine, "storage_manager", None), "storage_backends", None) or {}
        return [b for b in list(backends.values()) if isinstance(b, RemoteBackend)]

    def _watched(self, backend: Any) -> bool:
        with _lock:
            return backend.connection is None or self._url(backend) in _DOWN_AT_START

    @staticmethod
    def _url(backend: Any) -> str:
        return str(getattr(backend, "remote_url", None) or getattr(backend.config, "remote_url", ""))

    def start(self) -> "Reconnector":
        if any(self._watched(b) for b in self._backends()):
            self._thread = threading.Thread(target=self._run, name="lmcache-ascend-reconnect", daemon=True)
            self._thread.start()
        return self

    def _target(self, backend: Any) -> Optional[tuple[str, int]]:
        from lmcache_ascend.lmcache_bridge.backends import mooncake

        url = self._url(backend)
        if url.startswith(mooncake.URL_SCHEME):
            return mooncake.master_address(backend.config)
        return tcp_target(url)

    def attempt(self) -> int:
        """One pass; returns how many backends are still without a connection."""
        left = 0
        for backend in self._backends():
            if not self._watched(backend):
                continue
            self._down_since.setdefault(id(backend), self._started)
            target = self._target(backend)
            if target is not None and unreachable(*target):
                _count("reconnect")
                left += 1
                continue
            if backend.connection is None:
                # This check replaces LMCache's wait between attempts.
                overrides.apply(overrides.RECONNECT_NOW, backend, "failure_time", 0)
                backend.init_connection()
            if backend.connection is None:
                _count("reconnect")
                left += 1
                continue
            with _lock:
                _DOWN_AT_START.discard(self._url(backend))
            down = time.monotonic() - self._down_since.pop(id(backend))
            logger.info("lmcache-ascend: remote store %s connected (was unavailable for %.0f s)",
                        redact_url(self._url(backend)), down)
        return left

    def _run(self) -> None:
        while not self._stop.wait(RECONNECT_S):
            try:
                if self.attempt() == 0:
                    return
            except Exception as e:  # noqa: BLE001 - a failed attempt is retried, never raised into vLLM
                logger.warning("lmcache-ascend: reconnecting to the remote store failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
