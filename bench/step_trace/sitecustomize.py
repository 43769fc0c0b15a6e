# SPDX-License-Identifier: Apache-2.0
"""Step tracer for ``serving_profile.py --steps``: times vLLM's model-runner
step, its scheduler and the connector's hooks in every process of a server.

Python imports ``sitecustomize`` at start-up from ``sys.path``, so a server
started with this directory on ``PYTHONPATH`` and ``LMCA_STEP_TRACE_DIR`` set
writes one JSON line per call to ``<dir>/steps-<pid>.jsonl``. The methods are
wrapped when their modules are first imported (an import hook), so nothing is
imported early and vLLM alone is traced exactly like a server with the
connector. Without ``LMCA_STEP_TRACE_DIR`` this file does nothing.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("LMCA_STEP_TRACE_DIR")


def _scheduled(runner, scheduler_output, *args, **kwargs):
    return {"tokens": int(scheduler_output.total_num_scheduled_tokens),
            "reqs": len(scheduler_output.num_scheduled_tokens)}


_CONNECTOR_HOOKS = ("start_load_kv", "wait_for_save", "get_finished", "get_kv_connector_stats",
                    "get_num_new_matched_tokens", "update_state_after_alloc",
                    "build_connector_meta", "request_finished", "request_finished_all_groups")
# module -> [(class, method, extra-fields function or None)]
_TARGETS = {
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "execute_model", _scheduled),
                                        ("GPUModelRunner", "sample_tokens", None)],
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule", None),
                                     ("Scheduler", "update_from_output", None)],
    "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1": [
        ("LMCacheAscendConnectorV1Dynamic", m, None) for m in _CONNECTOR_HOOKS],
}


class _Sink:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.file = None

    def emit(self, rec: dict) -> None:
        with self.lock:
            if self.file is None:  # opened in the process that calls, not at import
                path = os.path.join(self.directory, f"steps-{os.getpid()}.jsonl")
                self.file = open(path, "a", buffering=1)
            self.file.write(json.dumps(rec) + "\n")


def _wrap(cls, name, extra, sink):
    fn = cls.__dict__.get(name)
    if fn is None:
        return
    label = f"{cls.__name__}.{name}"

    def traced(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            rec = {"f": label, "t": t0, "d": time.perf_counter() - t0}
            if extra is not None:
                try:
                    rec.update(extra(self, *args, **kwargs))
                except Exception as e:  # a changed vLLM type: keep the timing
                    rec["extra_error"] = repr(e)
            sink.emit(rec)

    setattr(cls, name, traced)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, sink: _Sink) -> None:
        self.sink = sink

    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)  # let the normal finders resolve it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        sink = self.sink

        def exec_and_wrap(module):
            exec_module(module)
            for cls_name, method, extra in _TARGETS[name]:
                cls = getattr(module, cls_name, None)
                if cls is not None:
                    _wrap(cls, method, extra, sink)

        spec.loader.exec_module = exec_and_wrap
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder(_Sink(_DIR)))
