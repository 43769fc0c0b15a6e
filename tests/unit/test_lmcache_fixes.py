"""LMCache 0.5.6's remote job executor survives cancelled callers.

``RemoteBackend.batched_get_blocking`` cancels the gets queued behind a
failed one. Unpatched, each such cancel can kill one of the executor's four
workers (``set_result`` on a cancelled future), after which every remote call
(``exists`` for lookups included) waits forever. The patches the vLLM plugin
and the connector module install (``adapter_route.install``) shield the
futures (lmcache_ascend/lmcache_bridge/patching/patches.py).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

from lmcache_ascend.integration.vllm import adapter_route

adapter_route.install()  # as the entry points do, before LMCache loads the module
from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor  # noqa: E402


def test_cancelled_callers_do_not_kill_the_workers():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert AsyncPQExecutor._lmcache_ascend_shielded
        executor = AsyncPQExecutor(loop, max_workers=2)
        release = asyncio.run_coroutine_threadsafe(_event(), loop).result(5)

        async def slow(x):
            await release.wait()
            return x

        # More cancelled callers than workers, each cancelled while its job
        # is queued or running (as batched_get_blocking does after a failure).
        futures = [
            asyncio.run_coroutine_threadsafe(executor.submit_job(slow, i, priority=1), loop)
            for i in range(6)
        ]
        for fut in futures:
            fut.cancel()
        loop.call_soon_threadsafe(release.set)

        async def quick():
            return "answered"

        # A later job (a lookup's exists) still gets a worker.
        later = asyncio.run_coroutine_threadsafe(executor.submit_job(quick, priority=0), loop)
        assert later.result(timeout=10) == "answered"
        assert sum(not w.done() for w in executor._workers) == 2  # both workers alive
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _event() -> asyncio.Event:
    return asyncio.Event()


class _InstantClient:
    """Stands in for LMCache's C++ client (``lmcache.lmcache_redis``) to force
    the interleaving a fast server makes by chance: the completion is
    signalled, and drained by the loop, before ``submit_*`` returns."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK)
        self._done: list = []
        self._drained = threading.Event()
        self._ids = itertools.count(1)

    def event_fd(self) -> int:
        return self._fd

    def _complete(self, n: int) -> int:
        fid = next(self._ids)
        self._drained.clear()
        self._done.append((fid, True, "", [True] * n))
        os.eventfd_write(self._fd, 1)
        # The loop drains it first; it cannot when this runs on the loop.
        self._drained.wait(0.5)
        return fid

    def submit_batch_exists(self, keys):
        return self._complete(len(keys))

    def submit_batch_get(self, keys, bufs):
        return self._complete(len(keys))

    def drain_completions(self):
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        items, self._done = self._done, []
        if items:
            self._drained.set()
        return items

    def close(self) -> None:
        os.close(self._fd)


def test_native_client_blocking_calls_see_instant_completions():
    from lmcache.v1.storage_backend.native_clients.connector_client_base import ConnectorClientBase

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        async def make():
            return ConnectorClientBase(_InstantClient(), loop)

        client = asyncio.run_coroutine_threadsafe(make(), loop).result(5)
        results: dict = {}

        def call():  # a daemon thread: unpatched, it never returns
            results["exists"] = client.batch_exists_sync(["a", "b"])
            results["get"] = client.batch_get_sync(["a"], [memoryview(bytearray(4))])

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(10)
        assert results == {"exists": [True, True], "get": None}, "a completion drained before registration was lost"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
