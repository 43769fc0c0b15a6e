"""Default chunk size: vLLM's block granularity unless the user chose one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache_ascend.planning.chunking import (
    chunk_size_configured,
    chunk_size_source,
    default_chunk_size,
    finest_chunk_size,
)
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup
from lmcache_ascend.planning.kv_format import LayoutHints
from lmcache_ascend.planning.planner import build_plan

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE


def groups(*rows) -> tuple[SchedulerGroup, ...]:
    return tuple(
        SchedulerGroup(index=i, kind=k, spec_name="S", block_size=bs, compress_ratio=r,
                       sliding_window=64 if k is SLIDING else None)
        for i, (k, bs, r) in enumerate(rows)
    )


@pytest.mark.parametrize(
    "layout, expected",
    [
        (groups((FULL, 128, 1)), 128),  # vLLM-CPU / vLLM-Ascend attention
        (groups((SLIDING, 128, 1),) * 5 + groups((FULL, 128, 1)), 128),  # Gemma-3
        (groups((FULL, 16, 1)), 128),  # GPU-sized blocks: raised to the floor
        (groups((FULL, 48, 1)), 144),  # a multiple of 48, at least 128
        # DeepSeek-V4 on vLLM-Ascend (--block-size 128): C4 512-token and C128
        # 16384-token blocks are addressed by rows, so only the ratios count.
        (groups((FULL, 512, 4), (FULL, 16384, 128), (SLIDING, 128, 1), (SLIDING, 8, 1), (SLIDING, 32, 1)), 128),
        (groups((FULL, 256, 4), (SLIDING, 64, 1), (FULL, 64, 1), (SLIDING, 4, 1), (SLIDING, 8, 1)), 128),
        (groups((STATE, 640, 1), (FULL, 640, 1)), 640),  # Qwen3-Next on vLLM-CPU
        (groups((FULL, 128, 128)), 128),
        (groups((STATE, 64, 1)), None),  # nothing to cut
    ],
)
def test_finest_chunk_size(layout, expected):
    got = finest_chunk_size(layout)
    assert got == expected
    if got is not None:
        for g in layout:
            if g.kind is not STATE:  # whole rows of compressed groups, whole blocks of the others
                assert got % (g.compress_ratio if g.compress_ratio > 1 else g.block_size) == 0


def test_explicit_chunk_size_is_detected_wherever_lmcache_reads_it(tmp_path):
    yaml_with = tmp_path / "with.yaml"
    yaml_with.write_text("chunk_size: 512\nlocal_cpu: true\n")
    yaml_without = tmp_path / "without.yaml"
    yaml_without.write_text("local_cpu: true\n")
    assert not chunk_size_configured({}, {})
    assert not chunk_size_configured({"lmcache.local_cpu": True}, {"LMCACHE_LOCAL_CPU": "1"})
    assert chunk_size_configured({"lmcache.chunk_size": 256}, {})
    assert chunk_size_configured({"chunk_size": 256}, {})
    assert chunk_size_configured(None, {"LMCACHE_CHUNK_SIZE": "256"})
    assert not chunk_size_configured(None, {"LMCACHE_CHUNK_SIZE": " "})
    assert chunk_size_configured(None, {"LMCACHE_CONFIG_FILE": str(yaml_with)})
    assert not chunk_size_configured(None, {"LMCACHE_CONFIG_FILE": str(yaml_without)})
    assert not chunk_size_configured(None, {"LMCACHE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_chunk_size_source_names_where_it_was_set_in_lmcaches_precedence(tmp_path):
    """An error about a chunk size the user set names where it was set (the
    value is often copied from an example for another block size)."""
    yaml_with = tmp_path / "with.yaml"
    yaml_with.write_text("chunk_size: 512\n")
    assert chunk_size_source({}, {}) is None
    assert chunk_size_source({"lmcache.chunk_size": 256}, {"LMCACHE_CHUNK_SIZE": "512"}) == \
        "kv_connector_extra_config['lmcache.chunk_size']"
    assert chunk_size_source({"chunk_size": 256}, {}) == "kv_connector_extra_config['chunk_size']"
    assert chunk_size_source({}, {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_CONFIG_FILE": str(yaml_with)}) == \
        "the environment variable LMCACHE_CHUNK_SIZE"
    assert chunk_size_source(None, {"LMCACHE_CONFIG_FILE": str(yaml_with)}) == \
        f"the LMCache config file {yaml_with} (LMCACHE_CONFIG_FILE)"


def _cpu_pages(block_size: int) -> dict[str, torch.Tensor]:
    # vLLM-CPU attention layer: [blocks, heads, block_size, 2 * head_size], moved
    # as opaque pages (vllm/v1/attention/backends/cpu_attn.py, get_kv_cache_shape).
    return {"model.layers.1.attn": torch.zeros(4, 1, block_size, 8)}


# Attention block sizes vLLM-CPU can pick for Mamba hybrids: it raises the
# attention block until a page holds a Mamba state page, in steps of its
# kernel block (vllm/platforms/cpu.py, vllm/model_executor/models/config.py,
# HybridAttentionMambaModelConfig); seen 384 and 640 on two machines.
@pytest.mark.parametrize("block_size", list(range(16, 2049, 16)) + [1056, 4096])
def test_default_chunk_size_is_valid_for_every_block_size_vllm_may_pick(block_size):
    layout = groups((STATE, block_size, 1), (FULL, block_size, 1))
    layout = (layout[0], dataclasses.replace(layout[1], layer_names=("model.layers.1.attn",)))
    size, replaced = default_chunk_size(layout, configured=False, current=256)
    assert size >= 128
    assert replaced == (size != 256)
    # The planner's own check accepts it (it raises for a chunk that cuts a page).
    plan = build_plan(_cpu_pages(block_size), layout, size, hints=LayoutHints(opaque_pages=True))
    assert plan.chunk_size == size
    assert size % block_size == 0


def test_configured_chunk_size_is_kept_and_refused_when_invalid():
    layout = groups((STATE, 384, 1), (FULL, 384, 1))
    layout = (layout[0], dataclasses.replace(layout[1], layer_names=("model.layers.1.attn",)))
    size, replaced = default_chunk_size(layout, configured=True, current=256)
    assert (size, replaced) == (256, False)
    with pytest.raises(ValueError, match=r"chunk_size 256 is invalid for group 1 .*block_size 384"):
        build_plan(_cpu_pages(384), layout, size, hints=LayoutHints(opaque_pages=True))
