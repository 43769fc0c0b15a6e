"""Lookups beside vLLM's steps (``ascend_async_lookup``).

A lookup asks the worker's lookup server for the stored prefix of a prompt.
With a disk or remote store that server fetches and verifies every chunk it
will report before it answers (``lmcache_bridge/integrity/staging.py``): a remote hit
of hundreds of MB keeps vLLM's scheduler waiting, and with it every request
already decoding. vLLM lets a connector answer "not yet": ``None`` from
``get_num_new_matched_tokens`` leaves the request waiting for this step and
asks again at the next one (0.23-0.30 ``skipped_waiting``, 0.32
``deferred_waiting``), while the other requests are scheduled.

``LookupAhead`` runs the scheduler's lookups on one daemon thread of their
own, in order, so the LMCache lookup client (one ZMQ socket per worker rank)
is only ever used by that thread. The scheduler half submits a request's
lookup, answers ``None`` until it is done, then admits it with the result:
the same verified prefix a synchronous lookup would have reported, so
verify-before-promise holds and no load failure reaches vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long the scheduler waits for a lookup inside its step before it
# answers "not yet". Short: the point is not to hold the step, but a local
# or warm lookup (about 1 ms) is then admitted in the same step, as it would
# be without the thread, and an idle engine does not spin through empty
# steps at full speed.
WAIT_IN_STEP_S = 0.002


class LookupAhead:
    """One thread running lookup jobs in submission order."""

    def __init__(self, name: str = "lmcache-ascend-lookup") -> None:
        self._jobs: "queue.SimpleQueue[Optional[tuple[Future, Callable[[], object]]]]" = queue.SimpleQueue()
        # Daemon: a lookup still waiting on a dead store must not keep a
        # user's script from exiting; its result is then of no use.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, job: Callable[[], T]) -> "Future[T]":
        if self._closed:
            raise RuntimeError("lookup thread closed")
        fut: Future = Future()
        self._jobs.put((fut, job))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, job = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler, which serves a miss
                fut.set_exception(e)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops taking jobs; waits up to ``timeout_s`` for the one running
        (bounded by LMCache's lookup timeout) so the client can be closed."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("lmcache-ascend: a lookup was still running %.0f s after close; left to end alone",
                           timeout_s)
