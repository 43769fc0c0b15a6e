"""Per-group chunk addressing (lmcache_ascend.planning.slot_mapping).

Every result is checked against a plain-Python, per-position reference
written from the documented semantics (not from the numpy code), plus a few
hand-computed cases:

- row ``j`` of a group is the compressed position ``token // compress_ratio``
  and lives at ``block_table[j // bpr] * bpr + j % bpr``;
- a chunk buffer has a fixed geometry: ``physical_rows`` (``physical_pages``)
  entries, the last ones of the full chunk;
- a position is *needed* if some token of ``[start, end)`` maps to it and, for
  sliding groups, that token lies in the window ``[end - window, end)``;
- needed positions whose block is the null block 0 or lies past the end of
  the block table are SKIP and counted in ``missing``; positions that are
  not needed are SKIP and never counted.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lmcache_ascend.planning.groups import NULL_BLOCK_ID, SKIP, GroupKind, SchedulerGroup
from lmcache_ascend.planning.slot_mapping import (
    chunk_pages,
    chunk_rows,
    chunks_pages,
    chunks_rows,
    primary_group,
)

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE


def grp(kind=FULL, block_size=16, ratio=1, window=None, index=0) -> SchedulerGroup:
    return SchedulerGroup(
        index=index,
        kind=kind,
        spec_name="TestSpec",
        block_size=block_size,
        compress_ratio=ratio,
        sliding_window=window,
    )


# ---- independent references ---------------------------------------------


def _needed_tokens(group, start, end):
    for t in range(start, end):
        if group.kind is SLIDING and t < end - group.sliding_window:
            continue
        yield t


def _block_of(table, idx):
    return table[idx] if idx < len(table) else NULL_BLOCK_ID


def ref_rows(group, table, start, end, chunk, bpr=None):
    r = group.compress_ratio
    bpr = bpr or max(1, group.block_size // r)
    n_logical = -(-chunk // r)
    n_phys = n_logical
    if group.kind is SLIDING:
        n_phys = min(n_logical, max(1, group.sliding_window // r))
    first = start // r
    stored = range(first + n_logical - n_phys, first + n_logical)
    needed = {t // r for t in _needed_tokens(group, start, end)}
    ids, missing = [], 0
    for row in stored:
        if row not in needed:
            ids.append(SKIP)
            continue
        block = _block_of(table, row // bpr)
        if block == NULL_BLOCK_ID:
            missing += 1
            ids.append(SKIP)
        else:
            ids.append(block * bpr + row % bpr)
    return ids, missing


def ref_pages(group, table, start, end, chunk):
    bs = group.block_size
    n_logical = -(-chunk // bs)
    n_phys = n_logical
    if group.kind is SLIDING:
        n_phys = min(n_logical, -(-group.sliding_window // bs))
    first = start // bs
    stored = range(first + n_logical - n_phys, first + n_logical)
    needed = {t // bs for t in _needed_tokens(group, start, end)}
    ids, missing = [], 0
    for b in stored:
        if b not in needed:
            ids.append(SKIP)
            continue
        block = _block_of(table, b)
        if block == NULL_BLOCK_ID:
            missing += 1
            ids.append(SKIP)
        else:
            ids.append(block)
    return ids, missing


def check_rows(group, table, start, end, chunk, bpr=None):
    got = chunk_rows(group, table, start, end, chunk, rows_per_block=bpr)
    want_ids, want_missing = ref_rows(group, table, start, end, chunk, bpr)
    assert got.ids.dtype == np.int64
    assert len(got.ids) == group.physical_rows(chunk)
    assert got.ids.tolist() == want_ids, (group, start, end, chunk, bpr)
    assert got.missing == want_missing, (group, start, end, chunk, bpr)
    return got


def check_pages(group, table, start, end, chunk):
    got = chunk_pages(group, table, start, end, chunk)
    want_ids, want_missing = ref_pages(group, table, start, end, chunk)
    assert got.ids.dtype == np.int64
    assert len(got.ids) == group.physical_pages(chunk)
    assert got.ids.tolist() == want_ids, (group, start, end, chunk)
    assert got.missing == want_missing, (group, start, end, chunk)
    return got


def table_for(n_blocks, seed=0, base=100):
    rng = random.Random(seed)
    ids = list(range(base, base + 4 * n_blocks))
    rng.shuffle(ids)
    return ids[:n_blocks]


# ---- chunk_rows: hand-computed cases ------------------------------------


def test_rows_full_hand_computed():
    g = grp(FULL, block_size=4)
    got = chunk_rows(g, [7, 3, 9, 5], 8, 16, 8)
    assert got.ids.tolist() == [36, 37, 38, 39, 20, 21, 22, 23]
    assert got.missing == 0


def test_rows_compressed_hand_computed():
    # ratio 4, 16 tokens per block -> 4 rows per block; tokens [32, 64) are
    # rows 8..15 -> logical blocks 2 and 3.
    g = grp(FULL, block_size=16, ratio=4)
    got = chunk_rows(g, [7, 3, 9, 5], 32, 64, 32)
    assert got.ids.tolist() == [36, 37, 38, 39, 20, 21, 22, 23]
    assert got.missing == 0


def test_rows_sliding_hand_computed_nulls_outside_window_are_not_missing():
    # window 6, block 4, chunk 8: the chunk [8, 16) keeps rows 10..15.
    g = grp(SLIDING, block_size=4, window=6)
    got = chunk_rows(g, [0, 0, 9, 5], 8, 16, 8)
    assert got.ids.tolist() == [38, 39, 20, 21, 22, 23]
    assert got.missing == 0
    # A null block inside the window is missing (rows 10, 11).
    got = chunk_rows(g, [4, 6, 0, 5], 8, 16, 8)
    assert got.ids.tolist() == [SKIP, SKIP, 20, 21, 22, 23]
    assert got.missing == 2


# ---- chunk_rows: reference comparisons ------------------------------------


@pytest.mark.parametrize("chunk_idx", [0, 1, 3])
def test_rows_full(chunk_idx):
    g = grp(FULL, block_size=16)
    chunk = 64
    check_rows(g, table_for(20), chunk_idx * chunk, (chunk_idx + 1) * chunk, chunk)


@pytest.mark.parametrize(
    "window,block",
    [(40, 16), (64, 16), (100, 16), (200, 16), (1000, 16), (96, 64), (33, 32)],
    ids=["short-unaligned", "short-aligned", "longer", "much-longer", "huge", "96/64", "33/32"],
)
def test_rows_sliding(window, block):
    g = grp(SLIDING, block_size=block, window=window)
    chunk = 64 if block <= 64 else block
    for ci in range(4):
        start = ci * chunk
        # out-of-window blocks are null, as vLLM hands them after a hit
        n = -(-(start + chunk) // block)
        table = table_for(n, seed=ci)
        for b in range(n):
            if (b + 1) * block <= start + chunk - window:
                table[b] = NULL_BLOCK_ID
        got = check_rows(g, table, start, start + chunk, chunk)
        assert got.missing == 0
        assert len(got.ids) == min(chunk, window)


def test_rows_sliding_window_length_when_window_longer_than_chunk():
    g = grp(SLIDING, block_size=16, window=300)
    got = check_rows(g, table_for(64), 256, 512, 256)
    # window covers the whole chunk: every row of the chunk is addressed
    assert (got.ids != SKIP).all() and len(got.ids) == 256


@pytest.mark.parametrize(
    "ratio,block,chunk",
    [(4, 64, 256), (4, 16, 256), (128, 256, 256), (128, 256, 512), (128, 128, 1024)],
)
def test_rows_compressed_full(ratio, block, chunk):
    g = grp(FULL, block_size=block, ratio=ratio)
    assert g.physical_rows(chunk) == math.ceil(chunk / ratio)
    for ci in range(3):
        table = table_for(3 * chunk // block + 2, seed=ci)
        got = check_rows(g, table, ci * chunk, (ci + 1) * chunk, chunk)
        assert len(got.ids) == math.ceil(chunk / ratio)
        assert (got.ids != SKIP).all()


@pytest.mark.parametrize(
    "ratio,window,block", [(4, 128, 64), (4, 64, 16), (128, 128, 256), (128, 256, 256)]
)
def test_rows_sliding_compressed_keeps_window_over_ratio_rows(ratio, window, block):
    chunk = 512
    g = grp(SLIDING, block_size=block, ratio=ratio, window=window)
    assert g.physical_rows(chunk) == window // ratio
    for ci in range(3):
        got = check_rows(g, table_for(4 * chunk // block, seed=ci), ci * chunk, (ci + 1) * chunk, chunk)
        assert len(got.ids) == window // ratio
        assert (got.ids != SKIP).all()


def test_rows_partial_last_chunk_full():
    g = grp(FULL, block_size=16)
    # the table stops at the last block the request has (ceil(100/16) = 7)
    table = table_for(7)
    got = check_rows(g, table, 64, 100, 64)
    assert got.missing == 0
    assert (got.ids[:36] != SKIP).all() and (got.ids[36:] == SKIP).all()


def test_rows_partial_last_chunk_compressed_counts_partial_row():
    g = grp(FULL, block_size=16, ratio=4)
    got = check_rows(g, table_for(8), 64, 102, 64)
    # tokens 64..101 -> rows 16..25 (row 25 is partially covered, still written)
    assert (got.ids != SKIP).sum() == 10


def test_rows_null_and_short_tables_count_missing_only_where_needed():
    g = grp(FULL, block_size=16)
    table = table_for(8)
    table[5] = NULL_BLOCK_ID
    got = check_rows(g, table, 64, 128, 64)
    assert got.missing == 16
    got = check_rows(g, table[:6], 64, 128, 64)  # blocks 6, 7 past the table
    assert got.missing == 16 + 32
    got = check_rows(g, table[:6], 64, 90, 64)  # rows 80..89 of null block 5
    assert got.missing == 10
    # sliding: null/short only matter inside the window
    s = grp(SLIDING, block_size=16, window=24)
    short = [0, 0, 0, 0, 0, 0, 0, 11]  # window [104, 128) -> blocks 6 (null), 7
    got = check_rows(s, short, 64, 128, 64)
    assert got.missing == 8  # rows 104..111 in null block 6
    got = check_rows(s, short[:7], 64, 128, 64)
    assert got.missing == 24  # block 7 is now past the table too


def test_rows_per_block_override():
    # a plane whose block holds 8 rows while the group's block is 32 tokens
    g = grp(FULL, block_size=32)
    table = table_for(16)
    got = check_rows(g, table, 64, 128, 64, bpr=8)
    assert got.ids[0] == table[8] * 8 and got.ids[9] == table[9] * 8 + 1
    gc = grp(SLIDING, block_size=64, ratio=4, window=128)
    check_rows(gc, table_for(16), 256, 512, 256, bpr=4)


def test_rows_random_sweep_against_reference():
    rng = random.Random(1234)
    for _ in range(400):
        ratio = rng.choice([1, 1, 2, 4, 128])
        block = ratio * rng.choice([1, 2, 4, 8]) if ratio < 128 else rng.choice([128, 256])
        chunk = block * rng.choice([1, 2, 4])
        kind = rng.choice([FULL, SLIDING])
        window = None
        if kind is SLIDING:
            window = rng.choice([ratio, 3 * ratio, 5 * ratio, chunk, 2 * chunk + ratio])
        g = grp(kind, block_size=block, ratio=ratio, window=window)
        ci = rng.randrange(4)
        start = ci * chunk
        end = start + chunk  # whole chunks; partial ones are checked below
        n = rng.randrange(0, (ci + 2) * chunk // block + 1)
        table = [rng.choice([0, rng.randrange(1, 500)]) for _ in range(n)]
        check_rows(g, table, start, end, chunk)
        check_pages(g, table, start, end, chunk)
        if kind is FULL:
            pend = rng.randrange(start + 1, end + 1)
            check_rows(g, table, start, pend, chunk)
            check_pages(g, table, start, pend, chunk)


def test_many_chunks_in_one_pass_match_reference():
    """chunks_rows / chunks_pages (what loads use) give every chunk of a
    batch, whole and partial, sliding and compressed, its reference address."""
    rng = random.Random(99)
    for _ in range(150):
        ratio = rng.choice([1, 2, 4])
        block = ratio * rng.choice([1, 2, 8])
        chunk = block * rng.choice([1, 2, 4])
        kind = rng.choice([FULL, SLIDING])
        window = rng.choice([ratio, 3 * ratio, chunk, 2 * chunk + ratio]) if kind is SLIDING else None
        g = grp(kind, block_size=block, ratio=ratio, window=window)
        n = rng.randrange(0, 12 * chunk // block)
        table = [rng.choice([0, rng.randrange(1, 500)]) for _ in range(n)]
        idx = sorted(rng.sample(range(10), rng.randrange(1, 6)))
        starts = [i * chunk for i in idx]
        ends = [s + (rng.randrange(1, chunk + 1) if kind is FULL else chunk) for s in starts]
        rows = chunks_rows(g, table, starts, ends, chunk)
        pages = chunks_pages(g, table, starts, ends, chunk)
        assert rows.ids.shape == (len(starts), g.physical_rows(chunk))
        assert pages.ids.shape == (len(starts), g.physical_pages(chunk))
        for k, (s, e) in enumerate(zip(starts, ends)):
            want_ids, want_missing = ref_rows(g, table, s, e, chunk)
            assert rows.ids[k].tolist() == want_ids and rows.missing[k] == want_missing, (g, s, e)
            want_ids, want_missing = ref_pages(g, table, s, e, chunk)
            assert pages.ids[k].tolist() == want_ids and pages.missing[k] == want_missing, (g, s, e)
    with pytest.raises(ValueError, match="chunk start 100"):
        chunks_pages(grp(FULL, 16), [1, 2], [0, 100], [16, 116], 16)


def _unaddressed_needed_rows(group, table, start, end, chunk):
    """Needed rows (window ending at ``end``) neither addressed nor counted
    in ``missing``: a store would persist the chunk without them."""
    got = chunk_rows(group, table, start, end, chunk)
    r, bpr = group.compress_ratio, group.rows_per_block
    addressed = {int(s) for s in got.ids if s != SKIP}
    needed = sorted({t // r for t in _needed_tokens(group, start, end)})
    lost = [j for j in needed if table[j // bpr] * bpr + j % bpr not in addressed]
    return lost, got.missing


@pytest.mark.parametrize("start,end", [(0, 100), (256, 356), (256, 500)])
def test_rows_partial_sliding_chunk_window_is_addressed_or_missing(start, end):
    """Docstring: sliding groups keep the rows of the window that ends at
    ``end``. For a partial chunk that window lies before the chunk's last
    ``physical_rows`` rows; each of its rows must be addressed, or counted in
    ``missing`` so the store is refused."""
    g = grp(SLIDING, block_size=16, window=64)
    table = table_for(32)
    lost, missing = _unaddressed_needed_rows(g, table, start, end, 256)
    assert not lost or missing >= len(lost), (
        f"rows {lost[0]}..{lost[-1]} of the window ending at {end} are neither "
        f"addressed nor missing (missing={missing})"
    )


def test_pages_partial_sliding_chunk_window_is_addressed_or_missing():
    g = grp(SLIDING, block_size=16, window=64)
    table = table_for(32)
    got = chunk_pages(g, table, 256, 356, 256)
    needed = sorted({t // 16 for t in _needed_tokens(g, 256, 356)})  # blocks 18..22
    addressed = {int(b) for b in got.ids if b != SKIP}
    lost = [b for b in needed if table[b] not in addressed]
    assert not lost or got.missing >= len(lost), (
        f"window blocks {lost} of the chunk ending at 356 are neither addressed "
        f"nor missing (ids={got.ids.tolist()}, missing={got.missing})"
    )


# ---- chunk_pages ------------------------------------------------------------


def test_pages_full():
    g = grp(FULL, block_size=64)
    table = table_for(12)
    got = check_pages(g, table, 256, 512, 256)
    assert got.ids.tolist() == table[4:8] and got.missing == 0
    got = check_pages(g, table, 512, 612, 256)  # partial: blocks 8, 9 needed
    assert got.ids.tolist() == table[8:10] + [SKIP, SKIP] and got.missing == 0


@pytest.mark.parametrize("window,pages", [(96, 2), (64, 1), (100, 2), (130, 3), (1000, 4)])
def test_pages_sliding(window, pages):
    g = grp(SLIDING, block_size=64, window=window)
    assert g.physical_pages(256) == pages
    for ci in range(4):
        table = table_for(4 * (ci + 1), seed=ci)
        got = check_pages(g, table, ci * 256, (ci + 1) * 256, 256)
        assert got.ids.tolist() == table[4 * (ci + 1) - pages :]


def test_pages_design_trap_1280_token_hit():
    """DESIGN 2: after a 1280-token hit (window 96, block 64) vLLM hands a
    sliding group 18 null blocks out of 20. Only blocks 18 and 19 intersect
    the window [1184, 1280); the earlier chunks cannot be stored."""
    g = grp(SLIDING, block_size=64, window=96)
    table = [NULL_BLOCK_ID] * 18 + [501, 502]
    got = check_pages(g, table, 1024, 1280, 256)
    assert got.ids.tolist() == [501, 502] and got.missing == 0
    got = check_pages(g, table, 768, 1024, 256)
    assert got.ids.tolist() == [SKIP, SKIP] and got.missing == 2
    # rows view of the same group: only the window's 96 rows are addressed
    got = check_rows(g, table, 1024, 1280, 256)
    assert len(got.ids) == 96 and got.missing == 0
    assert got.ids.tolist() == [501 * 64 + i for i in range(32, 64)] + [502 * 64 + i for i in range(64)]


# ---- bad ranges ---------------------------------------------------------------


@pytest.mark.parametrize(
    "start,end,words",
    [
        (-256, 0, ["-256", "0", "256"]),
        (256, 256, ["256"]),
        (256, 100, ["256", "100"]),
        (0, 300, ["0", "300", "256"]),
        (100, 200, ["100", "256"]),
    ],
)
@pytest.mark.parametrize("fn", [chunk_rows, chunk_pages], ids=["rows", "pages"])
def test_bad_ranges_raise_naming_values(fn, start, end, words):
    g = grp(FULL, block_size=16, index=3)
    with pytest.raises(ValueError) as exc:
        fn(g, table_for(64), start, end, 256)
    msg = str(exc.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "group 3" in msg


# ---- primary_group --------------------------------------------------------------


def test_primary_group_picks_most_tokens():
    gs = [grp(FULL, 16, index=0), grp(FULL, 64, index=1), grp(SLIDING, 128, window=64, index=2)]
    assert primary_group(gs, [[1] * 10, [1] * 3, [1] * 1]) == 1  # 160, 192, 128
    assert primary_group(gs, [[1] * 20, [1] * 3, [1] * 1]) == 0  # 320 wins
    assert primary_group(gs, [[1] * 8, [1] * 2, [1] * 1]) == 0  # tie 128: lowest index


def test_primary_group_groups_without_blocks_count_zero():
    gs = [grp(FULL, 4096, index=0), grp(FULL, 16, index=1)]
    assert primary_group(gs, [[], [5]]) == 1
    assert primary_group(gs, [[], []]) == 0
    # null blocks are still blocks of the table (sliding groups after a hit)
    gs2 = [grp(SLIDING, 64, window=96, index=0), grp(STATE, 64, index=1)]
    assert primary_group(gs2, [[0] * 18 + [4, 5], [9]]) == 0
