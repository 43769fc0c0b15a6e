"""A real ``redis-server`` for tests: started on 127.0.0.1 on a free port,
stopped by PID, never persisted (``--save "" --appendonly no``). With
``password`` it requires it (``--requirepass``, the ``default`` user); with
``tls`` it serves TLS only (``--tls-port``, ``--port 0``) with a CA and a
server certificate for 127.0.0.1 that :func:`make_tls_files` generates with
the ``openssl`` command.

If ``redis-server`` is not on PATH, :func:`ensure_redis_server` installs it
with ``apt-get`` (``apt-get update`` first) where that is possible, and the
caller skips otherwise.

:class:`RespClient` is a minimal RESP2 client over a raw socket, so tests can
inspect and damage stored entries (``KEYS``, ``DBSIZE``, ``GET``, ``SET``,
``DEL``) without depending on any client library.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Optional, Union

from ports import free_port

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0

Reply = Union[None, int, bytes, str, list]


def ensure_redis_server() -> Optional[str]:
    """Path of ``redis-server``, installing it with apt-get if missing.
    Returns None when it cannot be had (the caller skips)."""
    path = shutil.which("redis-server")
    if path:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None
    # The project's installer waits for apt's locks (held for the first
    # minutes of a fresh machine by unattended upgrades) instead of failing.
    script = Path(__file__).resolve().parents[2] / "scripts" / "apt_install.sh"
    try:
        subprocess.run(["bash", str(script), "redis-server"], check=True, timeout=900,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (subprocess.SubprocessError, OSError) as exc:
        said = (getattr(exc, "stderr", None) or b"").decode(errors="replace")[-2000:]
        print(f"installing redis-server failed: {said or exc}", file=sys.stderr)
        return None
    return shutil.which("redis-server")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TlsFiles:
    """A throwaway CA and a server certificate signed by it, valid for
    127.0.0.1 and localhost (what a client that checks hostnames needs)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("openssl")
    if exe is None:
        raise FileNotFoundError("the openssl command is needed to make test certificates")
    ca_key, ca_cert = workdir / "ca.key", workdir / "ca.crt"
    key, csr, cert = workdir / "server.key", workdir / "server.csr", workdir / "server.crt"
    ext = workdir / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([exe, *args], check=True, cwd=workdir, timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=lmca-test-ca",
        "-keyout", str(ca_key), "-out", str(ca_cert))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(ext), "-out", str(cert))
    for secret in (ca_key, key):
        secret.chmod(0o600)
    return TlsFiles(ca_cert, cert, key)


def closed_port() -> int:
    """A loopback port with nothing listening: claimed, so no test server takes it."""
    return free_port()


class RespError(RuntimeError):
    pass


class RespClient:
    """Blocking RESP2 client for one connection (test use only)."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0,
                 password: Optional[str] = None, ca_cert: Optional[Path] = None) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        if ca_cert is not None:
            sock = ssl.create_default_context(cafile=str(ca_cert)).wrap_socket(sock, server_hostname=host)
        self._sock = sock
        self._buf = b""
        if password is not None:
            self.command("AUTH", password)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "RespClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, *args: Union[str, bytes, int]) -> Reply:
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            data = a if isinstance(a, bytes) else str(a).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        self._sock.sendall(b"".join(parts))
        return self._reply()

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise RespError("connection closed by redis-server")
        self._buf += chunk

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            self._fill()
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self._buf) < n + 2:
            self._fill()
        data, self._buf = self._buf[:n], self._buf[n + 2 :]
        return data

    def _reply(self) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RespError(f"unexpected reply {line!r}")

    # Conveniences
    def keys(self, pattern: str = "*") -> list[bytes]:
        return list(self.command("KEYS", pattern) or [])

    def dbsize(self) -> int:
        return int(self.command("DBSIZE"))

    def get(self, key: bytes) -> Optional[bytes]:
        return self.command("GET", key)  # type: ignore[return-value]

    def set(self, key: bytes, value: bytes) -> None:
        self.command("SET", key, value)

    def delete(self, *keys: bytes) -> int:
        return int(self.command("DEL", *keys))


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; use as a context manager."""

    def __init__(self, workdir: Path, port: Optional[int] = None, password: Optional[str] = None,
                 tls: bool = False) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.password = password
        self.tls: Optional[TlsFiles] = make_tls_files(self.workdir / f"tls-{self.port}") if tls else None
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        """The URL LMCache's Redis connector (redis-py) takes: credentials of
        the ``default`` user in it, the CA as redis-py's ``ssl_ca_certs``."""
        auth = f"default:{self.password}@" if self.password is not None else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}"
        return f"rediss://{auth}127.0.0.1:{self.port}?ssl_ca_certs={self.tls.ca_cert}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "RedisServer":
        exe = ensure_redis_server()
        if exe is None:
            raise FileNotFoundError("redis-server is not installed and could not be installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca_cert),
                      "--tls-auth-clients", "no"]
        if self.password is not None:
            listen += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            [
                exe,
                *listen,
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--dir", str(self.workdir),
                "--logfile", str(self.log_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=str(self.workdir),
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}: "
                    + (self.log_path.read_text(errors="replace") if self.log_path.exists() else "")
                )
            try:
                with self.client(timeout=1.0) as c:
                    if c.command("PING") == "PONG":
                        return self
            except (OSError, RespError):
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING")

    def client(self, timeout: float = 10.0) -> RespClient:
        return RespClient(self.port, timeout=timeout, password=self.password,
                          ca_cert=self.tls.ca_cert if self.tls else None)

    def kill(self) -> None:
        """SIGKILL by PID: the abrupt outage a crashed server causes."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
