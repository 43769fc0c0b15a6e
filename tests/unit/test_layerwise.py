"""Layer-by-layer loads beside the forward (integration/vllm/layerwise.py):
the loader against a whole-chunk load, the forward's waits, failures, and
the worker half's use of it (claims held until the copies end, failures
reported to vLLM)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from lmcache_ascend.integration.vllm import layerwise as layerwise_mod
from lmcache_ascend.integration.vllm.layerwise import LayerwiseLoader, build_loader
from lmcache_ascend.integration.vllm.transfer_meta import LoadSpec, RequestTransfer, StepTransfers
from lmcache_ascend.integration.vllm.worker import WorkerHalf
from lmcache_ascend.lmcache_bridge.engine.chunk_io import DeferredChunk
from lmcache_ascend.planning.groups import ChunkRequest
from lmcache_ascend.planning.layer_stages import LayerStages, model_layer_index
from lmcache_ascend.planning.settings import ConfigValueError
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

from test_halves import _Engine
from test_layer_stages import CHUNK, GROUPS, TABLES, _flat, _name, _setup

ATTENTION = [_name(i) for i in range(6)]  # what vLLM waits on (not the indexer)


def _stored(ops, n_chunks=2):
    src, plan, xfer = _setup(ops, fill=True)
    bufs = []
    for j in range(n_chunks):
        buf = torch.empty(plan.chunk_bytes, dtype=torch.uint8)
        assert xfer.store(buf, ChunkRequest(j * CHUNK, (j + 1) * CHUNK, TABLES)).stored
        bufs.append(buf)
    whole, _, whole_xfer = _setup(ops, fill=False)
    for j, buf in enumerate(bufs):
        whole_xfer.load(buf, ChunkRequest(j * CHUNK, (j + 1) * CHUNK, TABLES))
    return plan, bufs, _flat(whole)


def _chunks(bufs, req_id="r"):
    return [DeferredChunk(req_id, j * CHUNK, buf, ChunkRequest(j * CHUNK, (j + 1) * CHUNK, TABLES))
            for j, buf in enumerate(bufs)]


def _learned(xfer, plan):
    loader = LayerwiseLoader(xfer, LayerStages.build(plan))
    assert not loader.ready
    for name in ATTENTION:  # a forward without loads
        loader.wait(name)
    assert loader.finish() == {} and loader.ready
    return loader


class _Gate:
    """Wraps a ChunkTransfer: each load_layers call waits for a permit, so a
    test sees what is in place at each wait of the forward."""

    def __init__(self, xfer, fail_start=None):
        self._xfer, self._fail = xfer, fail_start
        self.sem = threading.Semaphore(0)
        self.calls = 0

    def prepare_layers(self, buf, req):
        return self._xfer.prepare_layers(buf, req), req.start

    def run_layers(self, load, spans):
        self.sem.acquire()
        self.calls += 1
        if self._fail is not None and load[1] == self._fail:
            raise RuntimeError("injected copy failure")
        return self._xfer.run_layers(load[0], spans)


def test_each_wait_finds_its_layer_and_the_next_waited_one_in_place(ops):
    plan, bufs, whole = _stored(ops)
    kv, _, xfer = _setup(ops, fill=False)
    stages = LayerStages.build(plan)
    loader = _learned(xfer, plan)
    gate = _Gate(xfer)
    loader._transfer = gate
    for _ in range(len(bufs) * len(stages)):
        gate.sem.release()  # the copy may run ahead freely
    loader.begin(_chunks(bufs))
    for name in ATTENTION:
        loader.wait(name)
        now = _flat(kv)
        i = model_layer_index(name)
        for layer, data in now.items():
            if model_layer_index(layer) <= min(i + 1, 5):
                assert torch.equal(data, whole[layer]), (name, layer)
    assert loader.finish() == {}
    assert all(torch.equal(a, whole[k]) for k, a in _flat(kv).items())
    assert loader.counters.pipelined_steps == 1


def test_the_forward_blocks_until_its_layers_are_copied(ops):
    plan, bufs, whole = _stored(ops, n_chunks=1)
    kv, _, xfer = _setup(ops, fill=False)
    loader = _learned(xfer, plan)
    gate = _Gate(xfer)
    loader._transfer = gate
    gate.sem.release()  # stage 0 only: what the forward needs before it starts
    loader.begin(_chunks(bufs))
    assert gate.calls == 1
    reached = threading.Event()

    def forward():
        loader.wait(_name(0))  # needs stages through 1
        reached.set()

    t = threading.Thread(target=forward)
    t.start()
    assert not reached.wait(0.2)  # stage 1 not copied yet
    gate.sem.release()
    assert reached.wait(5)
    t.join()
    for _ in range(4):
        gate.sem.release()
    for name in ATTENTION[1:]:
        loader.wait(name)
    assert loader.finish() == {}
    assert loader.counters.stall_seconds >= 0.2
    assert all(torch.equal(a, whole[k]) for k, a in _flat(kv).items())


def test_a_failed_copy_is_reported_from_its_chunk_and_later_chunks_are_skipped(ops, caplog):
    plan, bufs, _ = _stored(ops)
    _, _, xfer = _setup(ops, fill=False)
    loader = _learned(xfer, plan)
    gate = _Gate(xfer, fail_start=0)
    loader._transfer = gate
    for _ in range(100):
        gate.sem.release()
    other = [DeferredChunk("other", CHUNK, bufs[1], ChunkRequest(CHUNK, 2 * CHUNK, TABLES))]
    loader.begin(_chunks(bufs) + other)
    for name in ATTENTION:
        loader.wait(name)
    with caplog.at_level(logging.ERROR):
        assert loader.finish() == {"r": 0}
    # After r's first chunk failed in stage 0, none of r's chunks is copied
    # again; the other request's chunk is, in every stage.
    assert gate.calls == 1 + len(LayerStages.build(plan))
    assert "copying layer 0 of the chunk at token 0 failed" in caplog.text


def test_a_forward_that_skips_a_wait_fails_the_steps_loads_and_relearns(ops, caplog):
    plan, bufs, _ = _stored(ops)
    _, _, xfer = _setup(ops, fill=False)
    loader = _learned(xfer, plan)
    loader.begin(_chunks(bufs))
    for name in ATTENTION[:3]:
        loader.wait(name)
    with caplog.at_level(logging.WARNING):
        assert loader.finish() == {"r": 0}
    assert "did not wait on layer(s) [3, 4, 5]" in caplog.text
    # Learned again from that forward (layers 0-2): more is copied before
    # each wait, nothing is read before it is in place.
    assert loader.ready and loader._schedule.waited == (0, 1, 2)


def test_nothing_is_deferred_before_a_forward_showed_the_waits(ops):
    plan, _, _ = _stored(ops)
    _, _, xfer = _setup(ops, fill=False)
    loader = LayerwiseLoader(xfer, LayerStages.build(plan))
    assert not loader.ready
    assert loader.finish() == {} and not loader.ready  # a step without waits teaches nothing


def test_build_loader_modes(ops, caplog, monkeypatch):
    _, plan, xfer = _setup(ops, fill=False)
    with caplog.at_level(logging.INFO):
        assert build_loader("off", plan, xfer) is None
    assert "copied into vLLM's KV cache before the forward (ascend_layerwise_load=off: off)" in caplog.text
    assert isinstance(build_loader("on", plan, xfer), LayerwiseLoader)
    monkeypatch.setattr(layerwise_mod, "AUTO_ON", True)
    assert isinstance(build_loader("auto", plan, xfer), LayerwiseLoader)
    monkeypatch.setattr(layerwise_mod, "AUTO_ON", False)
    assert build_loader("auto", plan, xfer) is None
    staged = ChunkTransfer(plan, ops, staging=True, device_module=torch.cpu)
    with pytest.raises(ConfigValueError, match="'ascend_layerwise_load': 'on' is not possible here: .*valid here: auto, off"):
        build_loader("on", plan, staged)
    assert build_loader("auto", plan, staged) is None


# ---- the worker half ---------------------------------------------------------


class _ClaimEngine(_Engine):
    """test_halves' engine stand-in, with one staged claim per lookup:
    load_claim defers its chunks as chunk_io's connector does."""

    def __init__(self, bufs):
        super().__init__(None, [])
        self.bufs = bufs
        self.events: list[str] = []

    def claim(self, lookup_id):
        return SimpleNamespace(lookup_id=lookup_id)

    def load_claim(self, claim, first, end, ctx):
        assert ctx.verified is False  # the worker's ctx; the engine marks its copy verified
        for j, buf in enumerate(self.bufs):
            req = ChunkRequest(j * CHUNK, (j + 1) * CHUNK, ctx.block_ids)
            ctx.deferred.append(DeferredChunk(ctx.req_id, j * CHUNK, buf, req))
        return end

    def release_claim(self, claim):
        self.events.append(f"release {claim.lookup_id}")

    def unpin(self, lookup_id):
        self.events.append(f"unpin {lookup_id}")

    def request_ended(self, req_id):
        self.events.append(f"ended {req_id}")


def _step(hit):
    load = LoadSpec(skip_tokens=0, hit_tokens=hit)
    req = RequestTransfer(req_id="r", token_ids=tuple(range(hit + 8)), block_ids=TABLES, load=load)
    return StepTransfers(requests=(req,))


@pytest.mark.parametrize("fail", [False, True])
def test_the_worker_holds_the_claim_until_the_copies_end_and_reports_a_failed_one(ops, fail):
    plan, bufs, whole = _stored(ops)
    kv, _, xfer = _setup(ops, fill=False)
    loader = _learned(xfer, plan)
    if fail:
        gate = _Gate(xfer, fail_start=CHUNK)
        loader._transfer = gate
        for _ in range(100):
            gate.sem.release()
    engine = _ClaimEngine(bufs)
    worker = WorkerHalf(GROUPS, CHUNK, engine, xfer, plan, layerwise=loader)
    step = _step(2 * CHUNK)
    worker.start_load(step)
    assert "release r" not in engine.events and "unpin r" in engine.events
    for name in ATTENTION:
        worker.wait_layer(name)
    errors = worker.take_load_errors()  # what vLLM reads after the forward
    assert engine.events[-1] == "release r"
    if not fail:
        assert errors == set() and worker.stats.loaded_tokens == 2 * CHUNK
        assert all(torch.equal(a, whole[k]) for k, a in _flat(kv).items())
    else:
        # Blocks of tokens [64, 128) of both groups go back to vLLM.
        assert errors == {5, 6, 7, 8} and worker.stats.loaded_tokens == CHUNK
        assert worker.stats.load_errors == 1 and "r" in worker._failed_loads
    worker.finish_loads()  # a second call in the step: nothing left
    assert engine.events.count("release r") == 1
