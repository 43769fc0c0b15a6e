"""A vLLM OpenAI server process started by a test: its readiness, its
process tree's RSS over its life, and its stop on SIGTERM.

Shared by tests/integration/test_server_load.py (which starts one with and
one without the connector) and test_data_parallel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from wait_progress import Progress

# A server's start imports torch and vLLM and builds its engine: about a
# minute on a normal 2-core machine, many on a slow one (seen: `import
# torch` alone took 135 s). So no fixed time: the wait lasts while the
# server's processes work (their CPU time changes), and gives up when they
# have used no CPU for START_IDLE_S (hung), when the server exits, or after
# START_CAP_S in all (under pytest's 900 s, so the failure says why).
START_IDLE_S = 120.0
START_CAP_S = 840.0
STOP_TIMEOUT_S = 60


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    peak_rss: int = 0  # whole life, startup included
    serving_peak_rss: int = 0  # since mark_serving()
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _sampler: Optional[threading.Thread] = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start_sampling(self) -> None:
        import psutil

        def sample() -> None:
            root = psutil.Process(self.proc.pid)
            while not self._stop.is_set() and self.proc.poll() is None:
                total = 0
                try:
                    procs = [root] + root.children(recursive=True)
                except psutil.Error:
                    break
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak_rss = max(self.peak_rss, total)
                self.serving_peak_rss = max(self.serving_peak_rss, total)
                self.samples += 1
                self._stop.wait(0.2)

        self._sampler = threading.Thread(target=sample, daemon=True, name=f"rss-{self.name}")
        self._sampler.start()

    def mark_serving(self) -> None:
        self.serving_peak_rss = 0

    def stop(self) -> float:
        """SIGTERM the server process (as a supervisor would); returns seconds
        until it exited, or inf when it needed SIGKILL after STOP_TIMEOUT_S.
        Whatever is left of its process group is killed afterwards."""
        self._stop.set()
        took = 0.0
        if self.proc.poll() is None:
            t0 = time.time()
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
                took = time.time() - t0
            except subprocess.TimeoutExpired:
                took = float("inf")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        return took


def tree_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user and system) of a process and its live descendants
    (None where the process is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def wait_ready(server: Server, idle_s: float = START_IDLE_S, cap_s: float = START_CAP_S) -> None:
    wait = Progress(lambda: tree_cpu_s(server.proc.pid), idle_s, cap_s)
    while True:
        if server.proc.poll() is not None:
            raise AssertionError(f"{server.name} exited ({server.proc.returncode}):\n" + server.log()[-6000:])
        try:
            with urllib.request.urlopen(server.base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        # A child that exited takes its CPU time with it: a change too.
        why = wait.gave_up()
        if why == "idle":
            raise AssertionError(f"{server.name} not ready after {wait.elapsed():.0f} s, and its processes used "
                                 f"no CPU in the last {idle_s:.0f} s:\n" + server.log()[-6000:])
        if why == "cap":
            raise AssertionError(f"{server.name} not ready in {cap_s:.0f} s:\n" + server.log()[-6000:])
        time.sleep(1.0)
