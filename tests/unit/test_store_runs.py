"""Which token ranges of a store the worker hands to LMCache
(planning/store_runs.py), against hand-computed runs."""

from __future__ import annotations

import pytest

from lmcache_ascend.planning.store_runs import chunk_starts, complete_runs, stripe_runs

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

T, F = True, False


def test_chunk_starts_cut_from_the_store_start():
    assert list(chunk_starts(0, 512, 128)) == [0, 128, 256, 384]
    assert list(chunk_starts(100, 400, 128)) == [100, 228, 356]  # last one short: [356, 400)
    assert list(chunk_starts(256, 256, 128)) == []


@pytest.mark.parametrize(
    "start,end,flags,runs",
    [
        # Every chunk complete: one run, one LMCache call.
        (0, 512, [T, T, T, T], [(0, 512)]),
        # Chunk [256, 384) incomplete splits the store; the short last chunk
        # [512, 600) is kept whole, so the second run ends at the store's end.
        (0, 600, [T, T, F, T, T], [(0, 256), (384, 600)]),
        # Incomplete at both ends: chunks start at 256, 384, 512.
        (256, 640, [F, T, F], [(384, 512)]),
        # Not chunk-aligned: chunks start at 100, 228, 356.
        (100, 400, [F, T, T], [(228, 400)]),
        # Alternating: every complete chunk is a run of its own.
        (0, 640, [T, F, T, F, T], [(0, 128), (256, 384), (512, 640)]),
        (0, 384, [F, F, F], []),
        (128, 128, [], []),
    ],
)
def test_complete_runs(start, end, flags, runs):
    assert complete_runs(start, end, 128, flags) == runs


def test_complete_runs_needs_one_flag_per_chunk():
    with pytest.raises(ValueError, match="2 completeness flags for 3 chunks of \\[0, 300\\)"):
        complete_runs(0, 300, 128, [T, T])


@pytest.mark.parametrize("chunk_size", [0, -128])
def test_chunk_size_must_be_positive(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        complete_runs(0, 256, chunk_size, [T, T])
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        stripe_runs([(0, 256)], chunk_size, None)


class _Part:
    """A stripe answering from a table keyed by (first chunk, chunk count),
    recording what it was asked."""

    def __init__(self, table: dict[tuple[int, int], tuple[int, int]]) -> None:
        self.table = table
        self.asked: list[tuple[int, int]] = []

    def part(self, first: int, k: int) -> tuple[int, int]:
        self.asked.append((first, k))
        return self.table[(first, k)]


def test_without_a_stripe_every_run_is_stored_whole():
    runs = [(0, 384), (512, 600)]
    assert stripe_runs(runs, 128, None) == runs


def test_stripe_is_asked_by_chunk_index_and_count_and_its_part_is_cut_at_chunk_boundaries():
    stripe = _Part({
        (0, 3): (1, 3),  # [0, 384): chunks 1-2 -> [128, 384)
        (4, 2): (0, 0),  # [512, 768): nothing for this rank
        (7, 3): (2, 3),  # [896, 1200): 2.4 chunks, the short last one -> [1152, 1200)
    })
    runs = [(0, 384), (512, 768), (896, 1200)]
    assert stripe_runs(runs, 128, stripe) == [(128, 384), (1152, 1200)]
    assert stripe.asked == [(0, 3), (4, 2), (7, 3)]


def test_stripe_of_an_unaligned_run_counts_chunks_from_the_run_start():
    # [100, 400) at 128: first chunk index 100 // 128 = 0, ceil(300 / 128) = 3
    # chunks starting at 100, 228, 356; part (0, 2) -> [100, 356).
    stripe = _Part({(0, 3): (0, 2)})
    assert stripe_runs([(100, 400)], 128, stripe) == [(100, 356)]


def test_two_ranks_of_the_integration_stripe_cover_each_run_exactly_once():
    """The vLLM integration's ``Stripe`` fits ``StripePart``: ranks 0 and 1
    of 2 share each run without overlap (same cases as test_replication)."""
    from lmcache_ascend.integration.vllm.parallel import Stripe

    runs = [(0, 384), (512, 768)]
    rank0 = stripe_runs(runs, 128, Stripe(0, 2))
    rank1 = stripe_runs(runs, 128, Stripe(1, 2))
    # 3 chunks from chunk 0: rank 0 writes 0-1, rank 1 writes 2; 2 chunks from
    # chunk 4 (even): rank 0 writes chunk 4, rank 1 chunk 5.
    assert rank0 == [(0, 256), (512, 640)]
    assert rank1 == [(256, 384), (640, 768)]
