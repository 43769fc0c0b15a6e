"""The test process's end of spawn_server.py: hands a test engine's
processes the address of a fork server for their environment.

A thread listens on a Unix socket (its path goes to every engine forked
from a zygote, ``spawn_server.BROKER_ENV``). Each request carries the
environment of a process about to spawn; the reply is the address of a
server forked from the zygote that serves that environment (the pool's
rule, engine_zygote.ZygotePool), started on first use and kept until the
session ends: a server never stops while a process it forked may still
run, since vLLM reads a dead server as a dead engine core.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import spawn_server

logger = logging.getLogger(__name__)

ENABLE_ENV = "LMCA_TEST_SPAWN_SERVER"
READY_TIMEOUT_S = 60


class SpawnBroker:
    def __init__(self, pool):
        import tempfile

        self.pool = pool
        # Sockets in a short folder of their own: a Unix socket's path has
        # at most 107 bytes, and a test's tmp_path can be longer.
        self.root = Path(tempfile.mkdtemp(prefix="lmca-spawn-"))
        self.address = str(self.root / "broker.sock")
        self._servers: dict[int, str] = {}  # zygote seq -> server address
        self._pids: list[int] = []
        self.served = 0  # processes handed a server
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(self.address)
        self._sock.listen(16)
        threading.Thread(target=self._loop, name="spawn-broker", daemon=True).start()

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the variables that lead its spawns here."""
        return {**env, spawn_server.BROKER_ENV: self.address, spawn_server.PGID_ENV: str(os.getpgid(0))}

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        return
                    buf += chunk
                env = json.loads(buf)["env"]
                reply = {"address": self._server_for(env)}
            except Exception as e:  # noqa: BLE001 - the engine spawns as vLLM does and says why
                reply = {"error": f"no fork server: {e}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass

    def _server_for(self, env: dict[str, str]) -> str:
        env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}
        with self.pool.lock:
            z = self.pool.zygote_for(env)
            address = self._servers.get(z.seq)
            if address is None:
                address = str(self.root / f"server{z.seq}.sock")
                reply = z.request({"module": "spawn_server", "args": [address], "cwd": str(z.state_dir),
                                   "log": str(z.state_dir / "spawn-server.log"), "new_session": False,
                                   "env": env})
                if "error" in reply:
                    raise RuntimeError(reply["error"])
                self._pids.append(int(reply["pid"]))
                end = time.monotonic() + READY_TIMEOUT_S
                while not os.path.exists(address):
                    if time.monotonic() > end:
                        raise RuntimeError(f"fork server {reply['pid']} did not listen within {READY_TIMEOUT_S} s")
                    time.sleep(0.02)
                self._servers[z.seq] = address
            self.served += 1
            return address

    def close(self) -> None:
        import shutil
        import signal

        try:
            self._sock.close()
        except OSError:
            pass
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def broker(pool) -> Optional[SpawnBroker]:
    """The pool's broker, started on first use (None where turned off)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    if pool.broker is None:
        pool.broker = SpawnBroker(pool)
    return pool.broker
