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
# ... unless the last step computed nothing: then no request is decoding or
# prefilling, and waiting longer holds nobody up (a request arriving meanwhile
# is scheduled at most this much later). Spinning through empty steps every
# 2 ms instead costs the lookup its reads: they run in this process, and the
# scheduler's loop takes the GIL and a core from them (bench_remote_hit's
# remote hit with nothing decoding: the lookup's reads 1.15 GB/s at 2 ms,
# 1.68 GB/s at 50 ms). One such wait per step.
IDLE_WAIT_S = 0.025


class StepWaits:
    """How long the scheduler waits inside a step for a lookup that is not
    done: ``IDLE_WAIT_S`` once in a step after one that computed nothing,
    else ``WAIT_IN_STEP_S``."""

    def __init__(self) -> None:
        self._idle = True  # no step yet: nothing is running

    def step_built(self, scheduled_tokens: int) -> None:
        """The step just planned computes ``scheduled_tokens`` tokens."""
        self._idle = scheduled_tokens == 0

    def take(self) -> float:
        if self._idle:
            self._idle = False
            return IDLE_WAIT_S
        return WAIT_IN_STEP_S


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
