"""Every change lmcache-ascend makes to LMCache's or vLLM's objects, in one
registry, and the one function that makes them.

Why one registry: each of these changes relies on upstream internals (a
private method, a config field, a class attribute) that a new release may
rename or change the meaning of. Listing them all, each with the releases it
was verified on and the tests that cover it, makes an upgrade a checklist,
and routing every change through :func:`apply` means none can run silently
on a release nobody checked (tests/unit/test_overrides.py scans the package
for attribute assignments to upstream objects made anywhere else).

Three kinds:

* a **module patch** replaces attributes of an LMCache module or class, once
  per process, when LMCache loads it (``patches.PATCHES`` gates and runs
  them; their records here are derived from those ``Patch`` records, so the
  verified releases are written once);
* a **per-instance override** replaces or sets an attribute of one LMCache
  (or vLLM) object: an engine's ``lookup``, a backend's put call, a config
  field;
* a **vLLM config change** sets a field of vLLM's config (the load-failure
  policy, the scheduler watermark, the block size vLLM-CPU resets).

Records name their target as text only: this module sits in the bridge and
must not import the vLLM integration (imports point down), so vLLM sites
are data here and call :func:`apply` from above.

Imports nothing of LMCache or vLLM.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

from lmcache_ascend.compat import (
    LMCACHE_VERSIONS,
    VLLM_SERIES,
    installed_lmcache_version,
    installed_vllm_version,
    untested_allowed,
)

logger = logging.getLogger(__name__)


class Kind(enum.Enum):
    MODULE_PATCH = "module patch"
    INSTANCE_OVERRIDE = "per-instance override"
    VLLM_CONFIG = "vLLM config change"


class Upstream(enum.Enum):
    LMCACHE = "LMCache"
    VLLM = "vLLM"


# The vLLM series compat supports, as "0.23"-style text (what vLLM entries'
# verified_on hold: vLLM's config fields change per series, not per patch).
VLLM_VERSIONS: tuple[str, ...] = tuple(f"{a}.{b}" for a, b in sorted(VLLM_SERIES))


@dataclass(frozen=True)
class Override:
    name: str
    target: str  # the object and attribute changed, as text ("LMCacheEngine.lookup (instance)")
    kind: Kind
    upstream: Upstream
    verified_on: tuple[str, ...]  # LMCache releases, or vLLM series ("0.26") for vLLM targets
    why: str  # the upstream problem worked around, or the reason for the change
    tests: tuple[str, ...]  # pytest node ids that fail without it (or exercise it)


@dataclass(frozen=True)
class Replaced:
    """What one :func:`apply` replaced: enough to put it back."""

    entry: Override
    obj: Any
    attr: str
    previous: Any  # the value read before the change (None where there was none)


class UnverifiedOverrideError(RuntimeError):
    """An override was asked for on a release it was not verified on."""


def _installed(upstream: Upstream) -> Optional[str]:
    if upstream is Upstream.LMCACHE:
        from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

        return lmcache_modules.release()
    version = installed_vllm_version()
    if version is None:
        return None
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


@functools.lru_cache(maxsize=None)
def _refusal(entry: Override, installed: Optional[str], allow_untested: bool) -> Optional[str]:
    """Why ``entry`` may not run on ``installed`` (None: it may). Cached: some
    overrides run once per request or per backend instance."""
    if installed in entry.verified_on:
        return None
    if allow_untested and installed is not None:
        # compat's opt-in for untested releases: the connector relies on its
        # overrides, so they run; compat has already logged the one warning.
        return None
    return (
        f"lmcache-ascend: override {entry.name!r} ({entry.target}) was verified on "
        f"{entry.upstream.value} {', '.join(entry.verified_on)}, not on the installed "
        f"{entry.upstream.value} {installed or '(not installed)'}; see lmcache_ascend/compat.py"
    )


def check(entry: Override) -> None:
    """Raise :class:`UnverifiedOverrideError` unless ``entry`` may run on the
    installed release."""
    why = _refusal(entry, _installed(entry.upstream), untested_allowed())
    if why is not None:
        raise UnverifiedOverrideError(why)


_lock = threading.Lock()
_applied: set[str] = set()


def apply(entry: Override, obj: Any, attr: str, value: Any) -> Replaced:
    """Set ``obj.<attr> = value`` for registry ``entry``, after checking the
    installed release; returns what was there, for :func:`undo`."""
    if entry not in ENTRIES:
        raise KeyError(f"lmcache-ascend: {entry.name!r} is not a registered override")
    check(entry)
    previous = getattr(obj, attr, None)
    setattr(obj, attr, value)
    if entry.name not in _applied:
        with _lock:
            _applied.add(entry.name)
    return Replaced(entry, obj, attr, previous)


def undo(replaced: Replaced) -> None:
    """Put back what :func:`apply` replaced (the value it read, as an
    attribute of the same object)."""
    setattr(replaced.obj, replaced.attr, replaced.previous)


def applied() -> frozenset[str]:
    """The names of the entries applied in this process (explain and tests)."""
    with _lock:
        return frozenset(_applied)


# ---- the registry --------------------------------------------------------------

_L = Upstream.LMCACHE
_V = Upstream.VLLM
_LMC = LMCACHE_VERSIONS


def _patch_entry(patch_name: str, target: str, tests: tuple[str, ...]) -> Override:
    """The record of a module patch, from its ``patches.Patch`` (one source
    for the verified releases and the reason)."""
    from lmcache_ascend.lmcache_bridge.patching.patches import PATCHES

    patch = next(p for p in PATCHES if p.name == patch_name)
    return Override(patch.name, target, Kind.MODULE_PATCH, _L, patch.verified_on, patch.works_around, tests)


PQ_EXECUTOR_SHIELD = _patch_entry(
    "pq_executor_shield",
    "AsyncPQExecutor.submit_job, AsyncPQExecutor._lmcache_ascend_shielded (class)",
    ("tests/unit/test_lmcache_fixes.py::test_cancelled_callers_do_not_kill_the_workers",),
)
NATIVE_SYNC_ON_LOOP = _patch_entry(
    "native_client_sync_on_loop",
    "ConnectorClientBase.batch_get_sync/batch_set_sync/batch_exists_sync (class)",
    ("tests/unit/test_lmcache_fixes.py::test_native_client_blocking_calls_see_instant_completions",),
)
CONFIG_KEYS = _patch_entry(
    "config_keys",
    "LMCacheEngineConfig.__init__/__repr__/__eq__/__dataclass_fields__/__match_args__ and one "
    "class attribute per ascend_* key (class)",
    (
        "tests/unit/test_ascend_config.py::test_defaults",
        "tests/unit/test_ascend_config.py::test_singleton_loader_sees_keys",
    ),
)
VLLM_ADAPTER_SHIM = _patch_entry(
    "vllm_adapter_shim",
    "LMCacheConnectorV1Impl.__init__/_apply_extra_config/register_kv_caches/"
    "get_num_new_matched_tokens/build_connector_meta (class), gpu_connector.CreateGPUConnector (module)",
    (
        "tests/unit/test_adapter_shim.py::test_import_patches_the_adapter_and_the_connector_factory",
        "tests/unit/test_adapter_shim.py::test_patched_adapter_hands_vllm_steps_to_the_registered_route",
    ),
)
MOVED_MODULE_SPEC = Override(
    "moved_module_spec",
    "module.__spec__ of an LMCache module served under its pre-0.5.7 name",
    Kind.MODULE_PATCH, _L, _LMC,
    "LMCache 0.5.7rc2 moved its in-process modules without aliases while vLLM imports the old "
    "names; the module served under the old name keeps its own spec (hook.py).",
    ("tests/unit/test_lmcache_modules.py::test_vllm_import_of_the_adapter_gets_the_patched_class",),
)
MOONCAKE_ACCOUNTING = Override(
    "mooncake_failure_accounting",
    "mooncakestore_connector.setup_mooncake_store, MooncakestoreConnector.__init__/close (module/class)",
    Kind.MODULE_PATCH, _L, _LMC,
    "LMCache's Mooncake connector ignores setup's result and the put result codes and reads "
    "is_exist errors as hits: a misconfigured store fails every operation silently (backends/mooncake.py).",
    ("tests/unit/test_mooncake_config.py::test_unreachable_master_is_an_outage_found_within_seconds",),
)
MOONCAKE_CHECKED_STORE = Override(
    "mooncake_checked_store",
    "MooncakestoreConnector.store (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "Counts and logs failed Mooncake operations and reads an is_exist error as a miss (backends/mooncake.py).",
    ("tests/unit/test_mooncake_config.py::test_checked_store_counts_failures_and_reads_errors_as_misses",
     "tests/unit/test_overrides.py::test_mooncake_connector_gets_a_checked_store"),
)
STAGED_LOOKUP = Override(
    "staged_lookup",
    "LMCacheEngine.lookup (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "A chunk LMCache's lookup reports can be gone (evicted, damaged) when the load reads it; the "
    "lookup stages what it reports so a hit loads exactly (integrity/staging.py).",
    ("tests/unit/test_staging.py::test_intact_chunks_load_exactly_even_when_the_store_loses_them_after_lookup",),
)
STEP_PUTS = Override(
    "step_puts",
    "StorageBackendInterface.batched_submit_put_task (instance; restored at close)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache submits each store's disk and remote puts at once; a step's puts are held and handed "
    "off together, off the step's thread (engine/step_puts.py).",
    ("tests/unit/test_step_seals.py::test_seals_are_held_only_inside_a_step_and_run_before_the_puts",
     "tests/integration/test_step_puts.py::test_close_hands_off_what_is_still_held"),
)
PREFIX_HASH_MEMO = Override(
    "prefix_hash_memo",
    "ChunkedTokenDatabase._prefix_hash, .lmcache_ascend_hash_memo (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache rehashes every prefix chunk on each lookup and store; a bounded memo returns the "
    "same keys (engine/hash_memo.py).",
    ("tests/unit/test_hash_memo.py::test_memoized_keys_equal_lmcache_keys",),
)
PINNED_INIT_HASH = Override(
    "pinned_init_hash",
    "ChunkedTokenDatabase._get_init_hash (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache seeds chunk hashes from vLLM's NONE_HASH, random per process before vLLM 0.32 "
    "without PYTHONHASHSEED: scheduler lookups and worker stores would never meet (engine/lmcache_engine.py).",
    ("tests/unit/test_chunk_keys.py::test_pinned_chunk_keys_agree_across_processes_without_pythonhashseed",),
)
KEY_METADATA = Override(
    "token_database_key_metadata",
    "LMCacheEngine.token_database.metadata (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "Chunk keys carry LMCache's metadata; replicated layouts key without the rank so every rank "
    "shares one copy (engine/lmcache_engine.py, EngineSpec.key_metadata).",
    ("tests/unit/test_replication.py::test_replicated_keys_do_not_depend_on_tp_or_rank",),
)
LAYOUT_MODEL_NAME = Override(
    "layout_model_name",
    "LMCacheEngineMetadata.model_name (instance, LMCacheConnectorV1 route)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "Chunks of this package's byte layout must never meet chunks LMCache's own connectors wrote "
    "in shared storage: the layout fingerprint joins the model name (adapter_shim.py).",
    ("tests/unit/test_adapter_shim.py::test_store_then_retrieve_into_other_blocks_is_byte_exact",),
)
ENGINE_GUARD = Override(
    "adapter_engine_guard",
    "LMCacheEngine.retrieve/store (instance, LMCacheConnectorV1 route)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache counts a chunk that failed to load as loaded and raises a failed store into vLLM "
    "(adapter_shim.py).",
    ("tests/unit/test_adapter_shim.py::test_failed_chunk_load_is_not_reported_as_loaded",
     "tests/unit/test_adapter_shim.py::test_failed_store_does_not_raise_into_vllm"),
)
REFUSED_SAVE = Override(
    "refused_request_save",
    "SaveSpec.can_save (instance, LMCacheConnectorV1 route)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache's adapter plans a store for every request it tracks, also for those whose keys would "
    "leave out what vLLM keys them on (cache_salt, LoRA, embeddings).",
    ("tests/unit/test_overrides.py::test_refused_requests_are_not_saved",),
)
WHOLE_CHUNKS_ONLY = Override(
    "save_unfull_chunk_off",
    "LMCacheEngineConfig.save_unfull_chunk (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "A partial tail chunk of a multi-group model cannot be restored exactly in every group.",
    ("tests/unit/test_overrides.py::test_engine_requirements_set_lmcache_config_fields",),
)
DETERMINISTIC_CHUNK_HASH = Override(
    "deterministic_chunk_hash",
    "LMCacheEngineConfig.pre_caching_hash_algorithm (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "A non-cryptographic hash seeded per process (PYTHONHASHSEED unset) gives vLLM's scheduler and "
    "worker different chunk keys.",
    ("tests/unit/test_overrides.py::test_engine_requirements_set_lmcache_config_fields",),
)
CHUNK_META_SETTING = Override(
    "chunk_meta_setting",
    "LMCacheEngineConfig.extra_config (instance: its save_chunk_meta entry)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache reads save_chunk_meta by truthiness (the text 'false' means true), and its Mooncake "
    "connector reads into its own buffers (batch_get_into) only with it off (engine/config.py).",
    ("tests/unit/test_chunk_meta.py::test_mooncake_values_go_without_metadata_unless_asked",
     "tests/unit/test_chunk_meta.py::test_save_chunk_meta_text_is_read_as_a_boolean",
     "tests/integration/test_mooncake.py::test_llama_engine_b_hits_what_a_stored"),
)
DEFAULT_CHUNK_SIZE = Override(
    "default_chunk_size",
    "LMCacheEngineConfig.chunk_size (instance, where the user set none)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache's default chunk size is not a whole number of every group's blocks; vLLM's block "
    "granularity is used instead (integration/vllm/wiring.py).",
    ("tests/unit/test_chunking.py::test_default_chunk_size_is_valid_for_every_block_size_vllm_may_pick",),
)
DETACHED_REMOTE_CONNECTION = Override(
    "detached_remote_connection",
    "RemoteBackend.connection (instance, at close)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "RedisConnector.close() deadlocks on the storage manager's loop; the connector is closed with "
    "its async calls and detached so RemoteBackend.close() skips it (engine/resources.py).",
    ("tests/unit/test_overrides.py::test_detached_remote_backend_has_no_connection",),
)
RECONNECT_NOW = Override(
    "reconnect_now",
    "RemoteBackend.failure_time (instance)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache waits between connection attempts; the reconnector's own reachability check replaces "
    "that wait (backends/remote_pool.py).",
    ("tests/unit/test_overrides.py::test_reconnector_clears_lmcaches_wait",),
)
REDIS_SYNC_CONTAINS = Override(
    "redis_sync_contains",
    "RemoteBackend.batched_contains (instance, redis:// with hiredis; restored at close)",
    Kind.INSTANCE_OVERRIDE, _L, _LMC,
    "LMCache asks Redis for a chunk's metadata key one EXISTS at a time through its event loop (a "
    "round trip per chunk before every staged read); the synchronous reader asks for all of them in "
    "one pipeline, same keys, same prefix count (backends/redis_reads.py).",
    ("tests/unit/test_redis_reads.py::test_contains_counts_the_prefix_lmcache_counts",),
)
RECOMPUTE_ON_LOAD_FAILURE = Override(
    "kv_load_failure_policy",
    "vllm_config.kv_transfer_config.kv_load_failure_policy",
    Kind.VLLM_CONFIG, _V, VLLM_VERSIONS,
    "A failed or partial load from the cache must cost speed, never the request: vLLM recomputes "
    "the blocks reported through get_block_ids_with_load_errors.",
    ("tests/unit/test_overrides.py::test_load_failure_policy_becomes_recompute",),
)
SCHEDULER_WATERMARK = Override(
    "scheduler_watermark",
    "vllm_config.scheduler_config.watermark",
    Kind.VLLM_CONFIG, _V, VLLM_VERSIONS,
    "A Mamba state hit in align mode takes one block per state group that vLLM's admission check "
    "does not count; the watermark keeps them free (vllm_engine_config.py).",
    ("tests/unit/test_overrides.py::test_watermark_keeps_the_state_blocks_free",),
)
ALIGN_BLOCK_SIZE = Override(
    "align_block_size",
    "vllm_config.cache_config.block_size (scheduler process)",
    Kind.VLLM_CONFIG, _V, VLLM_VERSIONS,
    "vLLM-CPU's engine core re-runs its platform check after startup and resets block_size to 128, "
    "so align-mode prefill steps end off the KV cache's block boundaries (align_repair.py).",
    ("tests/unit/test_align_repair.py::test_vllms_post_init_resets_the_block_size_and_the_guard_restores_it",),
)
CONNECTOR_SHUTDOWN = Override(
    "lmcache_connector_shutdown",
    "LMCacheConnectorV1.shutdown (instance, where vLLM's class keeps the base's no-op)",
    Kind.INSTANCE_OVERRIDE, _V, VLLM_VERSIONS,
    "vLLM's LMCacheConnectorV1 does not override shutdown, so LMCache's engine (a non-daemon "
    "storage thread) is never closed and the process never exits (adapter_route.py).",
    ("tests/unit/test_overrides.py::test_connector_without_a_shutdown_gets_one",),
)

ENTRIES: tuple[Override, ...] = (
    PQ_EXECUTOR_SHIELD, NATIVE_SYNC_ON_LOOP, CONFIG_KEYS, VLLM_ADAPTER_SHIM, MOVED_MODULE_SPEC, MOONCAKE_ACCOUNTING,
    MOONCAKE_CHECKED_STORE, STAGED_LOOKUP, STEP_PUTS, PREFIX_HASH_MEMO, PINNED_INIT_HASH, KEY_METADATA,
    LAYOUT_MODEL_NAME, ENGINE_GUARD, REFUSED_SAVE, WHOLE_CHUNKS_ONLY, DETERMINISTIC_CHUNK_HASH, CHUNK_META_SETTING,
    DEFAULT_CHUNK_SIZE, DETACHED_REMOTE_CONNECTION, RECONNECT_NOW, REDIS_SYNC_CONTAINS, RECOMPUTE_ON_LOAD_FAILURE,
    SCHEDULER_WATERMARK, ALIGN_BLOCK_SIZE, CONNECTOR_SHUTDOWN,
)
