"""The remote puts of a step's stores, handed to LMCache once per step and
off the step's thread.

LMCache's ``store`` ends with ``StorageManager.batched_put``, which gives
each remote backend its chunks with ``RemoteBackend.batched_submit_put_task``:
``asyncio.run_coroutine_threadsafe`` onto the storage manager's event-loop
thread, whose wake-up is a ``socket.send``. That send gives up the GIL; the
loop thread takes it and starts packing the chunks for the wire (redis-py
and asyncio copy large values into their write buffers holding the GIL), so
the storing thread waits for the GIL inside the call and again for every
line of Python after it. Measured at TP=2 with Redis, 16 or 32 chunks of
3.5 MB: 2 to 10 ms per hand-off, whatever the number of chunks, on a store
of 13 to 28 ms: the fixed cost that kept a rank storing half the chunks from
taking half the time.

``StepPuts`` holds what the remote backends are given while a step's stores
run. When they are done, the step's chunks go, one batch per backend, to a
thread of this class that makes LMCache's call: the worker thread never
waits on that hand-off, and the loop thread's packing runs while the worker
thread blocks (the forward's kernels, the wait for the next step) instead of
inside the store. A step with n storing requests makes one hand-off, not n.
The local CPU put stays synchronous (this process's lookups see the chunks
at once); a chunk reaches the remote backend as before, only without the
storing thread waiting for it.

LMCache's seam is the same in 0.5.6 and 0.5.7rc2: ``storage_manager.py``
(``batched_put``) calls ``backend.batched_submit_put_task(keys, objs,
transfer_spec=...)`` on ``remote_backend.RemoteBackend``; its memory objects
are ref-counted, and a held chunk keeps a reference until it is handed off.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass
class _Batch:
    submit: Callable[..., Any]
    name: str
    keys: list = field(default_factory=list)
    objs: list = field(default_factory=list)  # one per key, deduplicated
    extra: list = field(default_factory=list)  # references of duplicates, dropped at hand-off
    seen: set = field(default_factory=set)  # keys already held (a step's stores add up)


@dataclass
class Handoff:
    """What one step queued for the remote backends: filled in when the
    step's block ends."""

    chunks: int = 0
    seconds: float = 0.0  # the storing thread's time to queue them


class StepPuts:
    """Wraps the ``batched_submit_put_task`` of the given remote backends
    (instance attributes; LMCache's class is not touched)."""

    def __init__(self, backends: list[Any]) -> None:
        self._backends = backends
        self._orig = {id(b): b.batched_submit_put_task for b in backends}
        self._held: dict[int, _Batch] = {}
        self._open = False
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0  # batches queued, not yet handed off
        self._writing = 0  # chunks handed off whose remote write has not completed
        self.failures = 0  # batches whose hand-off raised (cumulative)
        self._thread = threading.Thread(target=self._run, name="lmcache-ascend-puts", daemon=True)
        self._thread.start()
        for backend in backends:
            backend.batched_submit_put_task = self._holder(backend)

    @classmethod
    def install(cls, engine: Any) -> Optional["StepPuts"]:
        """On the remote backends of an LMCache engine; None without any."""
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
        remote = [b for b in backends.values() if isinstance(b, RemoteBackend)]
        return cls(remote) if remote else None

    def _holder(self, backend: Any) -> Callable[..., Any]:
        orig = self._orig[id(backend)]

        def submit(keys, memory_objs, transfer_spec: Any = None, on_complete_callback: Any = None, **kw):
            # Outside a step's block, or with arguments this class does not
            # carry over, LMCache's call goes through unchanged.
            if not self._open or transfer_spec is not None or on_complete_callback is not None or kw:
                return orig(keys, memory_objs, transfer_spec=transfer_spec,
                            on_complete_callback=on_complete_callback, **kw)
            batch = self._held.get(id(backend))
            if batch is None:
                batch = self._held[id(backend)] = _Batch(orig, type(backend).__name__)
            for key, obj in zip(keys, memory_objs, strict=True):
                # The storage manager drops its reference when this returns;
                # a held chunk keeps its own until it is handed off.
                obj.ref_count_up()
                if key in batch.seen:
                    # Two requests of one step with the same prefix store the
                    # same chunk twice; one remote write is enough.
                    batch.extra.append(obj)
                    continue
                batch.seen.add(key)
                batch.keys.append(key)
                batch.objs.append(obj)
            return None

        return submit

    @contextlib.contextmanager
    def step(self) -> Iterator[Handoff]:
        """Holds remote puts inside the block and queues them for the
        hand-off thread at its end (also when the block raises)."""
        out = Handoff()
        self._open = True
        try:
            yield out
        finally:
            self._open = False
            t0 = time.perf_counter()
            out.chunks = self._queue_held()
            out.seconds = time.perf_counter() - t0

    def _queue_held(self) -> int:
        held, self._held = self._held, {}
        for batch in held.values():
            with self._idle:
                self._pending += 1
            self._queue.put(batch)
        return sum(len(b.keys) for b in held.values())

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            with self._idle:
                self._writing += len(batch.keys)
            try:
                # LMCache calls back once per key when its write completed
                # (or failed): what close() waits for.
                batch.submit(batch.keys, batch.objs, on_complete_callback=self._written)
            except Exception:  # noqa: BLE001 - a lost remote copy costs a later miss only
                with self._idle:
                    self._writing -= len(batch.keys)
                self.failures += 1
                if self.failures == 1:
                    logger.exception(
                        "lmcache-ascend: handing %d chunk(s) to LMCache's %s failed; they stay in "
                        "the local cache only (logged once; counted in backend_failures)",
                        len(batch.keys), batch.name,
                    )
            finally:
                for obj in batch.objs + batch.extra:
                    obj.ref_count_down()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _written(self, key: Any) -> None:
        with self._idle:
            self._writing -= 1
            self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits until every queued batch was handed off; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float) -> None:
        """Hands off what is held or queued and waits for those writes to
        complete (each within ``timeout``): the remote backends are closed
        next, and a write cut off there would be a chunk lost. Then stops the
        thread and gives LMCache its own calls back."""
        self._queue_held()  # a step cut short by shutdown leaves nothing behind
        if not self.drain(timeout):
            logger.warning("lmcache-ascend: %d remote put batch(es) not handed off within %.0f s of close",
                           self._pending, timeout)
        with self._idle:
            if not self._idle.wait_for(lambda: self._writing <= 0, timeout):
                logger.warning("lmcache-ascend: %d chunk(s) still being written to the remote store %.0f s "
                               "after close; they may be lost", self._writing, timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for backend in self._backends:
            backend.batched_submit_put_task = self._orig[id(backend)]
