"""Replicated vs sharded groups, the keys they get, and the stripe a rank
stores (planning/replication.py, integration/vllm/parallel.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup
from lmcache_ascend.planning.replication import bytes_per_rank, replication


def group(index: int, spec: str) -> SchedulerGroup:
    return SchedulerGroup(index=index, kind=GroupKind.FULL, spec_name=spec, block_size=128)


MLA = [group(0, "MLAAttentionSpec")]
DSV4 = [group(0, "AscendMLAAttentionSpec"), group(1, "AscendSlidingWindowMLASpec"), group(2, "AscendMLAAttentionSpec")]
DSA = [group(0, "AscendMLAAttentionSpec"), group(1, "AscendSFAIndexerCacheSpec")]
GQA = [group(0, "FullAttentionSpec"), group(1, "SlidingWindowSpec")]
MIXED = [group(0, "MLAAttentionSpec"), group(1, "FullAttentionSpec")]


@pytest.mark.parametrize("groups", [MLA, DSV4, DSA])
def test_mla_family_is_one_copy(groups):
    rep = replication(groups, 8)
    assert rep.single_copy and not rep.sharded_groups
    assert "one copy per chunk" in rep.describe()
    assert bytes_per_rank({g.index: 800 for g in groups}, rep) == 100 * len(groups)
    assert "no shared backend" in rep.describe(shared=False)
    assert "one copy per chunk" not in rep.describe(shared=False)


def test_heads_split_are_per_rank():
    rep = replication(GQA, 2)
    assert not rep.single_copy and rep.sharded_groups == (0, 1)
    assert "sharded" in rep.describe() and "per-rank chunks" in rep.describe()
    assert bytes_per_rank({0: 10, 1: 5}, rep) == 15


def test_mixed_layout_keeps_per_rank_chunks_and_says_so():
    rep = replication(MIXED, 2)
    assert not rep.single_copy
    assert "mixes replicated and sharded" in rep.describe({0: 7, 1: 3})


def test_replicated_keys_do_not_depend_on_tp_or_rank():
    from lmcache_ascend.lmcache_bridge.engine.lmcache_engine import EngineSpec

    def key_fields(rank: int, world: int, replicated: bool):
        spec = EngineSpec("m", "e", rank, world, 128, {}, replicated=replicated)
        md = spec.key_metadata(spec.metadata("worker", 1024, 3))
        return md.world_size, md.worker_id

    assert {key_fields(r, w, True) for w in (1, 2, 4) for r in range(w)} == {(1, 0)}
    assert key_fields(1, 2, False) == (2, 1)
    # Only the key metadata changes: lookup sockets keep the real rank.
    spec = EngineSpec("m", "e", 1, 2, 128, {}, replicated=True)
    assert spec.metadata("worker").worker_id == 1


def _vllm(tp=1, rank=0, pp=1, dcp=1):
    return SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, rank=rank, pipeline_parallel_size=pp, decode_context_parallel_size=dcp))


def test_stripe_needs_a_shared_backend():
    from lmcache_ascend.integration.vllm.parallel import store_stripe

    shared = SimpleNamespace(remote_url="redis://x")
    assert store_stripe(MLA, _vllm(2, 1), SimpleNamespace(remote_url=None))[1] is None
    assert store_stripe(GQA, _vllm(2, 1), shared)[1] is None
    assert store_stripe(MLA, _vllm(1, 0), shared)[1] is None
    stripe = store_stripe(MLA, _vllm(2, 1), shared)[1]
    assert stripe.part(0, 4) == (2, 4)


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_every_chunk_has_exactly_one_writer(tp):
    from lmcache_ascend.integration.vllm.parallel import Stripe

    for first in range(5):
        for k in range(1, 20):
            parts = [Stripe(r, tp).part(first, k) for r in range(tp)]
            covered = sorted(j for j0, j1 in parts for j in range(j0, j1))
            assert covered == list(range(k)), (first, k, parts)
    # One chunk per step: the writer rotates over the ranks.
    assert [next(r for r in range(tp) if Stripe(r, tp).part(i, 1) == (0, 1)) for i in range(tp)] == list(range(tp))


@pytest.mark.parametrize("field,value", [("pp", 2), ("dcp", 2)])
def test_refused_parallelism_names_the_setting(field, value):
    from lmcache_ascend.integration.vllm.parallel import check_parallelism

    with pytest.raises(ValueError, match=f"={value} is not supported \\(valid: 1\\)"):
        check_parallelism(_vllm(**{field: value}))
    check_parallelism(_vllm(tp=4))


def test_store_path_takes_only_its_stripe():
    from lmcache_ascend.integration.vllm.parallel import Stripe
    from lmcache_ascend.integration.vllm.worker import WorkerHalf

    def half(stripe):
        # Only the chunk size and the stripe matter to the store path's cut.
        plan = SimpleNamespace(chunk_bytes=0, group_bytes=lambda: {})
        return WorkerHalf((), 128, engine=None, transfer=None, plan=plan, stripe=stripe)

    assert half(None)._stripe_runs([(0, 384)]) == [(0, 384)]
    # 3 chunks from chunk 0: rank 0 writes chunks 0-1; 2 chunks from chunk 4
    # (first 4 is even): rank 0 writes chunk 4.
    assert half(Stripe(0, 2))._stripe_runs([(0, 384), (512, 768)]) == [(0, 256), (512, 640)]
    rank1 = half(Stripe(1, 2))
    assert rank1._stripe_runs([(0, 384), (512, 768)]) == [(256, 384), (640, 768)]
    assert rank1._stripe_runs([(128, 256)]) == [(128, 256)]  # chunk 1 alone: rank 1
    assert dataclasses.is_dataclass(Stripe)


def test_dsv4_and_dsa_fixtures_per_rank_bytes_at_tp_8_and_16():
    """The vLLM-Ascend DeepSeek-V4 and DSA fixtures (tests/fixtures, with
    their provenance) are replicated in every group: at TP 8 and 16 each
    rank writes 1/TP of every chunk's bytes and loads all of them."""
    pytest.importorskip("vllm", reason="the fixtures build vLLM's own KV cache config types")
    from fixtures import ascend_layouts as AL

    from lmcache_ascend.planning.planner import build_plan
    from lmcache_ascend.planning.replication import per_rank_table

    seen = set()
    for lay in AL.all_layouts():
        if not lay.name.startswith(("dsv4", "dsa", "glm")):
            continue
        seen.add(lay.name.split("-")[0])
        built = lay.build(False)
        plan = build_plan(built.kv_caches, lay.groups, lay.chunk_size, lay.config, lay.hints)
        gb = dict(plan.group_bytes())
        total = sum(gb.values())
        assert total == plan.chunk_bytes
        text = per_rank_table(lay.groups, gb)
        for tp in (8, 16):
            assert replication(lay.groups, tp).single_copy, lay.name
            assert f"TP {tp:<3} chunk: {total / tp:,.0f} / {total:,} written per rank, {total:,} loaded" in text
    assert {"dsv4", "dsa"} <= seen, seen
