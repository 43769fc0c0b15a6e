"""Moves one chunk between vLLM's paged KV and a flat chunk buffer.

The buffer (an LMCache MemoryObj's bytes) holds every kernel group of the
plan at its offset. Per chunk and kernel group this makes exactly one op
call: ``multi_plane_kv_transfer`` (row planes, and page planes expressed as
one-row blocks) or ``block_page_transfer`` (a single page plane). Addressing
comes from ``slot_mapping``: -1 entries are neither read nor written.

The ops module is a constructor argument; by default the compiled
``lmcache_ascend.ops`` is imported on first use, so importing this module
needs neither the extension nor vLLM.

Off the CPU, copies and kernels are only queued on the device's current
stream. LMCache releases (and may reuse) a chunk's MemoryObj as soon as
``batched_to_gpu`` returns, and reads it (checksum, storage put) as soon as
``batched_from_gpu`` returns; so a load or store off the CPU returns only
after the work it queued has run (one event wait per call, as LMCache's own
device connectors synchronise their streams). The direct CPU path is
synchronous and waits for nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, cast

import numpy as np
import torch

from lmcache_ascend.planning.flatten import PlaneAddressing
from lmcache_ascend.planning.groups import SKIP, ChunkRequest, Granularity, Plane
from lmcache_ascend.planning.planner import KernelGroup, KernelOp, TransferPlan
from lmcache_ascend.planning.slot_mapping import (
    ChunkAddresses,
    GroupAddress,
    Int64Array,
    chunks_pages,
    chunks_rows,
)


class TransferOps(Protocol):
    """The ops a ChunkTransfer calls: the native ``lmcache_ascend.ops``
    (typed by ``lmcache_ascend/_ops.pyi``) or ``reference_ops``."""

    def multi_plane_kv_transfer(
        self,
        chunk: torch.Tensor,
        plane_ptrs: torch.Tensor,
        plane_block_sizes: torch.Tensor,
        plane_block_stride_bytes: torch.Tensor,
        plane_row_bytes: torch.Tensor,
        plane_num_blocks: torch.Tensor,
        slot_mapping: torch.Tensor,
        plane_slot_offsets: torch.Tensor,
        to_chunk: bool,
        num_layers: int,
    ) -> None: ...

    def block_page_transfer(
        self,
        chunk: torch.Tensor,
        layer_ptrs: torch.Tensor,
        page_bytes: int,
        block_stride_bytes: int,
        num_blocks: int,
        block_ids: torch.Tensor,
        to_chunk: bool,
    ) -> None: ...


if TYPE_CHECKING:
    # Both ops modules provide what TransferOps names (mypy checks it here).
    from lmcache_ascend import _ops as _native_ops
    from lmcache_ascend.transfer import reference_ops as _reference_ops

    _OPS_MODULES: tuple[TransferOps, TransferOps] = (_native_ops, _reference_ops)

_TABLE_CACHE_LIMIT = 256
# Whole chunks addressed per numpy pass: a load of n chunks costs
# ceil(n / 64) passes instead of n.
_WINDOW_CHUNKS = 64


@dataclass(frozen=True)
class GroupMissing:
    """Needed positions of a group that had no real block (null block 0 or
    past the block table)."""

    group: int
    positions: int


@dataclass(frozen=True)
class StoreResult:
    stored: bool  # False: nothing was copied (a group was incomplete)
    incomplete: tuple[GroupMissing, ...]
    op_calls: int
    nbytes: int

    @property
    def incomplete_group(self) -> Optional[int]:
        return self.incomplete[0].group if self.incomplete else None


@dataclass(frozen=True)
class LoadResult:
    op_calls: int
    nbytes: int
    missing: tuple[GroupMissing, ...]  # positions vLLM gave no real block (left alone)


@dataclass(frozen=True)
class LayerLoad:
    """A chunk buffer and its slot lists per kernel group (``prepare_layers``)."""

    chunk: torch.Tensor
    slots: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _KernelCall:
    """Per kernel group tensors that do not change from chunk to chunk."""

    group: KernelGroup
    keys: tuple[int, ...]  # per plane: index into ChunkTransfer._keys
    ptrs: torch.Tensor  # int64 [L*P] (MULTI_PLANE) or [L] (BLOCK_PAGE)
    block_sizes: torch.Tensor
    strides: torch.Tensor
    row_bytes: torch.Tensor
    num_blocks: torch.Tensor
    slot_offsets: torch.Tensor  # int64 [P+1]

    def slot_ids(self, addrs: Sequence[GroupAddress]) -> Int64Array:
        """This group's slot list for one chunk: its planes' addressings in order."""
        if len(self.keys) == 1:
            return addrs[self.keys[0]].ids
        return np.concatenate([addrs[k].ids for k in self.keys])

    def run(
        self, ops: TransferOps, region: torch.Tensor, ptrs: torch.Tensor, slots: torch.Tensor,
        to_chunk: bool, num_layers: int,
    ) -> None:
        """One op call over ``num_layers`` entries: ``region`` and ``ptrs``
        are the whole group's or a slice of its entries (layer-major)."""
        kg = self.group
        if kg.op is KernelOp.BLOCK_PAGE:
            p = kg.planes[0][0]
            ops.block_page_transfer(region, ptrs, p.row_bytes, p.block_stride_bytes, p.num_blocks, slots, to_chunk)
        else:
            ops.multi_plane_kv_transfer(
                region, ptrs, self.block_sizes, self.strides, self.row_bytes,
                self.num_blocks, slots, self.slot_offsets, to_chunk, num_layers,
            )

    @classmethod
    def build(cls, kg: KernelGroup, key_index: dict[PlaneAddressing, int]) -> "_KernelCall":
        first = kg.planes[0]
        kernel_rows = [p.block_rows for p in first]
        counts = [a.rows_per_chunk for a in kg.addressing]

        def i64(values: Iterable[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64)

        return cls(
            group=kg,
            keys=tuple(key_index[a] for a in kg.addressing),
            ptrs=i64(p.data_ptr for planes in kg.planes for p in planes),
            block_sizes=i64(kernel_rows),
            strides=i64(p.block_stride_bytes for p in first),
            row_bytes=i64(p.row_bytes for p in first),
            num_blocks=i64(p.num_blocks for p in first),
            slot_offsets=i64(np.concatenate([[0], np.cumsum(counts)]).tolist()),
        )


def _check_chunk(chunk: torch.Tensor, need: int) -> None:
    if chunk.dtype != torch.uint8 or chunk.ndim != 1 or not chunk.is_contiguous():
        raise ValueError(
            f"chunk buffer must be a 1-D contiguous uint8 tensor, got {chunk.dtype} "
            f"shape {tuple(chunk.shape)}"
        )
    if chunk.numel() < need:
        raise ValueError(f"chunk buffer holds {chunk.numel()} bytes; the plan needs {need}")


def _tensors(entry: Any) -> list[torch.Tensor]:
    """The tensors of one kv_caches entry (a tensor or nested tuples/lists)."""
    if isinstance(entry, torch.Tensor):
        return [entry]
    if isinstance(entry, (tuple, list)):
        return [t for item in entry for t in _tensors(item)]
    raise TypeError(f"kv_caches entry of type {type(entry).__name__} is not a tensor or a tuple of tensors")


def _plane_extent(p: Plane) -> int:
    """Bytes from a plane's base the kernels may touch."""
    return (p.num_blocks - 1) * p.block_stride_bytes + p.block_rows * p.row_bytes


def _check_held(plan: TransferPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Every plane the kernels address must lie inside a held tensor's
    storage; otherwise holding the tensors would not keep the addresses
    valid (e.g. kv_caches from another worker or a stale dict)."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    for kg in plan.kernel_groups:
        for planes in kg.planes:
            for p in planes:
                lo, hi = p.data_ptr, p.data_ptr + _plane_extent(p)
                if not any(base <= lo and hi <= base + n for base, n in spans):
                    raise ValueError(
                        f"plane {p.layer_name}[{p.plane_index}] (bytes {lo:#x}..{hi:#x}) lies in none "
                        f"of the given kv_caches tensors: pass the kv_caches the plan was built from"
                    )


def _stream_wait(module: Any, device: torch.device) -> Callable[[], None]:
    """A function that returns once the work queued so far on ``device``'s
    current stream has run.

    ``module`` is torch's per-device module (``torch.npu`` once torch_npu is
    imported, ``torch.cuda``, ``torch.cpu``), the device-agnostic surface
    torch_npu implements. On NPU: ``current_stream`` is torch_npu's current
    ACL stream, the one ``Tensor.copy_`` and our launchers (``OpCommand`` on
    ``getCurrentNPUStream()``) queue on; ``Event()`` an ACL event;
    ``record(stream)`` is ``aclrtRecordEvent``; ``synchronize()`` is
    ``aclrtSynchronizeEvent``. Without ``Event`` the stream's
    ``synchronize()`` (``aclrtSynchronizeStream``) is used."""
    current = getattr(module, "current_stream", None)
    if current is None:
        raise RuntimeError(
            f"torch.{device.type} has no current_stream(): cannot wait for copies on {device} "
            f"(is the device's torch plugin, e.g. torch_npu, imported?)"
        )
    event_type = getattr(module, "Event", None)
    if event_type is None:
        return lambda: current(device).synchronize()
    event: list[Any] = []  # created on first use; one event re-recorded per call

    def wait() -> None:
        if not event:
            event.append(event_type())
        # Record then wait: only work queued up to now, not what other
        # threads queue on the stream meanwhile.
        event[0].record(current(device))
        event[0].synchronize()

    return wait


class ChunkTransfer:
    """Store / load chunks of one worker's KV caches according to a plan."""

    def __init__(
        self,
        plan: TransferPlan,
        ops: Optional[TransferOps] = None,
        kv_device: Optional[torch.device] = None,
        staging: Optional[bool] = None,
        kv_caches: Optional[Mapping[str, Any]] = None,
        device_module: Any = None,
    ) -> None:
        """``kv_device``: where vLLM's KV tensors live (default: the device
        of ``kv_caches``, else the CPU). Off the CPU (NPU), the kernels pack
        into a device staging buffer and one copy moves it to or from the host
        chunk buffer (an LMCache MemoryObj), with slot lists on the device.
        ``staging`` forces that path (tests run it on the CPU).

        ``kv_caches``: the tensors the plan was built from. They are held for
        the life of this object, since the op calls carry only their
        addresses; every addressed plane must lie inside one of them.

        ``device_module``: the stream API waited on after asynchronous work
        (default ``getattr(torch, kv_device.type)``, e.g. ``torch.npu``);
        tests pass a device that defers its copies."""
        self.plan = plan
        self._ops = ops
        held = [t for entry in (kv_caches or {}).values() for t in _tensors(entry)]
        if kv_device is None and held:
            kv_device = held[0].device
        self.kv_device = torch.device(kv_device) if kv_device is not None else torch.device("cpu")
        for t in held:
            if t.device.type != self.kv_device.type:
                raise ValueError(f"kv_caches hold a tensor on {t.device}; the KV device is {self.kv_device}")
        if kv_caches is not None:
            _check_held(plan, held)
        self._kv_tensors = tuple(held)  # keeps the planes' addresses valid
        use_staging = self.kv_device.type != "cpu" if staging is None else staging
        self._staging = (
            torch.empty(plan.chunk_bytes, dtype=torch.uint8, device=self.kv_device)
            if use_staging
            else None
        )
        # Anything may run asynchronously once a staging buffer or device KV
        # is involved; the direct CPU path is synchronous and never waits.
        self._wait: Optional[Callable[[], None]] = None
        if use_staging or self.kv_device.type != "cpu":
            stream_device = self._staging.device if self._staging is not None else self.kv_device
            module = device_module if device_module is not None else getattr(torch, stream_device.type, None)
            self._wait = _stream_wait(module, stream_device)
        self.op_calls = 0  # total op calls made (tests: calls per chunk)
        self._groups = {g.index: g for g in plan.groups}
        # Distinct addressings: each is computed once per chunk, however many
        # planes and kernel groups share it.
        key_index: dict[PlaneAddressing, int] = {}
        for kg in plan.kernel_groups:
            for a in kg.addressing:
                key_index.setdefault(a, len(key_index))
        self._keys = tuple(key_index)
        self._calls = tuple(_KernelCall.build(kg, key_index) for kg in plan.kernel_groups)
        self._tables: dict[int, tuple[tuple[int, ...], Int64Array]] = {}
        self._windows: dict[tuple[int, PlaneAddressing], tuple[tuple[int, ...], int, ChunkAddresses]] = {}

    @property
    def ops(self) -> TransferOps:
        if self._ops is None:
            try:
                # lmcache_ascend.ops re-exports lmcache_ascend._ops's public ops.
                self._ops = cast(TransferOps, importlib.import_module("lmcache_ascend.ops"))
            except ImportError as exc:
                raise ImportError(
                    "lmcache_ascend.ops (the native transfer ops) is not built; build the "
                    "package or pass ops= (e.g. lmcache_ascend.transfer.reference_ops)"
                ) from exc
        return self._ops

    def copy_threads(self) -> Optional[int]:
        """Threads the native CPU copies use now (None: KV is not on the CPU,
        or the ops module cannot tell, e.g. the reference ops)."""
        probe = getattr(self.ops, "cpu_copy_threads", None)
        if self.kv_device.type != "cpu" or probe is None:
            return None
        return int(probe())

    # ---- addressing -------------------------------------------------------

    def _raw_table(self, req: ChunkRequest, group: int) -> Any:
        try:
            return req.block_ids[group]
        except IndexError:
            raise ValueError(
                f"chunk request has block ids for {len(req.block_ids)} groups; the plan "
                f"stores group {group}"
            ) from None

    def _table(self, table: Any) -> Any:
        if not isinstance(table, tuple):
            return table  # a mutable list may change between calls: no caching
        hit = self._tables.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1]
        if len(self._tables) >= _TABLE_CACHE_LIMIT:
            self._tables.clear()
        arr = np.asarray(table, dtype=np.int64)
        self._tables[id(table)] = (table, arr)  # keeps `table` alive: id stays unique
        return arr

    def _address_chunks(
        self, key: PlaneAddressing, table: Any, starts: Int64Array, ends: Int64Array
    ) -> ChunkAddresses:
        group = key.group_view(self._groups[key.sched_group])
        size = self.plan.chunk_size
        if key.granularity is Granularity.ROW:
            return chunks_rows(group, table, starts, ends, size, rows_per_block=key.manager_rows)
        addr = chunks_pages(group, table, starts, ends, size)
        if key.kernel_split == 1:
            return addr
        # vLLM split each scheduler block into `kernel_split` kernel pages.
        s = key.kernel_split
        ids = addr.ids[:, :, None] * s + np.arange(s, dtype=np.int64)[None, None, :]
        ids = np.where(addr.ids[:, :, None] >= 0, ids, SKIP).reshape(len(starts), -1)
        return ChunkAddresses(ids=ids, missing=addr.missing * s)

    def _address(self, key: PlaneAddressing, req: ChunkRequest) -> GroupAddress:
        raw = self._raw_table(req, key.sched_group)
        size = self.plan.chunk_size
        if not isinstance(raw, tuple) or req.end - req.start != size or req.start % size:
            starts, ends = np.array([req.start]), np.array([req.end])
            return self._address_chunks(key, self._table(raw), starts, ends).at(0)
        # Whole chunks of a fixed table: address a window of them in one numpy
        # pass (a load asks for its chunks one by one, in order).
        j = req.start // size
        cached = self._windows.get((id(raw), key))
        if cached is not None and cached[0] is raw and cached[1] <= j < cached[1] + len(cached[2].missing):
            return cached[2].at(j - cached[1])
        tokens = len(raw) * self._groups[key.sched_group].block_size
        count = max(1, min(_WINDOW_CHUNKS, -(-tokens // size) - j))
        starts = (j + np.arange(count, dtype=np.int64)) * size
        window = self._address_chunks(key, self._table(raw), starts, starts + size)
        if len(self._windows) >= _TABLE_CACHE_LIMIT:
            self._windows.clear()
        self._windows[(id(raw), key)] = (raw, j, window)  # keeps `raw` alive
        return window.at(0)

    def _addresses(self, req: ChunkRequest) -> list[GroupAddress]:
        return [self._address(key, req) for key in self._keys]

    def addresses(self, req: ChunkRequest) -> dict[PlaneAddressing, GroupAddress]:
        """Addressing of every distinct plane addressing for one chunk."""
        return dict(zip(self._keys, self._addresses(req)))

    def _missing(self, addrs: Sequence[GroupAddress]) -> tuple[GroupMissing, ...]:
        per_group: dict[int, int] = {}
        for key, addr in zip(self._keys, addrs):
            if addr.missing:
                per_group[key.sched_group] = max(per_group.get(key.sched_group, 0), addr.missing)
        return tuple(GroupMissing(g, n) for g, n in sorted(per_group.items()))

    def incomplete_groups(self, req: ChunkRequest) -> tuple[int, ...]:
        """Stored groups with needed positions lacking a real block: such a
        chunk must not be stored (it would persist garbage)."""
        return tuple(m.group for m in self._missing(self._addresses(req)))

    # ---- transfers --------------------------------------------------------

    def _run(self, chunk: torch.Tensor, addrs: Sequence[GroupAddress], to_chunk: bool) -> int:
        if self._wait is None:
            return self._run_on(chunk, addrs, to_chunk, [])
        sources: list[Any] = []  # host memory queued copies read; alive until the wait
        try:
            staging = self._staging
            if staging is None:
                return self._run_on(chunk, addrs, to_chunk, sources)
            host = chunk[: self.plan.chunk_bytes]
            if not to_chunk:
                staging.copy_(host, non_blocking=True)
            calls = self._run_on(staging, addrs, to_chunk, sources)
            if to_chunk:
                host.copy_(staging, non_blocking=True)
            return calls
        finally:
            # Also on an error: LMCache releases the chunk either way, so no
            # queued copy may still read or write it after we return.
            self._wait()

    def _run_on(
        self, chunk: torch.Tensor, addrs: Sequence[GroupAddress], to_chunk: bool, sources: list[Any]
    ) -> int:
        ops = self.ops
        calls = 0
        on_device = chunk.device.type != "cpu"
        for call in self._calls:
            kg = call.group
            region = chunk[kg.offset : kg.offset + kg.nbytes]
            ids = call.slot_ids(addrs)
            if to_chunk and ids.min(initial=0) < 0:
                region.zero_()  # rows nobody writes must not carry stale bytes
            slots = torch.from_numpy(ids)
            if on_device:
                sources.append(slots)  # the async upload reads it (ids may be a temporary)
                slots = slots.to(chunk.device, non_blocking=True)
            call.run(ops, region, call.ptrs, slots, to_chunk, kg.num_layers)
            calls += 1
        self.op_calls += calls
        return calls

    @property
    def layerwise_capable(self) -> bool:
        """Whether ``load_layers`` may run here: the direct CPU path, whose
        copies are synchronous. Off the CPU a load stages the whole chunk on
        the device and waits for the stream once per chunk (see ``_run``)."""
        return self._wait is None

    def prepare_layers(self, chunk: torch.Tensor, req: ChunkRequest) -> "LayerLoad":
        """One chunk's addressing for ``run_layers``, computed once however
        many layer ranges are copied from it."""
        if not self.layerwise_capable:
            raise RuntimeError("layer-by-layer loads run on the direct CPU path only (KV on the CPU, no staging)")
        _check_chunk(chunk, self.plan.chunk_bytes)
        addrs = self._addresses(req)
        return LayerLoad(chunk, tuple(torch.from_numpy(call.slot_ids(addrs)) for call in self._calls))

    def run_layers(self, load: "LayerLoad", spans: Mapping[int, Sequence[tuple[int, int]]]) -> int:
        """Chunk buffer -> paged KV for some entries only: per kernel group
        (its position in ``plan.kernel_groups``), entry ranges [first, end).
        The entries' bytes are a contiguous slice of the group's region
        (layer-major), and their planes' pointers a contiguous slice of the
        group's table, so one op call moves a range. Returns the op calls."""
        ops = self.ops
        calls = 0
        for position, ranges in spans.items():
            call = self._calls[position]
            kg = call.group
            entry_bytes = kg.nbytes // kg.num_layers
            planes = kg.num_planes if kg.op is KernelOp.MULTI_PLANE else 1
            for first, end in ranges:
                if not 0 <= first < end <= kg.num_layers:
                    raise ValueError(f"kernel group {kg.index}: entries [{first}, {end}) outside [0, {kg.num_layers})")
                lo = kg.offset + first * entry_bytes
                region = load.chunk[lo : lo + (end - first) * entry_bytes]
                call.run(ops, region, call.ptrs[first * planes : end * planes], load.slots[position], False, end - first)
                calls += 1
        self.op_calls += calls
        return calls

    def load_layers(
        self, chunk: torch.Tensor, req: ChunkRequest, spans: Mapping[int, Sequence[tuple[int, int]]]
    ) -> int:
        """``prepare_layers`` then ``run_layers``, for one range set."""
        return self.run_layers(self.prepare_layers(chunk, req), spans)

    def store(self, chunk: torch.Tensor, req: ChunkRequest) -> StoreResult:
        """Paged KV -> chunk buffer. Copies nothing if any stored group lacks
        a real block for a needed position."""
        _check_chunk(chunk, self.plan.chunk_bytes)
        addrs = self._addresses(req)
        missing = self._missing(addrs)
        if missing:
            return StoreResult(False, missing, 0, 0)
        calls = self._run(chunk, addrs, to_chunk=True)
        return StoreResult(True, (), calls, self.plan.chunk_bytes)

    def load(self, chunk: torch.Tensor, req: ChunkRequest) -> LoadResult:
        """Chunk buffer -> paged KV. Positions without a real block (and
        skipped groups) are left alone."""
        _check_chunk(chunk, self.plan.chunk_bytes)
        addrs = self._addresses(req)
        calls = self._run(chunk, addrs, to_chunk=False)
        return LoadResult(calls, self.plan.chunk_bytes, self._missing(addrs))
