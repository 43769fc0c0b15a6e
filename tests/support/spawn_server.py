"""Test engines: the processes vLLM spawns, forked from a zygote instead.

vLLM-CPU sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in its platform's
``check_and_update_config`` (``vllm/platforms/cpu.py``, every release from
0.23 to 0.32), so an engine's core process and each of its workers is a
fresh interpreter that imports torch and vLLM again: 12-14 s each on a
2-core machine (an engine log: 12 s from the main process's last line to
the engine core's first, 14 s more to its worker's), paid by every
multiprocess and tensor-parallel engine of the tests. The zygotes
(engine_zygote.py) fork only an engine's main process.

Python's ``forkserver`` start method does what a spawn does, from a server
process: the child reads the same preparation data and process object,
through the same ``multiprocessing.spawn`` code, with the descriptors the
object needs sent over a Unix socket. Here the server is a child of a
zygote that serves the spawning process's environment (the same rule as
for engines: it agrees on every variable the zygote's imports read and on
those native libraries read), started on first use by the test process's
broker (spawn_broker.py) and kept for the session, so every engine core
and worker of the suite with a compatible environment forks from one.

What the child gets, as a spawned one would:

* the environment of the spawning process at ``start()``, exactly, taken
  before it unpickles the process object (so before it imports the
  target's module);
* the spawning process's stdout and stderr (the engine's log), sent with
  the other descriptors;
* the same process group: only a process in the test process's group uses
  a server (servers are children of zygotes, which are in that group); an
  engine in a session of its own (a test that kills it by process group)
  spawns as vLLM does, so ``killpg`` still reaches all of its processes.

What it does not get: a hash secret of its own (forks of one zygote share
it). Chunk keys must not depend on it: unit tests check that across fresh
interpreters (test_chunk_keys), and an engine's workers and engine core
still come from different zygotes (their environments differ in the
variables vLLM sets for them).

``LMCA_TEST_SPAWN_SERVER=0`` in pytest's environment turns it off (vLLM's
spawn, as before). Any failure to use a server is one line on the engine's
stderr, and that process is spawned as vLLM would.
"""

from __future__ import annotations

import functools
import io
import json
import os
import socket
import sys

BROKER_ENV = "LMCA_TEST_SPAWN_BROKER"  # the broker's socket path
PGID_ENV = "LMCA_TEST_SPAWN_PGID"  # the process group servers live in
_PREP_ENV = "lmca_environ"
_PREP_STDIO = "lmca_stdio"
_told: set[str] = set()


def _tell(line: str) -> None:
    if line not in _told:
        _told.add(line)
        sys.stderr.write(f"lmcache-ascend-test: {line} (pid {os.getpid()})\n")
        sys.stderr.flush()


def _server_address() -> tuple[str | None, str]:
    """The address of a server for this process's environment, or None
    and why not."""
    broker = os.environ.get(BROKER_ENV)
    if not broker:
        return None, "no broker"
    if str(os.getpgid(0)) != os.environ.get(PGID_ENV):
        return None, "this engine runs in a process group of its own"
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(600)
            s.connect(broker)
            s.sendall(json.dumps({"env": dict(os.environ)}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        answer = json.loads(reply or b"{}")
    except (OSError, ValueError) as e:
        return None, f"the broker did not answer ({e})"
    if "address" not in answer:
        return None, str(answer.get("error", "the broker gave no server"))
    return answer["address"], ""


def _popen(process_obj):
    address, why = _server_address()
    if address is None:
        _tell(f"spawned {process_obj.name} as vLLM does: {why}")
        from multiprocessing.popen_spawn_posix import Popen
        return Popen(process_obj)
    return _ServerPopen(process_obj, address)


@functools.cache  # built on first use: a process that never spawns imports none of it
def _server_popen_class():
    from multiprocessing import popen_forkserver, resource_tracker, spawn, util
    from multiprocessing.context import reduction, set_spawning_popen
    from multiprocessing.forkserver import read_signed

    class ServerPopen(popen_forkserver.Popen):
        """popen_forkserver.Popen with the server's address given, not the
        module's own server (whose launch is the same up to that)."""

        def __init__(self, process_obj, address):
            self._address = address
            super().__init__(process_obj)

        def _launch(self, process_obj):
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data[_PREP_ENV] = dict(os.environ)
            prep_data[_PREP_STDIO] = True
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            resource_tracker.ensure_running()
            # The server's protocol (forkserver.main): the child's two pipe
            # ends, an "alive" descriptor, the resource tracker's, then the
            # descriptors the object refers to by index, then (ours, last,
            # so the indices hold) this process's stdout and stderr.
            alive = os.open(os.devnull, os.O_RDONLY)
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            try:
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(self._address)
                    reduction.sendfds(client, [child_r, child_w, alive, resource_tracker.getfd()]
                                      + self._fds + [1, 2])
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                for fd in (child_r, child_w, alive):
                    os.close(fd)
            self.sentinel, w = parent_r, parent_w
            _parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = read_signed(self.sentinel)

    return ServerPopen


def _ServerPopen(process_obj, address):
    return _server_popen_class()(process_obj, address)


def _prepare_with(original):
    def prepare(data):
        env = data.get(_PREP_ENV)
        if env is not None:  # the spawning process's environment, exactly
            os.environ.clear()
            os.environ.update(env)
        if data.get(_PREP_STDIO):
            from multiprocessing import forkserver

            fds = forkserver._forkserver._inherited_fds
            out, err = fds[-2:]
            del fds[-2:]
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
        original(data)

    return prepare


def install() -> None:
    """In every test engine process (sitecustomize): children of the spawn
    context go through a server where one serves; a server's children
    take the spawning process's environment and stdio."""
    import multiprocessing.context as context
    import multiprocessing.spawn as spawn

    spawn.prepare = _prepare_with(spawn.prepare)
    if os.environ.get(BROKER_ENV):
        context.SpawnProcess._Popen = staticmethod(_popen)


def serve(address: str) -> None:
    """A zygote's child: Python's fork server on ``address``, kept until
    the test session stops it (and ended with its zygote)."""
    import ctypes
    import signal
    from multiprocessing import forkserver

    try:  # PR_SET_PDEATHSIG: ends with its zygote whatever happens
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    listener = socket.socket(socket.AF_UNIX)
    tmp = address + ".tmp"
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen()
    os.rename(tmp, address)  # the broker waits for the address to appear
    alive_r, _alive_w = os.pipe()  # never closed: the server outlives its clients
    forkserver.main(listener.fileno(), alive_r, [], None, None)


if __name__ == "__main__":
    serve(sys.argv[1])
