"""Bad configuration: each one must stop startup with an error that names
the key, the value and what is valid, and leave nothing behind that keeps
the process alive (or, where that is the convention, start with a clear
warning and a documented fallback).

Most cases run through a *config probe*: one subprocess that builds the
real vLLM config (``EngineArgs.create_engine_config``) and walks the
connector's startup path exactly as vLLM does — the worker-role connector's
``register_kv_caches`` (LMCache engine, plan) and the scheduler-role
connector — once per case, with vLLM-CPU-shaped KV tensors. That costs
about a second per case instead of a full engine start. Real engines then
check what a user sees: the error through vLLM's startup, and the fallback
for an unreachable Redis while requests are served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE_TIMEOUT_S = 400
CHUNK = 256


@dataclass
class Case:
    name: str
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    env: dict[str, str] = field(default_factory=dict)
    kv_role: str = "kv_both"
    # Substrings the error must contain (all of them, case-insensitive);
    # None: the configuration must be accepted.
    expect: Optional[list[str]] = None
    # Replace one layer's KV tensor by an unsupported layout:
    # "flat" (1-D) or "strided" (dims inside a block not densely packed).
    odd_layer: Optional[str] = None
    # Set model_config.enable_sleep_mode after vLLM built its config (vLLM-CPU
    # itself refuses the flag before any connector is built).
    sleep_mode: bool = False


def cases(closed_port: int, tmp: Path) -> list[Case]:
    closed = f"redis://127.0.0.1:{closed_port}"
    return [
        # -- keys and types -------------------------------------------------
        Case("unknown_key_prefixed", extra={"lmcache.chunk_sizee": 256},
             expect=["chunk_sizee", "chunk_size"]),
        Case("unknown_key_plain", extra={"max_local_cpu": 2},
             expect=["max_local_cpu", "max_local_cpu_size"]),
        Case("wrong_type_extra", extra={"lmcache.chunk_size": "abc"},
             expect=["chunk_size", "abc", "int"]),
        Case("wrong_type_env", env={"LMCACHE_CHUNK_SIZE": "abc"},
             expect=["chunk_size", "abc"]),
        Case("bool_garbage_extra", extra={"lmcache.local_cpu": "maybe"},
             expect=["local_cpu", "maybe", "true"]),
        Case("bool_garbage_env", env={"LMCACHE_LOCAL_CPU": "maybe"},
             expect=["local_cpu", "maybe", "true"]),
        # -- sizes ----------------------------------------------------------
        Case("negative_cpu_size_env", env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"},
             expect=["max_local_cpu_size", "-1", "> 0"]),
        Case("zero_cpu_size_extra", extra={"lmcache.max_local_cpu_size": 0},
             expect=["max_local_cpu_size", "0", "> 0"]),
        Case("negative_disk_size_extra",
             extra={"lmcache.local_disk": f"file://{tmp}/disk", "lmcache.max_local_disk_size": -2},
             expect=["max_local_disk_size", "-2", "> 0"]),
        Case("negative_chunk_size_env", env={"LMCACHE_CHUNK_SIZE": "-256"},
             expect=["chunk_size", "-256", "> 0"]),
        # A set size that cuts a block names where it was set and the size
        # the connector would pick by itself.
        Case("chunk_size_not_block_multiple", env={"LMCACHE_CHUNK_SIZE": "100"},
             expect=["chunk_size 100", "block_size 128", "LMCACHE_CHUNK_SIZE", "would use 128 tokens"]),
        Case("chunk_size_not_block_multiple_extra", extra={"lmcache.chunk_size": 192},
             expect=["chunk_size 192", "block_size 128", "kv_connector_extra_config['lmcache.chunk_size']",
                     "would use 128 tokens"]),
        # -- roles, algorithms, backends ------------------------------------
        Case("kv_role_invalid", kv_role="kv_foo",
             expect=["kv_role", "kv_foo", "kv_both"]),
        Case("hash_algorithm_unknown", extra={"lmcache.pre_caching_hash_algorithm": "md5"},
             expect=["pre_caching_hash_algorithm", "md5", "sha256_cbor"]),
        Case("remote_serde_unknown",
             extra={"lmcache.remote_url": closed, "lmcache.remote_serde": "bogus"},
             expect=["remote_serde", "bogus", "naive"]),
        Case("layerwise_unsupported", extra={"lmcache.use_layerwise": True},
             expect=["use_layerwise"]),
        Case("async_loading_unsupported", extra={"lmcache.enable_async_loading": True},
             expect=["enable_async_loading", "false"]),
        # -- versions: vLLM-Ascend names a source-built vLLM's release this way
        Case("vllm_version_untested_between", env={"VLLM_VERSION": "0.31.0"},
             expect=["vllm 0.31.0", "0.23.x", "0.30.x", "0.32.x", "LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS=1"]),
        Case("vllm_version_newer", env={"VLLM_VERSION": "0.33.0"},
             expect=["vllm 0.33.0", "newer than the newest", "0.32.x", "LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS=1"]),
        Case("vllm_version_older", env={"VLLM_VERSION": "0.20.2"},
             expect=["vllm 0.20.2", "older than the oldest", "0.23"]),
        # The opt-in runs a newer vLLM (its warning is checked in the log).
        Case("vllm_version_newer_opted_in",
             env={"VLLM_VERSION": "0.33.0", "LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS": "1"}),
        Case("sleep_mode", sleep_mode=True, expect=["sleep mode", "enable_sleep_mode"]),
        # -- lmcache-ascend keys --------------------------------------------
        Case("ascend_bool_env", env={"LMCACHE_ASCEND_SKIP_STATE_GROUPS": "perhaps"},
             expect=["ascend_skip_state_groups", "perhaps", "true/false"]),
        Case("ascend_bool_extra", extra={"lmcache.ascend_bundle_multi_spec": "perhaps"},
             expect=["ascend_bundle_multi_spec", "perhaps", "bool"]),
        Case("ascend_list_extra", extra={"lmcache.ascend_skip_state_spec_allowlist": 5},
             expect=["ascend_skip_state_spec_allowlist", "5"]),
        # -- a KV layout the planner cannot handle --------------------------
        Case("kv_layout_flat", odd_layer="flat",
             expect=["model.layers.1.self_attn.attn", "no block dimension"]),
        Case("kv_layout_strided", odd_layer="strided",
             expect=["model.layers.1.self_attn.attn", "not densely packed"]),
        # -- accepted: the fallback is warnings and misses ------------------
        Case("remote_unreachable", extra={"lmcache.remote_url": closed,
                                          "lmcache.remote_serde": "naive"}),
        Case("defaults"),
    ]


# ---- the probe (runs in its own process) ------------------------------------


def _probe(model: str, cases_json: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import lmcache.integration.vllm.utils as lmc_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1 import (
        LMCacheAscendConnectorV1Dynamic,
    )

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    # vLLM-CPU: block 128; KV per layer [blocks, kv_heads, block, 2 * head].
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    results = {}
    for raw in json.loads(cases_json):
        case = Case(**raw)
        saved = dict(os.environ)
        # A small LMCache CPU buffer per case (the default is 5 GB each).
        os.environ["LMCACHE_MAX_LOCAL_CPU_SIZE"] = "0.05"
        os.environ.update(case.env)
        lmc_utils._config_instance = None  # LMCache caches its config per process
        before = {t.ident for t in threading.enumerate()}
        started = []
        res: dict[str, Any] = {}
        t0 = time.time()
        try:
            ktc = {
                "kv_connector": "LMCacheAscendConnectorV1Dynamic",
                "kv_connector_module_path": "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1",
                "kv_role": case.kv_role,
                "kv_connector_extra_config": case.extra,
            }
            vllm_config = EngineArgs(
                model=model, dtype="float32", max_model_len=4096, enforce_eager=True,
                kv_transfer_config=ktc,
            ).create_engine_config()
            if case.sleep_mode:
                vllm_config.model_config.enable_sleep_mode = True
            worker = LMCacheAscendConnectorV1Dynamic(vllm_config, KVConnectorRole.WORKER, kv_config)
            started.append(worker)
            # What vLLM asks the connector (0.27.1+ / 0.33+); recorded on every version.
            res["requires_kv_delivery"] = worker.requires_kv_delivery
            base = getattr(KVConnectorBase_V1, "requires_kv_delivery", None)
            res["vllm_default_requires_kv_delivery"] = base.fget(worker) if isinstance(base, property) else None
            res["supports_sleep_mode"] = type(worker).supports_sleep_mode(vllm_config.kv_transfer_config)
            kv = {n: torch.zeros(8, 2, 128, 64) for n in layers}
            if case.odd_layer == "flat":
                kv[layers[1]] = torch.zeros(8 * 2 * 128 * 64)
            elif case.odd_layer == "strided":
                # Every other 64-float run of a wider tensor: gaps inside a block.
                kv[layers[1]] = torch.zeros(8, 2, 128, 128)[..., :64]
            worker.register_kv_caches(kv)
            sched = LMCacheAscendConnectorV1Dynamic(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
            started.append(sched)
            res["result"] = "accepted"
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            res.update(result="error", type=type(exc).__name__, message=str(exc))
        res["seconds"] = round(time.time() - t0, 2)
        for conn in started:
            conn.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        # Threads this case left running that would keep the process alive.
        res["left_nondaemon_threads"] = sorted(
            t.name for t in threading.enumerate() if t.ident not in before and not t.daemon
        )
        results[case.name] = res
        print("PROBE", case.name, json.dumps(res)[:300], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)
    # Threads left behind (recorded above) must not make the probe hang.
    os._exit(0)


# ---- tests ------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory, tiny_model) -> dict:
    from redis_server import closed_port

    model = tiny_model("llama")
    work = tmp_path_factory.mktemp("bad_config")
    all_cases = cases(closed_port(), work)
    out = work / "probe.json"
    log = work / "probe.log"
    env = dict(os.environ, LMCACHE_LOG_LEVEL="INFO", VLLM_LOGGING_LEVEL="INFO")
    with open(log, "w") as lf:
        proc = subprocess.run(
            [sys.executable, __file__, model, json.dumps([asdict(c) for c in all_cases]), str(out)],
            stdout=lf, stderr=subprocess.STDOUT, timeout=PROBE_TIMEOUT_S, cwd=str(work), env=env,
        )
    assert proc.returncode == 0 and out.exists(), log.read_text()[-6000:]
    return {"results": json.loads(out.read_text()), "cases": {c.name: c for c in all_cases},
            "log": log.read_text(errors="replace")}


def _case_names() -> list[str]:
    return [c.name for c in cases(1, Path("unused"))]


@pytest.mark.engine
@pytest.mark.compat
@pytest.mark.parametrize("name", _case_names())
def test_bad_config_is_refused_clearly(probe, name):
    case, res = probe["cases"][name], probe["results"][name]
    if case.expect is None:
        assert res["result"] == "accepted", res
    else:
        assert res["result"] == "error", f"{name}: accepted silently (expected an error naming {case.expect})"
        message = res["message"].lower()
        missing = [s for s in case.expect if s.lower() not in message]
        assert not missing, f"{name}: error {res['type']}: {res['message']!r} does not name {missing}"
    # A refused configuration must not leave threads that keep the process alive.
    assert not res["left_nondaemon_threads"], (
        f"{name}: left non-daemon threads {res['left_nondaemon_threads']} (the process cannot exit)"
    )


@pytest.mark.engine
@pytest.mark.compat
def test_answers_to_vllms_connector_questions(probe):
    """A best-effort cache whose stores finish inside their step has nothing
    pending at a preemption (with vLLM 0.27.1+'s kv_both default, a
    preempted request's in-flight output would be dropped and recomputed),
    and sleep mode is refused (vLLM 0.33+ asks, older ones are refused by
    the connector itself)."""
    res = probe["results"]["defaults"]
    assert res["requires_kv_delivery"] is False and res["supports_sleep_mode"] is False, res
    # vLLM's own default for this kv_both connector, where vLLM asks at all
    # (None before 0.27.1): the answer above is an override, not the default.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    asks = isinstance(getattr(KVConnectorBase_V1, "requires_kv_delivery", None), property)
    assert res["vllm_default_requires_kv_delivery"] is (True if asks else None), res


@pytest.mark.engine
@pytest.mark.compat
def test_untested_vllm_runs_only_when_opted_in_and_says_so_once(probe):
    assert probe["results"]["vllm_version_newer_opted_in"]["result"] == "accepted"
    warnings = [
        line for line in probe["log"].splitlines()
        if "vLLM 0.33.0 is newer than the newest tested versions" in line
        and "LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS is set" in line
    ]
    assert len(warnings) == 1, warnings


# ---- real engines -----------------------------------------------------------


@pytest.mark.engine
def test_engine_start_fails_cleanly_on_negative_cpu_size(tmp_path, tiny_model):
    """Through vLLM: the error reaches the user and the engine process exits
    (a failed LMCache engine build used to leave a thread that hung startup)."""
    from lmcache_ascend.cli.engine_run import Phase, Scenario
    from faults import run_engine_process
    from lmcache_ascend.cli.tiny_models import token_prompt

    run = run_engine_process(
        Scenario(model=tiny_model("llama"), phases=[Phase("p", [token_prompt(300, seed=1)])]),
        tmp_path,
        "negative_cpu",
        env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"},
        timeout_s=180,
    )
    assert not run.timed_out, "engine startup hung after the configuration error"
    assert run.returncode not in (0, None)
    assert "max_local_cpu_size" in run.log, run.log[-4000:]


@pytest.mark.engine
@pytest.mark.redis
def test_unreachable_remote_falls_back_to_local_cache(tmp_path, tiny_model):
    """Documented fallback: a Redis URL nobody listens on is not a startup
    error in LMCache 0.5.6. Each remote operation fails fast and logs a
    warning; lookups and stores use the other backends, requests are served
    and outputs are identical."""
    from redis_server import closed_port

    from lmcache_ascend.cli.engine_run import Phase, Scenario
    from faults import (
        mismatch,
        reference_outputs,
        reliability_prompts,
        request_transfers,
        run_engine_process,
    )

    model = tiny_model("llama")
    prompts = reliability_prompts()
    names = ["S0", "S0", "S1"]
    run = run_engine_process(
        Scenario(
            model=model,
            phases=[
                Phase("cold", [prompts["S0"]], sequential=True),
                Phase("warm", [prompts["S0"]], reset_prefix_cache=True, sequential=True),
                Phase("other", [prompts["S1"]], reset_prefix_cache=True, sequential=True),
            ],
        ),
        tmp_path,
        "unreachable",
        env={
            "LMCACHE_REMOTE_URL": f"redis://127.0.0.1:{closed_port()}",
            "LMCACHE_REMOTE_SERDE": "naive",
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
            "LMCACHE_CHUNK_SIZE": str(CHUNK),
        },
        timeout_s=300,
    )
    assert run.results is not None, run.log[-6000:]
    ref = reference_outputs(model, tmp_path)
    comps = [c for p in run.results for c in p.completions]
    for name, comp in zip(names, comps):
        assert mismatch(comp, ref[name]) is None, (name, mismatch(comp, ref[name]))
    tr = request_transfers(run.log)
    assert (tr[0].stored, tr[1].hit, tr[1].loaded) == (3 * CHUNK, 3 * CHUNK, 3 * CHUNK)
    assert "Remote connection failed" in run.log or "Connection refused" in run.log
    assert not run.timed_out and not run.hung_at_exit


if __name__ == "__main__":
    _probe(sys.argv[1], sys.argv[2], sys.argv[3])
