"""The default LMCache chunk size: as fine as vLLM's own prefix cache.

A hit is a whole number of chunks and never the whole prompt, so it leaves up
to ``chunk_size`` tokens to compute, where vLLM's own prefix cache leaves up
to one block. With LMCache's default chunk of 256 tokens and vLLM's 128-token
blocks, a hit from LMCache recomputes on average 128 tokens more than a hit
from vLLM's cache; at 8k tokens on a CPU that is 0.3-0.8 s (docs/benchmarks.md).
So when the user has not chosen a chunk size, the connector uses the smallest
size every group can be cut at (the lcm of their block sizes and compress
ratios), raised to a multiple of at least ``FLOOR_TOKENS`` so tiny blocks do
not multiply per-chunk costs. That size is valid for every block size vLLM
may pick (vLLM-CPU sizes hybrid Mamba models' attention blocks per machine,
e.g. 384 or 640 tokens), where LMCache's fixed 256 is not. An explicit
``chunk_size`` always wins, and the planner refuses it clearly when no
chunk can be cut at it.

Pure code: the caller passes the environment and the extra config.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup

FLOOR_TOKENS = 128
_EXTRA_KEYS = ("chunk_size", "lmcache.chunk_size")


def _yaml_keys(path: str) -> Mapping[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    return data if isinstance(data, dict) else {}


def chunk_size_source(
    extra: Optional[Mapping[str, Any]],
    environ: Mapping[str, str],
    read_config_file: Callable[[str], Mapping[str, Any]] = _yaml_keys,
) -> Optional[str]:
    """Where the user set ``chunk_size`` (in LMCache's order of precedence:
    vLLM's extra config over the environment over the config file), in
    words for an error message; None when it is not set anywhere."""
    for key in _EXTRA_KEYS:
        if extra and key in extra:
            return f"kv_connector_extra_config[{key!r}]"
    if environ.get("LMCACHE_CHUNK_SIZE", "").strip():
        return "the environment variable LMCACHE_CHUNK_SIZE"
    path = environ.get("LMCACHE_CONFIG_FILE", "").strip()
    # LMCache itself reports an unreadable file; here it just counts as unset.
    try:
        if path and "chunk_size" in read_config_file(path):
            return f"the LMCache config file {path} (LMCACHE_CONFIG_FILE)"
    except OSError:
        return None
    return None


def chunk_size_configured(
    extra: Optional[Mapping[str, Any]],
    environ: Mapping[str, str],
    read_config_file: Callable[[str], Mapping[str, Any]] = _yaml_keys,
) -> bool:
    """Did the user set ``chunk_size`` anywhere LMCache reads it from?"""
    return chunk_size_source(extra, environ, read_config_file) is not None


def default_chunk_size(
    groups: Sequence[SchedulerGroup], configured: bool, current: int
) -> tuple[int, bool]:
    """(chunk size to use, whether it replaced ``current``). A size the user
    configured is kept as is; otherwise the finest valid one is used."""
    if configured:
        return current, False
    finest = finest_chunk_size(groups)
    if finest is None or finest == current:
        return current, False
    return finest, True


def finest_chunk_size(groups: Sequence[SchedulerGroup], floor: int = FLOOR_TOKENS) -> Optional[int]:
    """Smallest chunk every attention group can be cut at, at least ``floor``
    tokens; None when there is no attention group.

    A compressed group is cut at its compress ratio, not its block size: its
    rows are addressed one by one (vLLM-Ascend hands them over as token
    rows), so a chunk need only end on a row. DeepSeek-V4 on vLLM-Ascend has
    512- and 16384-token compressed blocks but cuts at 128 tokens. Groups
    moved as whole pages are refused at plan time when a chunk would split
    one of their blocks."""
    units = [
        n
        for g in groups
        if g.kind is not GroupKind.STATE
        for n in ((g.compress_ratio,) if g.compress_ratio > 1 else (g.block_size,))
        if n and n > 0
    ]
    if not units:
        return None
    unit = math.lcm(*units)
    return unit * max(1, -(-floor // unit))
