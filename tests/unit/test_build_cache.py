"""setup.py's native build cache: a tree with the same sources, torch,
interpreter and compiler gets the modules another tree built (the
compatibility stacks of one torch build byte-identical modules), and any
change to what the build reads is a miss, never a stale module.

The cache class is exercised on copies of the real sources; a real CMake
build would cost a minute and a half of CPU per case and is not what is
under test (the stacks' kernel and engine tests run on the reused modules).
"""

from __future__ import annotations

import runpy
import shutil
import types
from pathlib import Path

import pytest
import setuptools

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
SO = "_ops.cpython-311-x86_64-linux-gnu.so"


def _tree(root: Path) -> Path:
    """A copy of what the build reads: setup.py, CMakeLists.txt, csrc/."""
    root.mkdir(parents=True)
    shutil.copy2(REPO / "setup.py", root / "setup.py")
    shutil.copy2(REPO / "CMakeLists.txt", root / "CMakeLists.txt")
    shutil.copytree(REPO / "csrc", root / "csrc")
    return root


def _setup_module(root: Path, monkeypatch) -> dict:
    # setup.py calls setuptools.setup() at the end: not here.
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    return runpy.run_path(str(root / "setup.py"))


def _fake_torch(tmp_path: Path, version: str = "2.13.0+cpu") -> types.SimpleNamespace:
    torch_dir = tmp_path / f"torch-{version}" / "torch"
    (torch_dir / "lib").mkdir(parents=True, exist_ok=True)
    (torch_dir / "lib" / "libtorch_cpu.so").write_bytes(b"lib" + version.encode())
    return types.SimpleNamespace(__version__=version, __file__=str(torch_dir / "__init__.py"))


def _built(root: Path, payload: bytes) -> Path:
    """What a build leaves: the module, its build info and the simulation."""
    target = root / "lmcache_ascend" / SO
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(payload)
    (target.parent / "_build_info.py").write_text("TORCH_VERSION = '2.13.0+cpu'\n")
    sim = root / "build" / "ascend-sim"
    sim.mkdir(parents=True, exist_ok=True)
    (sim / "lmca_ascend_sim.cpython-311-x86_64-linux-gnu.so").write_bytes(payload + b"-sim")
    (sim / "lmca_ascend_sim.pyi").write_text("# stub\n")
    return target


def _status(root: Path) -> str:
    return (root / "build" / "native-build.txt").read_text()


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCA_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LMCA_BUILD_ASCEND_SIM", "1")
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LMCA_DISABLE_ASCEND", "CXX", "CXXFLAGS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_a_second_tree_with_the_same_inputs_gets_the_first_trees_modules(env, monkeypatch):
    torch = _fake_torch(env)
    first = _tree(env / "first")
    ns = _setup_module(first, monkeypatch)
    target = _built(first, b"module-bytes")
    cache = ns["_BuildCache"](torch, target)
    assert not cache.restore()  # nothing kept yet: the caller builds
    cache.store()
    assert "built for torch 2.13.0+cpu, kept in" in _status(first)

    second = _tree(env / "second")
    ns2 = _setup_module(second, monkeypatch)
    target2 = second / "lmcache_ascend" / SO
    assert ns2["_BuildCache"](torch, target2).restore()
    assert target2.read_bytes() == b"module-bytes"
    assert (target2.parent / "_build_info.py").read_text() == (target.parent / "_build_info.py").read_text()
    sim2 = second / "build" / "ascend-sim"
    assert (sim2 / "lmca_ascend_sim.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"module-bytes-sim"
    assert (sim2 / "lmca_ascend_sim.pyi").exists()
    assert "reused from" in _status(second) and "LMCA_BUILD_CACHE=0" in _status(second)


@pytest.mark.parametrize("change", ["header", "cmake", "torch", "compiler_flags", "no_sim"])
def test_any_change_to_what_the_build_reads_is_a_miss(env, monkeypatch, change):
    torch = _fake_torch(env)
    first = _tree(env / "first")
    ns = _setup_module(first, monkeypatch)
    ns["_BuildCache"](torch, _built(first, b"old")).store()

    second = _tree(env / "second")
    if change == "header":
        header = next((second / "csrc" / "include").rglob("*.h"))
        header.write_text(header.read_text() + "\n// changed\n")
    elif change == "cmake":
        (second / "CMakeLists.txt").write_text((second / "CMakeLists.txt").read_text() + "\n# changed\n")
    elif change == "torch":
        torch = _fake_torch(env, "2.11.0")
    elif change == "compiler_flags":
        monkeypatch.setenv("CXXFLAGS", "-O0")
    elif change == "no_sim":
        monkeypatch.setenv("LMCA_BUILD_ASCEND_SIM", "0")
    ns2 = _setup_module(second, monkeypatch)
    target2 = second / "lmcache_ascend" / SO
    assert not ns2["_BuildCache"](torch, target2).restore()
    assert not target2.exists()  # nothing copied: the caller builds


@pytest.mark.parametrize("why", ["off", "cann"])
def test_cache_off_builds_and_says_why(env, monkeypatch, why):
    if why == "off":
        monkeypatch.setenv("LMCA_BUILD_CACHE", "0")
    else:
        monkeypatch.setenv("ASCEND_HOME_PATH", str(env))  # a toolkit the key cannot see into
    root = _tree(env / "tree")
    ns = _setup_module(root, monkeypatch)
    cache = ns["_BuildCache"](_fake_torch(env), _built(root, b"x"))
    assert not cache.restore()
    cache.store()
    expected = "LMCA_BUILD_CACHE=0" if why == "off" else "CANN toolkit"
    assert "built for torch 2.13.0+cpu (build cache off:" in _status(root) and expected in _status(root)
    assert not (env / "cache").exists()


def test_only_the_newest_entries_are_kept(env, monkeypatch):
    root = _tree(env / "tree")
    ns = _setup_module(root, monkeypatch)
    keep = ns["_BuildCache"].KEEP
    for i in range(keep + 2):
        ns["_BuildCache"](_fake_torch(env, f"2.{i}.0"), _built(root, b"v%d" % i)).store()
    entries = [p for p in (env / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == keep
    assert all((p / "complete").exists() for p in entries)
