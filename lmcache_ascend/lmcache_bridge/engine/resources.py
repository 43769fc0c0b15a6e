"""Closing LMCache resources without ever hanging.

LMCache 0.5.6's engine close can block forever when a Redis remote backend
is configured (its connector's close waits on its own event loop). Each
resource is closed on a daemon thread with a deadline, and the Redis
connector is detached first (``detach_remote_backends``), logging what did
not finish; the process exits regardless.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from lmcache_ascend.lmcache_bridge.patching import overrides

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


def bounded_close(name: str, fn: Callable[[], Any], timeout: float = CLOSE_TIMEOUT_S) -> bool:
    done = threading.Event()
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"lmcache-ascend-close-{name}", daemon=True).start()
    if not done.wait(timeout):
        logger.warning(
            "lmcache-ascend: closing %s did not finish within %.1f s (a known LMCache "
            "0.5.6 hang with remote backends); continuing shutdown without it",
            name,
            timeout,
        )
        return False
    if error:
        logger.warning("lmcache-ascend: closing %s raised %r", name, error[0])
        return False
    return True


def detach_remote_backends(engine: Any, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Work around LMCache 0.5.6's Redis close deadlock.

    ``RedisConnector.close()`` runs on the storage manager's event loop and
    calls the blocking ``AsyncPQExecutor.shutdown()``, which waits for a
    coroutine on that same loop: the loop's (non-daemon) thread deadlocks
    and the process can never exit. Close the connector's pieces with their
    async calls instead and detach it, so ``RemoteBackend.close()`` skips it.
    """
    import asyncio

    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
    for backend in list(backends.values()):
        conn = getattr(backend, "connection", None)
        if not isinstance(backend, RemoteBackend) or conn is None:
            continue
        overrides.apply(overrides.DETACHED_REMOTE_CONNECTION, backend, "connection", None)
        inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn

        async def close(inner: Any = inner) -> None:
            executor = getattr(inner, "pq_executor", None)
            if executor is not None:
                await executor.shutdown_async(wait=False)
            client = getattr(inner, "connection", None)
            if client is not None and hasattr(client, "aclose"):
                await client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(close(), backend.loop).result(timeout)
        except Exception as exc:  # noqa: BLE001
            logger.warning("lmcache-ascend: closing remote connector %r: %r", inner, exc)
