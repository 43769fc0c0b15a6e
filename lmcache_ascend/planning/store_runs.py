"""Which token ranges of a request's store the worker hands to LMCache.

A store covers ``[start, end)`` of a request's tokens, cut into chunks of
``chunk_size`` tokens from ``start`` (the last one may be shorter: it ends
at ``end``). A chunk is stored only if every stored group has real blocks
for it (the worker asks ``ChunkTransfer.incomplete_groups``); the others
split the store into runs of consecutive complete chunks, one LMCache store
call per run (its per-call cost is paid once, not per chunk). With a
replicated cache in a shared backend, each rank stores only its stripe of
each run (``integration/vllm/parallel.py``'s ``Stripe``).

Pure: integers in, integers out; no vLLM, LMCache or torch.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

# [start, end) in tokens of the request.
Run = tuple[int, int]


class StripePart(Protocol):
    """This rank's share of a store (``parallel.Stripe``)."""

    def part(self, first: int, k: int) -> tuple[int, int]:
        """This rank's chunks ``[j0, j1)`` of a ``k``-chunk store beginning at
        chunk index ``first`` (j0 == j1: none)."""
        ...


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def chunk_starts(start: int, end: int, chunk_size: int) -> range:
    """The first token of each chunk of the store ``[start, end)``."""
    _check_chunk_size(chunk_size)
    return range(start, end, chunk_size)


def complete_runs(start: int, end: int, chunk_size: int, complete: Sequence[bool]) -> list[Run]:
    """Maximal runs of consecutive complete chunks of the store ``[start, end)``.

    ``complete[i]`` says whether chunk ``i`` (from ``start + i * chunk_size``)
    may be stored. A run ends where the next incomplete chunk begins, or at
    ``end`` for the last one (so a short last chunk is kept whole).
    """
    starts = chunk_starts(start, end, chunk_size)
    if len(complete) != len(starts):
        raise ValueError(
            f"{len(complete)} completeness flags for {len(starts)} chunks of [{start}, {end}) "
            f"at chunk_size {chunk_size}"
        )
    runs: list[Run] = []
    run_start: Optional[int] = None
    for chunk_start, ok in zip(starts, complete):
        if not ok:
            if run_start is not None:
                runs.append((run_start, chunk_start))
                run_start = None
        elif run_start is None:
            run_start = chunk_start
    if run_start is not None:
        runs.append((run_start, end))
    return runs


def stripe_runs(runs: Sequence[Run], chunk_size: int, stripe: Optional[StripePart]) -> list[Run]:
    """The part of each run this rank stores: all of it without a stripe,
    else its contiguous share (another rank stores the rest under the same
    keys). The stripe is given the run's first chunk index (``start //
    chunk_size``) and its chunk count; its share is cut at chunk boundaries
    counted from the run's start."""
    _check_chunk_size(chunk_size)
    if stripe is None:
        return list(runs)
    out: list[Run] = []
    for start, end in runs:
        first, k = start // chunk_size, -(-(end - start) // chunk_size)
        j0, j1 = stripe.part(first, k)
        if j1 > j0:
            out.append((start + j0 * chunk_size, min(end, start + j1 * chunk_size)))
    return out
