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

The same holds the local disk backend's puts and the chunks' seals
(``DeferredSeals``): a chunk's checksum or MAC (``chunk_io``) reads its whole
payload (zlib-ng's crc32 at 10-16 GB/s here, BLAKE3 at about the copy out
of vLLM's KV cache on the CPU), and only the copies that leave this process
need it (the local CPU cache is trusted: ``staging._TRUSTED``). So inside a
step the chunk connector copies and the hand-off thread seals, and a sealed
chunk is only then given to the disk and remote backends: nothing unsealed
ever leaves the process. zlib-ng and BLAKE3 release the GIL on large buffers,
so the seals run on the cores the step leaves idle. This needs every backend
a chunk can leave through to be one whose puts are held here, and all of
them to share the local CPU backend's buffers (LMCache copies a chunk for a
backend with an allocator of its own, inside ``batched_put``, before any
seal): otherwise seals stay inside the step, logged once.

LMCache's seam is the same in 0.5.6 and 0.5.7rc2: ``storage_manager.py``
(``batched_put``) calls ``backend.batched_submit_put_task(keys, objs,
transfer_spec=...)`` on ``remote_backend.RemoteBackend`` and
``local_disk_backend.LocalDiskBackend`` (both allocate from the local CPU
backend: ``get_allocator_backend``); its memory objects are ref-counted, and
a held chunk keeps a reference until it is handed off.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from lmcache_ascend.lmcache_bridge.patching import overrides

logger = logging.getLogger(__name__)

_STOP = object()
# LMCache's backends whose puts are held (by class name: the disk backend's
# module is not imported for a check).
_REMOTE = "RemoteBackend"
_DISK = "LocalDiskBackend"
_LOCAL_CPU = "LocalCPUBackend"


def _is(backend: Any, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(backend).__mro__)


@dataclass
class _Batch:
    submit: Callable[..., Any]
    name: str
    # Remote writes call back once per key when done (what close() waits
    # for); the disk backend skips a key it already has without calling
    # back, so its writes are not tracked (LMCache's own close waits for them).
    tracked: bool = True
    keys: list = field(default_factory=list)
    objs: list = field(default_factory=list)  # one per key, deduplicated
    extra: list = field(default_factory=list)  # references of duplicates, dropped at hand-off
    seen: set = field(default_factory=set)  # keys already held (a step's stores add up)


@dataclass
class _HeldSeal:
    obj: Any  # LMCache MemoryObj; one reference held until sealed
    buf: Any  # its bytes (torch uint8), payload then trailer
    ident: Optional[int]


@dataclass
class _StepItem:
    """What one step hands to the thread: seals first, then the puts."""

    seals: list[_HeldSeal]
    batches: list[_Batch]


class DeferredSeals:
    """The seals of a step's chunks, held for the hand-off thread.

    Owned by the chunk connector (it knows how to seal) and opened by
    ``StepPuts`` around a step when every backend a chunk can leave through
    is held; outside that, ``hold`` says no and the connector seals at once."""

    def __init__(self, seal: Callable[[Any, Optional[int]], None]) -> None:
        self._seal = seal  # (buf, ident): writes the trailer
        self._open = False
        self._held: list[_HeldSeal] = []
        self.sealed = 0  # chunks sealed off the step (cumulative)
        self.seconds = 0.0  # the hand-off thread's time sealing them

    def hold(self, obj: Any, buf: Any, ident: Optional[int]) -> bool:
        """Takes the seal of ``obj`` for the hand-off thread; False outside
        a held step (the caller seals now)."""
        if not self._open:
            return False
        obj.ref_count_up()  # LMCache may drop its own before the thread seals
        self._held.append(_HeldSeal(obj, buf, ident))
        return True

    def _take(self) -> list[_HeldSeal]:
        held, self._held = self._held, []
        return held

    def run(self, held: list[_HeldSeal]) -> set[int]:
        """Seals ``held`` (hand-off thread); ids of the objects that could
        not be sealed: they must not be handed to a backend."""
        bad: set[int] = set()
        t0 = time.perf_counter()
        for item in held:
            try:
                self._seal(item.buf, item.ident)
            except Exception:  # noqa: BLE001 - the chunk stays local; logged once
                bad.add(id(item.obj))
                if len(bad) == 1:
                    logger.exception("lmcache-ascend: sealing a chunk failed; it stays in the local cache only")
        self.seconds += time.perf_counter() - t0
        self.sealed += len(held) - len(bad)
        return bad


@dataclass
class Handoff:
    """What one step queued for the disk and remote backends: filled in when
    the step's block ends."""

    chunks: int = 0
    seconds: float = 0.0  # the storing thread's time to queue them


class StepPuts:
    """Wraps the ``batched_submit_put_task`` of the given backends (instance
    attributes; LMCache's class is not touched)."""

    def __init__(self, backends: list[Any], seals: Optional[DeferredSeals] = None) -> None:
        self._backends = backends
        self._seals = seals
        self._orig = {id(b): b.batched_submit_put_task for b in backends}
        # What the registry replaced, put back in close().
        self._replaced: list[overrides.Replaced] = []
        self._held: dict[int, _Batch] = {}
        self._open = False
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0  # steps queued, not yet handed off
        self._writing = 0  # chunks handed off whose remote write has not completed
        self.failures = 0  # batches whose hand-off raised (cumulative)
        self._thread = threading.Thread(target=self._run, name="lmcache-ascend-puts", daemon=True)
        self._thread.start()
        for backend in backends:
            self._replaced.append(
                overrides.apply(overrides.STEP_PUTS, backend, "batched_submit_put_task", self._holder(backend))
            )

    @classmethod
    def install(cls, engine: Any, seals: Optional[DeferredSeals] = None) -> Optional["StepPuts"]:
        """On the remote and disk backends of an LMCache engine; None without
        any. ``seals`` are deferred to the hand-off thread only if those are
        all the backends a chunk can leave through, on the local CPU
        backend's buffers (see the module's docstring)."""
        backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
        held = [b for b in backends.values() if _is(b, _REMOTE) or _is(b, _DISK)]
        if not held:
            return None
        others = [name for name, b in backends.items() if b not in held and not _is(b, _LOCAL_CPU)]
        cpu = [b for b in backends.values() if _is(b, _LOCAL_CPU)]
        own_buffers = [
            type(b).__name__ for b in held
            if cpu and getattr(b, "get_allocator_backend", lambda: None)() is not cpu[0]
        ]
        if seals is not None and (others or own_buffers or not cpu):
            logger.warning(
                "lmcache-ascend: chunk checksums are computed inside vLLM's step: backend(s) %s %s; "
                "only the disk and remote backends on the local CPU cache's buffers let them run beside it",
                others or own_buffers or ["LocalCPUBackend"],
                "are not held by this connector" if others else
                "copy chunks into buffers of their own" if own_buffers else "missing",
            )
            seals = None
        return cls(held, seals)

    @property
    def seals_deferred(self) -> bool:
        """Whether a step's seals run on the hand-off thread."""
        return self._seals is not None

    def _holder(self, backend: Any) -> Callable[..., Any]:
        orig = self._orig[id(backend)]
        tracked = _is(backend, _REMOTE)

        def submit(keys, memory_objs, transfer_spec: Any = None, on_complete_callback: Any = None, **kw):
            # Outside a step's block, or with arguments this class does not
            # carry over, LMCache's call goes through unchanged.
            if not self._open or transfer_spec is not None or on_complete_callback is not None or kw:
                return orig(keys, memory_objs, transfer_spec=transfer_spec,
                            on_complete_callback=on_complete_callback, **kw)
            batch = self._held.get(id(backend))
            if batch is None:
                batch = self._held[id(backend)] = _Batch(orig, type(backend).__name__, tracked)
            for key, obj in zip(keys, memory_objs, strict=True):
                # The storage manager drops its reference when this returns;
                # a held chunk keeps its own until it is handed off.
                obj.ref_count_up()
                if key in batch.seen:
                    # Two requests of one step with the same prefix store the
                    # same chunk twice; one write is enough.
                    batch.extra.append(obj)
                    continue
                batch.seen.add(key)
                batch.keys.append(key)
                batch.objs.append(obj)
            return None

        return submit

    @contextlib.contextmanager
    def step(self) -> Iterator[Handoff]:
        """Holds puts (and seals) inside the block and queues them for the
        hand-off thread at its end (also when the block raises)."""
        out = Handoff()
        self._open = True
        if self._seals is not None:
            self._seals._open = True
        try:
            yield out
        finally:
            self._open = False
            if self._seals is not None:
                self._seals._open = False
            t0 = time.perf_counter()
            out.chunks = self._queue_held()
            out.seconds = time.perf_counter() - t0

    def _queue_held(self) -> int:
        held, self._held = self._held, {}
        seals = self._seals._take() if self._seals is not None else []
        if not held and not seals:
            return 0
        with self._idle:
            self._pending += 1
        self._queue.put(_StepItem(seals, list(held.values())))
        return sum(len(b.keys) for b in held.values())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                # Sealed before any backend sees a byte of them.
                bad = self._seals.run(item.seals) if self._seals is not None and item.seals else set()
                for batch in item.batches:
                    self._hand_off(batch, bad)
            finally:
                for seal in item.seals:
                    seal.obj.ref_count_down()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _hand_off(self, batch: _Batch, unsealed: set[int]) -> None:
        keep = [i for i, obj in enumerate(batch.objs) if id(obj) not in unsealed]
        keys = [batch.keys[i] for i in keep]
        objs = [batch.objs[i] for i in keep]
        if batch.tracked:
            with self._idle:
                self._writing += len(keys)
        try:
            if keys:
                # LMCache calls back once per key when its write completed
                # (or failed): what close() waits for.
                batch.submit(keys, objs, on_complete_callback=self._written if batch.tracked else None)
        except Exception:  # noqa: BLE001 - a lost copy costs a later miss only
            if batch.tracked:
                with self._idle:
                    self._writing -= len(keys)
            self.failures += 1
            if self.failures == 1:
                logger.exception(
                    "lmcache-ascend: handing %d chunk(s) to LMCache's %s failed; they stay in "
                    "the local cache only (logged once; counted in backend_failures)",
                    len(keys), batch.name,
                )
        finally:
            for obj in batch.objs + batch.extra:
                obj.ref_count_down()

    def _written(self, key: Any) -> None:
        with self._idle:
            self._writing -= 1
            self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits until every queued step was sealed and handed off; False on
        timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float) -> None:
        """Hands off what is held or queued and waits for those writes to
        complete (each within ``timeout``): the backends are closed next, and
        a write cut off there would be a chunk lost. Then stops the thread
        and gives LMCache its own calls back."""
        self._queue_held()  # a step cut short by shutdown leaves nothing behind
        if not self.drain(timeout):
            logger.warning("lmcache-ascend: %d step(s) of puts not handed off within %.0f s of close",
                           self._pending, timeout)
        with self._idle:
            if not self._idle.wait_for(lambda: self._writing <= 0, timeout):
                logger.warning("lmcache-ascend: %d chunk(s) still being written to the remote store %.0f s "
                               "after close; they may be lost", self._writing, timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for replaced in self._replaced:
            overrides.undo(replaced)
