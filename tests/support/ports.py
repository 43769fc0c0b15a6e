"""Loopback ports for the servers the tests start: vLLM's OpenAI server, Redis,
the Mooncake master.

Why not ``bind(("127.0.0.1", 0))`` and hand that port on: the kernel picks it
from its ephemeral range, and it is free again the moment the probe socket
closes. A vLLM server binds it only after its imports, 10-60 s later on two
busy cores. Meanwhile every outgoing connection on the machine and every
``bind(0)`` (vLLM's own engine ports; the pytest processes of the stacks that
``make test`` runs beside the primary suite) draws from that same range. A CI
run of ``make test`` failed that way: vLLM 0.27's API server got
``EADDRINUSE`` on the port its test had picked.

So a port here comes from outside the ephemeral range, where the kernel never
hands one out by itself, and a claim file per port under the temp directory
keeps test processes running side by side from choosing the same one. A claim
lapses when its process is gone or after :data:`CLAIM_S`; by then the server
that got the port has bound it, or has failed, and the bind check below skips
a bound port anyway.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# Longer than any server here takes to bind the port it was given: their
# start-up deadlines are 300 s at most.
CLAIM_S = 900.0
# Ports below this stay clear of well-known services' defaults.
LOWEST = 10000
EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_warned = False


def ephemeral_range(path: Path = EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ``ip_local_port_range``; Linux's default where unreadable."""
    try:
        low, high = (int(v) for v in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def candidate_range(ephemeral: tuple[int, int]) -> range:
    """The larger stretch of [LOWEST, 65535] outside the ephemeral range."""
    low, high = ephemeral
    below = range(LOWEST, max(LOWEST, low))
    above = range(max(LOWEST, high + 1), 65536)
    return below if len(below) >= len(above) else above


def claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "lmcache-ascend-test-ports"


def _claim_lapsed(path: Path) -> bool:
    try:
        pid_text, _, stamp_text = path.read_text().partition(" ")
        pid, stamp = int(pid_text), float(stamp_text)
    except (OSError, ValueError):
        return True  # unreadable or half-written by a process that died
    if time.time() - stamp > CLAIM_S:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _claim(port: int, where: Path) -> bool:
    path = where / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not _claim_lapsed(path):
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {time.time()}")
        return True
    return False


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, claims: Optional[Path] = None, rng: Optional[random.Random] = None,
              ephemeral: Optional[tuple[int, int]] = None) -> int:
    """A loopback port nothing listens on, claimed for this process."""
    global _warned
    where = claims or claims_dir()
    where.mkdir(parents=True, exist_ok=True)
    ephemeral = ephemeral or ephemeral_range()
    pool = candidate_range(ephemeral)
    if len(pool) < 1000:
        # Only a machine whose ephemeral range covers nearly every port gets
        # here: fall back to the kernel's choice, and say so once.
        if not _warned:
            _warned = True
            print(f"[ports] no room outside the ephemeral range {ephemeral}; "
                  "tests take the kernel's ports, which other processes may take first",
                  file=sys.stderr)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    pick = rng or random.SystemRandom()
    for _ in range(4 * len(pool)):
        port = pick.randrange(pool.start, pool.stop)
        if _bindable(port) and _claim(port, where):
            return port
    raise RuntimeError(f"no free loopback port in {pool.start}-{pool.stop - 1}: every one is bound or claimed "
                       f"under {where}")
