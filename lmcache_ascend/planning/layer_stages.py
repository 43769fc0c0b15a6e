"""Layer-by-layer loads: which bytes of a chunk each model layer needs, and
how far ahead of vLLM's forward they must be copied.

A chunk buffer holds each kernel group layer-major (planner.py), so the
entries of one model layer are a contiguous slice of every kernel group
that has them, and one op call per (kernel group, run of entries) copies
them. A *stage* is one model layer index (the first integer of the layer
name, vLLM's ``extract_layer_index``): every entry whose name carries that
index, in every kernel group.

vLLM calls ``wait_for_layer_load(name)`` before an attention layer reads its
KV, but not before every reader: a DSA indexer reads its cache before its
layer's MLA attention waits, and Mamba layers never wait. So the schedule
keeps one waited layer ahead: before the forward, every stage up to the
first layer vLLM waits on; at the wait of index ``i``, every stage up to the
next waited index (all of them after the last). A stage is thus in place
before any layer of its block runs, whoever reads it first. Which indices
vLLM waits on is learned from a forward (``WaitSchedule``), never assumed.

Pure: no torch, no vLLM.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from lmcache_ascend.planning.planner import TransferPlan


def model_layer_index(layer_name: str) -> Optional[int]:
    """The block index in a layer name (``model.layers.7.self_attn.attn`` ->
    7): its first integer component, or None if it has none."""
    for part in layer_name.split("."):
        if part.isdigit():
            return int(part)
    return None


@dataclass(frozen=True)
class LayerRun:
    """Entries [first, end) of kernel group ``kernel_group`` (its position in
    ``plan.kernel_groups``): one op call per chunk."""

    kernel_group: int
    first: int
    end: int


@dataclass(frozen=True)
class LayerStages:
    """The plan's KV entries by model layer index, in forward order."""

    indices: tuple[int, ...]  # ascending: the stage of position k has index indices[k]
    runs: tuple[tuple[LayerRun, ...], ...]  # per stage

    @classmethod
    def build(cls, plan: TransferPlan) -> "LayerStages":
        """Raises ValueError naming a layer whose name has no index (its
        place in the forward is unknown: load it whole instead)."""
        by_index: dict[int, list[LayerRun]] = {}
        for position, kg in enumerate(plan.kernel_groups):
            owners: list[int] = []
            for entry in kg.planes:
                name = entry[0].layer_name
                index = model_layer_index(name)
                if index is None:
                    raise ValueError(f"layer {name!r} has no layer index: its place in the forward is unknown")
                owners.append(index)
            start = 0
            for e in range(1, len(owners) + 1):
                if e == len(owners) or owners[e] != owners[start]:
                    by_index.setdefault(owners[start], []).append(LayerRun(position, start, e))
                    start = e
        indices = tuple(sorted(by_index))
        return cls(indices, tuple(tuple(by_index[i]) for i in indices))

    def __len__(self) -> int:
        return len(self.indices)

    def through(self, index: Optional[int]) -> int:
        """How many stages have a layer index <= ``index`` (None: all)."""
        if index is None:
            return len(self.indices)
        return bisect.bisect_right(self.indices, index)


@dataclass(frozen=True)
class WaitSchedule:
    """How many stages must be in place at each point of a forward, from the
    layer indices vLLM waited on in an earlier forward."""

    stages: LayerStages
    waited: tuple[int, ...]  # ascending, distinct

    @classmethod
    def learn(cls, stages: LayerStages, waited: Iterable[int]) -> Optional["WaitSchedule"]:
        """None when vLLM waited on nothing (nothing to pipeline against)."""
        seen = tuple(sorted(set(waited)))
        return cls(stages, seen) if seen else None

    def before_forward(self) -> int:
        return self.stages.through(self.waited[0])

    def at_wait(self, index: Optional[int]) -> int:
        """Stages needed when vLLM waits on a layer of ``index``: through the
        next waited index; all of them after the last, or for a layer whose
        index was not seen (nothing is known of what follows it)."""
        if index is None or index not in self.waited:
            return len(self.stages)
        k = self.waited.index(index)
        return self.stages.through(self.waited[k + 1]) if k + 1 < len(self.waited) else len(self.stages)


def group_runs(runs: Sequence[LayerRun]) -> dict[int, list[tuple[int, int]]]:
    """Runs per kernel group, adjacent ones merged (fewer op calls when
    several stages are copied at once)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for run in sorted(runs, key=lambda r: (r.kernel_group, r.first)):
        spans = out.setdefault(run.kernel_group, [])
        if spans and spans[-1][1] == run.first:
            spans[-1] = (spans[-1][0], run.end)
        else:
            spans.append((run.first, run.end))
    return out
