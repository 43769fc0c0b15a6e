"""Builds the scheduler and worker halves from a vLLM config.

The one place that joins vLLM's view (through the ``vllm_*`` modules), our planning
and LMCache (through ``lmcache_bridge``), so the entry class stays a thin
role bridge and each half receives the resources it owns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, TypedDict

import torch

from lmcache_ascend.integration.vllm import vllm_engine_config, vllm_kv_layout, vllm_specs
from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.worker import WorkerHalf
from lmcache_ascend.lmcache_bridge.patching import overrides
from lmcache_ascend.planning.agreement import HalfAgreement
from lmcache_ascend.planning.groups import SchedulerGroup
from lmcache_ascend.planning.isolation import Refusal
from lmcache_ascend.planning.settings import PLAN_FILE_KEY, AscendConfig, ConfigValueError, plan_file_for
from lmcache_ascend.planning.state_align import SnapshotLayout, StateGate

if TYPE_CHECKING:
    # Imported where used, at startup of the half that needs them; named here
    # for the annotations. (vLLM's config types stay untyped to mypy, which skips
    # vLLM's sources; tests hand in plain namespaces.)
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from lmcache_ascend.integration.vllm.lookup_ahead import LookupAhead
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec
    from lmcache_ascend.planning.kv_format import LayerEntry, LayoutHints
    from lmcache_ascend.planning.planner import TransferPlan
    from lmcache_ascend.planning.replication import Replication
    from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
    from lmcache_ascend.transfer.state_transfer import StateTransfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorSetup:
    """Everything both halves derive from the configs, alike."""

    lmcache_config: Any  # LMCache's LMCacheEngineConfig: LMCache ships no types
    ascend_config: AscendConfig
    groups: tuple[SchedulerGroup, ...]
    chunk_size: int
    engine: EngineSpec
    agreement: HalfAgreement
    # Mamba / GDN state hits: the gate (None without Mamba groups) and, when
    # it is open, the snapshot layout.
    state_gate: Optional[StateGate] = None
    snapshot: Optional[SnapshotLayout] = None
    # Where the user set chunk_size (None: the connector chose it).
    chunk_source: Optional[str] = None
    # Set when the model's identity is unknown: every request is refused.
    model_refusal: Optional[Refusal] = None


def load_setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ConnectorSetup:
    from lmcache_ascend.lmcache_bridge.engine.config import (
        apply_extra_config,
        enforce_engine_requirements,
        register_config_keys,
        validate_engine_config,
    )
    from lmcache_ascend.integration.vllm.parallel import check_parallelism, single_copy
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec, attach_logging
    from lmcache_ascend.lmcache_bridge.patching.lmcache_modules import engine_config

    attach_logging()
    register_config_keys()
    config = engine_config()
    extra = vllm_engine_config.kv_transfer_extra_config(vllm_config)
    apply_extra_config(config, extra)
    # LMCache converts its LMCACHE_* variables itself; re-read them only to
    # name a value it dropped (it keeps None) in the error.
    validate_engine_config(config, os.environ)
    groups = vllm_specs.scheduler_groups(kv_cache_config)
    enforce_engine_requirements(config, len(groups))
    source = _default_chunk_size(config, groups, extra)
    chunk_size = int(config.chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"LMCache chunk_size must be > 0, got {chunk_size}")
    model, engine_id, rank, world = vllm_engine_config.engine_identity(vllm_config)
    check_parallelism(vllm_config)
    replicated = single_copy(groups, vllm_config, config)
    ascend = AscendConfig.from_lmcache(config)
    identity, model_refusal = model_identity(vllm_config, ascend)
    gate, snapshot = _state_setup(vllm_config, kv_cache_config, groups, chunk_size, ascend)
    agreement = HalfAgreement.of(groups, chunk_size, ascend)
    if gate is not None:
        agreement = dataclasses.replace(
            agreement, state=(gate.enabled, gate.block_size, snapshot.fingerprint if snapshot else "")
        )
    return ConnectorSetup(
        lmcache_config=config,
        ascend_config=ascend,
        groups=groups,
        chunk_size=chunk_size,
        # "@" separates fields in LMCache's key strings: "+" joins ours.
        engine=EngineSpec(f"{model}+m{identity}", engine_id, rank, world, chunk_size, extra, replicated=replicated),
        agreement=agreement,
        state_gate=gate,
        snapshot=snapshot,
        chunk_source=source,
        model_refusal=model_refusal,
    )


def model_identity(vllm_config: VllmConfig, ascend: AscendConfig) -> tuple[str, Optional[Refusal]]:
    """The fingerprint of the weights and settings behind the KV
    (planning/identity.py), part of every chunk key: engines serving other
    weights under one model name never share entries. Where the weights
    cannot be read and no ``ascend_model_identity`` is set, every request is
    refused (fail closed) and the log says how to fix it."""
    from lmcache_ascend.integration.vllm.vllm_keys import model_facts
    from lmcache_ascend.planning.identity import IdentityError, model_fingerprint

    facts = model_facts(vllm_config, ascend.model_identity or None)
    try:
        fingerprint = model_fingerprint(facts)
    except IdentityError as e:
        logger.warning(
            "lmcache-ascend: %s, so chunk keys cannot tell these weights from others served under the "
            "same name: no request is looked up or stored. Set ascend_model_identity (kv_connector_extra_config "
            "or LMCACHE_ASCEND_MODEL_IDENTITY) to an identifier of these weights to enable the cache.",
            e,
        )
        return "unknown", Refusal("model_identity", str(e))
    logger.info(
        "lmcache-ascend: model identity %s (%s; dtype %s, KV cache dtype %s)",
        fingerprint,
        "set by ascend_model_identity" if facts.explicit else f"sampled from the files under {facts.path}",
        facts.settings.get("dtype"),
        facts.settings.get("kv_cache_dtype"),
    )
    return fingerprint, None


def _state_setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: tuple[SchedulerGroup, ...], chunk_size: int,
                 ascend: AscendConfig) -> tuple[Optional[StateGate], Optional[SnapshotLayout]]:
    """Whether Mamba state hits are exact here (planning/state_align.py)."""
    from lmcache_ascend.planning.state_align import decide, snapshot_layout
    from lmcache_ascend.planning.state_skip import skipped_groups

    facts = vllm_engine_config.state_align_facts(vllm_config, kv_cache_config)
    skipped = tuple(s.index for s in skipped_groups(groups, ascend))
    gate = decide(facts, groups, chunk_size, skipped)
    if gate is None or not gate.enabled:
        return gate, None
    return gate, snapshot_layout(facts, groups, chunk_size, skipped)


def hit_blockers(setup: ConnectorSetup) -> tuple[tuple[SchedulerGroup, ...], Optional[str]]:
    """Groups that make hits unsafe, and the one line that says why (None:
    the scheduler's generic line). Mamba groups block hits only while the
    state gate is shut."""
    from lmcache_ascend.planning.state_skip import unrestorable_groups

    blockers = unrestorable_groups(setup.groups, setup.ascend_config)
    gate = setup.state_gate
    if gate is None:
        return blockers, None
    if gate.enabled:
        return tuple(g for g in blockers if g.index not in gate.groups), None
    only_mamba = all(g.index in gate.groups for g in blockers)
    return blockers, gate.refusal() if only_mamba else None


# config: LMCache's LMCacheEngineConfig (untyped); extra: the user's
# kv_connector_extra_config, JSON values of any kind.
def _default_chunk_size(config: Any, groups: tuple[SchedulerGroup, ...], extra: Mapping[str, Any]) -> Optional[str]:
    """Unless the user chose one, chunk as finely as vLLM's blocks (see
    ``planning/chunking.py``). Returns where the user set it, or None."""
    from lmcache_ascend.planning.chunking import chunk_size_source, default_chunk_size, finest_chunk_size

    current = int(config.chunk_size)
    source = chunk_size_source(extra, os.environ)
    size, replaced = default_chunk_size(groups, source is not None, current)
    if source is not None:
        logger.info("lmcache-ascend: chunk_size %d tokens, as set by %s", current, source)
        return source
    if not replaced:
        # Also said when nothing changes, so the log always tells the size
        # and why (a shape whose blocks are 256 tokens keeps LMCache's 256).
        why = ("vLLM's block granularity for this model" if finest_chunk_size(groups) == current
               else "no attention group sets a granularity")
        logger.info("lmcache-ascend: chunk_size not set; using LMCache's default %d tokens (%s)", current, why)
        return None
    logger.info(
        "lmcache-ascend: chunk_size not set; using %d tokens (vLLM's block granularity) "
        "instead of LMCache's default %d: a chunk must be a whole number of every "
        "group's blocks, and a hit then leaves no more tokens to compute than vLLM's "
        "own prefix cache does. Set chunk_size to choose another.",
        size,
        current,
    )
    overrides.apply(overrides.DEFAULT_CHUNK_SIZE, config, "chunk_size", size)
    return None


def build_scheduler_half(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> SchedulerHalf:
    """The scheduler half with its LMCache lookup client."""
    from lmcache_ascend.integration.vllm.scheduler import StateHits
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import SchedulerLookup

    from lmcache_ascend.integration.vllm.shutdown import advise_drain
    from lmcache_ascend.lmcache_bridge.backends.credentials import redact_url

    setup = load_setup(vllm_config, kv_cache_config)
    vllm_engine_config.ensure_recompute_on_load_failure(vllm_config)
    cfg = setup.lmcache_config
    advise_drain(vllm_config, " and ".join(
        ([f"the remote store {redact_url(cfg.remote_url)}"] if cfg.remote_url else [])
        + ([f"the local disk {cfg.local_disk}"] if cfg.local_disk else [])))
    blockers, refusal = hit_blockers(setup)
    state = None
    guard = None
    if setup.snapshot is not None and setup.state_gate is not None:
        from lmcache_ascend.integration.vllm.align_repair import AlignBlockSize

        gate = setup.state_gate
        state = StateHits(gate.groups, gate.block_size, setup.snapshot.marks())
        guard = AlignBlockSize(vllm_config.cache_config, gate.block_size)
        vllm_engine_config.keep_admission_blocks_free(vllm_config, kv_cache_config, len(gate.groups))
        logger.info(
            "lmcache-ascend: Mamba/GDN state hits on (vLLM align mode, block %d tokens): state "
            "group(s) %s, %s",
            gate.block_size,
            list(gate.groups),
            setup.snapshot.describe(),
        )
    half = SchedulerHalf(
        setup.groups,
        setup.chunk_size,
        SchedulerLookup.create(setup.lmcache_config, setup.engine),
        hit_blockers=blockers,
        agreement=setup.agreement,
        state=state,
        refusal=refusal,
        refuse_all=setup.model_refusal,
        before_admission=guard,
        ahead=_lookup_ahead(setup),
    )
    logger.info(
        "lmcache-ascend scheduler: %d KV cache group(s) %s, chunk %d tokens (plan %s)",
        len(setup.groups),
        [f"{g.index}:{g.kind.value}/{g.spec_name}/bs{g.block_size}" for g in setup.groups],
        setup.chunk_size,
        setup.agreement.fingerprint,
    )
    return half


def _lookup_ahead(setup: ConnectorSetup) -> Optional[LookupAhead]:
    """The lookup thread, where ``ascend_async_lookup`` asks for one (auto:
    where a lookup reads a disk or remote store), with one line saying so."""
    from lmcache_ascend.integration.vllm.lookup_ahead import IDLE_WAIT_S, WAIT_IN_STEP_S, LookupAhead

    cfg = setup.lmcache_config
    mode = setup.ascend_config.async_lookup
    stores = [name for name, on in (("local_disk", cfg.local_disk), ("remote_url", cfg.remote_url)) if on]
    if mode == "off" or (mode == "auto" and not stores):
        logger.info("lmcache-ascend: lookups run inside vLLM's step (ascend_async_lookup=%s%s)", mode,
                    "" if mode == "off" else ": the local CPU cache alone answers in about a millisecond")
        return None
    logger.info(
        "lmcache-ascend: lookups run beside vLLM's step (ascend_async_lookup=%s%s): a request whose lookup "
        "takes longer than %.0f ms (%.0f ms while nothing else runs) waits for it while the other requests "
        "are scheduled, then is admitted with the prefix the lookup verified",
        mode, f", {' and '.join(stores)} set" if mode == "auto" else "", WAIT_IN_STEP_S * 1e3, IDLE_WAIT_S * 1e3)
    return LookupAhead()


# kv_caches: vLLM's per-layer KV entries, a tensor or a list of tensor views
# depending on the attention backend and vLLM release (planning/kv_format.py).
def build_worker_half(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, LayerEntry]
) -> WorkerHalf:
    """Plans transfers for ``kv_caches`` and starts this worker's LMCache
    engine and lookup server (owned by the returned half)."""
    from lmcache_ascend.integration.vllm.layerwise import build_loader
    from lmcache_ascend.integration.vllm.parallel import failed_load_vote, store_stripe
    from lmcache_ascend.lmcache_bridge.engine.chunk_io import PagedChunkConnector
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import WorkerEngine, checksums_enabled
    from lmcache_ascend.lmcache_bridge.integrity.pool_secret import load_mac_key
    from lmcache_ascend.planning.planner import build_plan
    from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

    setup = load_setup(vllm_config, kv_cache_config)
    mac_key = load_mac_key(setup.lmcache_config)  # a bad pool secret stops startup here
    hints = worker_layout_hints(kv_cache_config)
    try:
        plan = build_plan(kv_caches, setup.groups, setup.chunk_size, setup.ascend_config, hints)
    except ValueError as e:
        raise _with_chunk_source(e, setup) from e
    state: Optional[StateTransfer] = None
    if setup.snapshot is not None and setup.state_gate is not None:
        state, plan = _worker_state(setup, plan, kv_caches)
    transfer = ChunkTransfer(plan, kv_device=kv_device(kv_caches), kv_caches=kv_caches)
    layerwise = build_loader(setup.ascend_config.layerwise_load, plan, transfer)  # before the engine starts
    connector = PagedChunkConnector(
        plan.chunk_bytes,
        setup.chunk_size,
        transfer.store,
        transfer.load,
        checksums=checksums_enabled(setup.lmcache_config),
        mac_key=mac_key,
    )
    engine = WorkerEngine.start(
        setup.lmcache_config, setup.engine, connector, plan.chunk_bytes, len(kv_caches), plan.layout_fingerprint
    )
    rep, stripe = store_stripe(setup.groups, vllm_config, setup.lmcache_config)
    half = WorkerHalf(
        setup.groups, setup.chunk_size, engine, transfer, plan, setup.agreement, state=state,
        stripe=stripe, vote_failed_loads=failed_load_vote(vllm_config),
        layerwise=layerwise,
    )
    text = plan_text(setup.groups, plan, setup.state_gate, setup.snapshot) + "\n" + rep.describe(
        dict(plan.group_bytes()), shared=bool(setup.lmcache_config.remote_url))
    logger.info("lmcache-ascend worker plan (%s):\n%s", setup.agreement.fingerprint, text)
    log_copy_threads(transfer)
    if setup.ascend_config.plan_file:
        record = plan_record(setup, plan, rep, text, striped=stripe is not None)
        path = write_plan_file(setup.ascend_config.plan_file, setup.engine.rank, record)
        logger.info("lmcache-ascend: worker plan written to %s", path)
    return half


class PlanRecord(TypedDict):
    """A worker's plan as data: what ``ascend_plan_file`` holds, and what
    ``lmcache-ascend explain``, the demo and the benches read (through
    ``lmcache_ascend.cli.plan_file.read_plan``)."""

    rank: int
    text: str  # the plan as logged after "lmcache-ascend worker plan"
    # JSON values of any kind (json.dumps of dataclasses.asdict output).
    plan: dict[str, Any]  # planner.PlanDescription, as a dict
    groups: list[dict[str, Any]]  # the scheduler groups (SchedulerGroup)
    agreement: str  # the fingerprint the two halves compare
    state: Optional[dict[str, Any]]  # state_record(); None without Mamba groups
    replication: dict[str, Any]


def plan_record(setup: ConnectorSetup, plan: TransferPlan, rep: Replication, text: str, striped: bool) -> PlanRecord:
    """The one place the plan record is built (``plan``: the worker's
    TransferPlan; ``rep``: its replication, parallel.store_stripe)."""
    return {
        "rank": int(setup.engine.rank),
        "text": text,
        "plan": dataclasses.asdict(plan.describe()),
        "groups": [dataclasses.asdict(g) for g in setup.groups],
        "agreement": setup.agreement.fingerprint,
        "state": state_record(setup.state_gate, setup.snapshot),
        "replication": {"tp": rep.tp, "single_copy": rep.single_copy, "replicated": list(rep.replicated_groups),
                        "sharded": list(rep.sharded_groups), "stripe": striped},
    }


def write_plan_file(base: str, rank: int, record: Mapping[str, Any]) -> Path:  # JSON values of any kind
    """Writes ``record`` as JSON to worker ``rank``'s file for an
    ``ascend_plan_file`` of ``base`` (settings.plan_file_for) and returns
    that path.

    Written to a temporary file beside it, then renamed over it: a reader
    polling for the file, or one left from an earlier engine, never sees
    half a record. A file that cannot be written stops startup, naming the
    path: whoever set the key runs a tool that needs the file, and would
    otherwise only learn that it is missing after the engine has run."""
    path = Path(plan_file_for(base, rank))
    data = json.dumps(record, default=str, indent=1)  # default=str: enums, frozensets as text
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            # mkstemp creates the file readable by its owner only; the plan is
            # no secret, and the tool reading it may run as another user.
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise ConfigValueError(
            f"config key {PLAN_FILE_KEY!r}: cannot write worker {rank}'s plan to {str(path)!r} "
            f"(from {base!r}): {e.strerror or e}"
        ) from e
    return path


def _with_chunk_source(error: ValueError, setup: ConnectorSetup) -> ValueError:
    """A plan refused for a chunk size the user set says where it was set and
    what the connector would use on its own: the size is often copied from
    an example written for another model or block size, and the block size
    vLLM picks (hybrid Mamba models: per machine and shape) is not known to
    the user beforehand. A size the connector chose is never refused (it is
    a multiple of every block size), so other errors pass unchanged."""
    from lmcache_ascend.planning.chunking import finest_chunk_size

    if setup.chunk_source is None or "chunk_size" not in str(error):
        return error
    finest = finest_chunk_size(setup.groups)
    hint = f"; left unset, the connector would use {finest} tokens here" if finest else ""
    return ValueError(f"{error}. chunk_size {setup.chunk_size} was set by {setup.chunk_source}{hint}")


def _worker_state(
    setup: ConnectorSetup, plan: TransferPlan, kv_caches: Mapping[str, LayerEntry]
) -> tuple[StateTransfer, TransferPlan]:
    """The state transfer for this worker's Mamba tensors, and the plan with
    the Mamba groups no longer counted as unrestorable (they are restored by
    state snapshots, not moved in chunks)."""
    from lmcache_ascend.transfer.state_transfer import StateTransfer

    snapshot, gate = setup.snapshot, setup.state_gate
    assert snapshot is not None and gate is not None  # the caller checks both
    if snapshot.piece_bytes > plan.chunk_bytes:
        # The scheduler sized pieces by a lower bound of the chunk buffer
        # (planning/state_align.py): a bigger piece means the bound is wrong.
        raise ValueError(
            f"lmcache-ascend: a Mamba state piece of {snapshot.piece_bytes} bytes does not fit the "
            f"{plan.chunk_bytes}-byte chunk buffer"
        )
    state = StateTransfer(snapshot, kv_caches)
    plan = dataclasses.replace(plan, unrestorable_groups=plan.unrestorable_groups - frozenset(gate.groups))
    return state, plan


# JSON values of any kind: part of the plan record.
def state_record(gate: Optional[StateGate], snapshot: Optional[SnapshotLayout]) -> Optional[dict[str, Any]]:
    """The Mamba state part of the plan record (None without Mamba groups)."""
    if gate is None:
        return None
    out: dict[str, Any] = {
        "enabled": gate.enabled,
        "groups": list(gate.groups),
        "block_size": gate.block_size,
        "reason": gate.reason,
        "setting": gate.setting,
    }
    if snapshot is not None:
        out.update(
            snapshot_bytes=snapshot.snapshot_bytes,
            pieces=snapshot.pieces,
            piece_bytes=snapshot.piece_bytes,
            fingerprint=snapshot.fingerprint,
            layer_bytes={str(g.index): g.layer_bytes for g in snapshot.groups},
        )
    return out


def state_text(gate: Optional[StateGate], snapshot: Optional[SnapshotLayout]) -> str:
    if gate is None:
        return ""
    if not gate.enabled:
        return (
            f"Mamba/GDN state groups {list(gate.groups)}: hits refused: {gate.reason}; {gate.setting}"
        )
    assert snapshot is not None
    return (
        f"Mamba/GDN state groups {list(gate.groups)} (align mode, block {gate.block_size} tokens): "
        f"state bytes per chunk boundary {snapshot.snapshot_bytes} ({snapshot.describe()}); a hit ends "
        f"at a boundary with stored state"
    )


def plan_text(groups: tuple[SchedulerGroup, ...], plan: TransferPlan, gate: Optional[StateGate] = None,
              snapshot: Optional[SnapshotLayout] = None) -> str:
    """vLLM's KV cache groups as the connector read them, then the plan."""
    lines = ["scheduler groups (vLLM KV cache groups):"]
    for g in groups:
        lines.append(
            f"  g{g.index:<2} {g.spec_name:<24} {g.kind.value:<7} block {g.block_size} tokens, "
            f"compress ratio {g.compress_ratio}, sliding window {g.sliding_window or '-'}, "
            f"{len(g.layer_names)} layer(s)"
        )
    state = state_text(gate, snapshot)
    return "\n".join(lines) + "\n" + str(plan.describe()) + ("\n" + state if state else "")


def log_copy_threads(transfer: ChunkTransfer) -> Optional[int]:
    """Says how many threads the CPU copies use; warns when the ops module
    was built without OpenMP and so copies on one of several threads."""
    used = transfer.copy_threads()
    if used is None:
        return None
    available = torch.get_num_threads()
    if used < available:
        logger.warning(
            "lmcache-ascend CPU copies use %d of torch's %d threads: lmcache_ascend.ops "
            "was built without torch's OpenMP runtime (see the CMake warning of the "
            "build); loads and stores run at single-thread memory bandwidth",
            used,
            available,
        )
    else:
        logger.info("lmcache-ascend CPU copies use %d thread(s)", used)
    return used


def worker_layout_hints(kv_cache_config: KVCacheConfig) -> LayoutHints:
    """vLLM-CPU attention blocks are opaque pages (K is transposed inside a
    block); other platforms hand over token-row tensors in the layout vLLM
    resolved (NHD/HND), possibly with per-layer compress ratios."""
    from lmcache_ascend.planning.kv_format import LayoutHints

    if vllm_engine_config.is_cpu_platform():
        return LayoutHints(opaque_pages=True)
    facts = vllm_kv_layout.layout_facts(kv_cache_config)
    return LayoutHints(kv_layout=facts.kv_layout, layer_compress_ratio=facts.layer_compress_ratio)


def kv_device(kv_caches: Mapping[str, LayerEntry]) -> torch.device:
    for entry in kv_caches.values():
        tensor = entry if isinstance(entry, torch.Tensor) else next(iter(entry))
        return tensor.device
    return torch.device("cpu")
