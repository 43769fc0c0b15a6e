"""vLLM's parallel layout as the connector needs it: the TP size and rank,
how replicated caches are stored (planning/replication.py), and the
parallel settings it refuses at startup.

Storing a replicated cache once: every rank looks its chunks up under the
same TP-independent keys, so each rank can load a chunk any rank stored,
but only from a backend the ranks share (LMCache's ``remote_url``). With
one, the ranks stripe: each store's chunks are cut into TP contiguous parts
and each rank writes one (``Stripe``; bytes 1/TP, store time about 1/TP
per rank), and every rank loads every chunk from the shared backend. Without one (each rank's LMCache CPU
cache is its own process memory), every rank stores every chunk, as for a
sharded cache, and says so once at startup.

LMCache's own switch for this, ``extra_config: {"save_only_first_rank":
false}`` (its MLA setting), keeps per-rank keys and copies instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lmcache_ascend.planning.groups import SchedulerGroup
from lmcache_ascend.planning.replication import Replication, replication

if TYPE_CHECKING:
    # vLLM's config type names what is passed; mypy skips vLLM's sources, so
    # to it the type stays untyped, and unit tests hand in plain namespaces.
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stripe:
    """Which chunks of a store this rank writes. A store of ``k`` chunks
    from chunk index ``first`` is cut into ``size`` contiguous parts (one
    LMCache call per rank: its per-call cost is paid once, not per chunk),
    part ``p`` going to rank ``(p + first) % size`` so that stores of one
    chunk per step rotate over the ranks. Every rank derives the same cut
    from the same scheduler output, so each chunk has exactly one writer."""

    rank: int
    size: int

    def owner(self, first: int, k: int, j: int) -> int:
        """The rank that writes chunk ``first + j`` of a ``k``-chunk store."""
        return (j * self.size // k + first) % self.size

    def part(self, first: int, k: int) -> tuple[int, int]:
        """This rank's chunks ``[j0, j1)`` of the store (j0 == j1: none)."""
        mine = [j for j in range(k) if self.owner(first, k, j) == self.rank]
        return (mine[0], mine[-1] + 1) if mine else (0, 0)


def tp_layout(vllm_config: VllmConfig) -> tuple[int, int]:
    """(TP size, this worker's TP rank); the scheduler is rank 0."""
    pc = vllm_config.parallel_config
    # Duck-typed on purpose (tests hand in namespaces): ParallelConfig has
    # both on every supported vLLM (0.23-0.32).
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    return tp, int(getattr(pc, "rank", 0) or 0) % tp


# lmcache_config (here and below): LMCache's config, which ships no types.
# Its extra_config and remote_url are on LMCache 0.5.6 and 0.5.7rc2 alike;
# probed because tests hand in namespaces with only what they set.
def single_copy(groups: Sequence[SchedulerGroup], vllm_config: VllmConfig, lmcache_config: Any) -> bool:
    """Whether this layout's chunks get TP-independent keys: every group is
    replicated and LMCache's ``save_only_first_rank`` is not set false."""
    extra = getattr(lmcache_config, "extra_config", None) or {}  # None when unset
    if not replication(groups, tp_layout(vllm_config)[0]).single_copy:
        return False
    return extra.get("save_only_first_rank", True) not in (False, "false", "False", 0)


def check_parallelism(vllm_config: VllmConfig) -> None:
    """Refuses at startup what the connector does not serve, naming the
    setting and what is valid. Pipeline parallelism: each stage holds other
    layers, but chunk keys and the lookup (the minimum over every rank)
    assume that each rank holds one slice of every layer; not tested on
    vLLM-CPU, so refused rather than trusted."""
    pc = vllm_config.parallel_config
    # Duck-typed, as tp_layout: both are on every supported vLLM (0.23-0.32).
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise ValueError(
            f"lmcache-ascend: pipeline_parallel_size={pp} is not supported (valid: 1); use tensor "
            "parallelism (tensor_parallel_size) or data parallelism (data_parallel_size) instead"
        )
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    if dcp != 1:
        raise ValueError(
            f"lmcache-ascend: decode_context_parallel_size={dcp} is not supported (valid: 1): "
            "each rank would hold a slice of the tokens, which chunk keys do not describe"
        )


def store_stripe(groups: Sequence[SchedulerGroup], vllm_config: VllmConfig, lmcache_config: Any) -> tuple[Replication, Optional[Stripe]]:
    """This layout's replication at this TP size, and this rank's stripe
    (None: it stores every chunk). Logs the choice once per worker."""
    tp, rank = tp_layout(vllm_config)
    rep = replication(groups, tp)
    if rep.single_copy and not single_copy(groups, vllm_config, lmcache_config):
        if rank == 0:
            logger.info("lmcache-ascend: replicated cache kept per rank (extra_config save_only_first_rank=false)")
        return Replication(tp, rep.replicated_groups, (), kept_per_rank=True), None
    if tp == 1 or not rep.single_copy:
        return rep, None
    if not getattr(lmcache_config, "remote_url", None):  # as extra_config above
        if rank == 0:
            logger.info(
                "lmcache-ascend: the cache is replicated across the %d TP ranks but no backend is "
                "shared (remote_url unset): every rank stores every chunk in its own CPU cache "
                "(keys are TP-independent all the same); set remote_url to store one copy",
                tp,
            )
        return rep, None
    if rank == 0:
        logger.info(
            "lmcache-ascend: the cache is replicated across the %d TP ranks: each chunk is stored "
            "once, in the shared backend, by one rank (each rank writes 1/%d of every store); every "
            "rank loads every chunk",
            tp,
            tp,
        )
    return rep, Stripe(rank, tp)


def failed_load_vote(vllm_config: VllmConfig) -> Optional[Callable[[Sequence[str], set[str]], set[str]]]:
    """At TP > 1: a function that returns, of ``candidates`` (the requests
    of this step that both load and store, in scheduler order), those whose
    load failed on any TP rank, given this rank's ``failed``. One MAX
    all-reduce over the TP group's CPU (gloo) group, only in steps that
    load and store for one request: vLLM's own collectives run on the
    device group and are not touched. None at TP 1."""
    tp, _ = tp_layout(vllm_config)
    if tp == 1:
        return None
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group

    def vote(candidates: Sequence[str], failed: set[str]) -> set[str]:
        flags = torch.tensor([1 if r in failed else 0 for r in candidates], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return {r for r, f in zip(candidates, flags.tolist()) if f}

    return vote
