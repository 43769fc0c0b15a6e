"""When a step's seals may run beside it (lmcache_bridge/engine/step_puts.py): only
if every backend a chunk can leave the process through has its puts held,
on the local CPU backend's buffers. The backends here are stand-ins named as
LMCache's (the check reads class names); the real engine is in
tests/integration/test_step_puts.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lmcache_ascend.lmcache_bridge.engine.step_puts import DeferredSeals, StepPuts


class LocalCPUBackend:
    def batched_submit_put_task(self, keys, objs, transfer_spec=None, on_complete_callback=None):
        pass


class _Held:
    def __init__(self, cpu):
        self._cpu = cpu
        self.puts: list = []

    def get_allocator_backend(self):
        return self._cpu

    def batched_submit_put_task(self, keys, objs, transfer_spec=None, on_complete_callback=None):
        self.puts.append(list(keys))


class RemoteBackend(_Held):
    pass


class LocalDiskBackend(_Held):
    pass


class P2PBackend(_Held):
    pass


class _Obj:
    def __init__(self):
        self.refs = 1

    def ref_count_up(self):
        self.refs += 1

    def ref_count_down(self):
        self.refs -= 1


def _engine(**backends):
    return SimpleNamespace(storage_manager=SimpleNamespace(storage_backends=backends))


def _seals(log):
    return DeferredSeals(lambda buf, ident: log.append((buf, ident)))


def test_disk_and_remote_on_the_cpu_buffers_defer_the_seals():
    cpu = LocalCPUBackend()
    puts = StepPuts.install(_engine(LocalCPUBackend=cpu, LocalDiskBackend=LocalDiskBackend(cpu),
                                    RemoteBackend=RemoteBackend(cpu)), _seals([]))
    try:
        assert puts is not None and puts.seals_deferred
    finally:
        puts.close(5)


@pytest.mark.parametrize("why", ["unheld backend", "own buffers", "no cpu backend"])
def test_otherwise_the_seals_stay_in_the_step_and_it_is_logged(why, caplog):
    cpu = LocalCPUBackend()
    backends = {"LocalCPUBackend": cpu, "RemoteBackend": RemoteBackend(cpu)}
    if why == "unheld backend":
        backends["P2PBackend"] = P2PBackend(cpu)
    elif why == "own buffers":
        backends["LocalDiskBackend"] = LocalDiskBackend(LocalCPUBackend())
    else:
        del backends["LocalCPUBackend"]
    with caplog.at_level(logging.WARNING, logger="lmcache_ascend.lmcache_bridge.engine.step_puts"):
        puts = StepPuts.install(_engine(**backends), _seals([]))
    try:
        assert puts is not None and not puts.seals_deferred
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "inside vLLM's step" in lines[0]
        assert {"unheld backend": "P2PBackend", "own buffers": "LocalDiskBackend",
                "no cpu backend": "LocalCPUBackend"}[why] in lines[0]
    finally:
        puts.close(5)


def test_seals_are_held_only_inside_a_step_and_run_before_the_puts():
    cpu = LocalCPUBackend()
    remote = RemoteBackend(cpu)
    order: list = []
    seals = DeferredSeals(lambda buf, ident: order.append(("seal", ident)))
    remote.puts = order  # LMCache's put, as the thread calls it, lands in the same record
    puts = StepPuts.install(_engine(LocalCPUBackend=cpu, RemoteBackend=remote), seals)
    obj = _Obj()
    assert seals.hold(obj, "buf", 1) is False  # outside a step: the caller seals now
    try:
        with puts.step():
            assert seals.hold(obj, "buf", 7) is True
            remote.batched_submit_put_task(["k7"], [obj])
            assert order == []
        assert puts.drain(5)
        assert order == [("seal", 7), ["k7"]]
        assert obj.refs == 1  # the seal's and the put's references returned
    finally:
        puts.close(5)
