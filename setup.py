# SPDX-License-Identifier: Apache-2.0
"""Build lmcache_ascend.ops with CMake (see CMakeLists.txt).

Metadata lives in pyproject.toml; this file only adds the CMake-driven
extension.  The CMake build tree is kept under build/ so that rebuilds
(including `pip install -e .`) only recompile what changed.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

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
        if target != out:
            shutil.copy2(target, out)
            shutil.copy2(target.parent / "_build_info.py", out.parent / "_build_info.py")
        # Older builds wrote the AscendC simulation into the package; it is a
        # test-only module now (build/ascend-sim/) and must not be imported
        # or shipped from there.
        for stale in target.parent.glob("_ascend_sim*.so"):
            stale.unlink()


def _sim_requested() -> bool:
    """LMCA_BUILD_ASCEND_SIM=1 (the Makefile's test build) adds the test-only
    AscendC simulation module; anything else, or unset, leaves it out."""
    return os.environ.get("LMCA_BUILD_ASCEND_SIM", "0").strip().lower() in ("1", "on", "true", "yes")


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
