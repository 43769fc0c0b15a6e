"""Which compatibility stacks a test runs on: a table, not a guess.

Each stack (requirements/stacks/) differs from the others in a few facts
that change which code path of this package runs: the versions of torch
(the native ops are built against it) and LMCache (lmcache_bridge's patches
and module map), the connector hooks vLLM calls, and what vLLM's configs
expose that ``integration/vllm`` reads. ``probe()`` reads them from the
installed packages; ``TABLE`` records them for every stack, and
``tests/unit/test_stack_facts.py`` fails on any stack whose probe disagrees
with its row, so the table cannot go stale.

A test marked ``compat("fact", ...)`` names the facts its code path depends
on. It runs on the primary stack, and on a compatibility stack when that
stack brings a value of one of those facts that no stack before it in
``ORDER`` has (each value covered once). A bare ``compat`` marker (or the
fact ``vllm``) means vLLM's own behaviour is the subject (shutdown, fork
after its imports): every stack runs it. The conftest deselects the others
and says which stack covered them.

Imports nothing of vLLM, LMCache or torch at import time: the conftest
reads ``TABLE`` on every stack, ``probe()`` is called by the one test.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

# Primary first, then the compatibility stacks (the Makefile's order).
ORDER = ("vllm-0.32", "vllm-0.26", "vllm-0.30", "vllm-0.29", "vllm-0.27", "vllm-0.23")

# What each fact is and which code reads it.
FACTS: Mapping[str, str] = {
    "vllm": "the vLLM series (tests of vLLM's own behaviour: every stack)",
    "python": "Python major.minor (the same on every stack: a test naming only this runs on the primary)",
    "torch": "torch major.minor: the native ops are built against it",
    "lmcache": "LMCache version: lmcache_bridge's patches and module map (lmcache_bridge/patching/lmcache_modules.py)",
    "connector_hooks": "hooks of LMCacheAscendConnectorV1Dynamic that vLLM's KVConnectorBase_V1 declares "
                       "(a hook it does not declare is never called)",
    "kv_layout_source": "where vllm_kv_layout._kv_cache_layout reads the layout: the KV cache config or "
                        "the attention backends' helper",
    "hash_block_size": "KVCacheConfig.hash_block_size exists (vllm_engine_config.state_align_facts)",
    "prefix_match_unit": "CacheConfig.prefix_match_unit exists (vllm_engine_config.state_align_facts)",
    "admission_watermark": "SchedulerConfig.watermark exists (vllm_engine_config.keep_admission_blocks_free)",
    "state_copy": "vLLM-CPU replaces align mode's Triton state copy (vllm_engine_config._state_copy_missing)",
    "checkpoint_blocks": "MambaSpec.num_prefill_checkpoint_blocks exists (vllm_engine_config.state_align_facts)",
    "request_key_fields": "Request fields the chunk key reads (vllm_keys.request_key_parts)",
    "lmcache_connector_v1": "methods vLLM's own LMCacheConnectorV1 defines (the adapter route's shim)",
    "stats_need_worker_stats": "compat.VllmFeatures.scheduler_stats_need_worker_stats",
    "none_hash_seed": "vLLM seeds NONE_HASH with a fixed string when PYTHONHASHSEED is unset "
                      "(kv_cache_utils.DEFAULT_NONE_HASH_SEED; else os.urandom per process): what "
                      "lmcache_engine.pin_init_hash makes every process agree on",
}

_HOOKS_ALL = ("build_connector_meta,build_kv_connector_stats,build_prom_metrics,get_block_ids_with_load_errors,"
              "get_finished,get_kv_connector_stats,get_num_new_matched_tokens,register_kv_caches,"
              "request_finished,request_finished_all_groups,requires_kv_delivery,save_kv_layer,shutdown,"
              "start_load_kv,update_state_after_alloc,wait_for_layer_load,wait_for_save")
_HOOKS_OLD = _HOOKS_ALL.replace("requires_kv_delivery,", "")
_LMCACHE_V1_OLD = ("build_connector_meta,get_block_ids_with_load_errors,get_finished,"
                   "get_kv_connector_kv_cache_events,get_num_new_matched_tokens,register_kv_caches,request_finished,"
                   "requires_piecewise_for_cudagraph,save_kv_layer,start_load_kv,take_events,update_connector_output,"
                   "update_state_after_alloc,wait_for_layer_load,wait_for_save")
_LMCACHE_V1 = "bind_connector_metadata," + _LMCACHE_V1_OLD


def _row(vllm, torch, lmcache, hooks, layout, hash_block, match_unit, watermark, state_copy, checkpoint,
         stats, seed, v1=_LMCACHE_V1, key_fields="cache_salt,lora_request,mm_features,prompt_embeds"):
    return {"vllm": vllm, "python": "3.11", "torch": torch, "lmcache": lmcache, "connector_hooks": hooks,
            "kv_layout_source": layout, "hash_block_size": hash_block, "prefix_match_unit": match_unit,
            "admission_watermark": watermark, "state_copy": state_copy, "checkpoint_blocks": checkpoint,
            "request_key_fields": key_fields, "lmcache_connector_v1": v1, "stats_need_worker_stats": stats,
            "none_hash_seed": seed}


# Filled from probe() on each stack; checked against it by test_stack_facts.
TABLE: Mapping[str, Mapping[str, str]] = {
    "vllm-0.32": _row("0.32", "2.13", "0.5.6", _HOOKS_ALL, "config", "yes", "yes", "yes", "yes", "yes", "no", "yes"),
    "vllm-0.26": _row("0.26", "2.11", "0.5.6", _HOOKS_OLD, "backend", "no", "yes", "yes", "yes", "no", "no", "no",
                      v1=_LMCACHE_V1_OLD),
    "vllm-0.30": _row("0.30", "2.13", "0.5.7rc2", _HOOKS_ALL, "config", "no", "yes", "yes", "yes", "yes", "no", "yes"),
    "vllm-0.29": _row("0.29", "2.13", "0.5.6", _HOOKS_ALL, "config", "no", "yes", "yes", "yes", "yes", "no", "yes"),
    "vllm-0.27": _row("0.27", "2.13", "0.5.6", _HOOKS_ALL, "backend", "no", "yes", "yes", "yes", "no", "no", "no",
                      v1=_LMCACHE_V1_OLD),
    "vllm-0.23": _row("0.23", "2.11", "0.5.6", _HOOKS_OLD, "backend", "no", "no", "no", "no", "no", "yes", "no",
                      v1=_LMCACHE_V1_OLD),
}


def stack_of(vllm_series: str) -> Optional[str]:
    """The table's stack for a vLLM series ("0.30"), None if it has none."""
    return next((s for s, row in TABLE.items() if row["vllm"] == vllm_series), None)


def check_facts(facts: Iterable[str]) -> tuple[str, ...]:
    facts = tuple(facts)
    unknown = [f for f in facts if f not in FACTS]
    if unknown:
        raise ValueError(f"compat marker names unknown facts {unknown}; known: {sorted(FACTS)}")
    return facts


def covered_by(stack: str, facts: Iterable[str]) -> Optional[str]:
    """None when ``stack`` must run a test depending on ``facts``: the first
    stack in ``ORDER`` that does, or one of them brings a value no earlier
    stack has. Otherwise the earlier stack that already covers them all."""
    facts = check_facts(facts) or ("vllm",)
    earlier = ORDER[: ORDER.index(stack)]
    if not earlier:
        return None
    for fact in facts:
        if TABLE[stack][fact] not in {TABLE[s][fact] for s in earlier}:
            return None
    # Name the latest earlier stack that shares most of the values.
    return max(earlier, key=lambda s: sum(TABLE[s][f] == TABLE[stack][f] for f in facts))


def probe() -> dict[str, str]:
    """The facts of the running stack, read from the installed packages."""
    import dataclasses
    import importlib.metadata as md
    import sys

    import torch
    import vllm
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
    from vllm.v1.request import Request

    from lmcache_ascend.compat import vllm_features
    from lmcache_ascend.integration.vllm import vllm_engine_config
    from lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1 import LMCacheAscendConnectorV1Dynamic

    def has(cls, name):
        return "yes" if name in {f.name for f in dataclasses.fields(cls)} else "no"

    def methods(cls):  # what the class itself defines: functions, static/class methods, properties
        return {n for n in vars(cls) if not n.startswith("_")}

    ours = methods(LMCacheAscendConnectorV1Dynamic)
    declared = {n for n in dir(KVConnectorBase_V1) + dir(SupportsHMA) if not n.startswith("_")}
    request_fields = set(__import__("inspect").signature(Request.__init__).parameters)
    key_fields = ("cache_salt", "lora_request", "mm_features", "prompt_embeds")
    return {
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
        "python": "%d.%d" % sys.version_info[:2],
        "torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
        "lmcache": md.version("lmcache"),
        "connector_hooks": ",".join(sorted(ours & declared)),
        "kv_layout_source": "config" if has(KVCacheConfig, "kv_cache_layout") == "yes" else "backend",
        "hash_block_size": has(KVCacheConfig, "hash_block_size"),
        "prefix_match_unit": has(CacheConfig, "prefix_match_unit"),
        "admission_watermark": has(SchedulerConfig, "watermark"),
        "state_copy": "yes" if vllm_engine_config._state_copy_missing() is None else "no",
        "checkpoint_blocks": has(MambaSpec, "num_prefill_checkpoint_blocks"),
        "request_key_fields": ",".join(f for f in key_fields if f in request_fields or hasattr(Request, f)),
        "lmcache_connector_v1": ",".join(sorted(methods(LMCacheConnectorV1) & declared)),
        "stats_need_worker_stats": "yes" if vllm_features().scheduler_stats_need_worker_stats else "no",
        "none_hash_seed": "yes" if hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED") else "no",
    }
