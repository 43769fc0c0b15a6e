"""LMCache's engine, lookup client and lookup server as the connector's two
halves own them.

* :class:`SchedulerLookup` (scheduler process): LMCache's lookup client,
  called as ``lookup(token_ids, req_id)``; ``close()``.
* :class:`WorkerEngine` (worker process): one ``LMCacheEngine`` with our
  chunk connector, and its lookup server; ``retrieve``/``store``/``unpin``;
  ``close()``.

Both start their chunk-hash chain from the same deterministic seed and
memoize prefix hashes (:func:`prepare_token_database`). Imports LMCache,
never vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from lmcache_ascend.lmcache_bridge.backends import remote_pool
from lmcache_ascend.lmcache_bridge.backends.remote_pool import Reconnector
from lmcache_ascend.lmcache_bridge.engine.chunk_io import (
    ChunkBufferMetadata,
    PagedChunkConnector,
    TransferContext,
    key_scope_of,
)
from lmcache_ascend.lmcache_bridge.engine.config import value_encoding_tag
from lmcache_ascend.lmcache_bridge.engine.resources import CLOSE_TIMEOUT_S, bounded_close, detach_remote_backends
from lmcache_ascend.lmcache_bridge.engine.step_puts import Handoff, StepPuts
from lmcache_ascend.lmcache_bridge.integrity.staging import LOCAL_CPU, Claim, LookupStaging, StagingCounts
from lmcache_ascend.lmcache_bridge.patching import lmcache_modules, overrides

logger = logging.getLogger(__name__)

ENGINE_INSTANCE_PREFIX = "lmcache-ascend"
# vLLM 0.32's seed of its block-hash chain when PYTHONHASHSEED is unset
# (vllm/v1/core/kv_cache_utils.py, DEFAULT_NONE_HASH_SEED).
NONE_HASH_SEED = "vllm-none-hash"

_logging_lock = threading.Lock()
_logging_attached = False


def attach_logging() -> None:
    """Our loggers (``lmcache_ascend.*``) follow LMCache's logging setup
    (handler, format, ``LMCACHE_LOG_LEVEL``) from the moment a connector
    starts: LMCache's own ``init_logger`` configures the package logger."""
    global _logging_attached
    with _logging_lock:
        if _logging_attached:
            return
        from lmcache.logging import init_logger

        from lmcache_ascend.lmcache_bridge.backends import credentials

        # Before LMCache reads and prints its configuration (remote_url).
        credentials.install()
        init_logger("lmcache_ascend")
        # LMCache advice and errors that do not apply under this connector.
        from lmcache_ascend.lmcache_bridge.patching import log_filters

        log_filters.install()
        _logging_attached = True


@dataclass(frozen=True)
class EngineSpec:
    """What LMCache's metadata needs to know about this engine."""

    model_name: str
    engine_id: str
    rank: int
    world_size: int
    chunk_size: int
    extra_config: Mapping[str, Any]
    # Every TP rank holds the same bytes (planning/replication.py): chunk
    # keys then carry world size 1 and worker 0 on every rank, so they do not
    # depend on the TP size or the rank, and any rank (of any TP size) finds
    # a chunk another stored in a shared backend.
    replicated: bool = False

    def key_metadata(self, metadata: ChunkBufferMetadata) -> ChunkBufferMetadata:
        """The metadata LMCache's token database makes chunk keys from (and
        only that: lookup sockets and ranks keep ``metadata``'s own)."""
        if not self.replicated:
            return metadata
        # These are fields of LMCache's LMCacheMetadata, the base class, which mypy
        # does not see (LMCache ships no types).
        return dataclasses.replace(  # type: ignore[call-arg]
            metadata, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0
        )

    def metadata(self, role: str, chunk_bytes: int = 0, num_layers: int = 1) -> ChunkBufferMetadata:
        return ChunkBufferMetadata(
            model_name=self.model_name,
            world_size=self.world_size,
            local_world_size=self.world_size,
            worker_id=self.rank,
            local_worker_id=self.rank,
            kv_dtype=torch.uint8,
            kv_shape=(max(1, num_layers), 1, self.chunk_size, 1, 1),
            use_mla=False,
            role=role,
            chunk_size=self.chunk_size,
            engine_id=self.engine_id,
            kv_connector_extra_config=dict(self.extra_config),
            chunk_bytes=chunk_bytes,
        )


def pin_init_hash(db: Any) -> int:
    """Make ``db``'s chunk-hash chain start from a seed every process derives
    alike: ``PYTHONHASHSEED`` when set, else vLLM 0.32's fixed seed, hashed
    with the database's own hash function. LMCache copies vLLM's NONE_HASH,
    which vLLM < 0.32 draws from os.urandom per process when PYTHONHASHSEED is
    unset, so the scheduler's lookups and the worker's stores would never
    meet. The value equals what LMCache computes itself on vLLM 0.32, so
    chunks are shared between engines of every supported vLLM. Pinned per
    instance: a later token database re-seeds LMCache's module global."""
    token_database = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE)

    seed = os.environ.get("PYTHONHASHSEED") or NONE_HASH_SEED
    value = token_database._normalize_hash_to_int(db.hash_func(seed))
    overrides.apply(overrides.PINNED_INIT_HASH, db, "_get_init_hash", lambda: value)
    return value


def prepare_token_database(owner: Any, chunk_size: int, where: str) -> Optional[Any]:
    """Pins the chunk-hash seed of ``owner.token_database`` (an LMCache engine
    or lookup client) and memoizes its prefix hashes (see hash_memo.py).
    Returns the memo."""
    from lmcache_ascend.lmcache_bridge.engine import hash_memo

    token_database = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE)

    db = getattr(owner, "token_database", None)
    if not isinstance(db, token_database.ChunkedTokenDatabase):
        logger.info(
            "lmcache-ascend %s: chunk prefix hashes are not memoized (%s uses %s)",
            where,
            type(owner).__name__,
            type(db).__name__,
        )
        return None
    memo = getattr(db, "lmcache_ascend_hash_memo", None)
    if memo is None:  # a bypass lookup client shares the engine's database
        seed = pin_init_hash(db)  # before the memo captures _get_init_hash
        memo = hash_memo.install(db, chunk_size)
        logger.info(
            "lmcache-ascend %s: chunk hashes seeded with %#x, prefix hashes memoized "
            "(last %d chunks)",
            where,
            seed,
            memo.capacity,
        )
    return memo


def checksums_enabled(config: Any) -> bool:
    """Chunks that leave this process (disk, remote) can come back damaged;
    LMCache 0.5.6 does not verify them, so we checksum every chunk then."""
    return bool(config.local_disk or config.remote_url)


class SchedulerLookup:
    """The scheduler's lookup over an LMCache lookup client: tokens of the
    longest stored prefix, or None when nothing answered (timeout, transport
    error; LMCache's client returns 0 for those exactly as for a miss)."""

    def __init__(self, client: Any, chunk_size: int) -> None:
        self._client = client
        self._chunk_size = chunk_size

    @classmethod
    def create(cls, lmcache_config: Any, spec: EngineSpec) -> "SchedulerLookup":
        factory = lmcache_modules.load(lmcache_modules.LOOKUP_CLIENT_FACTORY).LookupClientFactory
        client = factory.create_lookup_client(lmcache_config, spec.metadata("scheduler"))
        prepare_token_database(client, spec.chunk_size, "scheduler")
        return cls(client, spec.chunk_size)

    def __call__(self, token_ids: Sequence[int], req_id: str) -> Optional[int]:
        tokens = list(token_ids)
        client = self._client
        try:
            hit = client.lookup(tokens, lookup_id=req_id)
            # The client records a result only when the lookup server
            # answered; a timeout or transport error returns 0 unrecorded.
            answered = hit is not None and client.lookup_cache(req_id) != -1
        finally:
            # We keep hits ourselves; LMCache's per-request record would
            # otherwise grow for the life of the server.
            client.clear_lookup_status(req_id)
        if not answered and len(tokens) >= self._chunk_size:
            return None
        return int(hit or 0)

    def close(self) -> None:
        bounded_close("lookup client", self._client.close)


_engine_lock = threading.Lock()


class WorkerEngine:
    """This worker's LMCache engine (with ``connector`` as its GPU connector)
    and the lookup server the scheduler's client asks. Its lookups stage
    what they report (``integrity/staging.py``); loads copy from what was staged."""

    def __init__(
        self, engine: Any, server: Any, instance_id: str, staging: Optional[LookupStaging] = None,
        connector: Any = None, step_puts: Optional[StepPuts] = None,
    ) -> None:
        self.engine = engine
        self.connector = connector
        self._step_puts = step_puts
        self._server = server
        self.instance_id = instance_id
        self.staging = staging
        self._closed = False
        self._reconnector: Optional[Reconnector] = None

    @classmethod
    def start(
        cls, lmcache_config: Any, spec: EngineSpec, connector: PagedChunkConnector, chunk_bytes: int, num_layers: int,
        layout_fingerprint: str,
    ) -> "WorkerEngine":
        builder = lmcache_modules.load(lmcache_modules.CACHE_ENGINE).LMCacheEngineBuilder
        factory = lmcache_modules.load(lmcache_modules.LOOKUP_CLIENT_FACTORY).LookupClientFactory

        metadata = spec.metadata("worker", chunk_bytes, num_layers)
        # Chunk keys carry the model name; adding the buffer layout's
        # fingerprint keeps chunks of different layouts (bundled vs exploded,
        # another chunk size) apart in shared or persistent storage. ("@"
        # separates key fields in LMCache's key strings, so use "+".) So does
        # how a remote value is encoded (config.value_encoding_tag).
        metadata.model_name = f"{spec.model_name}+{layout_fingerprint}{value_encoding_tag(lmcache_config)}"
        instance_id = f"{ENGINE_INSTANCE_PREFIX}-{spec.engine_id}-{spec.rank}"
        with _engine_lock:
            engine = builder.get_or_create(
                instance_id, lmcache_config, metadata, connector, _broadcast_noop, _broadcast_object_noop
            )
            overrides.apply(overrides.KEY_METADATA, engine.token_database, "metadata", spec.key_metadata(metadata))
            # A pool entry's MAC binds these chunk keys' fields (chunk_io).
            connector.key_scope = key_scope_of(engine.token_database)
            engine.post_init()
            prepare_token_database(engine, spec.chunk_size, "worker")
            # Before the lookup server exists: every lookup it answers stages.
            staging = LookupStaging(engine, connector.verify).install()
            # The seals of a step's chunks run beside it when they can
            # (step_puts.py); a connector without checksums has none.
            step_puts = StepPuts.install(engine, connector.seals if connector.checksums else None)
        server = factory.create_lookup_server(engine, metadata)
        worker = cls(engine, server, instance_id, staging, connector, step_puts)
        worker._reconnector = Reconnector(engine).start()
        return worker

    def step(self) -> contextlib.AbstractContextManager[Handoff]:
        """Around one step's stores: their disk and remote puts, and the
        chunks' seals, are handed off once, at the end, and run off this
        thread (``step_puts.py``)."""
        return self._step_puts.step() if self._step_puts is not None else contextlib.nullcontext(Handoff())

    def drain_puts(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Waits until the queued remote puts were handed to LMCache."""
        return self._step_puts.drain(timeout) if self._step_puts is not None else True

    def chunk_ids(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[int, int]:
        """Token start -> LMCache chunk hash of the chunks ``mask`` selects
        (memoized prefix hashes; no keys are made for the others): what each
        chunk's checksum is bound to."""
        return {
            start: key.chunk_hash
            for start, end, key in self.engine.token_database.process_tokens(tokens=tokens, mask=mask)
            if end > start
        }

    def retrieve(self, tokens: torch.Tensor, mask: torch.Tensor, ctx: TransferContext) -> torch.Tensor:
        """LMCache's own retrieve: reads the store again (used only when no
        staged chunks exist for the load)."""
        ctx = dataclasses.replace(ctx, chunk_ids=self.chunk_ids(tokens, mask))
        return self.engine.retrieve(tokens, mask=mask, req_id=ctx.req_id, lmcache_ascend_ctx=ctx)

    def store(self, tokens: torch.Tensor, mask: torch.Tensor, ctx: TransferContext) -> None:
        ids = self.chunk_ids(tokens, mask)
        ctx = dataclasses.replace(ctx, chunk_ids=ids)
        self.engine.store(tokens, mask=mask, req_id=ctx.req_id, lmcache_ascend_ctx=ctx)
        if self.staging is not None:
            self.staging.stored(list(ids.values()))

    def claim(self, lookup_id: str) -> Optional[Claim]:
        """What ``lookup_id``'s lookup staged, or None (nothing staged)."""
        return self.staging.claim(lookup_id) if self.staging is not None else None

    def load_claim(self, claim: Claim, first: int, end: int, ctx: TransferContext) -> int:
        """Copies the claimed chunks covering [``first``, ``end``) into vLLM's
        KV cache through the chunk connector (verified at lookup: not
        checked again). Returns where the contiguous run from ``first``
        ends; ``ctx.outcome`` says what the copies did."""
        objs, starts, ends = [], [], []
        pos = first
        for chunk in claim.chunks:
            if chunk.end <= first:
                continue
            if chunk.start != pos or chunk.end > end:
                break
            objs.append(chunk.obj)
            starts.append(chunk.start)
            ends.append(chunk.end)
            pos = chunk.end
        if objs:
            ids = {c.start: c.ident for c in claim.chunks}
            ctx = dataclasses.replace(ctx, chunk_ids=ids, verified=True)
            self.connector.batched_to_gpu(objs, starts, ends, lmcache_ascend_ctx=ctx)
        return pos

    def release_claim(self, claim: Claim) -> None:
        if self.staging is not None:
            self.staging.release_claim(claim)

    def backend_failures(self) -> int:
        """Failed operations of the remote stores, cumulative: those of the
        store connectors lmcache-ascend wraps (Mooncake: lookups, puts,
        gets; for this process) and this engine's remote put hand-offs."""
        mooncake = sys.modules.get("lmcache_ascend.lmcache_bridge.backends.mooncake")
        wrapped = sum(mooncake.failure_counts().values()) if mooncake is not None else 0
        return wrapped + (self._step_puts.failures if self._step_puts is not None else 0)

    def remote_unavailable(self) -> int:
        """Times a remote store was found unavailable (startup, reconnects): cumulative."""
        return remote_pool.unavailable_count()

    def take_counts(self) -> StagingCounts:
        return self.staging.take_counts() if self.staging is not None else StagingCounts()

    def unpin(self, lookup_id: str) -> None:
        if self.staging is not None:
            self.staging.release(lookup_id)
        self.engine.lookup_unpin(lookup_id)

    def request_ended(self, req_id: str) -> None:
        """``req_id`` is gone for good: what its lookups staged or pinned is
        released, also what a lookup of it still reading stages later."""
        if self.staging is not None:
            self.staging.request_ended(req_id)
        self.engine.lookup_unpin(req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        builder = lmcache_modules.load(lmcache_modules.CACHE_ENGINE).LMCacheEngineBuilder

        if self._reconnector is not None:
            self._reconnector.stop()
        if self._server is not None:
            bounded_close("lookup server", self._server.close)
        if self.staging is not None:
            self.staging.close()
        if self._step_puts is not None:
            # Before the remote backends are detached: what a last step
            # queued still reaches them.
            self._step_puts.close(CLOSE_TIMEOUT_S)
        self._report_held_chunks()
        bounded_close("remote backends", lambda: detach_remote_backends(self.engine))
        bounded_close("LMCache engine", lambda: builder.destroy(self.instance_id))


    def _report_held_chunks(self) -> None:
        """Once the last puts are done, every chunk in LMCache's CPU cache is
        held by the cache alone: a lookup pin no load or unpin released, or
        a reference a load or store kept, would show here (ref count above
        1, or pinned). Said at every close, a WARNING when any is held: the
        leak check of aborts, preemptions and shutdowns with transfers in
        flight."""
        try:
            # LMCache 0.5.6 and 0.5.7rc2: the local CPU backend's hot_cache
            # (key -> MemoryObj); no public accessor.
            backend = self.engine.storage_manager.storage_backends.get(LOCAL_CPU)
            objs = list(backend.hot_cache.values()) if backend is not None else []
            held = sum(1 for o in objs if o.is_pinned or o.get_ref_count() > 1)
        except Exception:  # noqa: BLE001 - a report, never a reason to fail a close
            logger.debug("lmcache-ascend: could not read LMCache's CPU cache at close", exc_info=True)
            return
        (logger.warning if held else logger.info)(
            "lmcache-ascend: closing: %d of %d chunk(s) in LMCache's CPU cache still pinned or referenced%s",
            held,
            len(objs),
            " (a pin or reference that no load, unpin or put released)" if held else "",
        )


def _broadcast_noop(tensor: torch.Tensor, src: int) -> torch.Tensor:
    return tensor


def _broadcast_object_noop(obj: Any, src: int) -> Any:
    return obj
