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
