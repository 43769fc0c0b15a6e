"""Moves Mamba / GDN state snapshots between vLLM's state blocks and
LMCache chunk buffers (see planning/state_align.py for what a snapshot is).

A layer's state in vLLM is one block-major tensor (vLLM 0.32: a raw int8
view of each page's real bytes) or several typed views of one page (0.23 /
0.26: conv state, then SSM state). Either way block ``b`` of every element
is contiguous, and the elements in page order are the layer's state bytes:
that concatenation is what a snapshot holds per layer, so snapshots of the
two forms are byte-identical. Page padding is never read nor written.

Copies are plain tensor copies (a snapshot is a few dozen segments, each
one layer's state of one block); they work on any device, the chunk buffer
being host memory. Imports neither vLLM nor LMCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from lmcache_ascend.planning.groups import NULL_BLOCK_ID
from lmcache_ascend.planning.state_align import SnapshotLayout, SnapshotSegment


class StateLayoutError(ValueError):
    """A state tensor that does not match what vLLM's spec says it holds."""


@dataclass(frozen=True)
class _Element:
    tensor: torch.Tensor  # [num_blocks, ...], block b contiguous
    offset: int  # inside the layer's snapshot segment
    nbytes: int  # per block


def _describe(entry: Any) -> str:
    tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
    return "; ".join(f"{tuple(t.shape)} stride {tuple(t.stride())} {t.dtype}" for t in tensors)


def _elements(seg: SnapshotSegment, parts: Sequence[int], entry: Any) -> tuple[_Element, ...]:
    tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise StateLayoutError(f"state layer {seg.layer!r}: not a tensor or a list of tensors ({type(entry).__name__})")
    num_blocks = {t.shape[0] for t in tensors if t.dim() >= 1}
    if len(num_blocks) != 1 or any(t.dim() < 2 for t in tensors):
        raise StateLayoutError(f"state layer {seg.layer!r}: elements are not block-major: {_describe(entry)}")
    # Page order: views of one page sorted by where they start.
    tensors.sort(key=lambda t: t.data_ptr())
    sizes = []
    for t in tensors:
        if not t[0].is_contiguous():
            raise StateLayoutError(
                f"state layer {seg.layer!r}: a block of {tuple(t.shape)} stride {tuple(t.stride())} "
                "is not contiguous"
            )
        sizes.append(t[0].numel() * t.element_size())
    # One raw page view per layer, padded past the state: vLLM 0.27.1/0.28
    # register Mamba layers as [num_blocks, 1, 1, page_size_bytes] int8
    # (v1/worker/gpu_model_runner.py, initialize_kv_cache_tensors), where
    # page_size_bytes is the hybrid page (MambaSpec.page_size_padded) and the
    # state parts sit packed from the page's first byte, in the spec's order
    # (model_executor/layers/mamba/abstract.py, MambaBase.bind_kv_cache).
    # Only those leading bytes are state; the rest is never read or written.
    if len(sizes) == 1 and sizes[0] > seg.nbytes:
        sizes = [seg.nbytes]
    # One raw view of the whole state, or one view per state part (conv,
    # SSM) of the sizes vLLM's spec gives, in the spec's order.
    if sum(sizes) != seg.nbytes or (len(sizes) > 1 and list(sizes) != list(parts)):
        raise StateLayoutError(
            f"state layer {seg.layer!r}: per-block bytes {sizes} do not match vLLM's spec "
            f"({list(parts)}, {seg.nbytes} bytes): {_describe(entry)}"
        )
    out, offset = [], 0
    for t, n in zip(tensors, sizes):
        out.append(_Element(t, offset, n))
        offset += n
    return tuple(out)


class StateTransfer:
    """Gathers / scatters snapshot pieces for one worker's state tensors."""

    def __init__(self, layout: SnapshotLayout, kv_caches: Mapping[str, Any]) -> None:
        self.layout = layout
        parts = {g.index: tuple(p.nbytes for p in g.parts) for g in layout.groups}
        self._segments: list[tuple[SnapshotSegment, tuple[_Element, ...]]] = []
        for seg in layout.segments():
            if seg.layer not in kv_caches:
                raise StateLayoutError(f"state layer {seg.layer!r} of group {seg.group} was not registered")
            self._segments.append((seg, _elements(seg, parts[seg.group], kv_caches[seg.layer])))
        self.num_blocks = min((e[0].tensor.shape[0] for _, e in self._segments), default=0)

    @property
    def snapshot_bytes(self) -> int:
        return self.layout.snapshot_bytes

    def _check_block(self, block: int) -> None:
        if block == NULL_BLOCK_ID or not 0 < block < self.num_blocks:
            raise ValueError(f"state block {block} is the null block or out of range (num_blocks {self.num_blocks})")

    def _spans(self, piece: int) -> Iterator[tuple[int, int, int, _Element, int, int]]:
        """(piece-buffer range, element, element byte range) of ``piece``."""
        lo, hi = self.layout.piece_range(piece)
        for seg, elements in self._segments:
            for el in elements:
                a, b = seg.offset + el.offset, seg.offset + el.offset + el.nbytes
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    yield seg.group, s - lo, e - lo, el, s - a, e - a

    @staticmethod
    def _block_bytes(el: _Element, block: int) -> torch.Tensor:
        return el.tensor[block].reshape(-1).view(torch.uint8)

    def gather(self, buf: torch.Tensor, piece: int, blocks: Mapping[int, int]) -> int:
        """State of ``blocks`` (group -> block id) -> piece ``piece`` of a
        snapshot in ``buf`` (uint8, at least ``piece_bytes``). Returns bytes."""
        for b in blocks.values():
            self._check_block(b)
        lo, hi = self.layout.piece_range(piece)
        if buf.numel() < hi - lo:
            raise ValueError(f"chunk buffer of {buf.numel()} bytes cannot hold a {hi - lo}-byte state piece")
        for group, s, e, el, es, ee in self._spans(piece):
            buf[s:e].copy_(self._block_bytes(el, blocks[group])[es:ee])
        buf[hi - lo :].zero_()  # no stale bytes after the snapshot's end
        return hi - lo

    def scatter(self, buf: torch.Tensor, piece: int, targets: Sequence[Mapping[int, int]]) -> int:
        """Piece ``piece`` in ``buf`` -> every block map in ``targets``."""
        for blocks in targets:
            for b in blocks.values():
                self._check_block(b)
        lo, hi = self.layout.piece_range(piece)
        for group, s, e, el, es, ee in self._spans(piece):
            src = buf[s:e]
            for blocks in targets:
                self._block_bytes(el, blocks[group])[es:ee].copy_(src)
        return hi - lo
