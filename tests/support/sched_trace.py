"""Reads the forward steps ``sitecustomize.py`` recorded in an engine run,
and says whether two runs computed alike.

A step is the batch vLLM ran in one forward: ``(request, computed,
scheduled)`` for each request, in batch order (``computed``: tokens already
in the KV cache before the step, from any cache or earlier steps), plus the
torch thread count. Two runs with equal steps ran the same kernels on the
same shapes, so at equal KV bytes their outputs are bit-identical on any
CPU; where the steps differ, only the bf16 noise of that difference may
separate them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Step:
    threads: int
    batch: tuple[tuple[str, int, int], ...]  # (request, computed, scheduled)


def read(directory: Path) -> list[Step]:
    """The steps of one engine (its first worker: with tensor parallelism
    every worker runs the same steps)."""
    files = sorted(Path(directory).glob("sched-*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    steps = []
    for line in files[0].read_text().splitlines():
        rec = json.loads(line)
        steps.append(Step(int(rec["threads"]), tuple(tuple(x) for x in rec["batch"])))
    return steps


def first_differing(a: list[Step], b: list[Step]) -> int:
    """Index of the first step the two runs ran differently; the shorter
    run's length where one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_difference(a: list[Step], b: list[Step]) -> str | None:
    """None when both runs ran the same steps; else the first that differs,
    in words (for a test's message)."""
    if not a or not b:
        return f"no steps recorded ({len(a)} / {len(b)})"
    i = first_differing(a, b)
    if i < min(len(a), len(b)):
        return f"step {i}: {a[i]} != {b[i]}"
    if len(a) != len(b):
        return f"{len(a)} steps != {len(b)} steps"
    return None


def of_requests(steps: list[Step], requests: range, from_token: int = 0) -> list[Step]:
    """The steps as far as ``requests`` (vLLM's request numbers, in
    submission order) took part, from token ``from_token`` of each on: the
    part of two runs that must match where one run loaded a longer prefix
    than the other."""
    wanted = {str(r) for r in requests}
    out = []
    for step in steps:
        batch = tuple(x for x in step.batch if x[0] in wanted and x[1] >= from_token)
        if batch:
            out.append(Step(step.threads, batch))
    return out


def tokens_before(steps: list[Step], request: int, prompt_len: int, upto: int) -> int:
    """How many output tokens of ``request`` the first ``upto`` steps of a
    run produced (where two runs' steps first differ, the tokens before it
    were computed alike). An entry (request, computed, scheduled) emits the
    next token when it reaches the end of what the request holds (prompt
    and outputs so far); a recomputation after a preemption emits none
    until it catches up."""
    n = 0
    for step in steps[:upto]:
        for req, computed, scheduled in step.batch:
            if req == str(request) and computed + scheduled >= prompt_len + n:
                n += 1
    return n
