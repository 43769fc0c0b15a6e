"""Which scheduler groups are left out of chunks, and which make hits unsafe.

Decided from the groups and our config alone, so the scheduler half (which
has no KV tensors) and the worker half agree.

* Skipped: groups a hit never needs. Without the user's say: groups with no
  layers, groups vLLM excludes from transfer, and compressor-state groups
  whose compressor reads no state at a chunk boundary (DeepSeek-V4's C128
  compressor, ``CompressorState.tokens_read == 0``; the planner checks that
  chunk boundaries are multiples of its ratio). On the user's say only
  (empty by default): groups listed by the spec allowlist or with every
  layer named by a listed suffix. Neither stored nor loaded nor sized.
* Unrestorable: STATE groups that are not skipped (Mamba / GDN running
  state, and any spec the classifier does not know). Their state at a chunk
  boundary cannot be rebuilt from token positions, so a hit would resume
  from stale state: the scheduler must refuse hits while such a group exists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup


class SkipReason(str, enum.Enum):
    SPEC_ALLOWLIST = "spec_allowlist"
    LAYER_SUFFIX = "layer_suffix"
    NO_LAYERS = "no_layers"  # the group addresses no layer: nothing to move
    NOT_TRANSFERABLE = "not_transferable"  # vLLM rebuilds it after a load
    UNREAD_STATE = "unread_state"  # its compressor reads no state at a chunk boundary


@dataclass(frozen=True)
class SkippedGroup:
    index: int
    spec_name: str
    reason: SkipReason
    detail: str


def _suffix_match(group: SchedulerGroup, suffixes: Sequence[str]) -> bool:
    """True if every layer of the group ends with a listed suffix.

    A group matched only in part is refused: storing some of its layers
    would make a hit restore the group half-way.
    """
    if not suffixes or not group.layer_names:
        return False
    hits = [any(name.endswith(s) for s in suffixes) for name in group.layer_names]
    if all(hits):
        return True
    if any(hits):
        matched = [n for n, h in zip(group.layer_names, hits) if h][:3]
        other = [n for n, h in zip(group.layer_names, hits) if not h][:3]
        raise ValueError(
            f"group {group.index} ({group.spec_name}): ascend_skip_state_layer_suffixes "
            f"{list(suffixes)} match only some of its layers (e.g. {matched}, not {other}); "
            "a group is skipped whole or not at all"
        )
    return False


def skipped_groups(groups: Sequence[SchedulerGroup], config: AscendConfig) -> tuple[SkippedGroup, ...]:
    out = []
    for g in groups:
        if not g.layer_names:
            out.append(SkippedGroup(g.index, g.spec_name, SkipReason.NO_LAYERS, "addresses no layer"))
            continue
        if not g.transferable:
            out.append(
                SkippedGroup(
                    g.index, g.spec_name, SkipReason.NOT_TRANSFERABLE,
                    "vLLM excludes it from KV transfer (rebuilt from its source group after a load)",
                )
            )
            continue
        if g.compressor is not None and g.compressor.tokens_read == 0:
            out.append(
                SkippedGroup(
                    g.index, g.spec_name, SkipReason.UNREAD_STATE,
                    f"compressor state of ratio-{g.compressor.ratio} layers without overlap: "
                    f"not read when a prefill resumes at a multiple of {g.compressor.ratio} tokens",
                )
            )
            continue
        if not config.skip_state_groups:
            continue
        if g.spec_name in config.skip_state_spec_allowlist:
            out.append(
                SkippedGroup(
                    g.index, g.spec_name, SkipReason.SPEC_ALLOWLIST,
                    f"spec {g.spec_name} is in ascend_skip_state_spec_allowlist",
                )
            )
        elif _suffix_match(g, config.skip_state_layer_suffixes):
            out.append(
                SkippedGroup(
                    g.index, g.spec_name, SkipReason.LAYER_SUFFIX,
                    "every layer ends with one of ascend_skip_state_layer_suffixes",
                )
            )
    return tuple(out)


def unrestorable_groups(groups: Sequence[SchedulerGroup], config: AscendConfig) -> tuple[SchedulerGroup, ...]:
    """STATE groups with layers that are not skipped: hits must be refused."""
    skipped = {s.index for s in skipped_groups(groups, config)}
    return tuple(g for g in groups if g.kind is GroupKind.STATE and g.index not in skipped)
