"""Drives the connector's SchedulerHalf the way vLLM's scheduler does, for the
scheduler tests (tests/unit/test_scheduler_half.py, test_scheduler_phases.py).

`Engine` plays vLLM's scheduler: real `Request` objects, real
`SchedulerOutput` / `NewRequestData` / `CachedRequestData` (read through
`step_view`), per-group block tables grown as vLLM grows them (null block 0
for sliding-window positions that are out of the window after a hit, None in
`new_block_ids` when a step allocates nothing). The only fake is the LMCache
lookup: an in-memory set of stored chunk prefixes, filled from the store
ranges the scheduler plans (as the worker would store them). Every step
checks the invariants of each RequestTransfer against the engine's own truth
(block tables, tokens, hits, chunks already stored). Imports vLLM: import it
after ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import math

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.vllm_keys import request_view
from lmcache_ascend.integration.vllm.vllm_specs import scheduler_groups
from lmcache_ascend.integration.vllm.vllm_step_view import step_view
from lmcache_ascend.planning.groups import NULL_BLOCK_ID, GroupKind, SchedulerGroup

CHUNK = 256
FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE
ATTN = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)


# ---- layouts ------------------------------------------------------------------


def _vllm_groups(*specs) -> tuple[SchedulerGroup, ...]:
    cfg = KVCacheConfig(
        num_blocks=1024,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)],
    )
    return scheduler_groups(cfg)


def _groups(*rows) -> tuple[SchedulerGroup, ...]:
    return tuple(
        SchedulerGroup(
            index=i,
            kind=k,
            spec_name=f"{k.value}Spec",
            block_size=bs,
            compress_ratio=r,
            sliding_window=w,
        )
        for i, (k, bs, r, w) in enumerate(rows)
    )


def llama():
    return _vllm_groups(FullAttentionSpec(block_size=16, **ATTN))


def gemma3():
    swa = SlidingWindowSpec(block_size=128, sliding_window=512, **ATTN)
    return _vllm_groups(swa, swa, swa, swa, swa, FullAttentionSpec(block_size=128, **ATTN))


# Synthetic multi-group tables for the scheduler's generic logic: mixed block
# sizes, compress ratios, windows and state groups. They describe no release
# (the real vLLM-Ascend DeepSeek-V4 structure is in test_scheduler_dsv4.py).
def mixed_5():
    return _groups(
        (FULL, 256, 4, None),  # compressed attention
        (SLIDING, 64, 1, 128),  # SWA
        (FULL, 64, 1, None),  # indexer
        (SLIDING, 4, 1, 8),  # compressor state, ratio 4
        (SLIDING, 8, 1, 128),  # compressor state, ratio 128
    )


def mixed_11():
    return _groups(
        (FULL, 128, 4, None),
        (SLIDING, 128, 1, 128),
        (SLIDING, 128, 1, 128),
        (FULL, 128, 4, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (STATE, 128, 1, None),
        (SLIDING, 128, 128, 128),
        (SLIDING, 128, 1, 128),
        (STATE, 128, 1, None),
    )


LAYOUTS = {"llama": llama, "gemma3": gemma3, "mixed_5": mixed_5, "mixed_11": mixed_11}


# ---- the fake lookup and the engine ------------------------------------------------


class FakeLMCache:
    """Stored chunk prefixes; lookup returns the longest stored prefix."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.stored: set[tuple[int, ...]] = set()
        self.calls: list[tuple[str, int]] = []
        self.override: int | None = None
        self.found: dict[str, int] = {}  # req_id -> whole chunks last reported

    def put(self, tokens, start: int, end: int) -> None:
        for k in range(start + self.chunk, end + 1, self.chunk):
            self.stored.add(tuple(tokens[:k]))

    def lookup(self, token_ids, req_id: str) -> int:
        toks = list(token_ids)
        self.calls.append((req_id, len(toks)))
        n = 0
        while n + self.chunk <= len(toks) and tuple(toks[: n + self.chunk]) in self.stored:
            n += self.chunk
        if self.override is not None:
            n = self.override
        self.found[req_id] = min(n, len(toks)) // self.chunk * self.chunk
        return n


class Engine:
    def __init__(self, groups, blockers=(), chunk: int = CHUNK) -> None:
        self.groups = tuple(groups)
        self.chunk = chunk
        self.cache = FakeLMCache(chunk)
        self.half = SchedulerHalf(self.groups, chunk, self.cache.lookup, hit_blockers=blockers)
        self.reqs: dict[str, Request] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.next_id = [1000 * (g.index + 1) for g in self.groups]
        self.scheduled_once: set[str] = set()
        self.to_resume: set[str] = set()
        self.preempted: set[str] = set()
        self.finished: set[str] = set()
        self.hit: dict[str, int] = {}
        self.stored_chunks: dict[str, set[int]] = {}
        self.saw_none_entry = False
        self.saw_empty_group_entry = False

    # -- vLLM scheduler actions --
    def add(self, req_id: str, tokens) -> Request:
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=4096), None)
        self.reqs[req_id] = req
        self.blocks[req_id] = [[] for _ in self.groups]
        self.stored_chunks.setdefault(req_id, set())
        return req

    def admit(self, req_id: str, local: int = 0) -> int:
        """get_num_new_matched_tokens + update_state_after_alloc."""
        req = self.reqs[req_id]
        ext, is_async = self.half.get_num_new_matched_tokens(request_view(req), local)
        assert is_async is False and ext >= 0
        assert (local + ext) % self.chunk == 0 or ext == 0
        self.half.update_state_after_alloc(req_id, ext)
        req.num_computed_tokens = local + ext
        # chunks LMCache reported must never be stored again by this request
        found = self.cache.found.pop(req_id, 0)
        self.hit[req_id] = max(self.hit.get(req_id, 0), found, local + ext if ext else 0)
        return ext

    def preempt(self, req_id: str) -> None:
        self.blocks[req_id] = [[] for _ in self.groups]
        self.reqs[req_id].num_computed_tokens = 0
        self.preempted.add(req_id)
        self.to_resume.add(req_id)

    def finish(self, req_id: str) -> None:
        assert self.half.request_finished(req_id) == (False, None)
        self.finished.add(req_id)
        self.stored_chunks.pop(req_id, None)

    def decode(self, req_id: str, token: int) -> None:
        self.reqs[req_id].append_output_token_ids(token)

    def _alloc(self, req_id: str, upto: int, computed: int) -> list[list[int]]:
        new = []
        for g in self.groups:
            have = self.blocks[req_id][g.index]
            want = 1 if g.kind is STATE else math.ceil(upto / g.block_size)
            ids = []
            for b in range(len(have), want):
                out_of_window = (
                    g.kind is SLIDING and (b + 1) * g.block_size <= computed - g.sliding_window
                )
                if out_of_window:
                    ids.append(NULL_BLOCK_ID)
                else:
                    ids.append(self.next_id[g.index])
                    self.next_id[g.index] += 1
            have.extend(ids)
            new.append(ids)
        return new

    def step(self, sched: dict[str, int]):
        new_reqs, cached = [], CachedRequestData.make_empty()
        for req_id, n in sched.items():
            req = self.reqs[req_id]
            computed = req.num_computed_tokens
            new = self._alloc(req_id, computed + n, computed)
            if req_id not in self.scheduled_once:
                self.scheduled_once.add(req_id)
                all_ids = tuple(list(b) for b in self.blocks[req_id])
                new_reqs.append(NewRequestData.from_request(req, all_ids))
                continue
            cached.req_ids.append(req_id)
            if req_id in self.to_resume:
                self.to_resume.discard(req_id)
                cached.resumed_req_ids.add(req_id)
                cached.new_block_ids.append(tuple(list(b) for b in self.blocks[req_id]))
            elif all(not ids for ids in new):
                self.saw_none_entry = True
                cached.new_block_ids.append(None)
            else:
                self.saw_empty_group_entry |= any(not ids for ids in new)
                cached.new_block_ids.append(tuple(new))
            cached.num_computed_tokens.append(computed)
            cached.num_output_tokens.append(req.num_output_tokens)
        out = scheduler_output(new_reqs, cached, sched, self.finished, self.preempted)
        self.finished.clear()
        self.preempted.clear()
        transfers = self.last_transfers = self.half.build(step_view(out))
        assert transfers.finished_req_ids == frozenset(out.finished_req_ids)
        for t in transfers.requests:
            self._check(t, sched)
        for req_id, n in sched.items():
            self.reqs[req_id].num_computed_tokens += n
        return {t.req_id: t for t in transfers.requests}

    def _check(self, t, sched) -> None:
        req = self.reqs[t.req_id]
        assert t.req_id in sched
        assert t.block_ids == tuple(tuple(b) for b in self.blocks[t.req_id])
        end = max(t.load.hit_tokens if t.load else 0, t.store.end if t.store else 0)
        assert t.token_ids == tuple(req.all_token_ids[:end])
        if t.load is not None:
            assert t.load.hit_tokens % self.chunk == 0
            assert 0 <= t.load.skip_tokens < t.load.hit_tokens < req.num_tokens
        if t.store is not None:
            s = t.store
            assert s.start % self.chunk == 0 and s.end % self.chunk == 0 and s.start < s.end
            assert s.end <= req.num_computed_tokens + sched[t.req_id]
            assert s.end <= req.num_tokens
            assert s.start >= self.hit.get(t.req_id, 0), "re-stores chunks that were hit"
            chunks = set(range(s.start, s.end, self.chunk))
            assert not chunks & self.stored_chunks[t.req_id], "chunk stored twice"
            self.stored_chunks[t.req_id] |= chunks
            self.cache.put(req.all_token_ids, s.start, s.end)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def prefill(eng: Engine, req_id: str, budget: int) -> list[dict]:
    """Schedules `req_id` until its prompt is computed; returns each step's transfers."""
    req, steps = eng.reqs[req_id], []
    while req.num_computed_tokens < req.num_tokens:
        steps.append(eng.step({req_id: min(budget, req.num_tokens - req.num_computed_tokens)}))
    return steps


def scheduler_output(new_reqs, cached, sched: dict[str, int], finished, preempted) -> SchedulerOutput:
    """vLLM's SchedulerOutput of one step: the new and cached requests, the
    tokens scheduled per request, the finished and preempted ids."""
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(sched),
        total_num_scheduled_tokens=sum(sched.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
        num_common_prefix_blocks=[],  # required before vLLM 0.32
    )
