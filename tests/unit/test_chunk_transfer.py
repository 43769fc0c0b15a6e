"""ChunkTransfer behaviour around the edges: incomplete chunks, null blocks,
partial chunks, buffer checks, op-call accounting."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer
from lmcache_ascend.planning.groups import ChunkRequest, GroupKind, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayoutHints
from lmcache_ascend.planning.planner import build_plan

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING


def _setup(ops, fill=True):
    gen = torch.Generator().manual_seed(0)

    def t():
        if not fill:
            return torch.zeros(12, 16, 32, dtype=torch.uint8)
        return torch.randint(0, 256, (12, 16, 32), dtype=torch.uint8, generator=gen)

    caches = {"a": (t(), t()), "b": t()}
    groups = (
        SchedulerGroup(0, FULL, "FullAttentionSpec", 16, layer_names=("a",)),
        SchedulerGroup(1, SLIDING, "SlidingWindowSpec", 16, sliding_window=16, layer_names=("b",)),
    )
    plan = build_plan(caches, groups, 64)
    return caches, plan, ChunkTransfer(plan, ops)


TABLES = ((1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 4, 5, 6, 7, 8))


def test_incomplete_chunk_copies_nothing(ops):
    caches, plan, xfer = _setup(ops)
    buf = torch.full((plan.chunk_bytes,), 7, dtype=torch.uint8)
    # Group 0 has the null block inside the chunk; group 1 only needs its window.
    tables = ((1, 0, 3, 4), (0, 0, 0, 4))
    req = ChunkRequest(0, 64, tables)
    assert xfer.incomplete_groups(req) == (0,)
    res = xfer.store(buf, req)
    assert not res.stored and res.incomplete_group == 0 and res.incomplete[0].positions == 16
    assert res.op_calls == 0 and xfer.op_calls == 0
    assert bool((buf == 7).all())
    # Past the end of the block table counts as missing too.
    assert xfer.incomplete_groups(ChunkRequest(64, 128, tables)) == (0, 1)
    ok = ChunkRequest(0, 64, ((1, 2, 3, 4), (0, 0, 0, 4)))
    assert xfer.incomplete_groups(ok) == ()
    assert xfer.store(buf, ok).stored and xfer.op_calls == len(plan.kernel_groups)


def test_load_leaves_null_and_skipped_positions_alone(ops):
    src, plan, xfer = _setup(ops)
    buf = torch.empty(plan.chunk_bytes, dtype=torch.uint8)
    assert xfer.store(buf, ChunkRequest(0, 64, TABLES)).stored
    dst, plan2, xfer2 = _setup(ops, fill=False)
    res = xfer2.load(buf, ChunkRequest(0, 64, ((1, 0, 3, 4), (0, 0, 0, 8))))
    assert [(m.group, m.positions) for m in res.missing] == [(0, 16)]
    k, v = dst["a"]
    assert torch.equal(k[1], src["a"][0][1]) and torch.equal(v[4], src["a"][1][4])
    assert not k[2].any() and not v[2].any()  # block 2 was not in the load table
    assert torch.equal(dst["b"][8], src["b"][4])  # window block, remapped
    assert not dst["b"][:8].any() and not dst["b"][9:].any()


def test_partial_chunk_zero_fills_unstored_rows(ops):
    _, plan, xfer = _setup(ops)
    buf = torch.full((plan.chunk_bytes,), 0xEE, dtype=torch.uint8)
    assert xfer.store(buf, ChunkRequest(0, 40, TABLES)).stored
    kg0 = plan.kernel_groups[0]
    rows = buf[kg0.offset : kg0.offset + kg0.nbytes].view(2, 64, 32)  # planes x rows x bytes
    assert not rows[:, 40:].any()


def test_chunk_buffer_checks(ops):
    _, plan, xfer = _setup(ops)
    req = ChunkRequest(0, 64, TABLES)
    with pytest.raises(ValueError, match="holds"):
        xfer.store(torch.empty(plan.chunk_bytes - 1, dtype=torch.uint8), req)
    with pytest.raises(ValueError, match="uint8"):
        xfer.load(torch.empty(plan.chunk_bytes, dtype=torch.float32), req)
    with pytest.raises(ValueError, match="block ids for 1 groups"):
        xfer.store(torch.empty(plan.chunk_bytes, dtype=torch.uint8), ChunkRequest(0, 64, TABLES[:1]))


def test_list_tables_are_not_cached(ops):
    _, plan, xfer = _setup(ops)
    table0 = [1, 2, 3, 4]
    req = ChunkRequest(0, 64, (table0, TABLES[1]))  # type: ignore[arg-type]
    assert xfer.incomplete_groups(req) == ()
    table0[1] = 0  # vLLM-style in-place edit must be seen
    assert xfer.incomplete_groups(req) == (0,)


def test_windowed_addressing_equals_per_chunk_addressing(ops):
    """Whole chunks of a tuple table are addressed 64 at a time and cached;
    list tables (and partial chunks) are addressed one by one. Both must
    agree for every chunk, sliding windows and split kernel pages included."""
    _, plan, xfer = _setup(ops)
    split_groups = (SchedulerGroup(0, FULL, "FullAttentionSpec", 16, layer_names=("p",)),)
    split_plan = build_plan({"p": torch.zeros(40, 2, 8, 32)}, split_groups, 64, None,
                            LayoutHints(opaque_pages=True))
    assert split_plan.kernel_groups[0].addressing[0].kernel_split == 2
    cases = [(xfer, 2), (ChunkTransfer(split_plan, ops), 1)]
    gen = torch.Generator().manual_seed(3)
    for transfer, ngroups in cases:
        for n_blocks in (3, 8, 19):
            tables = tuple(
                tuple(int(b) * int(torch.rand(1, generator=gen) > 0.2)
                      for b in torch.randint(1, 12, (n_blocks,), generator=gen))
                for _ in range(ngroups)
            )
            lists = tuple(list(t) for t in tables)
            for start in range(0, (n_blocks + 2) * 16, 64):
                for end in (start + 64, start + 17):
                    win = transfer.addresses(ChunkRequest(start, end, tables))
                    one = transfer.addresses(ChunkRequest(start, end, lists))  # type: ignore[arg-type]
                    assert win.keys() == one.keys()
                    for k in win:
                        assert win[k].ids.tolist() == one[k].ids.tolist(), (n_blocks, start, end)
                        assert win[k].missing == one[k].missing, (n_blocks, start, end)


def test_missing_native_module_message(monkeypatch):
    import importlib

    _, plan, _ = _setup(None)
    xfer = ChunkTransfer(plan)

    def fail(name):
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match="pass ops="):
        xfer.store(torch.empty(plan.chunk_bytes, dtype=torch.uint8), ChunkRequest(0, 64, TABLES))


def test_hnd_bundled_is_one_call_for_all_heads(ops):
    phys = torch.randint(0, 100, (2, 6, 4, 16, 8), dtype=torch.int16)
    caches = {"a": phys.permute(0, 1, 3, 2, 4)}
    groups = (SchedulerGroup(0, FULL, "FullAttentionSpec", 16, layer_names=("a",)),)
    plan = build_plan(caches, groups, 32, hints=LayoutHints(kv_layout="HND"))
    assert plan.kernel_groups[0].num_planes == 8
    xfer = ChunkTransfer(plan, ops)
    buf = torch.empty(plan.chunk_bytes, dtype=torch.uint8)
    assert xfer.store(buf, ChunkRequest(0, 32, ((3, 5),))).op_calls == 1
    rows = buf.view(torch.int16).view(2, 4, 32, 8)  # K/V, head, token, hs
    assert torch.equal(rows[1, 2, 16:], phys[1, 5, 2])


def test_planning_modules_import_neither_vllm_nor_lmcache_nor_native_ops():
    import fresh_python

    code = (
        "import sys, pkgutil, importlib, lmcache_ascend.planning, lmcache_ascend.transfer\n"
        "for pkg in (lmcache_ascend.planning, lmcache_ascend.transfer):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'lmcache') or m in "
        "('lmcache_ascend.ops', 'lmcache_ascend._ops')]\n"
        "assert not bad, bad\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    fresh_python.run(code, check=True, timeout=120, cwd=root)


def test_copy_threads_are_logged_and_a_serial_build_is_warned(caplog):
    import logging
    import types

    from lmcache_ascend.integration.vllm.wiring import log_copy_threads

    native = pytest.importorskip("lmcache_ascend.ops")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _, _, xfer = _setup(native)
        with caplog.at_level(logging.INFO, "lmcache_ascend"):
            assert log_copy_threads(xfer) == 2
        assert "CPU copies use 2 thread(s)" in caplog.text
        # A module built without OpenMP copies on one thread: that must be loud.
        serial = types.SimpleNamespace(**vars(native))
        serial.cpu_copy_threads = lambda: 1
        _, _, xfer = _setup(serial)
        caplog.clear()
        with caplog.at_level(logging.INFO, "lmcache_ascend"):
            assert log_copy_threads(xfer) == 1
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "1 of torch's 2 threads" in warned[0].getMessage()
        # Reference ops (no native copies) and non-CPU KV report nothing.
        from lmcache_ascend.transfer import reference_ops

        assert ChunkTransfer(xfer.plan, reference_ops).copy_threads() is None
    finally:
        torch.set_num_threads(before)
