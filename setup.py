# SPDX-License-Identifier: Apache-2.0
"""Build lmcache_ascend.ops with CMake (see CMakeLists.txt).

Metadata lives in pyproject.toml; this file only adds the CMake-driven
extension.  The CMake build tree is kept under build/ so that rebuilds
(including `pip install -e .`) only recompile what changed.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        try:
            import torch  # the extension is compiled against the torch it runs with
        except ImportError:
            raise SystemExit(
                "lmcache-ascend: building the native ops needs the torch they will run "
                "with, and this build environment has none. Install torch (the one your "
                "vLLM / vLLM-Ascend uses) first, then build without isolation: "
                "pip install --no-build-isolation ."
            ) from None

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        # Editable/in-place builds: CMake writes straight into the source
        # package, so `cmake --build build/cmake-*` alone refreshes the module;
        # the copy at get_ext_fullpath keeps setuptools' own copy step happy.
        target = out
        if self.inplace or getattr(self, "editable_mode", False):
            package, _, _ = ext.name.rpartition(".")
            package_dir = self.get_finalized_command("build_py").get_package_dir(package)
            target = (Path(package_dir) / out.name).resolve()
        # One build tree per interpreter and torch: a clone may build for
        # several stacks (torch versions) side by side.
        tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}-torch{torch.__version__}"
        build_dir = ROOT / "build" / f"cmake-{tag}"
        cache = _BuildCache(torch, target)
        if cache.restore():
            # The tree's own outputs no longer match what is in place, so a
            # later edit must rebuild from scratch, never relink stale objects.
            shutil.rmtree(build_dir, ignore_errors=True)
        else:
            self._cmake_build(build_dir, target, torch)
            cache.store()
        if target != out:
            shutil.copy2(target, out)
            shutil.copy2(target.parent / "_build_info.py", out.parent / "_build_info.py")
        # Older builds wrote the AscendC simulation into the package; it is a
        # test-only module now (build/ascend-sim/) and must not be imported
        # or shipped from there.
        for stale in target.parent.glob("_ascend_sim*.so"):
            stale.unlink()

    def _cmake_build(self, build_dir: Path, target: Path, torch) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("LMCA_BUILD_TYPE", "Release")
        cmake = _tool("cmake")
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DLMCA_OUTPUT_DIR={target.parent}",
            f"-DLMCA_OUTPUT_NAME={target.name}",
            # Passed on every configure, so a cached ON from a test build never
            # leaks into a wheel build (the module is written outside the
            # package either way: build/ascend-sim/).
            f"-DLMCA_BUILD_ASCEND_SIM={'ON' if _sim_requested() else 'OFF'}",
        ]
        ninja = _tool("ninja")
        if not (build_dir / "CMakeCache.txt").exists() and ninja != "ninja":
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(
            [cmake, "--build", str(build_dir), "--config", build_type, "-j", jobs],
            check=True,
        )
        # lmcache_ascend._native refuses to load the modules into another torch.
        (target.parent / "_build_info.py").write_text(
            "# Written by setup.py when the native modules were built; do not edit.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
        )


class _BuildCache:
    """Built modules kept per machine, keyed by everything the build reads.

    The compatibility stacks build the same sources against the same torch
    (the stacks of one torch share its install) with the same compiler: the
    modules come out byte-identical, and compiling them again cost about 1.5
    CPU-minutes per stack. The key hashes the sources (csrc/, CMakeLists.txt,
    this file), torch (version, install, library), the interpreter, the
    compiler, cmake and the build's environment; a hit copies the modules
    in place of the build and says so. LMCA_BUILD_CACHE=0 turns it off, a
    path moves it. With a CANN toolkit the Ascend kernels also depend on
    the toolkit's contents, which the key cannot see: no cache there.
    """

    KEEP = 6  # newest entries kept: a few torch versions and source states

    def __init__(self, torch, target: Path) -> None:
        self.torch_version = torch.__version__
        self.files = {target.name: target, "_build_info.py": target.parent / "_build_info.py"}
        self.sim_dir = ROOT / "build" / "ascend-sim"
        self.status_file = ROOT / "build" / "native-build.txt"
        self.root, self.why_not = self._root()
        self.key = self._key(torch, target) if self.root is not None else ""

    @staticmethod
    def _root() -> tuple[Optional[Path], str]:
        setting = os.environ.get("LMCA_BUILD_CACHE", "").strip()
        if setting.lower() in ("0", "off", "no", "false"):
            return None, f"LMCA_BUILD_CACHE={setting}"
        if _cann_path() and not _truthy(os.environ.get("LMCA_DISABLE_ASCEND", "")):
            return None, "a CANN toolkit is present: the Ascend kernels depend on it"
        if setting:
            return Path(setting).expanduser(), ""
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "lmcache-ascend" / "native-builds", ""

    def _key(self, torch, target: Path) -> str:
        h = hashlib.sha256()

        def add(label: str, value) -> None:
            h.update(f"{label}={value}\0".encode())

        for path in sorted([*(ROOT / "csrc").rglob("*"), ROOT / "CMakeLists.txt", Path(__file__).resolve()]):
            if path.is_file():
                add("file", path.relative_to(ROOT))
                h.update(path.read_bytes())
        torch_dir = Path(torch.__file__).resolve().parent
        libtorch = torch_dir / "lib" / "libtorch_cpu.so"
        stat = libtorch.stat() if libtorch.exists() else None
        add("torch", (self.torch_version, torch_dir, stat and (stat.st_size, stat.st_mtime_ns)))
        add("python", (sys.version, Path(sys.executable).resolve(), sysconfig.get_paths()["include"],
                       sysconfig.get_config_var("EXT_SUFFIX"), target.name))
        cxx = os.environ.get("CXX", "c++")
        found = shutil.which(cxx)
        add("compiler", (cxx, found and Path(found).resolve(), _version_of(cxx)))
        # Each venv has its own cmake launcher: its version is what counts.
        add("cmake", _version_of(_tool("cmake")))
        for var in ("CXX", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CMAKE_ARGS", "LMCA_BUILD_TYPE", "LMCA_DISABLE_ASCEND"):
            add("env", (var, os.environ.get(var)))
        add("sim", _sim_requested())
        return h.hexdigest()[:24]

    def _built_files(self) -> dict[str, Path]:
        """Entry name -> where the build leaves it (and a hit puts it)."""
        files = dict(self.files)
        if _sim_requested():
            files.update({p.name: p for p in self.sim_dir.glob("lmca_ascend_sim*")})
        return files

    def restore(self) -> bool:
        if self.root is None:
            return False
        entry = self.root / self.key
        if not (entry / "complete").exists():
            return False
        try:
            for kept in entry.iterdir():
                if kept.name == "complete":
                    continue
                dest = self.files.get(kept.name, self.sim_dir / kept.name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(kept, dest)
            os.utime(entry)  # newest used: kept longest
        except OSError as e:
            self._say(f"lmcache-ascend: native build cache entry {entry} unreadable ({e}); building")
            return False
        self._say(f"lmcache-ascend: native ops for torch {self.torch_version} reused from {entry} "
                  "(same sources, torch, interpreter and compiler; LMCA_BUILD_CACHE=0 builds)")
        return True

    def store(self) -> None:
        if self.root is None:
            self._say(f"lmcache-ascend: native ops built for torch {self.torch_version} "
                      f"(build cache off: {self.why_not})")
            return
        entry = self.root / self.key
        tmp = self.root / f".tmp-{self.key}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, src in self._built_files().items():
                shutil.copy2(src, tmp / name)
            (tmp / "complete").write_text(self.key + "\n")
            if entry.exists():
                shutil.rmtree(tmp)  # another build stored the same modules first
            else:
                os.replace(tmp, entry)
            for old in sorted((p for p in self.root.iterdir() if not p.name.startswith(".")),
                              key=lambda p: p.stat().st_mtime, reverse=True)[self.KEEP:]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self._say(f"lmcache-ascend: native ops built for torch {self.torch_version}; "
                      f"not kept in {self.root} ({e})")
            return
        self._say(f"lmcache-ascend: native ops built for torch {self.torch_version}, kept in {entry}")

    def _say(self, line: str) -> None:
        print(line, flush=True)
        # pip -q shows no build output: the Makefile prints this file.
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        self.status_file.write_text(line + "\n")


def _version_of(tool: str) -> str:
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "missing"


def _cann_path() -> str:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = os.environ.get(var, "")
        if value and Path(value).exists():
            return value
    return ""


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "on", "true", "yes")


def _sim_requested() -> bool:
    """LMCA_BUILD_ASCEND_SIM=1 (the Makefile's test build) adds the test-only
    AscendC simulation module; anything else, or unset, leaves it out."""
    return _truthy(os.environ.get("LMCA_BUILD_ASCEND_SIM", "0"))


def _tool(name: str) -> str:
    """The build tool next to this interpreter (venv), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name) or name


setup(
    ext_modules=[CMakeExtension("lmcache_ascend._ops")],
    cmdclass={"build_ext": CMakeBuild},
)
