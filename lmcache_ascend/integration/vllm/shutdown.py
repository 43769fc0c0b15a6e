"""Closing the connector when vLLM will not.

vLLM < 0.32's in-process engine never calls its connectors' ``shutdown()``,
and 0.32's only when the engine client is garbage collected or at exit,
after the interpreter joined non-daemon threads (see ``lmcache_ascend.compat``);
LMCache's storage event-loop thread is not a daemon: a script that never
deletes its ``LLM`` would wait for it forever.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    # Named for readers; mypy skips vLLM's sources, so to it this stays untyped.
    from vllm.config import VllmConfig

T = TypeVar("T")

logger = logging.getLogger(__name__)


def close_before_thread_join(owner: T, close: Callable[[T], object]) -> bool:
    """Run ``close(owner)`` when the interpreter starts to exit, if ``owner``
    is still alive then. vLLM < 0.32's in-process engine never shuts its
    connectors down, and LMCache's storage event-loop thread is not a daemon:
    the interpreter would wait for it forever. Plain ``atexit`` callbacks run
    only after non-daemon threads are joined (too late); CPython's
    ``threading._register_atexit`` (used by concurrent.futures) runs before.
    Returns False where that hook is not available (logged once)."""
    import weakref

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        logger.warning(
            "lmcache-ascend: this Python has no threading._register_atexit; an "
            "in-process vLLM engine may not exit until its LMCache engine is closed"
        )
        return False
    ref = weakref.ref(owner)

    def at_exit() -> None:
        obj = ref()
        if obj is not None:
            close(obj)

    try:
        register(at_exit)
    except RuntimeError:  # the interpreter is already shutting down
        return False
    return True


SHUTDOWN_ADVICE = (
    "lmcache-ascend: vLLM's shutdown_timeout is 0 (its default, abort mode) and this connector "
    "writes to %s: on SIGTERM vLLM ends the engine processes without draining (vLLM 0.32 kills "
    "them at once), so chunks still being written there are lost, uncounted (their prompts are "
    "computed again on a later miss; no output changes). Serve with --shutdown-timeout 15 to let "
    "the connector finish its writes and close (README, 'Shutdown is bounded')"
)


def advise_drain(vllm_config: VllmConfig, shared_store: str) -> bool:
    """Say once, at startup, that vLLM's default shutdown loses the writes
    in flight to ``shared_store`` (disk or remote; nothing where it is
    empty), and how to keep them. A killed process cannot count what it
    lost, so this line is the only account of it. Returns whether it was
    logged."""
    # A probe: VllmConfig has shutdown_timeout on every supported vLLM
    # (0.23-0.32); one without graceful shutdown (none supported now) would
    # not, and gets no advice.
    timeout = getattr(vllm_config, "shutdown_timeout", None)
    if not shared_store or timeout is None or int(timeout) != 0:
        return False
    logger.info(SHUTDOWN_ADVICE, shared_store)
    return True
