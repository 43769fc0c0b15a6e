"""Layer-by-layer loads: stages of a plan, the wait schedule, and
``ChunkTransfer.load_layers`` against a whole-chunk ``load``."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.planning.groups import ChunkRequest, GroupKind, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayoutHints
from lmcache_ascend.planning.layer_stages import (
    LayerStages,
    WaitSchedule,
    group_runs,
    model_layer_index,
)
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer

pytestmark = pytest.mark.pure

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING
BLOCK, CHUNK, BLOCKS = 16, 64, 12


def _name(i: int, part: str = "self_attn.attn") -> str:
    return f"model.layers.{i}.{part}"


def _caches(fill: bool, seed: int = 0) -> dict[str, object]:
    """A Gemma-3-like model (sliding layers 0, 1, 3, 4; full 2 and 5; K and V
    tensors) plus a DSA-like indexer cache in layer 2 (one tensor, its own
    page layout), so kernel groups hold interleaved layer indices."""
    gen = torch.Generator().manual_seed(seed)

    def t(width: int = 32) -> torch.Tensor:
        if not fill:
            return torch.zeros(BLOCKS, BLOCK, width, dtype=torch.uint8)
        return torch.randint(0, 256, (BLOCKS, BLOCK, width), dtype=torch.uint8, generator=gen)

    caches: dict[str, object] = {_name(i): (t(), t()) for i in range(6)}
    caches[_name(2, "self_attn.indexer.k_cache")] = t(48)
    return caches


GROUPS = (
    SchedulerGroup(0, FULL, "FullAttentionSpec", BLOCK,
                   layer_names=(_name(2), _name(5), _name(2, "self_attn.indexer.k_cache"))),
    SchedulerGroup(1, SLIDING, "SlidingWindowSpec", BLOCK, sliding_window=32,
                   layer_names=tuple(_name(i) for i in (0, 1, 3, 4))),
)
TABLES = ((1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 4, 5, 6, 7, 8))


def _setup(ops, fill: bool):
    caches = _caches(fill)
    plan = build_plan(caches, GROUPS, CHUNK, None, LayoutHints())
    return caches, plan, ChunkTransfer(plan, ops)


def _flat(caches) -> dict[str, torch.Tensor]:
    out = {}
    for name, entry in caches.items():
        tensors = entry if isinstance(entry, tuple) else (entry,)
        out[name] = torch.cat([t.reshape(-1) for t in tensors])
    return out


def test_layer_index_is_the_first_integer_of_the_name():
    assert model_layer_index("model.layers.17.self_attn.attn") == 17
    assert model_layer_index("model.language_model.layers.3.mixer") == 3
    assert model_layer_index("lm_head") is None


def test_every_entry_is_in_exactly_one_stage_in_forward_order(ops):
    _, plan, _ = _setup(ops, fill=False)
    stages = LayerStages.build(plan)
    assert stages.indices == (0, 1, 2, 3, 4, 5)
    seen = []
    for index, runs in zip(stages.indices, stages.runs):
        for run in runs:
            kg = plan.kernel_groups[run.kernel_group]
            for e in range(run.first, run.end):
                assert model_layer_index(kg.planes[e][0].layer_name) == index
                seen.append((run.kernel_group, e))
    assert sorted(seen) == sorted((k, e) for k, kg in enumerate(plan.kernel_groups) for e in range(kg.num_layers))
    # Layer 2 has two entries in different kernel groups (attention, indexer).
    assert len({r.kernel_group for r in stages.runs[2]}) == 2
    assert stages.through(-1) == 0 and stages.through(2) == 3 and stages.through(None) == 6


def test_a_layer_without_an_index_is_refused_by_name(ops):
    caches = {"attn": (torch.zeros(4, BLOCK, 32, dtype=torch.uint8),) * 2}
    plan = build_plan(caches, (SchedulerGroup(0, FULL, "FullAttentionSpec", BLOCK, layer_names=("attn",)),), CHUNK)
    with pytest.raises(ValueError, match="'attn' has no layer index"):
        LayerStages.build(plan)


def test_the_schedule_keeps_one_waited_layer_ahead(ops):
    _, plan, _ = _setup(ops, fill=False)
    stages = LayerStages.build(plan)
    assert WaitSchedule.learn(stages, []) is None
    # vLLM waits on the attention layers only (not the indexer, not Mamba).
    sched = WaitSchedule.learn(stages, [0, 1, 2, 3, 4, 5, 2])
    assert sched is not None and sched.waited == (0, 1, 2, 3, 4, 5)
    assert sched.before_forward() == 1  # layer 0, before anything runs
    # At layer 1's wait, layer 2 (its indexer is read before layer 2 waits).
    assert sched.at_wait(1) == 3
    assert sched.at_wait(5) == 6 and sched.at_wait(None) == 6
    assert sched.at_wait(9) == 6  # never seen: everything
    # A hybrid whose first attention layer is 2 (Mamba layers 0, 1 never
    # wait): all of 0..2 before the forward, then through 5 at 2's wait.
    sparse = WaitSchedule.learn(stages, [2, 5])
    assert sparse is not None and sparse.before_forward() == 3 and sparse.at_wait(2) == 6


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_stage_loads_equal_a_whole_load_and_touch_only_their_layers(ops, order):
    src, plan, xfer = _setup(ops, fill=True)
    stages = LayerStages.build(plan)
    bufs = []
    for start in range(0, 128, CHUNK):
        buf = torch.empty(plan.chunk_bytes, dtype=torch.uint8)
        assert xfer.store(buf, ChunkRequest(start, start + CHUNK, TABLES)).stored
        bufs.append((start, buf))
    whole, _, whole_xfer = _setup(ops, fill=False)
    for start, buf in bufs:
        whole_xfer.load(buf, ChunkRequest(start, start + CHUNK, TABLES))
    staged, _, staged_xfer = _setup(ops, fill=False)
    ks = range(len(stages)) if order == "forward" else reversed(range(len(stages)))
    for k in ks:
        before = _flat(staged)
        calls = 0
        for start, buf in bufs:
            calls += staged_xfer.load_layers(buf, ChunkRequest(start, start + CHUNK, TABLES),
                                             group_runs(stages.runs[k]))
        assert calls == len(bufs) * len(stages.runs[k])
        after = _flat(staged)
        for name in after:
            if model_layer_index(name) != stages.indices[k]:
                assert torch.equal(after[name], before[name]), (k, name)
            else:
                assert not torch.equal(after[name], before[name]), (k, name)
    assert all(torch.equal(a, b) for a, b in zip(_flat(staged).values(), _flat(whole).values()))
    assert any(t.any() for t in _flat(whole).values())


def test_merged_runs_make_one_call_per_kernel_group(ops):
    src, plan, xfer = _setup(ops, fill=True)
    stages = LayerStages.build(plan)
    buf = torch.empty(plan.chunk_bytes, dtype=torch.uint8)
    assert xfer.store(buf, ChunkRequest(0, CHUNK, TABLES)).stored
    dst, _, dst_xfer = _setup(ops, fill=False)
    every = [r for runs in stages.runs for r in runs]
    spans = group_runs(every)
    assert all(len(v) == 1 for v in spans.values())  # adjacent runs merged
    assert dst_xfer.load_layers(buf, ChunkRequest(0, CHUNK, TABLES), spans) == len(plan.kernel_groups)
    ref, _, ref_xfer = _setup(ops, fill=False)
    ref_xfer.load(buf, ChunkRequest(0, CHUNK, TABLES))
    assert all(torch.equal(a, b) for a, b in zip(_flat(dst).values(), _flat(ref).values()))


def test_load_layers_refuses_a_range_outside_the_group_and_the_staging_path(ops):
    _, plan, xfer = _setup(ops, fill=False)
    buf = torch.zeros(plan.chunk_bytes, dtype=torch.uint8)
    n = plan.kernel_groups[0].num_layers
    with pytest.raises(ValueError, match=rf"entries \[0, {n + 1}\) outside"):
        xfer.load_layers(buf, ChunkRequest(0, CHUNK, TABLES), {0: [(0, n + 1)]})
    staged = ChunkTransfer(plan, ops, staging=True, device_module=torch.cpu)
    assert not staged.layerwise_capable and xfer.layerwise_capable
    with pytest.raises(RuntimeError, match="layer-by-layer loads run on the direct CPU path only"):
        staged.load_layers(buf, ChunkRequest(0, CHUNK, TABLES), {0: [(0, 1)]})
