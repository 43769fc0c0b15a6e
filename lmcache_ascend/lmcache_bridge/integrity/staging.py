"""Verify before promising: the lookup stages the chunks it reports.

vLLM cannot recover from a failed load on models with several KV cache
groups (0.23-0.29 crash in the invalid-block path, 0.30 recomputes the whole
request, 0.32 raises), and on one-group models a failed load still costs a
recomputation. A load fails when an entry the lookup saw is damaged,
truncated, foreign, undecodable, deleted, or its backend dies or stalls
before the load. So the lookup itself reads every chunk it is about to
report, verifies it (size, and with checksums on the crc seeded with the
chunk's key: ``chunk_io``), and holds a reference to it in this process until
the load copies it or the scheduler lets the request go. It reports only the
prefix of chunks that verified; a chunk that did not is counted, logged once
with its key and reason, removed where the backend can remove it, and
skipped by later lookups for ``QUARANTINE_S`` or until this process stores it
again (a remote entry is overwritten by the store of the request that
recomputes it).

After a lookup answered N tokens, nothing between it and the load touches the
store: the load copies from the held objects (``claim``/``release_claim``).

The lookup runs in LMCache's lookup-server thread of the worker process (or
in the scheduler's, with the bypass lookup client); claims and releases run
in the worker's thread. One lock guards the bookkeeping; reads from the
backends run outside it. Imports LMCache, never vLLM.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lmcache_ascend.lmcache_bridge.backends import redis_reads
from lmcache_ascend.lmcache_bridge.patching import overrides

logger = logging.getLogger(__name__)

# How long a refused chunk is skipped by this process's lookups: long enough
# for the recomputing request's store to overwrite it, short enough that an
# entry another instance writes again is used again soon.
QUARANTINE_S = 120.0
# At most this many refused keys are remembered (oldest forgotten first).
QUARANTINE_MAX = 4096
# Staged chunks no load claimed within this time are released: the backstop
# for a lookup whose answer never reached the scheduler (its RPC timed out)
# while its request still runs. Its request's end releases them sooner, also
# when the lookup lands after it (``request_ended``).
STAGE_TTL_S = 300.0
# The scheduler's lookup ids of one request: the request id itself, or the
# request id, this separator and a suffix (a Mamba state probe: ``r#state3``).
REQUEST_ID_SEP = "#"
# Chunks per read while the previous ones are verified: large enough that a
# backend's batched read pays its round trips once per window, small enough
# that the first checks start early (16 chunks of 256 tokens of a large
# model are tens of MB).
FETCH_WINDOW = 16

LOCAL_CPU = "LocalCPUBackend"
# Backends whose entries were written by this process's own allocator and
# never left it: no checksum to verify (LMCache's CPU cache, or a verified
# chunk written back to it).
_TRUSTED = (LOCAL_CPU,)


@dataclass
class StagingCounts:
    """What the lookups refused since the last ``take_counts``."""

    checksum_failures: int = 0  # damaged, truncated, foreign: refused by verification
    unreadable_chunks: int = 0  # listed by a backend but could not be read
    quarantine_skips: int = 0  # lookups cut short at a chunk refused earlier
    staged_chunks: int = 0  # chunks read from disk or remote and verified at lookup


@dataclass(frozen=True)
class _Fetched:
    """One chunk a backend returned (``obj`` None: listed but not read)."""

    location: str
    backend: Any
    key: Any  # LMCache CacheEngineKey
    obj: Any  # LMCache MemoryObj or None


@dataclass
class _Timing:
    """Where one lookup's time went (the fetch thread adds, then this one)."""

    started: float = field(default_factory=time.perf_counter)
    keys_s: float = 0.0  # the prompt's chunk keys (LMCache's token database)
    fetch_s: float = 0.0
    check_s: float = 0.0
    bytes_by_location: dict[str, int] = field(default_factory=dict)

    def add(self, location: str, nbytes: int) -> None:
        self.bytes_by_location[location] = self.bytes_by_location.get(location, 0) + nbytes

    def wall_s(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class _Entry:
    obj: Any  # LMCache MemoryObj; one reference held by the staging
    holders: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class StagedChunk:
    start: int
    end: int
    ident: int  # the chunk's key identity (LMCache chunk hash)
    obj: Any


@dataclass
class Claim:
    """The chunks one lookup staged, held for the load until released."""

    token: int
    keys: tuple[Any, ...]
    chunks: tuple[StagedChunk, ...]


@dataclass
class _Registration:
    token: int
    keys: tuple[Any, ...]
    chunks: tuple[StagedChunk, ...]
    at: float


class LookupStaging:
    """Replaces ``engine.lookup`` (``install``) with a staging lookup."""

    def __init__(
        self,
        engine: Any,
        verify: Callable[[Any, int, Optional[int]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``verify(memory_obj, start, ident)`` raises on a chunk that must
        not be loaded (``PagedChunkConnector.verify``)."""
        self._engine = engine
        self._verify = verify
        self._clock = clock
        self._original_lookup = engine.lookup
        self._lock = threading.Lock()
        self._entries: dict[Any, _Entry] = {}
        self._registrations: dict[str, _Registration] = {}
        # Lookup id -> its lookups still reading (the lookup server's thread,
        # or a scheduler-side client's); ids whose request ended meanwhile,
        # so what those lookups stage is released when they land instead of
        # being held for a load that cannot come.
        self._running: dict[str, int] = {}
        self._ended: set[str] = set()
        # Chunk hash -> when it was refused.
        self._quarantine: "OrderedDict[int, float]" = OrderedDict()
        self._tokens = itertools.count(1)
        self._counts = StagingCounts()
        # Reads ahead of the checks (``_read``); started by the first read.
        self._pool: Optional[ThreadPoolExecutor] = None
        # Location -> its synchronous reader (``redis_reads``), or None for
        # LMCache's own reads; decided once the backend has a connection.
        self._readers: dict[str, Optional[redis_reads.SyncRedisReader]] = {}
        # LMCache's lookup client gives up after this (the request is then
        # computed as a miss): a read that takes longer is said once.
        self._timeout_s = float(getattr(getattr(engine, "config", None), "lookup_timeout_ms", 0) or 0) / 1e3
        self._said_too_slow = False

    def install(self) -> "LookupStaging":
        # An instance attribute: LMCache's lookup server (and the bypass
        # client) call ``engine.lookup(..., lookup_id=..., pin=True)``.
        overrides.apply(overrides.STAGED_LOOKUP, self._engine, "lookup", self.lookup)
        return self

    # ---- lookup (lookup-server thread) ------------------------------------

    def lookup(
        self,
        tokens: Any = None,
        hashes: Optional[list] = None,
        offsets: Optional[list] = None,
        search_range: Optional[list] = None,
        lookup_id: Optional[str] = None,
        pin: bool = False,
        request_configs: Optional[dict] = None,
    ) -> int:
        if not pin or lookup_id is None:
            # Not a scheduler lookup (nothing will be loaded for it).
            return self._original_lookup(
                tokens=tokens, hashes=hashes, offsets=offsets, search_range=search_range,
                lookup_id=lookup_id, pin=pin, request_configs=request_configs,
            )
        engine = self._engine
        if not engine.is_healthy():
            logger.warning("LMCache is unhealthy, skipping lookup operation")
            return 0
        n_tokens = len(tokens) if tokens is not None else sum(offsets or ())
        lookup_stats = engine.stats_monitor.on_lookup_request(n_tokens)
        found = 0
        timing = _Timing()
        try:
            chunks = [
                (start, end, key)
                for start, end, key in engine.token_database.process_tokens(
                    tokens=tokens, hashes=hashes, offsets=offsets, request_configs=request_configs
                )
                if end > start
            ]
            timing.keys_s = timing.wall_s()
            staged = self._stage(lookup_id, chunks, search_range, timing)
            found = staged[-1].end if staged else 0
            return found
        finally:
            engine.stats_monitor.on_lookup_finished(lookup_stats, found)

    def _stage(self, lookup_id: str, chunks: Sequence[tuple], search_range: Optional[list],
               timing: "_Timing") -> list[StagedChunk]:
        token = next(self._tokens)
        now = self._clock()
        staged: list[StagedChunk] = []
        with self._lock:
            self._running[lookup_id] = self._running.get(lookup_id, 0) + 1
            self._sweep(now)
            # Chunks an earlier lookup (this request's, or a Mamba probe's)
            # holds already are not read again.
            for start, end, key in chunks:
                entry = self._entries.get(key)
                if entry is None:
                    break
                entry.holders.add(token)
                staged.append(StagedChunk(start, end, key.chunk_hash, entry.obj))
        rest = chunks[len(staged):]
        try:
            fresh = self._read(rest, search_range, now, timing) if rest else []
        except BaseException:
            with self._lock:
                self._drop(token, [key for _, _, key in chunks[: len(staged)]])
                self._landed(lookup_id)
            raise
        with self._lock:
            for (_, _, key), chunk in zip(rest, fresh):
                entry = self._entries.get(key)
                if entry is None:
                    self._entries[key] = _Entry(chunk.obj, {token})
                else:  # staged meanwhile by a concurrent lookup: keep one copy
                    chunk.obj.ref_count_down()
                    entry.holders.add(token)
                    chunk = StagedChunk(chunk.start, chunk.end, chunk.ident, entry.obj)
                staged.append(chunk)
            keys = tuple(key for _, _, key in chunks[: len(staged)])
            old = self._registrations.pop(lookup_id, None)
            if old is not None:
                self._drop(old.token, old.keys)
            if self._landed(lookup_id):
                # Its request ended while this lookup read (a client gone, or
                # a scheduler that stopped waiting: LMCache's lookup_timeout_ms).
                self._drop(token, keys)
                logger.debug("lmcache-ascend: lookup %s landed after its request ended; released "
                             "its %d staged chunk(s)", lookup_id, len(keys))
            else:
                self._registrations[lookup_id] = _Registration(token, keys, tuple(staged), now)
        return staged

    def _landed(self, lookup_id: str) -> bool:
        """(Lock held.) One lookup of ``lookup_id`` ended; whether its
        request ended while it ran."""
        left = self._running.pop(lookup_id, 1) - 1
        if left:
            self._running[lookup_id] = left
            return lookup_id in self._ended
        if lookup_id in self._ended:
            self._ended.discard(lookup_id)
            return True
        return False

    def _read(self, chunks: Sequence[tuple], search_range: Optional[list], now: float,
              timing: "_Timing") -> list[StagedChunk]:
        """Reads and verifies the longest prefix of ``chunks`` the backends
        hold; each returned chunk carries one reference for the staging.

        Windows of ``FETCH_WINDOW`` chunks are pipelined: the fetch thread
        asks the backends for window k+1 while this thread verifies window k
        (the crc32 and BLAKE3 release the GIL, the backends wait on
        their own I/O threads), so a remote hit costs about its reads, not
        its reads plus its checks."""
        out: list[StagedChunk] = []
        windows = [chunks[i : i + FETCH_WINDOW] for i in range(0, len(chunks), FETCH_WINDOW)]
        # The first window is read on this thread: a lookup of one window
        # (most of them, and every miss) pays no hand-off to the fetch thread.
        fetched, complete = self._fetch(windows[0], search_range, timing)
        pending: Optional[Future] = None
        for k, window in enumerate(windows):
            if pending is not None:
                fetched, complete = pending.result()
                pending = None
            if complete and k + 1 < len(windows):
                pending = self._fetcher().submit(self._fetch, windows[k + 1], search_range, timing)
            t0 = time.perf_counter()
            good, clean = self._check(window, fetched, now)
            timing.check_s += time.perf_counter() - t0
            out.extend(good)
            if not (clean and complete):
                if pending is not None:  # the read ahead is not used: its references go back
                    for item in pending.result()[0]:
                        if item.obj is not None:
                            item.obj.ref_count_down()
                break
        self._log_read(out, timing)
        return out

    def _fetcher(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-ascend-fetch")
        return self._pool

    def _fetch(self, chunks: Sequence[tuple], search_range: Optional[list],
               timing: "_Timing") -> tuple[list["_Fetched"], bool]:
        """(Fetch thread.) The objects the backends hold for the longest
        prefix of ``chunks``, in order, with where each came from; a None
        object marks the first one listed but not read. ``complete``: every
        chunk of ``chunks`` was read."""
        t0 = time.perf_counter()
        manager = self._engine.storage_manager
        _, mapping = manager.batched_contains([key for _, _, key in chunks], search_range, False)
        out: list[_Fetched] = []
        complete = False
        for location, keys in mapping.items():
            cut = None
            if location not in _TRUSTED:
                # A chunk refused earlier is not read from disk or remote
                # again (a copy this process stored since is in its CPU cache).
                with self._lock:
                    cut = next((i for i, key in enumerate(keys) if key.chunk_hash in self._quarantine), None)
                    if cut is not None:
                        self._counts.quarantine_skips += 1
                if cut is not None:
                    keys = keys[:cut]
                    if not keys:
                        break
            backend = manager.storage_backends[location]
            objs = redis_reads.read_prefix(backend, list(keys), self._reader(location, backend))
            out.extend(_Fetched(location, backend, key, obj) for key, obj in zip(keys, objs))
            if location not in _TRUSTED:
                timing.add(location, sum(o.get_size() for o in objs if o is not None))
            if cut is not None or len(objs) < len(keys) or (objs and objs[-1] is None):
                break
        else:
            complete = len(out) == len(chunks)
        timing.fetch_s += time.perf_counter() - t0
        return out, complete

    def _reader(self, location: str, backend: Any) -> Optional["redis_reads.SyncRedisReader"]:
        if location in _TRUSTED:
            return None
        with self._lock:
            if location not in self._readers:
                if getattr(backend, "connection", None) is None:
                    return None  # down at startup: decided once it is connected
                self._readers[location] = redis_reads.reader_for(backend)
            return self._readers[location]

    def _check(self, chunks: Sequence[tuple], fetched: list["_Fetched"], now: float) -> tuple[list[StagedChunk], bool]:
        """Verifies ``fetched`` (a prefix of ``chunks``) in order; returns the
        chunks that verified and whether every fetched one did. A chunk
        refused and the ones after it are released."""
        out: list[StagedChunk] = []
        ok_keys: dict[str, list] = {}  # location -> LMCache's CacheEngineKeys
        ok_objs: dict[str, list] = {}  # location -> MemoryObjs
        clean = True
        for i, item in enumerate(fetched):
            start, end, _ = chunks[i]
            reason = None
            if item.obj is None and item.location in _TRUSTED:
                # Evicted between contains and get: a race, not bad data.
                clean = False
                break
            if item.obj is None:
                reason = "listed but could not be read (deleted, evicted, undecodable or timed out)"
            elif item.location not in _TRUSTED:
                try:
                    self._verify(item.obj, start, item.key.chunk_hash)
                except Exception as exc:  # noqa: BLE001 - any refusal is a miss
                    reason = str(exc)
            if reason is not None:
                self._refuse(item.key, item.location, item.backend, reason, unreadable=item.obj is None, now=now)
                for extra in fetched[i:]:
                    if extra.obj is not None:
                        extra.obj.ref_count_down()
                clean = False
                break
            out.append(StagedChunk(start, end, item.key.chunk_hash, item.obj))
            if item.location not in _TRUSTED:
                ok_keys.setdefault(item.location, []).append(item.key)
                ok_objs.setdefault(item.location, []).append(item.obj)
        for location, keys in ok_keys.items():
            self._write_back(location, keys, ok_objs[location])
        return out, clean

    def _log_read(self, staged: list[StagedChunk], timing: "_Timing") -> None:
        if not timing.bytes_by_location:
            return
        total = sum(timing.bytes_by_location.values())
        took = timing.wall_s()
        logger.info(
            "lmcache-ascend: lookup staged %d chunk(s); read %.1f MB from %s in %.3f s (%.2f GB/s; "
            "chunk keys %.3f s, then reads %.3f s and checks %.3f s, overlapped)",
            len(staged), total / 1e6, ", ".join(sorted(timing.bytes_by_location)), took,
            total / took / 1e9 if took > 0 else float("inf"), timing.keys_s, timing.fetch_s, timing.check_s,
        )
        if self._timeout_s and took > self._timeout_s and not self._said_too_slow:
            # The scheduler stopped waiting before this read ended: the
            # request was computed, and the read serves nobody. Say so once,
            # with what to change.
            self._said_too_slow = True
            logger.warning(
                "lmcache-ascend: a lookup read %.1f MB in %.1f s, longer than LMCache's lookup_timeout_ms "
                "(%.0f ms): the scheduler had stopped waiting and computed its request (a lookup "
                "failure). Its chunks are released once the request ends. Raise lookup_timeout_ms "
                "(LMCACHE_LOOKUP_TIMEOUT_MS) where prefixes this large should hit; it also bounds how "
                "long a request waits for a stalled store. Said once.",
                total / 1e6, took, self._timeout_s * 1e3,
            )

    def _write_back(self, location: str, keys: list, objs: list) -> None:
        """Verified chunks from disk or remote go to LMCache's CPU cache, as
        LMCache's own retrieve does (which writes them back unverified)."""
        if not keys or location in _TRUSTED:
            return
        with self._lock:
            self._counts.staged_chunks += len(keys)
        local = self._engine.storage_manager.storage_backends.get(LOCAL_CPU)
        if local is not None and getattr(local, "use_hot", False):
            local.batched_submit_put_task(keys, objs)

    def _refuse(self, key: Any, location: str, backend: Any, reason: str, unreadable: bool, now: float) -> None:
        removed = False
        if location != "RemoteBackend":
            # LMCache's remote connectors mostly cannot delete (Redis raises
            # NotImplementedError); the recomputing request overwrites it.
            try:
                removed = bool(backend.remove(key))
            except Exception:  # noqa: BLE001 - removal is best effort
                removed = False
        with self._lock:
            if unreadable:
                self._counts.unreadable_chunks += 1
            else:
                self._counts.checksum_failures += 1
            self._quarantine[key.chunk_hash] = now
            self._quarantine.move_to_end(key.chunk_hash)
            while len(self._quarantine) > QUARANTINE_MAX:
                self._quarantine.popitem(last=False)
        logger.warning(
            "lmcache-ascend: chunk %s in %s refused at lookup: %s; served as a miss from there "
            "(vLLM computes it), %s, skipped by this process's lookups for %.0f s or until "
            "this process stores it again",
            key.to_string() if hasattr(key, "to_string") else key,
            location,
            reason,
            "removed" if removed else "left to be overwritten by the next store",
            QUARANTINE_S,
        )

    def _sweep(self, now: float) -> None:
        """(Lock held.) Forget expired quarantine entries and release
        registrations no load claimed in time."""
        while self._quarantine:
            key, at = next(iter(self._quarantine.items()))
            if now - at < QUARANTINE_S:
                break
            self._quarantine.popitem(last=False)
        stale = [lid for lid, reg in self._registrations.items() if now - reg.at > STAGE_TTL_S]
        for lid in stale:
            reg = self._registrations.pop(lid)
            self._drop(reg.token, reg.keys)
        if stale:
            logger.info(
                "lmcache-ascend: released the staged chunks of %d lookup(s) no load claimed "
                "within %.0f s", len(stale), STAGE_TTL_S,
            )

    def _drop(self, token: int, keys: Sequence[Any]) -> None:
        """(Lock held.) ``token`` no longer holds ``keys``."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.holders.discard(token)
            if not entry.holders:
                del self._entries[key]
                entry.obj.ref_count_down()

    def stored(self, idents: Sequence[int]) -> None:
        """This process stored these chunks again (the recomputation of a
        refused chunk): the new copy is no longer skipped."""
        with self._lock:
            for ident in idents:
                self._quarantine.pop(ident, None)

    # ---- load (worker thread) ---------------------------------------------

    def claim(self, lookup_id: str) -> Optional[Claim]:
        """The chunks ``lookup_id``'s lookup staged, held until
        ``release_claim``; a later lookup of the same id cannot drop them."""
        with self._lock:
            reg = self._registrations.pop(lookup_id, None)
        if reg is None:
            return None
        return Claim(reg.token, reg.keys, reg.chunks)

    def release_claim(self, claim: Claim) -> None:
        with self._lock:
            self._drop(claim.token, claim.keys)

    def release(self, lookup_id: str) -> None:
        """The scheduler let ``lookup_id`` go without a load. (A lookup of
        the same id may run meanwhile for the same, still living request,
        e.g. readmitted after a preemption: what it stages is kept.)"""
        with self._lock:
            reg = self._registrations.pop(lookup_id, None)
            if reg is not None:
                self._drop(reg.token, reg.keys)

    def request_ended(self, req_id: str) -> None:
        """``req_id`` finished or was aborted: no load will come for any of
        its lookup ids. What they staged is released now, and what a lookup
        of them still reading stages is released when it lands (an RPC that
        timed out, a client that left before its fetch ended); otherwise
        those chunks would be held until ``STAGE_TTL_S``."""
        prefix = req_id + REQUEST_ID_SEP
        with self._lock:
            for lookup_id in [i for i in self._registrations if i == req_id or i.startswith(prefix)]:
                reg = self._registrations.pop(lookup_id)
                self._drop(reg.token, reg.keys)
            self._ended.update(i for i in self._running if i == req_id or i.startswith(prefix))

    def take_counts(self) -> StagingCounts:
        with self._lock:
            counts, self._counts = self._counts, StagingCounts()
        return counts

    def held(self) -> int:
        """Chunks held right now (tests, logs)."""
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        with self._lock:
            held, lookups = len(self._entries), len(self._registrations)
            for entry in self._entries.values():
                entry.obj.ref_count_down()
            self._entries.clear()
            self._registrations.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for reader in self._readers.values():
            if reader is not None:
                reader.close()
        # Every staged chunk is released by its load, its request's end (the
        # next step's unpins) or STAGE_TTL_S. Any still held at close means
        # one of those paths missed it: say so, an operator's leak check.
        (logger.warning if held else logger.info)(
            "lmcache-ascend: closing: %d staged chunk(s) still held (%d lookup(s) no load claimed); released",
            held,
            lookups,
        )

