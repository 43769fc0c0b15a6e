# SPDX-License-Identifier: Apache-2.0
"""Independent torch-indexing reference for LMCache token-row formats.

It builds each paged layer as a logical strided view (as_strided over a flat
pool, so padded blocks are real padding bytes) and moves token rows with
advanced indexing.  It shares no code with the native addressing header.
"""

from __future__ import annotations

import torch

# EngineKVFormat values.
TWO_NB_BS_NH_HS = 1
NB_TWO_BS_NH_HS = 2
NB_BS_HS = 3  # MLA
TWO_NB_NH_BS_HS = 6
NB_TWO_NH_BS_HS = 7
HND = (TWO_NB_NH_BS_HS, NB_TWO_NH_BS_HS)
TWO_MAJOR = (TWO_NB_BS_NH_HS, TWO_NB_NH_BS_HS)


def num_kv(fmt: int) -> int:
    return 1 if fmt == NB_BS_HS else 2


def tight_block_elems(fmt: int, bs: int, nh: int, hs: int) -> int:
    half = bs * nh * hs
    return 2 * half if fmt in (NB_TWO_BS_NH_HS, NB_TWO_NH_BS_HS) else half


def pool_elems(fmt: int, nb: int, bs: int, nh: int, hs: int, stride: int) -> int:
    s = stride or tight_block_elems(fmt, bs, nh, hs)
    return (2 * nb * s) if fmt in TWO_MAJOR else nb * s


def layer_view(pool: torch.Tensor, fmt: int, nb: int, bs: int, nh: int, hs: int, stride: int):
    """Logical paged layer over a flat pool; `stride` = elems between blocks."""
    s = stride or tight_block_elems(fmt, bs, nh, hs)
    if fmt == TWO_NB_BS_NH_HS:
        return pool.as_strided((2, nb, bs, nh, hs), (nb * s, s, nh * hs, hs, 1))
    if fmt == NB_TWO_BS_NH_HS:
        return pool.as_strided((nb, 2, bs, nh, hs), (s, bs * nh * hs, nh * hs, hs, 1))
    if fmt == NB_BS_HS:
        return pool.as_strided((nb, bs, hs), (s, hs, 1))
    if fmt == TWO_NB_NH_BS_HS:
        return pool.as_strided((2, nb, nh, bs, hs), (nb * s, s, bs * hs, hs, 1))
    if fmt == NB_TWO_NH_BS_HS:
        return pool.as_strided((nb, 2, nh, bs, hs), (s, nh * bs * hs, bs * hs, hs, 1))
    raise ValueError(fmt)


def _rows(view: torch.Tensor, fmt: int, kv: int, b: torch.Tensor, o: torch.Tensor):
    """Index expression selecting token rows -> ([n, ...] view-index tuple)."""
    if fmt == TWO_NB_BS_NH_HS:
        return (kv, b, o)
    if fmt == NB_TWO_BS_NH_HS:
        return (b, kv, o)
    if fmt == NB_BS_HS:
        return (b, o)
    if fmt == TWO_NB_NH_BS_HS:
        return (kv, b, slice(None), o)
    return (b, kv, slice(None), o)


def transfer(
    chunk_rows,  # callable (kv, layer) -> [T, H] tensor view of the chunk
    views: list[torch.Tensor],
    slots: torch.Tensor,
    fmt: int,
    bs: int,
    d2h: bool,
    skip: int = 0,
) -> None:
    """Reference multi-layer token-row transfer (in place)."""
    t = torch.arange(slots.numel())
    sel = (slots >= 0) & (t >= skip)
    tok, s = t[sel], slots[sel]
    b, o = s // bs, s % bs
    for layer, view in enumerate(views):
        for kv in range(num_kv(fmt)):
            rows = chunk_rows(kv, layer)
            idx = _rows(view, fmt, kv, b, o)
            if d2h:
                rows[tok] = view[idx].reshape(tok.numel(), rows.shape[-1])
            else:
                shape = view[idx].shape
                view[idx] = rows[tok].reshape(shape)
