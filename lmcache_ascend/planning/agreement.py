"""What the scheduler and the worker must agree on, checked rather than
assumed.

The scheduler plans loads and stores per chunk; the worker moves them with
its own plan. Both derive the chunk size and which groups are moved,
skipped or unrestorable from their own copies of the configuration, in
different processes. :class:`HalfAgreement` records those decisions; the
scheduler ships its fingerprint with every step and the worker refuses to
move anything planned under a different one (a wrong load would be silent).

Pure: imports neither vLLM, LMCache nor the compiled ops.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from lmcache_ascend.planning.groups import SchedulerGroup
from lmcache_ascend.planning.settings import AscendConfig
from lmcache_ascend.planning.state_skip import skipped_groups, unrestorable_groups


@dataclass(frozen=True)
class HalfAgreement:
    chunk_size: int
    # (index, kind, block_size, compress_ratio, sliding_window, number of layers)
    groups: tuple[tuple[object, ...], ...]
    skipped: tuple[int, ...]
    unrestorable: tuple[int, ...]
    # Mamba state hits (planning/state_align.py): (on, block size, snapshot
    # layout fingerprint); empty for models without Mamba groups.
    state: tuple[object, ...] = ()

    @classmethod
    def of(cls, groups: Sequence[SchedulerGroup], chunk_size: int, config: AscendConfig) -> "HalfAgreement":
        return cls(
            chunk_size=chunk_size,
            groups=tuple(
                (g.index, g.kind.value, g.block_size, g.compress_ratio, g.sliding_window, len(g.layer_names))
                for g in groups
            ),
            skipped=tuple(s.index for s in skipped_groups(groups, config)),
            unrestorable=tuple(g.index for g in unrestorable_groups(groups, config)),
        )

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"chunk {self.chunk_size} tokens, groups {list(self.groups)}, skipped {list(self.skipped)}, "
            f"unrestorable {list(self.unrestorable)}"
            + (f", state hits {list(self.state)}" if self.state else "")
        )


class HalvesDisagree(RuntimeError):
    """The scheduler planned transfers under another chunk size or grouping."""
