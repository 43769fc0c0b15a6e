"""Which KV cache groups every tensor-parallel rank holds whole (replicated)
and which it holds a slice of (sharded), and so how chunks are keyed.

A replicated cache holds the same bytes on every rank, so one copy per
chunk serves them all: every rank keys it alike, with world size 1 and
worker 0, and with a backend the ranks share each chunk is written by one
rank and read by all (integration/vllm/parallel.py). Its keys then do not
depend on the TP size, so an instance of one TP size hits what an instance
of another stored (through a shared backend).
A sharded cache keeps per-rank keys (world size and rank in the key): each
rank stores and loads its own slice, and another TP size cuts other slices,
so those chunks are not shared across TP sizes.

What each rank allocates (provenance):

* vLLM's ``MLAAttentionSpec`` (vllm 0.32.0, vllm/model_executor/layers/
  attention/mla_attention.py, ``MLAAttention.get_kv_cache_spec``):
  ``num_kv_heads=1``, one ``kv_lora_rank + qk_rope_head_dim`` latent row per
  token on every rank, written from ``kv_a_proj_with_mqa``, a
  ``ReplicatedLinear`` (vllm/model_executor/models/deepseek_v2.py,
  ``DeepseekV2MLAAttention.__init__``): replicated.
* vLLM's ``SlidingWindowMLASpec`` (vllm/v1/kv_cache_interface.py): the
  same latent rows, windowed: replicated.
* vLLM-Ascend's ``AscendMLAAttentionSpec`` (DSA's MLA cache, DeepSeek-V4's
  compressed C4/C128 caches and its C4 indexer K cache),
  ``AscendSlidingWindowMLASpec`` (DeepSeek-V4's SWA cache and compressor
  states) and ``AscendSFAIndexerCacheSpec`` (DSA's indexer): all built with
  ``num_kv_heads=1`` and a head size that does not depend on the TP size
  (vllm_ascend 0.23.0 / 0.26.0rc1 core/kv_cache_interface.py, mirrored in
  tests/fixtures/ascend_specs.py; the DeepSeek-V4 specs as
  models/layer/attention/layer.py builds them, tests/fixtures/
  ascend_layouts.py ``dsv4_specs``): replicated. A DCP-replicated indexer
  (``sfa_dcp_replicated_indexer_size`` > 1) is refused before this is asked
  (integration/vllm/vllm_specs.py).
* Every other attention spec (``FullAttentionSpec``, ``SlidingWindowSpec``,
  ``ChunkedLocalAttentionSpec``) holds ``num_kv_heads / tp`` heads per rank,
  and Mamba / GDN state specs their heads split the same way: sharded.
  (With fewer KV heads than ranks vLLM gives each rank a copy of one head;
  those copies are still keyed per rank.)

A layout is stored once per chunk only when every one of its groups is
replicated: a chunk is one buffer of all groups, so a layout that mixes the
two keeps per-rank chunks (said once in the plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lmcache_ascend.planning.groups import SchedulerGroup

REPLICATED_SPECS = frozenset(
    {
        "MLAAttentionSpec",
        "SlidingWindowMLASpec",
        "AscendMLAAttentionSpec",
        "AscendSlidingWindowMLASpec",
        "AscendSFAIndexerCacheSpec",
    }
)


def group_replicated(group: SchedulerGroup) -> bool:
    """True when every TP rank holds this group's whole cache (see above)."""
    return group.spec_name in REPLICATED_SPECS


@dataclass(frozen=True)
class Replication:
    """How this layout's chunks are stored at tensor-parallel size ``tp``."""

    tp: int
    replicated_groups: tuple[int, ...]
    sharded_groups: tuple[int, ...]
    # Replicated but kept per rank by LMCache's save_only_first_rank=false.
    kept_per_rank: bool = False

    @property
    def single_copy(self) -> bool:
        """One copy per chunk (TP-independent keys)."""
        return bool(self.replicated_groups) and not self.sharded_groups and not self.kept_per_rank

    def describe(self, group_bytes: dict[int, int] | None = None, shared: bool = True) -> str:
        """What each rank stores, for the plan text and the startup log.
        ``shared``: the ranks share a backend, so a single copy is striped
        over them; without one every rank keeps its own copy."""
        lines = []
        for index in self.replicated_groups + self.sharded_groups:
            rep = index in self.replicated_groups
            n = (group_bytes or {}).get(index)
            size = f"{n} B per chunk" if n is not None else "its bytes"
            if rep and self.single_copy and self.tp == 1:
                what = f"replicated: {size} stored once (keys without TP size or rank)"
            elif rep and self.single_copy and shared:
                what = (f"replicated: {size} stored once (keys without TP size or rank), each rank "
                        f"writing 1/{self.tp} of the chunks; every rank loads every chunk")
            elif rep and self.single_copy:
                what = (f"replicated: keys without TP size or rank, but no shared backend: each of "
                        f"{self.tp} rank(s) stores {size} in its own cache")
            elif rep and self.kept_per_rank:
                what = f"replicated, stored per rank ({size} on each of {self.tp} rank(s)): save_only_first_rank=false"
            elif rep:
                what = f"replicated, but stored per rank ({size} on each of {self.tp} rank(s)): the layout mixes replicated and sharded groups"
            else:
                what = f"sharded: each of {self.tp} rank(s) stores its own slice, {size} (keys carry TP size and rank)"
            lines.append(f"  g{index:<2} {what}")
        if not self.single_copy:
            mode = "per-rank chunks"
        elif shared or self.tp == 1:
            mode = "one copy per chunk (TP-independent keys)"
        else:
            mode = "TP-independent keys, a copy per rank (no shared backend)"
        head = f"tensor parallel {self.tp}: {mode}"
        return "\n".join([head] + lines)


def replication(groups: Sequence[SchedulerGroup], tp: int) -> Replication:
    rep = tuple(g.index for g in groups if group_replicated(g))
    shard = tuple(g.index for g in groups if not group_replicated(g))
    return Replication(tp=tp, replicated_groups=rep, sharded_groups=shard)


def bytes_per_rank(group_bytes: dict[int, int], rep: Replication) -> float:
    """Bytes one rank stores per chunk, on average over a prompt's chunks: a
    single copy striped over ``tp`` ranks puts 1/tp of them on each rank;
    otherwise every rank stores every chunk."""
    total = sum(group_bytes.values())
    return total / rep.tp if rep.single_copy else float(total)


def per_rank_table(groups: Sequence[SchedulerGroup], group_bytes: dict[int, int], tps: Sequence[int] = (8, 16)) -> str:
    """Bytes per chunk per rank at each TP size in ``tps`` (for ``explain``).
    A replicated group's chunk is written once, by one rank (shared
    backend), so a rank writes 1/TP of its bytes on average and loads all of
    them; without a shared backend every rank writes all of them. A sharded
    group's bytes are this layout's per-rank slice at the TP size it was
    planned at: another TP size cuts other slices, so none is extrapolated."""
    lines = ["bytes per chunk per rank by TP size (written with a shared backend / without one; loaded):"]
    for tp in tps:
        rep = replication(groups, tp)
        total_write = 0.0
        for g in groups:
            n = group_bytes.get(g.index, 0)
            if g.index in rep.replicated_groups and rep.single_copy:
                w = n / tp
                lines.append(f"  TP {tp:<3} g{g.index:<2} {g.spec_name:<28} replicated: {w:,.0f} / {n:,} written, {n:,} loaded")
            elif g.index in rep.replicated_groups:
                w = float(n)
                lines.append(f"  TP {tp:<3} g{g.index:<2} {g.spec_name:<28} replicated, per-rank chunks (mixed layout): {n:,} written, {n:,} loaded")
            else:
                w = float(n)
                lines.append(f"  TP {tp:<3} g{g.index:<2} {g.spec_name:<28} sharded: {n:,} written, {n:,} loaded (this TP size's slice)")
            total_write += w
        total = sum(group_bytes.get(g.index, 0) for g in groups)
        lines.append(f"  TP {tp:<3} chunk: {total_write:,.0f} / {total:,} written per rank, {total:,} loaded per rank")
    return "\n".join(lines)
