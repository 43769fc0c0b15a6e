"""Exact prefix hits for Mamba / GDN hybrids under vLLM's "align" cache mode.

What vLLM does in align mode (0.23, 0.26, 0.32 read in their source; run on
0.26, 0.27.1, 0.29, 0.30 and 0.32: tests/integration/test_mamba_hits.py):

* A Mamba group has the attention block size B. The model keeps one
  *running* state block per request, at block index ``cdiv(end, B) - 1``;
  a scheduler step that ends at a position P with ``P % B == 0`` leaves the
  state after P tokens in block ``P / B - 1`` (valid in that step's
  ``wait_for_save``). A position that was not a step end has no state
  anywhere, for vLLM's own prefix cache as well.
* On an external hit of N tokens vLLM hands the request a "hit" block at
  index ``N / B - 1`` and a running block at ``cdiv(N + S, B) - 1`` (S: the
  tokens scheduled in that step), and copies hit -> running *before* a
  synchronous connector's ``start_load_kv``. A load must therefore write the
  state into both blocks: the running one for this request, the hit one for
  vLLM's own prefix cache, which has already registered it under the hash
  of the first N tokens.

So the connector stores, at every chunk boundary P that was a step end, a
*state snapshot*: the real state bytes (no page padding) of block P/B-1 of
every Mamba group, and a hit ends at a boundary whose snapshot is stored.
A snapshot lives in LMCache under the token sequence ``tokens[:P] +
marks``: the marks are ``pieces`` chunks of negative token ids (no real
token is negative) carrying the snapshot layout's fingerprint, so one
LMCache lookup of that sequence says whether the KV chunks of [0, P) *and*
the state at P are all stored, and one retrieve loads both.

This module decides whether such hits are exact for a configuration
(:func:`decide`, one reason and the setting that enables them when not) and
describes the snapshot (:class:`SnapshotLayout`). Pure: imports neither
vLLM, LMCache nor the compiled ops; ``vllm_engine_config.state_align_facts``
reads the facts from vLLM.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup

# First mark token of a snapshot key; the rest follow from the layout. Any
# negative id cannot be a real token, so a snapshot key never equals a
# prompt's chunk key.
MARK_MAGIC = -0x5354  # "ST"
MARK_FILL = -2


@dataclass(frozen=True)
class MambaGroupFacts:
    """One vLLM ``MambaSpec`` group as the gate and the snapshot need it."""

    index: int
    block_size: int
    mode: str  # vLLM's mamba_cache_mode on the spec: "align", "none", "all"
    speculative_blocks: int
    checkpoint_blocks: int  # 0.32 prefill checkpoint blocks (Mamba2 / KDA)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    dtype_sizes: tuple[int, ...]
    layer_names: tuple[str, ...]

    @property
    def layer_bytes(self) -> int:
        """Real state bytes of one layer's block (no page padding)."""
        return sum(math.prod(s) * d for s, d in zip(self.shapes, self.dtype_sizes))


@dataclass(frozen=True)
class AttentionGroupFacts:
    index: int
    block_size: int
    page_bytes: int  # one layer's block
    num_layers: int


@dataclass(frozen=True)
class StateAlignFacts:
    """What vLLM's configs say about Mamba state, read alike in both halves
    (from the KV cache config, never from ``cache_config.block_size``: vLLM
    0.32's scheduler keeps a copy taken before the hybrid block size was
    resolved)."""

    mamba: tuple[MambaGroupFacts, ...]
    attention: tuple[AttentionGroupFacts, ...]
    prefix_caching: bool
    speculative_tokens: int  # speculative_config.num_speculative_tokens, 0 if off
    prefix_match_unit: Optional[int]  # 0.26+: hash granularity finer than a block
    hash_block_size: Optional[int]  # 0.32: the KV cache config's hash block size
    # Why vLLM itself cannot copy state between blocks on this platform
    # (vLLM 0.23's CPU backend has no replacement for the Triton copy align
    # mode runs), or None.
    state_copy_missing: Optional[str]
    # vLLM's scheduler can keep blocks free when it admits a request (its
    # ``watermark``, 0.26+). A synchronous external hit makes vLLM take one
    # block per Mamba group that its admission check does not count (the
    # "hit" block, MambaManager.get_num_blocks_to_allocate caps new blocks at
    # the running one): without that headroom a full KV cache stops vLLM
    # ("Cannot get 1 free blocks from the pool").
    admission_headroom: bool = True


@dataclass(frozen=True)
class StateGate:
    """Whether state hits are on, and if not why and what turns them on."""

    enabled: bool
    groups: tuple[int, ...]  # the Mamba groups
    block_size: int  # B (0 when there is none)
    reason: str = ""
    setting: str = ""

    def refusal(self) -> str:
        return (
            f"lmcache-ascend: external cache hits are refused for this model: its Mamba/GDN "
            f"state group(s) {list(self.groups)} cannot be restored exactly because {self.reason}; "
            f"{self.setting}. Nothing is stored either (chunks without that state could serve no hit). "
            f"Outputs stay identical to a no-cache run."
        )


_ALIGN = "--mamba-cache-mode align with prefix caching on (vLLM's default for this model when prefix caching is on)"


def decide(
    facts: StateAlignFacts, groups: Sequence[SchedulerGroup], chunk_size: int, skipped: Sequence[int] = ()
) -> Optional[StateGate]:
    """The gate for ``facts``; None when the model has no Mamba group.

    ``skipped``: groups left out of chunks (state_skip.skipped_groups); a
    Mamba group the user skipped is not restored, so the gate stays shut."""
    if not facts.mamba:
        return None
    ids = tuple(m.index for m in facts.mamba)
    block = facts.mamba[0].block_size

    def refuse(reason: str, setting: str) -> StateGate:
        return StateGate(False, ids, block, reason, setting)

    if facts.state_copy_missing:
        return refuse(facts.state_copy_missing, "use vLLM >= 0.26 (vLLM-Ascend 0.26.0rc1) on this platform")
    if not facts.admission_headroom:
        return refuse(
            "this vLLM's scheduler admits an external hit without counting the Mamba blocks it "
            "takes and cannot keep blocks free for them (no scheduler watermark)",
            "use vLLM >= 0.26 (vLLM-Ascend 0.26.0rc1)",
        )
    modes = sorted({m.mode for m in facts.mamba})
    if modes != ["align"]:
        mode = "/".join(modes)
        why = (
            "it keeps only the latest state of each request"
            if mode == "none"
            else "this connector restores only align mode's per-boundary states"
        )
        return refuse(f"vLLM's Mamba cache mode is '{mode}' ({why})", f"start vLLM with {_ALIGN}")
    if not facts.prefix_caching:
        return refuse("vLLM's prefix caching is off (align mode keeps no state then)", "start vLLM with --enable-prefix-caching")
    if facts.speculative_tokens > 0 or any(m.speculative_blocks for m in facts.mamba):
        return refuse(
            "speculative decoding is on (the state at a boundary then depends on tokens the "
            "worker accepted, which the connector cannot see)",
            "turn speculative decoding off (no speculative_config)",
        )
    if any(m.checkpoint_blocks for m in facts.mamba):
        return refuse(
            "its layers use vLLM's prefill checkpoint blocks (Mamba2 / KDA), which this connector does not read",
            "no setting enables them for this model yet",
        )
    if not all(m.shapes and len(m.shapes) == len(m.dtype_sizes) for m in facts.mamba):
        return refuse("its state layout (shapes and dtypes) is not described by vLLM", "no setting enables them")
    sizes = {m.block_size for m in facts.mamba} | {a.block_size for a in facts.attention}
    if len(sizes) != 1:
        return refuse(
            f"its groups use different block sizes {sorted(sizes)} (align mode needs one)",
            "no setting enables them for this layout",
        )
    if facts.prefix_match_unit is not None and facts.prefix_match_unit != block:
        return refuse(
            f"prefix_match_unit {facts.prefix_match_unit} is not the block size {block} "
            "(vLLM then hits inside a block)",
            "unset --prefix-match-unit",
        )
    if facts.hash_block_size is not None and facts.hash_block_size != block:
        return refuse(
            f"vLLM hashes every {facts.hash_block_size} tokens, not every block of {block}",
            "unset --prefix-match-unit",
        )
    if any(i in skipped for i in ids):
        return refuse("the state group is skipped by ascend_skip_state_* settings", "remove it from those settings")
    by_index = {g.index: g for g in groups}
    if not any(by_index[a.index].kind is GroupKind.FULL and a.num_layers for a in facts.attention if a.index in by_index):
        return refuse("it has no full-attention group to carry the chunks", "no setting enables them")
    if chunk_size % block:
        return refuse(
            f"chunk_size {chunk_size} is not a multiple of the Mamba block size {block}",
            f"leave chunk_size unset (it then equals the block size) or use a multiple of {block}",
        )
    return StateGate(True, ids, block)


@dataclass(frozen=True)
class StatePart:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class StateGroupLayout:
    index: int
    layers: tuple[str, ...]
    parts: tuple[StatePart, ...]  # per layer, in the page's byte order

    @property
    def layer_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class SnapshotSegment:
    """One layer's state bytes inside a snapshot."""

    group: int
    layer: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SnapshotLayout:
    """Byte layout of one state snapshot: every Mamba group in group order,
    every layer of a group in its order, each layer's real state bytes (the
    parts of its page, in order). Stored as ``pieces`` LMCache objects of at
    most ``piece_bytes`` each."""

    groups: tuple[StateGroupLayout, ...]
    chunk_size: int
    pieces: int
    piece_bytes: int

    @property
    def snapshot_bytes(self) -> int:
        return sum(g.layer_bytes * len(g.layers) for g in self.groups)

    @property
    def marks_tokens(self) -> int:
        return self.pieces * self.chunk_size

    @property
    def fingerprint(self) -> str:
        """Hash of the byte layout (shapes, dtypes, order, pieces): snapshots
        of another layout never share a key."""
        parts: list[tuple[object, ...]] = [
            (g.index, len(g.layers), tuple((p.shape, p.dtype) for p in g.parts)) for g in self.groups
        ]
        parts.append((self.chunk_size, self.pieces, self.piece_bytes))
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    def marks(self) -> tuple[int, ...]:
        words = [int(self.fingerprint[i : i + 4], 16) for i in range(0, 16, 4)]
        head = [MARK_MAGIC] + [-(w + 16) for w in words] + [-(self.pieces + 16)]
        return tuple(head + [MARK_FILL] * (self.marks_tokens - len(head)))

    def segments(self) -> tuple[SnapshotSegment, ...]:
        out, offset = [], 0
        for g in self.groups:
            for layer in g.layers:
                out.append(SnapshotSegment(g.index, layer, offset, g.layer_bytes))
                offset += g.layer_bytes
        return tuple(out)

    def piece_range(self, piece: int) -> tuple[int, int]:
        lo = piece * self.piece_bytes
        return lo, min(lo + self.piece_bytes, self.snapshot_bytes)

    def describe(self) -> str:
        layers = sum(len(g.layers) for g in self.groups)
        per = sorted({g.layer_bytes for g in self.groups})
        return (
            f"{self.snapshot_bytes} bytes per snapshot ({layers} layer(s) of "
            f"{'/'.join(str(b) for b in per)} bytes, page padding not stored), "
            f"{self.pieces} LMCache object(s) of <= {self.piece_bytes} bytes, at each chunk "
            f"boundary where a vLLM step ended"
        )


def chunk_bytes_lower_bound(facts: StateAlignFacts, groups: Sequence[SchedulerGroup], chunk_size: int,
                            skipped: Sequence[int] = ()) -> int:
    """Bytes every chunk buffer holds at least: the full-attention layers'
    pages of one chunk. Both halves can compute it from the KV cache config,
    so they derive the same number of snapshot pieces; the worker checks a
    piece fits its real chunk buffer."""
    by_index = {g.index: g for g in groups}
    total = 0
    for a in facts.attention:
        g = by_index.get(a.index)
        if g is None or g.kind is not GroupKind.FULL or not g.transferable or a.index in skipped:
            continue
        total += a.num_layers * a.page_bytes * (chunk_size // a.block_size)
    return total


def snapshot_layout(facts: StateAlignFacts, groups: Sequence[SchedulerGroup], chunk_size: int,
                    skipped: Sequence[int] = ()) -> SnapshotLayout:
    state_groups = tuple(
        StateGroupLayout(
            m.index,
            m.layer_names,
            tuple(StatePart(tuple(s), d, math.prod(s) * n) for s, d, n in zip(m.shapes, m.dtypes, m.dtype_sizes)),
        )
        for m in facts.mamba
    )
    total = sum(g.layer_bytes * len(g.layers) for g in state_groups)
    bound = chunk_bytes_lower_bound(facts, groups, chunk_size, skipped)
    if bound <= 0:
        raise ValueError("no full-attention chunk bytes to size state snapshot pieces by")
    pieces = max(1, -(-total // bound))
    return SnapshotLayout(state_groups, chunk_size, pieces, -(-total // pieces))


# ---- boundary arithmetic (block indices in a Mamba group's block table) ----


def hit_block_index(position: int, block_size: int) -> int:
    """Block holding the state after ``position`` tokens (a block multiple)."""
    return position // block_size - 1


def running_block_index(position: int, scheduled: int, block_size: int) -> int:
    """Block the first step after a hit at ``position`` reads and updates."""
    return -(-(position + scheduled) // block_size) - 1
