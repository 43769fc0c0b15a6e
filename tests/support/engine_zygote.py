"""Test engines forked from an interpreter that already imported vLLM.

Most of an in-process test engine's wall time is Python importing torch,
vLLM, transformers and LMCache (about 15 s of a 23 s llama run on a 2-core
machine, measured with ``python -X importtime``), paid again by every
engine of every test. A zygote is a process started with exactly the
environment an engine process would get, that imports those modules once
and then forks one child per engine run. The child runs the same module a
fresh process would (``python -m lmcache_ascend.cli.engine_run ...`` or
``python -m faults ...``), with its output in the engine's log, and exits
the way an interpreter does: it joins its non-daemon threads, runs the
``atexit`` handlers, then exits with the module's status. A child that
hangs at exit hangs here too, and is killed and reported the same way.

What a fork shares that fresh processes would not, and how it is kept
apart:

* The environment: while a zygote imports, it records every variable
  Python code reads (``os.environ``/``os.getenv``, absent ones included).
  It then serves only environments that agree with its own on those
  variables and on every variable native libraries read when they load
  (``ALWAYS_COMPARED``: OpenMP, OpenBLAS, MKL, the loader, torch, Python),
  so every module imported before the fork holds what a fresh process
  would have read. The child then takes the engine's environment exactly
  (variables set, changed and removed) before it runs the module. Imports
  that iterate over the whole environment make the zygote serve its own
  environment only. Before, a zygote served one whole environment: each
  test's own paths, ports and cache settings started a zygote of their own
  (48 zygotes for 72 engines in one run of the suite).
* Python's hash secret (``PYTHONHASHSEED`` is unset for test engines): two
  engines of one test with the same environment come from two different
  zygotes, so chunk keys are still checked to agree across processes
  whose hash secrets differ.
* Threads: a fork keeps only the calling thread, and an OpenMP pool
  started before a fork breaks the child's. Before every fork a zygote
  checks that it has one Python thread and no OS thread beyond those its
  imports started (OpenBLAS', see ``serve``), and otherwise stops serving;
  the caller then starts fresh processes and logs why.

The child is the engine's main process only. vLLM-CPU spawns its engine
core, tensor-parallel workers and data-parallel ranks (it sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``): those come from fork servers that
are children of zygotes too (spawn_server.py, spawn_broker.py).
``LMCA_TEST_ZYGOTE=0`` turns both off (every engine process fresh, as
before).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from wait_progress import Progress

logger = logging.getLogger(__name__)

ENABLE_ENV = "LMCA_TEST_ZYGOTE"
# What an engine process imports before it builds its engine (engine_run:
# ``from vllm import LLM, SamplingParams``), and nothing more: a module
# imported earlier than in a fresh process can change what vLLM does at
# start-up (its CPU platform rebinds kernels in every module already
# imported, and fails on some: llvmlite's, seen when the zygote imported
# every module an earlier engine had).
EAGER = ("vllm", "vllm.entrypoints.llm")
# Set to any value, it gives engines a zygote of their own (compared always).
ZYGOTE_KEY_ENV = "LMCA_ZYGOTE_KEY"
# Variables always compared: those native code may read (getenv in C) when
# the imports load it, and those support/sitecustomize.py reads at
# interpreter start-up, before the recording begins.
ALWAYS_COMPARED = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "LD_", "MALLOC_", "TORCH", "PYTORCH",
                   "CUDA", "NVIDIA", "DNNL_", "ONEDNN_", "ATEN_", "PYTHON", "TCMALLOC", "JE_", "HOME", "PATH",
                   "TMPDIR", "LMCA_CPU_ISA", "NETWORKX_", "TQDM_", ZYGOTE_KEY_ENV)
# Zygotes alive at once (each holds an interpreter with torch and vLLM,
# about 0.5 GB, shared copy-on-write with its children): two for engines'
# main processes (two engines of a test never share one), and those for
# the environments vLLM gives its engine cores and workers.
MAX_ALIVE = 6
# A zygote's first reply comes after its imports (torch, vLLM): 10-20 s on a
# normal 2-core machine, over 300 s on a slow one (seen: a machine where
# `import torch` alone took 135 s; a fixed 300 s there failed every zygote,
# and every engine then paid the imports again as a fresh process). So no
# fixed time: the wait lasts while the zygote works (its CPU time grows), and
# gives up when it has used no CPU for REPLY_IDLE_S (hung), when it exits, or
# after REPLY_CAP_S in all (under pytest's 900 s, so the failure says why).
REPLY_IDLE_S = 120.0
REPLY_CAP_S = 840.0


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ---- the zygote process ------------------------------------------------------


def _child(req: dict) -> None:
    """In the forked child: become ``python -m <module> <args>``; never returns."""
    import atexit
    import runpy
    import threading
    import traceback

    rc = 1
    try:
        if req.get("new_session"):
            os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        if req.get("env") is not None:  # the engine's environment, exactly
            os.environ.clear()
            os.environ.update(req["env"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.argv = [req["module"]] + list(req["args"])
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            code = e.code
            if code is None:
                rc = 0
            elif isinstance(code, int):
                rc = code
            else:
                print(code, file=sys.stderr)
                rc = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print
            traceback.print_exc()
            rc = 1
        # What the interpreter does at exit, in its order: join the
        # non-daemon threads (a thread that never ends hangs the child, as it
        # would hang a fresh process), then run the atexit handlers.
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def serve(state_dir: Path) -> int:
    """The zygote's loop: one JSON request per stdin line, one JSON reply per
    stdout line; each child's exit status goes to ``state_dir/exit-<pid>``."""
    import gc
    import importlib
    import threading

    # Replies go to the test process on a descriptor of their own: vLLM logs
    # to stdout, on some versions while it is imported. What the zygote
    # itself prints goes to its log (stderr).
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(reply_fd, "w")
    stop_recording, reads = _record_environ_reads()
    # Python's cyclic GC ran about ten full collections while the imports
    # built their two million objects (2.2 s of a zygote's start-up on 2
    # cores), and every engine forked after it scanned them all again at
    # each full collection of its own, vLLM's explicit gc.collect() calls
    # included (about 2 s per engine), writing to every page it shares with
    # the zygote. So the imports run without it, and what they built goes to
    # the permanent generation (gc.freeze, what vLLM's own engine core does
    # once started): a child collects only what it allocated itself. A
    # frozen object that becomes cyclic garbage in a child stays allocated
    # until the child exits; nothing it computes changes.
    gc.disable()
    try:
        for name in EAGER:  # an error ends the zygote; the caller starts fresh processes
            importlib.import_module(name)
    finally:
        stop_recording()
        gc.enable()
    gc.collect()
    gc.freeze()
    # The imports start OpenBLAS' thread servers (numpy's and OpenCV's, as a
    # fresh engine process has them), which OpenBLAS stops before a fork
    # (its pthread_atfork handler) and restarts on use. Nothing may start
    # another thread before a fork: an OpenMP pool would break the child's.
    allowed = _os_threads()
    reply.write(json.dumps({"ready": True, "threads": _os_threads(),
                            "reads": None if reads.everything else sorted(reads.keys)}) + "\n")
    reply.flush()
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        _reap(state_dir)
        ready, _, _ = select.select([stdin], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            break  # the test session ended
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            threads = _os_threads()
            if threads > allowed or threading.active_count() != 1:
                reply.write(json.dumps({"error": f"{threads} OS threads (at most {allowed}), "
                                        f"{threading.active_count()} Python threads: "
                                        "a fork would not be a clean engine"}) + "\n")
                reply.flush()
                return 1
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                reply.close()  # the child never writes to the test process
                _child(req)
            reply.write(json.dumps({"pid": pid}) + "\n")
            reply.flush()
    while _reap(state_dir, block=True):
        pass
    return 0


@dataclass
class _Reads:
    keys: set = field(default_factory=set)
    everything: bool = False  # the whole environment was iterated or copied


# Modules whose whole-environment reads at import do not depend on the
# variables' values: the standard library copying it for a subprocess
# (platform, to run ``file``) or for CGI (wsgiref.handlers), and libraries
# scanning it for their own prefix (compared always: ALWAYS_COMPARED).
_IGNORED_READERS = ("platform", "wsgiref", "networkx", "tqdm")


def _reader() -> str:
    """The module that reads the environment (past os and collections.abc)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("os", "_collections_abc", "collections.abc"):
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", "")) if frame is not None else ""


def _record_environ_reads():
    """Records the variables Python code reads from ``os.environ`` (and so
    ``os.getenv``) until the returned function is called."""
    cls = type(os.environ)
    getitem, iterate = cls.__getitem__, cls.__iter__
    reads = _Reads()

    def recorded_getitem(self, key):
        if isinstance(key, str) and _reader().split(".")[0] not in _IGNORED_READERS:
            reads.keys.add(key)
        return getitem(self, key)

    def recorded_iter(self):
        if _reader().split(".")[0] not in _IGNORED_READERS:
            reads.everything = True
        return iterate(self)

    cls.__getitem__, cls.__iter__ = recorded_getitem, recorded_iter

    def stop():
        cls.__getitem__, cls.__iter__ = getitem, iterate

    return stop, reads


def _reap(state_dir: Path, block: bool = False) -> bool:
    """Records the exit status of finished children; False when none is left."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        rc = os.waitstatus_to_exitcode(status)
        tmp = state_dir / f".exit-{pid}"
        tmp.write_text(str(rc))
        tmp.rename(state_dir / f"exit-{pid}")
        if block:
            return True


# ---- the test side -----------------------------------------------------------


class ForkedProcess:
    """A zygote's child, with the part of ``subprocess.Popen`` the engine
    launchers use (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int, state_dir: Path, zygote: subprocess.Popen):
        self.pid = pid
        self.returncode: Optional[int] = None
        self._exit = state_dir / f"exit-{pid}"
        self._zygote = zygote

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._exit.exists():
            self.returncode = int(self._exit.read_text())
        elif self.returncode is None and self._zygote.poll() is not None and not _alive(self.pid):
            self.returncode = -signal.SIGKILL  # its zygote died before it could report it
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class _Zygote:
    proc: subprocess.Popen
    state_dir: Path
    env: dict = field(default_factory=dict)
    # Variables its imports read (None: all of them, it serves its own
    # environment only).
    reads: Optional[frozenset] = None
    seq: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def serves(self, env: dict[str, str]) -> bool:
        if self.reads is None:
            return env == self.env
        return all(env.get(k) == self.env.get(k) for k in self.reads) and _native(env) == _native(self.env)

    def request(self, req: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return _read_reply(self.proc)

    def retire(self) -> None:
        """No more forks: the zygote waits for its children, records their
        exit status, then exits (an engine still running keeps its status)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        self.retire()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cpu_ticks(pid: int) -> Optional[int]:
    """User plus system CPU time of a process, in clock ticks (None where
    /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return int(fields[11]) + int(fields[12])  # utime and stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None


def _read_reply(proc: subprocess.Popen, idle_s: float = REPLY_IDLE_S, cap_s: float = REPLY_CAP_S,
                slice_s: float = 5.0) -> dict:
    """The zygote's next reply line, waited for while it works (REPLY_IDLE_S)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    wait = Progress(lambda: _cpu_ticks(proc.pid), idle_s, cap_s)
    while True:
        ready, _, _ = select.select([fd], [], [], slice_s)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"zygote {proc.pid} closed its output without a reply after "
                                   f"{wait.elapsed():.0f} s (exit code {proc.poll()})")
            return json.loads(line)
        if proc.poll() is not None:
            raise RuntimeError(f"zygote {proc.pid} exited ({proc.returncode}) without a reply after "
                               f"{wait.elapsed():.0f} s")
        why = wait.gave_up()
        if why == "idle":
            raise RuntimeError(f"zygote {proc.pid} gave no reply in {wait.elapsed():.0f} s and used no CPU "
                               f"in the last {idle_s:.0f} s")
        if why == "cap":
            raise RuntimeError(f"zygote {proc.pid} gave no reply within {cap_s:.0f} s")


# Variables pytest sets per test: a fresh engine would inherit them, and
# nothing in an engine reads them.
_PER_TEST = ("PYTEST_CURRENT_TEST",)


def _native(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(ALWAYS_COMPARED)}


_POOL: Optional["ZygotePool"] = None


def pool() -> "ZygotePool":
    """The session's zygotes (stopped when the test process exits)."""
    global _POOL
    if _POOL is None:
        import atexit
        import tempfile

        _POOL = ZygotePool(Path(tempfile.mkdtemp(prefix="lmca-zygotes-")))
        atexit.register(_POOL.close)
    return _POOL


class ZygotePool:
    """Zygotes started on first use; an engine is forked from the oldest one
    that serves its environment and did not fork this test's previous
    engine (two engines of a test never share a hash secret)."""

    def __init__(self, root: Path):
        self.root = root
        self._zygotes: dict[int, _Zygote] = {}
        self._failed: list[dict] = []  # environments whose zygote failed
        self._retired: list[_Zygote] = []  # evicted, exiting once their children have
        self._last: dict[str, int] = {}  # owner -> the zygote of its previous engine
        self._seq = 0
        self.forks = 0  # engines forked so far
        self.started = 0  # zygotes started so far
        self._warmed = False  # vLLM's model-class cache (see _warm)
        # The test process's thread and the spawn broker's (spawn_broker.py).
        self.lock = threading.RLock()
        self.broker = None  # spawn_broker.SpawnBroker, started on first use

    def launch(self, module: str, args: list[str], env: dict[str, str], cwd: Path, log: Path,
               owner: str, new_session: bool = False) -> Optional[ForkedProcess]:
        """A forked engine process, or None where the caller must start a
        fresh one (turned off, or this environment's zygote failed: logged)."""
        if os.environ.get(ENABLE_ENV, "1") == "0":
            return None
        import spawn_broker

        env = {k: v for k, v in env.items() if k not in _PER_TEST}
        broker = spawn_broker.broker(self)
        if broker is not None:
            env = broker.env(env)
        with self.lock:
            return self._launch(module, args, env, cwd, log, owner, new_session)

    def _launch(self, module, args, env, cwd, log, owner, new_session) -> Optional[ForkedProcess]:
        if env in self._failed:
            return None
        z = None
        try:
            z = self._zygote(env, avoid=self._last.get(owner))
            reply = z.request({"module": module, "args": args, "cwd": str(cwd), "log": str(log),
                               "new_session": new_session, "env": env})
            if "error" in reply:
                raise RuntimeError(reply["error"])
        except (OSError, RuntimeError, ValueError) as e:
            self._failed.append(env)
            if z is not None:
                self._drop(z.seq)
            logger.warning("engine zygote unusable (%s); this environment's engines start as fresh processes", e)
            return None
        z.last_used = time.monotonic()
        self._last[owner] = z.seq
        self.forks += 1
        return ForkedProcess(int(reply["pid"]), z.state_dir, z.proc)

    def zygote_for(self, env: dict[str, str]) -> _Zygote:
        """The zygote that serves ``env`` (started if none does); under ``lock``."""
        if env in self._failed:
            raise RuntimeError("this environment's zygote failed before")
        try:
            return self._zygote(env, avoid=None)
        except (OSError, RuntimeError, ValueError):
            self._failed.append(env)
            raise

    def _zygote(self, env: dict[str, str], avoid: Optional[int]) -> _Zygote:
        for seq in sorted(self._zygotes):
            z = self._zygotes[seq]
            if seq != avoid and z.proc.poll() is None and z.serves(env):
                return z
        self._retired = [r for r in self._retired if r.proc.poll() is None]  # reaps those done
        while len(self._zygotes) >= MAX_ALIVE:
            lru = self._zygotes.pop(min(self._zygotes, key=lambda k: self._zygotes[k].last_used))
            lru.retire()
            self._retired.append(lru)
        self._seq += 1
        self.started += 1
        seq = self._seq
        state_dir = self.root / f"zygote{seq}"
        state_dir.mkdir(parents=True, exist_ok=True)
        log = open(state_dir / "zygote.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_zygote", str(state_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env=env, cwd=str(state_dir),
        )
        log.close()
        z = _Zygote(proc, state_dir, env=dict(env), seq=seq)
        self._zygotes[seq] = z
        try:
            ready = _read_reply(proc)
            if not ready.get("ready"):
                raise RuntimeError(f"zygote did not start: {ready}")
        except RuntimeError:
            self._drop(seq)
            raise
        if ready.get("reads") is None:
            logger.warning("engine zygote %d: the imports read the whole environment; it serves this "
                           "environment only", seq)
        else:
            z.reads = frozenset(ready["reads"])
        if not self._warmed:
            self._warmed = True
            self._warm(z)
        return z

    def _warm(self, z: _Zygote) -> None:
        """Once per session, beside the first engine: vLLM's model-class
        cache filled by a forked child (support/modelinfo_warm.py) instead of
        by a fresh interpreter per architecture. Not waited for: an engine
        that needs an entry first computes it as vLLM always does."""
        try:
            reply = z.request({"module": "modelinfo_warm", "args": [], "cwd": str(z.state_dir),
                               "log": str(z.state_dir / "modelinfo-warm.log"), "new_session": False,
                               "env": z.env})
            if "error" in reply:
                raise RuntimeError(reply["error"])
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("engine zygote %d: model-class cache not warmed (%s); vLLM fills it per engine", z.seq, e)

    def _drop(self, seq: int) -> None:
        z = self._zygotes.pop(seq, None)
        if z is not None:
            z.stop()

    def close(self) -> None:
        import shutil

        if self.broker is not None:
            self.broker.close()
        # All told to stop first, then waited for: each takes 2-3 s to exit.
        everyone = list(self._zygotes.values()) + self._retired
        self._zygotes.clear()
        for z in everyone:
            z.retire()
        for z in everyone:
            z.stop()
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))
