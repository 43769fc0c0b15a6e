"""Off the CPU, a load or store must not return while the copies it queued
still need the chunk buffer: LMCache releases (and may reuse) the buffer as
soon as ``batched_to_gpu`` returns, and reads it (checksum, put) as soon as
``batched_from_gpu`` returns. A deferred-copy device reproduces on the CPU
what an NPU does: copies, fills and kernels are queued on a stream and only
run when the host waits. Expected bytes come from numpy, not from the code
under test. Also: ChunkTransfer holds the KV tensors whose addresses its op
calls carry."""

from __future__ import annotations

import gc
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from fixtures import layouts as L
from lmcache_ascend.planning.groups import ChunkRequest, GroupKind, SchedulerGroup
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

BLOCK, CHUNK, ROW = 16, 64, 32
LAYERS = ("a", "b")
TABLE = (3, 7, 1, 10, 5, 2, 11, 4)  # one full-attention group


class DeferredDevice(TorchFunctionMode):
    """A fake accelerator over CPU memory with one in-order stream.

    Inside ``with device:`` every ``copy_(..., non_blocking=True)``, every
    ``zero_()`` (ChunkTransfer zeroes only its staging buffer) and every call
    of the two transfer ops (through ``queued(ops)``) is queued and the call
    returns at once, as on a real device; a blocking ``copy_`` first drains
    the stream, as torch's does. Queued work runs, in order, only at
    ``Event.synchronize`` (up to the event's record), ``Stream.synchronize``
    or ``synchronize()``: the part of torch.npu's API ChunkTransfer uses,
    passed to it as ``device_module``."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Callable[[], Any]] = deque()
        self.issued = 0  # work items ever queued
        self.done = 0  # work items run
        self.records = 0  # Event.record calls (waits the code under test made)

    @property
    def pending(self) -> int:
        return self.issued - self.done

    def enqueue(self, work: Callable[[], Any]) -> None:
        self._queue.append(work)
        self.issued += 1

    def run_until(self, mark: int) -> None:
        # Queued work calls torch itself: keep it from being queued again.
        with torch._C.DisableTorchFunction():
            while self.done < mark:
                self._queue.popleft()()
                self.done += 1

    def synchronize(self, device: Any = None) -> None:
        self.run_until(self.issued)

    # -- the device-module surface (torch.npu.current_stream / Event) ------

    def current_stream(self, device: Any = None) -> "_Stream":
        return _Stream(self)

    def Event(self) -> "_Event":  # noqa: N802 - torch.npu.Event
        return _Event(self)

    def queued(self, ops: Any) -> "_QueuedOps":
        return _QueuedOps(self, ops)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                self.enqueue(lambda: dst.copy_(src))
                return dst
            self.synchronize()
        elif func is torch.Tensor.zero_:
            self.enqueue(lambda: args[0].zero_())
            return args[0]
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, device: DeferredDevice) -> None:
        self._device = device

    def synchronize(self) -> None:
        self._device.synchronize()


class _Event:
    def __init__(self, device: DeferredDevice) -> None:
        self._device = device
        self._mark = 0

    def record(self, stream: Any = None) -> None:
        self._device.records += 1
        self._mark = self._device.issued

    def synchronize(self) -> None:
        self._device.run_until(self._mark)


class _QueuedOps:
    """Kernel launches: queued on the device's stream."""

    def __init__(self, device: DeferredDevice, ops: Any) -> None:
        self._device, self._ops = device, ops

    def multi_plane_kv_transfer(self, *args: Any) -> None:
        self._device.enqueue(lambda: self._ops.multi_plane_kv_transfer(*args))

    def block_page_transfer(self, *args: Any) -> None:
        self._device.enqueue(lambda: self._ops.block_page_transfer(*args))


# ---- fixtures: two K/V layers, independent numpy expectations ------------


def _caches(seed: int | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed or 0)

    def t() -> torch.Tensor:
        if seed is None:
            return torch.zeros(12, BLOCK, ROW, dtype=torch.uint8)
        return torch.randint(0, 256, (12, BLOCK, ROW), dtype=torch.uint8, generator=gen)

    return {name: (t(), t()) for name in LAYERS}


def _plan(caches):
    group = SchedulerGroup(0, GroupKind.FULL, "FullAttentionSpec", BLOCK, layer_names=LAYERS)
    plan = build_plan(caches, (group,), CHUNK)
    # The numpy packing below assumes this layout: one kernel group, layer
    # after layer, K rows then V rows.
    (kg,) = plan.kernel_groups
    assert [[(p.layer_name, p.plane_index) for p in planes] for planes in kg.planes] == [
        [(n, 0), (n, 1)] for n in LAYERS
    ]
    return plan


def _blocks(start: int) -> list[int]:
    return list(TABLE[start // BLOCK : start // BLOCK + CHUNK // BLOCK])


def _packed(kv: dict[str, tuple[np.ndarray, np.ndarray]], start: int, rows: int = CHUNK) -> np.ndarray:
    """The chunk's bytes for tokens [start, start + rows): per layer, its K
    rows then its V rows, token order; rows past ``rows`` zero."""
    parts = []
    for name in LAYERS:
        for plane in kv[name]:
            r = plane[_blocks(start)].reshape(CHUNK, ROW).copy()
            r[rows:] = 0
            parts.append(r.reshape(-1))
    return np.concatenate(parts)


def _numpy(caches) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {n: tuple(t.numpy().copy() for t in pair) for n, pair in caches.items()}


def _staged(dev: DeferredDevice, ops: Any, caches) -> ChunkTransfer:
    return ChunkTransfer(_plan(caches), ops=dev.queued(ops), staging=True, kv_caches=caches,
                         device_module=dev)


# ---- the reuse hazard -----------------------------------------------------


@pytest.mark.parametrize("start", [0, CHUNK])
def test_load_is_done_with_the_chunk_when_it_returns(ops, start):
    src = _numpy(_caches(1))
    dst = _caches(None)
    chunk = torch.from_numpy(_packed(src, start))
    dev = DeferredDevice()
    xfer = _staged(dev, ops, dst)
    with dev:
        xfer.load(chunk, ChunkRequest(start, start + CHUNK, (TABLE,)))
    left = dev.pending
    chunk.fill_(0xA5)  # LMCache released the buffer; its next user writes it
    dev.synchronize()  # the device catches up (vLLM's forward pass)
    for name in LAYERS:
        for p, plane in enumerate(dst[name]):
            want = np.zeros_like(src[name][p])
            want[_blocks(start)] = src[name][p][_blocks(start)]
            bad = int(np.count_nonzero(plane.numpy() != want))
            assert bad == 0, (
                f"{name}[{p}]: {bad} KV bytes differ from the stored chunk; the load "
                f"returned with {left} copies/kernels still queued, which then read the "
                f"reused buffer"
            )
    assert left == 0 and dev.records >= 1


@pytest.mark.parametrize("rows", [CHUNK, 40], ids=["whole", "partial"])
def test_store_has_filled_the_chunk_when_it_returns(ops, rows):
    caches = _caches(2)
    want = _packed(_numpy(caches), 0, rows)
    dev = DeferredDevice()
    xfer = _staged(dev, ops, caches)
    chunk = torch.full((want.size,), 7, dtype=torch.uint8)
    with dev:
        res = xfer.store(chunk, ChunkRequest(0, rows, (TABLE,)))
    left = dev.pending
    seen = chunk.numpy().copy()  # what LMCache checksums and puts right away
    for pair in caches.values():  # vLLM may reuse the blocks once the store returned
        for t in pair:
            t.fill_(0x5A)
    dev.synchronize()
    assert res.stored
    bad = int(np.count_nonzero(seen != want))
    assert bad == 0, f"{bad} chunk bytes wrong when store returned ({left} items still queued)"
    assert left == 0


def test_failed_load_is_done_with_the_chunk_too():
    """An op that refuses its arguments (as the native ops validate before
    launching) after the upload was queued: the error propagates, LMCache
    releases the chunk, so the queued upload must have run by then."""

    class Refusing:
        def multi_plane_kv_transfer(self, *args):
            raise ValueError("slot_mapping[3] is out of range")

    dst = _caches(None)
    dev = DeferredDevice()
    xfer = ChunkTransfer(_plan(dst), ops=Refusing(), staging=True, kv_caches=dst, device_module=dev)
    chunk = torch.zeros(xfer.plan.chunk_bytes, dtype=torch.uint8)
    with dev, pytest.raises(ValueError, match="out of range"):
        xfer.load(chunk, ChunkRequest(0, CHUNK, (TABLE,)))
    assert dev.issued == 1 and dev.pending == 0


def test_direct_cpu_path_never_waits(ops):
    caches = _caches(3)
    dev = DeferredDevice()
    xfer = ChunkTransfer(_plan(caches), ops=ops, kv_caches=caches, device_module=dev)
    chunk = torch.empty(_plan(caches).chunk_bytes, dtype=torch.uint8)
    assert xfer.store(chunk, ChunkRequest(0, CHUNK, (TABLE,))).stored
    xfer.load(chunk, ChunkRequest(0, CHUNK, (TABLE,)))
    assert dev.records == 0 and dev.issued == 0
    assert np.array_equal(chunk.numpy(), _packed(_numpy(caches), 0))


def test_deferred_device_defers_and_orders():
    """The mirror itself: nothing runs before a wait, an event waits only for
    work queued before its record, and work runs in queue order."""
    dev = DeferredDevice()
    a, b = torch.zeros(4, dtype=torch.uint8), torch.full((4,), 3, dtype=torch.uint8)
    with dev:
        a.copy_(b, non_blocking=True)
        event = dev.Event()
        event.record(dev.current_stream())
        a[:2].zero_()
    assert not a.any() and dev.pending == 2
    event.synchronize()
    assert a.tolist() == [3, 3, 3, 3] and dev.pending == 1
    dev.current_stream().synchronize()
    assert a.tolist() == [0, 0, 3, 3] and dev.pending == 0
    with dev:
        b.copy_(torch.ones(4, dtype=torch.uint8), non_blocking=True)
        a.copy_(b)  # blocking: drains the stream first
    assert a.tolist() == [1, 1, 1, 1]


# ---- holding the KV tensors ------------------------------------------------


def test_transfer_holds_the_kv_tensors(ops):
    caches = _caches(4)
    want = _packed(_numpy(caches), 0)
    refs = [weakref.ref(t) for pair in caches.values() for t in pair]
    xfer = ChunkTransfer(_plan(caches), ops=ops, kv_caches=caches)
    del caches
    gc.collect()
    assert all(r() is not None for r in refs), "a KV tensor was freed while the transfer uses it"
    chunk = torch.empty(want.size, dtype=torch.uint8)
    assert xfer.store(chunk, ChunkRequest(0, CHUNK, (TABLE,))).stored
    assert np.array_equal(chunk.numpy(), want)
    del xfer
    gc.collect()
    # Nothing else (the plan holds addresses only) kept them: the transfer did.
    assert all(r() is None for r in refs)


def test_kv_caches_must_contain_the_planes():
    caches = _caches(5)
    plan = _plan(caches)
    with pytest.raises(ValueError, match=r"plane a\[0\] .* lies in none of the given kv_caches"):
        ChunkTransfer(plan, kv_caches=_caches(6))
    with pytest.raises(TypeError, match="not a tensor"):
        ChunkTransfer(plan, kv_caches={"a": "x"})
    assert ChunkTransfer(plan, kv_caches=caches).kv_device == torch.device("cpu")


@pytest.mark.parametrize("layout", L.all_layouts(), ids=lambda x: x.name)
def test_kv_caches_check_accepts_every_fixture_layout(layout):
    """Blob views, padded strides, page pools, tuples: every plane of a real
    layout lies inside one of its tensors (no false refusal at startup)."""
    built = layout.build(False)
    plan = build_plan(built.kv_caches, layout.groups, layout.chunk_size, layout.config, layout.hints)
    held = ChunkTransfer(plan, kv_caches=built.kv_caches)._kv_tensors
    assert len(held) == sum(1 if isinstance(e, torch.Tensor) else len(e) for e in built.kv_caches.values())
