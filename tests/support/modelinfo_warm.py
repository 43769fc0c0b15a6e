"""Fills vLLM's model-class cache for the tiny test models' architectures,
in a child forked from an engine zygote (vLLM already imported).

vLLM computes a model class's properties (``_ModelInfo``: generative,
hybrid, multimodal, ...) in a fresh interpreter the first time an engine
uses the class (``registry._run_in_subprocess``, there so that CUDA is never
initialised in the engine's own process), and caches them under
``VLLM_CACHE_ROOT/modelinfos`` keyed by the hash of the class's source file.
On 2 cores that interpreter costs 10-15 s, paid by the first engine of every
architecture on every stack of a fresh machine. This child computes the
same function, ``_ModelInfo.from_model_cls``, in itself: it has vLLM
imported already and no CUDA to initialise. An engine then finds the
entry, and a stale or missing entry is still recomputed by vLLM as before.
"""

from __future__ import annotations

import sys
import time

# The architectures lmcache_ascend.cli.tiny_models builds.
ARCHITECTURES = ("LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3NextForCausalLM",
                 "DeepseekV2ForCausalLM", "Idefics3ForConditionalGeneration")


def main() -> int:
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    for arch in ARCHITECTURES:
        model = registry.ModelRegistry.models.get(arch)
        if model is None or not hasattr(model, "inspect_model_cls"):
            print(f"modelinfo warm: {arch}: not a lazily registered model here; left to vLLM")
            continue
        t0 = time.monotonic()
        try:
            model.inspect_model_cls()
        except Exception as e:  # noqa: BLE001 - vLLM recomputes it in the engine as before
            print(f"modelinfo warm: {arch}: {e!r}; left to vLLM")
            continue
        print(f"modelinfo warm: {arch} ready in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
