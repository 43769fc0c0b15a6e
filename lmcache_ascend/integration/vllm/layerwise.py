"""Loads copied layer by layer beside vLLM's forward (``ascend_layerwise_load``).

Without it, a hit's chunks are copied into vLLM's KV cache in
``start_load_kv``, before the forward starts. With it, ``start_load_kv``
only collects the verified chunks a lookup staged (the claim holds their
buffers) and a thread copies them stage by stage, one model layer at a
time (planning/layer_stages.py), while the forward computes the layers
before; ``wait_for_layer_load`` blocks only until the layers it needs are
in place. The step ends (``finish``) before anything reads the step's KV
for storing or reports load errors.

Chunks loaded through LMCache's retrieve (nothing staged) and Mamba state
pieces are copied before the forward as always: LMCache frees a retrieved
buffer when the call returns, and Mamba layers never wait.

Which layers vLLM waits on is learned from a forward; a step is pipelined
only once it is known, and checked at its end: if the forward did not wait
on every layer it waited on before, the step's deferred chunks are
reported as failed loads (vLLM recomputes them) and the schedule is
learned again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from lmcache_ascend.planning.layer_stages import LayerStages, WaitSchedule, group_runs, model_layer_index
from lmcache_ascend.planning.settings import ConfigValueError

if TYPE_CHECKING:
    from lmcache_ascend.lmcache_bridge.engine.chunk_io import DeferredChunk
    from lmcache_ascend.planning.planner import TransferPlan
    from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer, LayerLoad

logger = logging.getLogger(__name__)


@dataclass
class LayerwiseCounters:
    pipelined_steps: int = 0  # steps whose copies ran beside the forward
    stall_seconds: float = 0.0  # time the forward waited for a layer's copy


class LayerwiseLoader:
    """One worker's layer-by-layer loads: the learned wait schedule and the
    copy thread of the current step."""

    def __init__(self, transfer: ChunkTransfer, stages: LayerStages) -> None:
        self._transfer = transfer
        self._stages = stages
        self._schedule: Optional[WaitSchedule] = None
        self._waited: list[int] = []  # layer indices vLLM waited on in this forward
        self._cond = threading.Condition()
        self._done = 0  # stages in place in this step
        self._thread: Optional[threading.Thread] = None
        self._chunks: Sequence[DeferredChunk] = ()
        self._failed: dict[str, int] = {}  # req_id -> first token whose copy failed
        self.counters = LayerwiseCounters()

    @property
    def ready(self) -> bool:
        """Whether this step's copies may be deferred (the schedule is known)."""
        return self._schedule is not None

    def begin(self, chunks: Sequence[DeferredChunk]) -> None:
        """Starts copying ``chunks`` and returns once the stages the first
        waited layer needs are in place."""
        assert self._schedule is not None and self._thread is None
        if not chunks:
            return
        self._chunks, self._failed, self._done = chunks, {}, 0
        self._thread = threading.Thread(target=self._run, name="lmcache-ascend-layerwise-load", daemon=True)
        self._thread.start()
        self.counters.pipelined_steps += 1
        self._wait_for(self._schedule.before_forward())

    def wait(self, layer_name: str) -> None:
        """vLLM is about to run attention layer ``layer_name``."""
        index = model_layer_index(layer_name)
        if index is not None:
            self._waited.append(index)
        if self._thread is not None and self._schedule is not None:
            self._wait_for(self._schedule.at_wait(index))

    def _wait_for(self, stages: int) -> None:
        t0 = time.perf_counter()
        with self._cond:
            while self._done < stages:
                self._cond.wait()
        self.counters.stall_seconds += time.perf_counter() - t0

    def _run(self) -> None:
        try:
            # LMCache's buffers are inference tensors; the mode is per thread.
            with torch.inference_mode():
                loads: list[Optional[LayerLoad]] = []
                for chunk in self._chunks:
                    try:
                        loads.append(self._transfer.prepare_layers(chunk.buf, chunk.request))
                    except Exception:  # noqa: BLE001 - reported as a load error at finish
                        logger.exception("lmcache-ascend: request %s: addressing the chunk at token %d failed",
                                         chunk.req_id, chunk.start)
                        self._fail(chunk)
                        loads.append(None)
                for k, runs in enumerate(self._stages.runs):
                    spans = group_runs(runs)
                    for chunk, load in zip(self._chunks, loads):
                        if load is None or (chunk.req_id in self._failed and chunk.start >= self._failed[chunk.req_id]):
                            continue
                        try:
                            self._transfer.run_layers(load, spans)
                        except Exception:  # noqa: BLE001 - reported as a load error at finish
                            logger.exception(
                                "lmcache-ascend: request %s: copying layer %d of the chunk at token %d failed",
                                chunk.req_id, self._stages.indices[k], chunk.start,
                            )
                            self._fail(chunk)
                    with self._cond:
                        self._done = k + 1
                        self._cond.notify_all()
        finally:
            with self._cond:
                self._done = len(self._stages)
                self._cond.notify_all()

    def _fail(self, chunk: DeferredChunk) -> None:
        self._failed[chunk.req_id] = min(self._failed.get(chunk.req_id, chunk.start), chunk.start)

    def finish(self) -> dict[str, int]:
        """Ends the step: every copy done. Returns, per request, the first
        token whose KV is not in place (empty: all of it is)."""
        waited, self._waited = self._waited, []
        thread, self._thread = self._thread, None
        failed: dict[str, int] = {}
        if thread is not None:
            thread.join()
            failed = dict(self._failed)
            assert self._schedule is not None
            missed = set(self._schedule.waited) - set(waited)
            if missed:
                # The forward read layers without waiting for them: what it
                # computed for these requests may rest on missing KV.
                logger.warning(
                    "lmcache-ascend: vLLM's forward did not wait on layer(s) %s this step, as it did "
                    "before; the step's layer-by-layer loads are reported as failed (vLLM recomputes "
                    "them) and the wait schedule is learned again",
                    sorted(missed),
                )
                for chunk in self._chunks:
                    failed[chunk.req_id] = min(failed.get(chunk.req_id, chunk.start), chunk.start)
                self._schedule = None
            self._chunks = ()
        if self._schedule is None and waited:
            self._schedule = WaitSchedule.learn(self._stages, waited)
            if self._schedule is not None:
                logger.info(
                    "lmcache-ascend: layer-by-layer loads on: vLLM waits on %d layer(s); %d stage(s), "
                    "%d before the forward",
                    len(self._schedule.waited), len(self._stages), self._schedule.before_forward(),
                )
        return failed

    def close(self) -> None:
        self.finish()


# What ``ascend_layerwise_load=auto`` does where layer-by-layer loads are
# possible (KV on the CPU): off, measured (bench/bench_layerwise.py,
# docs/benchmarks.md). On a 2-core vLLM-CPU the copy before the forward
# costs 0-9 ms at 4k-8k tokens (about 20 GB/s); copied beside the forward
# it cost 9-20 ms: the copy thread takes a core the forward's threads use,
# and each layer of each chunk is an op call of its own (12x the calls).
AUTO_ON = False


def build_loader(mode: str, plan: TransferPlan, transfer: ChunkTransfer) -> Optional[LayerwiseLoader]:
    """The loader ``ascend_layerwise_load`` asks for, with one line saying
    what loads do. ``on`` where it cannot run stops startup, naming why."""
    why_not = None
    stages: Optional[LayerStages] = None
    if not transfer.layerwise_capable:
        why_not = (
            f"vLLM's KV cache is on {transfer.kv_device} (this path stages whole chunks on the device; "
            "layer-by-layer loads run where the KV cache is on the CPU)"
        )
    else:
        try:
            stages = LayerStages.build(plan)
        except ValueError as e:
            why_not = str(e)
    if mode == "on" and why_not is not None:
        raise ConfigValueError(
            f"config key 'ascend_layerwise_load': 'on' is not possible here: {why_not}; valid here: auto, off"
        )
    if stages is None or mode == "off" or (mode == "auto" and not AUTO_ON):
        reason = why_not if why_not is not None else (
            "off" if mode == "off" else "auto: off where it does not pay, docs/benchmarks.md")
        logger.info(
            "lmcache-ascend: a hit's chunks are copied into vLLM's KV cache before the forward "
            "(ascend_layerwise_load=%s: %s)", mode, reason)
        return None
    logger.info(
        "lmcache-ascend: a hit's staged chunks are copied layer by layer beside the forward "
        "(ascend_layerwise_load=%s; %d layer stage(s)), once a forward has shown which layers vLLM waits on",
        mode, len(stages))
    return LayerwiseLoader(transfer, stages)
