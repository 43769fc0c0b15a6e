"""DeepSeek-V4 on vLLM-Ascend: the hit granularity the connector offers, end
to end through the scheduler half and the worker path.

The scheduler half runs with the real group structure (the DSv4 fixture's
groups as vLLM's scheduler process sees them) and the default chunk size.
``AscendEngine`` plays vLLM's scheduler and model for one request at a time:

* block tables grow as vLLM-Ascend's managers grow them (restated here, not
  taken from the planner): a compressed group holds ``cdiv(tokens // ratio,
  rows per block)`` blocks (vllm_ascend/core/single_type_kv_cache_manager.py,
  CompressAttentionManager.allocate_new_blocks / allocate_new_computed_blocks);
  a sliding group frees the blocks of tokens below ``computed - window + 1``
  before each step and, for an external hit, gets the null block for them
  (vLLM's SlidingWindowManager: get_num_skipped_tokens, remove_skipped_blocks);
  all groups draw ids from one pool, as their layers share raw tensors;
* the "forward" writes, for every token it computes, a row pattern that is a
  function of (layer, element, row) into every layer that row belongs to,
  compressor state included; stores run after it, loads before it;
* LMCache is a dict of chunk buffers keyed by token prefix.

After a hit, every row the resumed forward reads (per the fixture's
provenance) must hold the pattern the first request wrote for it.
vLLM-Ascend's own prefix cache aligns DeepSeek-V4 hits to the lcm of its
groups' effective block sizes (patch_kv_cache_coordinator.py,
_get_effective_block_size and lcm_block_size): 16384 tokens at
``--block-size 128``, so none of these prompts would hit there.

vLLM-Ascend 0.29.0rc1 / 0.30.0rc2 (vLLM 0.29 / 0.30; release rows with
``token_blocks``): the compressed specs count tokens, so vLLM's own
FullAttentionManager sizes their tables (``cdiv(tokens, block_size)``
blocks of 512 / 16384 tokens), and vLLM's scheduler block size becomes the
lcm of the groups' block sizes, 16384 (vllm/v1/core/kv_cache_utils.py
resolve_kv_cache_block_sizes, ``scheduler_block_size = math.lcm(*group_block_sizes)``,
0.29 l.729, 0.30 l.746; vLLM-Ascend's _ascend_resolve_kv_cache_block_sizes
defers to it for DCP 1). That block size does NOT constrain external hits:
Scheduler.schedule (0.29 l.848-888, 0.30 l.927-970) takes the connector's
count as is and only trims a local hit's partial tail (``partial_tail =
num_new_local_computed_tokens % self.block_size``), which is 0 for
DeepSeek-V4 (its local hits are 16384-aligned by vLLM-Ascend's coordinator,
_cache_hit_alignment_tokens). So the finest exact granularity stays the
chunk: 128 tokens, the C128 compressor's ratio, below which the planner
refuses chunk boundaries.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="driven through vLLM's real scheduler types")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from fixtures import ascend_layouts as AL
from fixtures import ascend_releases as R
from fixtures import ascend_specs as S
from fixtures import layouts as L
from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.vllm_keys import request_view
from lmcache_ascend.integration.vllm.vllm_step_view import step_view
from lmcache_ascend.planning.chunking import default_chunk_size
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, ChunkRequest
from lmcache_ascend.planning.planner import build_plan
from lmcache_ascend.transfer import reference_ops
from lmcache_ascend.transfer.chunk_transfer import ChunkTransfer


def pattern(layer: str, element: int, row: int, nbytes: int) -> np.ndarray:
    seed = zlib.crc32(f"{layer}/{element}/{row}".encode())
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def vllm_ascend_alignment(block_size: int = 128) -> int:
    """lcm of the effective block sizes (block_size x compress_ratio where
    the spec has one) of the DeepSeek-V4 groups."""
    mod = S.specs_module("0.23.0")
    sizes = []
    for g in S.group_dsv4(mod, AL.dsv4_specs(mod, block_size)):
        first = next(iter(g.kv_cache_spec.kv_cache_specs.values()))
        sizes.append(first.block_size * getattr(first, "compress_ratio", 1))
    return math.lcm(*sizes)


class AscendEngine:
    def __init__(self, layout: L.Layout, token_blocks: bool = False) -> None:
        # token_blocks: compressed groups' tables grow as vLLM's
        # FullAttentionManager grows token-counted blocks (0.27.1rc1+:
        # cdiv(tokens, block_size)), else as CompressAttentionManager.
        self.token_blocks = token_blocks
        self.layout = layout
        self.tables = L.table_groups(layout)
        size, replaced = default_chunk_size(layout.groups, configured=False, current=256)
        assert replaced
        self.chunk = size
        self.built = layout.build(False)
        self.plan = build_plan(self.built.kv_caches, layout.groups, size)
        self.transfer = ChunkTransfer(self.plan, reference_ops)
        self.stored: dict[tuple[int, ...], torch.Tensor] = {}
        self.half = SchedulerHalf(layout.groups, size, self.lookup)
        self.free = list(range(layout.num_blocks[0] - 1, 0, -1))
        self.blocks: dict[str, list[list[int]]] = {}
        self.reqs: dict[str, Request] = {}
        self.fresh: set[str] = set()
        self.loaded_chunks = 0

    # -- LMCache --
    def lookup(self, token_ids, req_id: str) -> int:
        toks, n = tuple(token_ids), 0
        while n + self.chunk <= len(toks) and toks[: n + self.chunk] in self.stored:
            n += self.chunk
        return n

    # -- vLLM-Ascend's block managers --
    def _take(self) -> int:
        assert self.free, "pool exhausted"
        return self.free.pop()

    def _grow(self, req_id: str, computed: int, upto: int, external: bool) -> list[list[int]]:
        new = []
        for g, tg in enumerate(self.tables):
            have = self.blocks[req_id][g]
            if tg.window is not None:
                skipped = max(0, computed - tg.window + 1) // tg.block_tokens
                for i in range(min(skipped, len(have))):
                    if have[i] != NULL_BLOCK_ID:
                        self.free.append(have[i])  # left the window: freed
                        have[i] = NULL_BLOCK_ID
                want = math.ceil(upto / tg.block_tokens)
                nulls = skipped if external else 0
            elif self.token_blocks:
                want, nulls = math.ceil(upto / tg.block_tokens), 0
            else:
                want = math.ceil((upto // tg.ratio) / (tg.block_tokens // tg.ratio))
                nulls = 0
            ids = [NULL_BLOCK_ID if len(have) + i < nulls else self._take() for i in range(want - len(have))]
            have.extend(ids)
            new.append(ids)
        return new

    # -- requests --
    def admit(self, req_id: str, tokens) -> int:
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=1), None)
        self.reqs[req_id], self.blocks[req_id] = req, [[] for _ in self.tables]
        ext, is_async = self.half.get_num_new_matched_tokens(request_view(req), 0)
        assert not is_async
        self._grow(req_id, ext, ext, external=True)
        self.half.update_state_after_alloc(req_id, ext)
        req.num_computed_tokens = ext
        self.fresh.add(req_id)
        return ext

    def step(self, req_id: str, n: int) -> None:
        req = self.reqs[req_id]
        computed = req.num_computed_tokens
        new = self._grow(req_id, computed, computed + n, external=False)
        cached = CachedRequestData.make_empty()
        new_reqs = []
        if req_id in self.fresh:
            self.fresh.discard(req_id)
            new_reqs.append(NewRequestData.from_request(req, tuple(list(b) for b in self.blocks[req_id])))
        else:
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(tuple(new) if any(new) else None)
            cached.num_computed_tokens.append(computed)
            cached.num_output_tokens.append(0)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: n},
            total_num_scheduled_tokens=n, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[], preempted_req_ids=set(), num_common_prefix_blocks=[],
        )
        (t,) = self.half.build(step_view(out)).requests or (None,)
        if t is not None:
            # Live blocks match vLLM's; the connector never hears of blocks
            # vLLM freed in place (it keeps their old ids and never reads them).
            for mine, theirs in zip(t.block_ids, self.blocks[req_id]):
                assert len(mine) == len(theirs)
                assert all(a == b for a, b in zip(mine, theirs) if b != NULL_BLOCK_ID)
        if t is not None and t.load is not None:  # start_load_kv: before the forward
            for start in range(0, t.load.hit_tokens, self.chunk):
                if start + self.chunk <= t.load.skip_tokens:
                    continue
                buf = self.stored[tuple(t.token_ids[: start + self.chunk])]
                self.transfer.load(buf, ChunkRequest(start, start + self.chunk, t.block_ids))
                self.loaded_chunks += 1
        self._forward(req_id, computed, computed + n)
        if t is not None and t.store is not None:  # wait_for_save: after it
            for start in range(t.store.start, t.store.end, self.chunk):
                buf = torch.empty(self.plan.chunk_bytes, dtype=torch.uint8)
                res = self.transfer.store(buf, ChunkRequest(start, start + self.chunk, t.block_ids))
                assert res.stored, f"chunk at {start}: {res.incomplete}"
                self.stored[tuple(t.token_ids[: start + self.chunk])] = buf
        req.num_computed_tokens += n

    def rows(self, req_id: str, e: L.Element, lo: int, hi: int):
        """(logical row, kernel block, row) of element ``e`` for rows [lo, hi)
        that have a real block in the request's table."""
        table = self.blocks[req_id][e.group]
        sched_rows = e.block_tokens // e.ratio
        for j in range(lo, hi):
            idx = j // sched_rows
            blk = table[idx] if idx < len(table) else NULL_BLOCK_ID
            if blk != NULL_BLOCK_ID:
                yield j, blk, j % sched_rows

    def _forward(self, req_id: str, a: int, b: int) -> None:
        for e in self.built.elements:
            for j, blk, row in self.rows(req_id, e, a // e.ratio, b // e.ratio):
                dst = e.view[blk, row].view(torch.uint8).reshape(-1)
                dst.copy_(torch.from_numpy(pattern(e.layer, e.element, j, dst.numel())))

    def finish(self, req_id: str) -> None:
        for ids in self.blocks.pop(req_id):
            self.free.extend(i for i in ids if i != NULL_BLOCK_ID)
        self.half.request_finished(req_id)

    def unread_rows(self, req_id: str, hit: int) -> list[str]:
        """Rows a forward resuming at ``hit`` reads that do not hold what the
        first request's forward wrote there."""
        bad = []
        for e in self.built.elements:
            lo = 0 if e.read is None else max(0, hit - e.read)
            rows = list(self.rows(req_id, e, lo // e.ratio, hit // e.ratio))
            assert len(rows) == hit // e.ratio - lo // e.ratio, f"{e.layer}: a row read at {hit} has no block"
            for j, blk, row in rows:
                got = e.view[blk, row].view(torch.uint8).reshape(-1).numpy()
                if not np.array_equal(got, pattern(e.layer, e.element, j, got.size)):
                    bad.append(f"{e.layer}[{e.element}] row {j}")
        return bad


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


RELEASES = R.params([R.row(v) for v in ("0.23.0", "0.29.0rc1", "0.30.0rc2")])


@pytest.fixture(scope="module", params=RELEASES)
def engine(request) -> AscendEngine:
    eng = AscendEngine(AL.dsv4(request.param, num_blocks=160), token_blocks=request.param.token_blocks)
    eng.release = request.param
    base = prompt(1000, 1)
    assert eng.admit("a", base) == 0
    while eng.reqs["a"].num_computed_tokens < 1000:
        eng.step("a", min(256, 1000 - eng.reqs["a"].num_computed_tokens))
    eng.finish("a")
    eng.base = base
    return eng


def test_default_chunk_is_128_and_vllm_ascend_aligns_to_16384(engine):
    assert engine.chunk == 128
    assert vllm_ascend_alignment(128) == 16384 and vllm_ascend_alignment(64) == 8192
    if engine.release.token_blocks:
        # vLLM 0.29/0.30's scheduler block size for these groups: their lcm.
        mod = S.specs_module(engine.release)
        groups = S.group_dsv4(mod, AL.dsv4_specs(mod))
        assert S.lcm_block_tokens(groups) == 16384
        assert [g.block_size for g in engine.layout.groups[:2]] == [512, 16384]
    # the first request stored each whole chunk once, in the step completing it
    assert len(engine.stored) == 1000 // 128


@pytest.mark.parametrize("shared, hit", [(700, 640), (130, 128), (999, 896)])
def test_hit_at_any_128_token_boundary_resumes_exactly(engine, shared, hit):
    """A prompt sharing ``shared`` tokens with the first one hits at the last
    whole chunk inside them, far below 16384, and after the load every row the
    resumed forward reads (compressed rows, SWA window, C4 compressor state
    of the last 4 tokens, indexer K and scales) is what the first forward
    wrote."""
    req_id = f"b{shared}"
    tokens = engine.base[:shared] + prompt(100, 7)
    before = engine.loaded_chunks
    assert engine.admit(req_id, tokens) == hit
    assert hit % engine.chunk == 0 and hit < vllm_ascend_alignment(128)
    engine.step(req_id, len(tokens) - hit)  # loads, then computes the rest
    assert engine.loaded_chunks - before == hit // engine.chunk
    assert engine.unread_rows(req_id, hit) == []
    engine.finish(req_id)


def test_without_the_compressor_state_the_resume_would_read_stale_rows(engine):
    """Control: the same hit with the C4 compressor-state rows zeroed after
    the load (what skipping those groups leaves) is caught by the check."""
    tokens = engine.base[:700] + prompt(100, 8)
    assert engine.admit("c", tokens) == 640
    engine.step("c", 160)
    for e in engine.built.elements:
        if e.layer.endswith(".compressor.state_cache") and e.read:
            for j, blk, row in engine.rows("c", e, 640 - e.read, 640):
                e.view[blk, row].view(torch.uint8).zero_()
    bad = engine.unread_rows("c", 640)
    assert bad and all(".compressor.state_cache" in b for b in bad)
    engine.finish("c")


@pytest.mark.skipif(not R.HAS_TOKENS_PER_STATE, reason="vLLM >= 0.29 (token-counted specs, scheduler_block_size)")
@pytest.mark.parametrize("ext", [128, 640, 896])
def test_vllms_kv_cache_manager_accepts_128_token_external_hits(ext):
    """vLLM's own KVCacheManager (0.29, 0.30, 0.32), with the 0.30.0rc2
    DeepSeek-V4 groups' block sizes and managers (vLLM-Ascend registers
    FullAttentionManager for AscendMLAAttentionSpec and SlidingWindowManager
    for AscendSlidingWindowMLASpec, core/kv_cache_interface.py
    register_ascend_kv_cache_specs) and the 16384-token scheduler block
    size, allocates a request whose external hit is any multiple of 128:
    nothing rounds it to 16384."""
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowMLASpec

    if "scheduler_block_size" not in inspect.signature(KVCacheManager.__init__).parameters:
        pytest.skip("this vLLM's KVCacheManager has no scheduler_block_size")
    layout = AL.dsv4("0.30.0rc2")
    mla = dict(num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    groups = []
    for g in layout.groups:
        if g.sliding_window is None:
            spec = MLAAttentionSpec(block_size=g.block_size, tokens_per_state=g.compress_ratio, **mla)
        else:
            spec = SlidingWindowMLASpec(block_size=g.block_size, sliding_window=g.sliding_window, **mla)
        groups.append(KVCacheGroupSpec([f"g{g.index}"], spec))
    sched_block = math.lcm(*(g.block_size for g in layout.groups))
    assert sched_block == 16384
    mgr = KVCacheManager(
        KVCacheConfig(num_blocks=800, kv_cache_tensors=[], kv_cache_groups=groups),
        max_model_len=40000, scheduler_block_size=sched_block,
        hash_block_size=math.gcd(*(g.block_size for g in layout.groups)), enable_caching=True,
    )
    req = Request("r", prompt(1000, 3), SamplingParams(max_tokens=1), None)
    blocks, local = mgr.get_computed_blocks(req)[:2]
    assert local == 0
    out = mgr.allocate_slots(
        req, 1000 - ext, num_new_computed_tokens=local, new_computed_blocks=blocks, num_external_computed_tokens=ext
    )
    assert out is not None
    ids = mgr.get_block_ids("r")
    # Tables cover the whole prompt in token-counted blocks: 2 C4 blocks of
    # 512 tokens, 1 C128 block of 16384, 8 SWA blocks of 128.
    assert [len(ids[0]), len(ids[1])] == [2, 1] and len(ids[2]) == math.ceil(1000 / 128)
