"""vLLM's per-step ``SchedulerOutput``, normalized into our ``StepView``:
the requests scheduled this step (new, cached or resumed, their block ids
and token counts) and those finished or preempted.

Kept apart from the startup readers (vllm_specs, vllm_kv_layout,
vllm_engine_config): this runs on every step of the scheduler half
(``build_connector_meta``), and scheduler.py types its input with
``StepView`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from vllm.v1.core.sched.output import SchedulerOutput


# vLLM's per-group block ids as its SchedulerOutput holds them (a tuple of
# lists on 0.23-0.32).
def block_ids_of(block_ids: Iterable[Iterable[int]]) -> tuple[list[int], ...]:
    """Normalize vLLM's per-group block ids (tuple of lists) to fresh lists."""
    return tuple(list(ids) for ids in block_ids)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in this step, normalized from SchedulerOutput."""

    req_id: str
    is_new: bool  # first time scheduled (NewRequestData)
    resumed: bool  # rescheduled after preemption: block ids replace, not append
    block_ids: Optional[tuple[list[int], ...]]  # new/resumed: all; else the appended ones
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


@dataclass(frozen=True)
class StepView:
    scheduled: tuple[ScheduledRequest, ...]
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]


def step_view(output: SchedulerOutput) -> StepView:
    sched: list[ScheduledRequest] = []
    counts = output.num_scheduled_tokens
    for new in output.scheduled_new_reqs:
        sched.append(
            ScheduledRequest(
                req_id=new.req_id,
                is_new=True,
                resumed=False,
                block_ids=block_ids_of(new.block_ids),
                num_computed_tokens=int(new.num_computed_tokens),
                num_scheduled_tokens=int(counts.get(new.req_id, 0)),
            )
        )
    cached = output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        sched.append(
            ScheduledRequest(
                req_id=req_id,
                is_new=False,
                resumed=req_id in cached.resumed_req_ids,
                block_ids=None if new_ids is None else block_ids_of(new_ids),
                num_computed_tokens=int(cached.num_computed_tokens[i]),
                num_scheduled_tokens=int(counts.get(req_id, 0)),
            )
        )
    return StepView(
        scheduled=tuple(sched),
        finished_req_ids=frozenset(output.finished_req_ids),
        preempted_req_ids=frozenset(output.preempted_req_ids or ()),
    )
