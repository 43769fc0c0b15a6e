"""A real Mooncake store for tests: one ``mooncake_master`` and one
``mooncake_client`` (the segment holder that owns the pool's memory), both
on 127.0.0.1 on free ports, stopped by PID.

The binaries come from the ``mooncake-transfer-engine-non-cuda`` wheel
(``make system-deps`` installs it into ``.venv`` with the Debian libraries
it links, libibverbs1 and libnl-3, needed even for TCP). There is no
silent skip: ``make test`` installs Mooncake, so a machine without it is a
broken setup and :func:`mooncake_bin` raises.

Metadata: P2PHANDSHAKE by default (no metadata server, nothing listening
beyond the loopback). ``http_metadata=True`` starts the master's built-in
HTTP metadata server instead (it binds 0.0.0.0 whatever its host flag says,
so only the test that needs it, the metadata-mismatch probe, uses it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ports import free_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def mooncake_bin(name: str) -> str:
    """Path of a Mooncake executable next to this interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: Mooncake is not installed in this environment "
            "(`make system-deps`, or `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` "
            "plus `apt-get install libibverbs1 libnl-3-200 libnl-route-3-200`)"
        )
    return str(path)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


class MooncakeStore:
    """Master plus segment holder; use as a context manager."""

    def __init__(self, workdir: Path, segment: str = "256MB", http_metadata: bool = False,
                 holder: bool = True, master_args: tuple[str, ...] = ()) -> None:
        self.workdir = Path(workdir)
        # Mooncake refuses segments below 16 MB.
        self.segment = segment
        self.with_holder = holder
        self.master_args = tuple(master_args)
        self.http_metadata = http_metadata
        self.master_port = free_port()
        self.metrics_port = free_port()
        self.metadata_port = free_port() if http_metadata else None
        self.holder_port = free_port()
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def metadata_server(self) -> str:
        if self.metadata_port is None:
            return "P2PHANDSHAKE"
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def extra_config(self, **overrides) -> dict:
        """LMCache ``extra_config`` for a client of this store: it holds no
        segment of its own (the holder does) and keeps LMCache's default
        metadata-in-value mode."""
        cfg = {
            "mooncake_master_server_addr": self.master_addr,
            "mooncake_metadata_server": self.metadata_server,
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_protocol": "tcp",
            "mooncake_global_segment_size": 0,
            "mooncake_local_buffer_size": 64 << 20,
        }
        cfg.update(overrides)
        return cfg

    def engine_env(self, **overrides) -> dict[str, str]:
        return {
            "LMCACHE_REMOTE_URL": f"mooncakestore://{self.master_addr}/",
            "LMCACHE_REMOTE_SERDE": "naive",
            "LMCACHE_EXTRA_CONFIG": json.dumps(self.extra_config(**overrides)),
        }

    def _log(self, name: str):
        return open(self.workdir / f"mooncake-{name}-{self.master_port}.log", "w")

    def start(self) -> "MooncakeStore":
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            mooncake_bin("mooncake_master"),
            f"--rpc_port={self.master_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            f"--enable_http_metadata_server={'true' if self.http_metadata else 'false'}",
        ]
        args += list(self.master_args)
        if self.metadata_port is not None:
            args += ["--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.metadata_port}"]
        with self._log("master") as log:
            self.master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=str(self.workdir))
        self._wait(self.master, self.master_port, "mooncake_master")
        if self.with_holder:
            self.start_holder()
        return self

    def start_holder(self) -> None:
        with self._log("holder") as log:
            self.holder = subprocess.Popen(
                [
                    mooncake_bin("mooncake_client"),
                    f"--global_segment_size={self.segment}",
                    f"--master_server_address={self.master_addr}",
                    f"--metadata_server={self.metadata_server}",
                    "--host=127.0.0.1",
                    f"--port={self.holder_port}",
                    "--protocol=tcp",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(self.workdir),
            )
        self._wait(self.holder, self.holder_port, "mooncake_client")

    def _wait(self, proc: subprocess.Popen, port: int, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{what} exited with {proc.returncode}; see {self.workdir}")
            # The holder listens only after it has mounted its segment.
            if _listening(port):
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s")

    def log_text(self, name: str) -> str:
        p = self.workdir / f"mooncake-{name}-{self.master_port}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        _stop(self.holder)
        _stop(self.master)

    def __enter__(self) -> "MooncakeStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
