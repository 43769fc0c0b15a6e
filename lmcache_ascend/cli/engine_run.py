"""Run a real vLLM engine (CPU) through a scripted workload and report what
came out: tokens, logprobs, cached-token counts and timings.

Used by the demo and ``explain`` (and by the tests and the end-to-end bench).
It runs as ``python -m lmcache_ascend.cli.engine_run SCENARIO.json OUT.json``
in its own process, so every engine starts from a clean slate (vLLM and
LMCache keep process-wide singletons).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

CONNECTOR_MODULE = "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"


@dataclass
class Phase:
    name: str
    prompts: list[list[int]]
    max_tokens: int = 8
    reset_prefix_cache: bool = False
    # Submit prompts one by one (sequential) instead of as one batch.
    sequential: bool = False
    # Per prompt: vLLM's cache_salt, and the name of a LoRA adapter of the
    # scenario's ``loras`` (None: none).
    salts: Optional[list[Optional[str]]] = None
    loras: Optional[list[Optional[str]]] = None
    # Per prompt: the seeds of its images (tiny_models.tiny_image), one per
    # image placeholder token of the prompt, in order (None: no image).
    images: Optional[list[Optional[list[int]]]] = None


@dataclass
class Scenario:
    model: str
    phases: list[Phase]
    # "none" | "ascend" (module path) | "ascend-plugin" (entry point name only)
    # | "lmcache" (vLLM's own LMCacheConnectorV1, served through our shim)
    connector: str = "ascend"
    kv_role: str = "kv_both"
    kv_extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    logprobs: int = 1
    # LoRA adapters the phases may name: name -> directory (engine_kwargs
    # must enable LoRA).
    loras: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Scenario":
        phases = [Phase(**p) for p in data.pop("phases")]
        return Scenario(phases=phases, **data)


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    seconds: float  # wall time of a sequential generate call (NaN in batches)
    ttft: float  # vLLM's first-token latency for this request


@dataclass
class PhaseResult:
    name: str
    completions: list[Completion]
    seconds: float
    # Preemptions while the phase ran (vLLM's vllm:num_preemptions counter,
    # which every supported vLLM has; per-request counts exist only in 0.32).
    preemptions: int = 0
    # The connector's Prometheus counters (vllm:lmcache_ascend_<name>_total)
    # at the end of the phase, cumulative, by <name>; empty where vLLM's
    # offline engine exports none.
    counters: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "PhaseResult":
        comps = [Completion(**c) for c in data["completions"]]
        return PhaseResult(
            data["name"], comps, data["seconds"], data.get("preemptions", 0), data.get("counters", {})
        )


def _preemptions(llm: Any) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(getattr(metric, "value", 0) or 0)
    return 0


# Prometheus' client names a counter family without its "_total" suffix.
_COUNTER = re.compile(r"^vllm:lmcache_ascend_(\w+?)(?:_total)?$")


def _connector_counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        m = _COUNTER.match(metric.name)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(getattr(metric, "value", 0) or 0)
    return out


def kv_transfer_config(s: Scenario) -> Optional[dict[str, Any]]:
    if s.connector == "none":
        return None
    if s.connector == "lmcache":
        return {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": s.kv_role,
            "kv_connector_extra_config": dict(s.kv_extra),
        }
    cfg: dict[str, Any] = {
        "kv_connector": "LMCacheAscendConnectorV1Dynamic",
        "kv_role": s.kv_role,
        "kv_connector_extra_config": dict(s.kv_extra),
    }
    if s.connector == "ascend":
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE
    elif s.connector != "ascend-plugin":
        raise ValueError(
            f"unknown connector {s.connector!r}; valid: none, ascend, ascend-plugin, lmcache"
        )
    return cfg


def _prompts(phase: Phase) -> list[Any]:
    from vllm.inputs import TokensPrompt

    salts = phase.salts or [None] * len(phase.prompts)
    if len(salts) != len(phase.prompts):
        raise ValueError(f"phase {phase.name}: {len(salts)} salts for {len(phase.prompts)} prompts")
    images = phase.images or [None] * len(phase.prompts)
    if len(images) != len(phase.prompts):
        raise ValueError(f"phase {phase.name}: {len(images)} image lists for {len(phase.prompts)} prompts")
    out = []
    for p, salt, seeds in zip(phase.prompts, salts, images):
        prompt = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            prompt["cache_salt"] = salt
        if seeds:
            from lmcache_ascend.cli.tiny_models import tiny_image

            prompt["multi_modal_data"] = {"image": [tiny_image(seed) for seed in seeds]}
        out.append(prompt)
    return out


def _lora_requests(s: Scenario, phase: Phase) -> Optional[list[Any]]:
    if not phase.loras:
        return None
    from vllm.lora.request import LoRARequest

    if len(phase.loras) != len(phase.prompts):
        raise ValueError(f"phase {phase.name}: {len(phase.loras)} adapters for {len(phase.prompts)} prompts")
    ids = {name: i + 1 for i, name in enumerate(sorted(s.loras))}
    out = []
    for name in phase.loras:
        if name is not None and name not in s.loras:
            raise ValueError(f"phase {phase.name}: unknown LoRA adapter {name!r}; valid: {sorted(s.loras)}")
        out.append(LoRARequest(name, ids[name], s.loras[name]) if name is not None else None)
    return out


def run(s: Scenario, progress=None) -> list[PhaseResult]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.kv_cache_gib))
    os.environ.update(s.env)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=s.model,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        enforce_eager=True,
        seed=0,
        max_num_batched_tokens=max(s.max_model_len, 2048),
        disable_log_stats=False,  # per-request first-token latency
    )
    kwargs.update(s.engine_kwargs)
    ktc = kv_transfer_config(s)
    if ktc is not None:
        kwargs["kv_transfer_config"] = ktc
    if progress:
        progress("starting vLLM engine")
    llm = LLM(**kwargs)
    results: list[PhaseResult] = []
    try:
        for phase in s.phases:
            if progress:
                progress(f"phase {phase.name}: {len(phase.prompts)} prompt(s)")
            if phase.reset_prefix_cache:
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache")
            sp = SamplingParams(temperature=0.0, max_tokens=phase.max_tokens, logprobs=s.logprobs)
            prompts = _prompts(phase)
            loras = _lora_requests(s, phase)
            preempted_before = _preemptions(llm)
            t0 = time.perf_counter()
            outs = []
            if phase.sequential:
                for i, p in enumerate(prompts):
                    t1 = time.perf_counter()
                    lora = [loras[i]] if loras is not None else None
                    o = llm.generate([p], sp, use_tqdm=False, lora_request=lora)[0]
                    outs.append((o, time.perf_counter() - t1))
            else:
                for o in llm.generate(prompts, sp, use_tqdm=False, lora_request=loras):
                    outs.append((o, float("nan")))
            dt = time.perf_counter() - t0
            comps = []
            for o, secs in outs:
                c = o.outputs[0]
                lps = [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [])]
                ttft = float(getattr(o.metrics, "first_token_latency", float("nan")) or float("nan"))
                comps.append(Completion(list(c.token_ids), lps, int(o.num_cached_tokens or 0), secs, ttft))
            results.append(
                PhaseResult(phase.name, comps, dt, _preemptions(llm) - preempted_before, _connector_counters(llm))
            )
    finally:
        del llm
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m lmcache_ascend.cli.engine_run SCENARIO.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        scenario = Scenario.from_json(json.load(f))
    results = run(scenario)
    with open(argv[2], "w") as f:
        json.dump([asdict(r) for r in results], f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
