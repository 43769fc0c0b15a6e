"""How long the tests wait for a vLLM OpenAI server to become ready
(tests/support/openai_server.py ``wait_ready``): as long as its processes
work, however slow the machine; not past START_IDLE_S without CPU use, nor
past a server that exited. Real processes stand in for the server: one
that computes (in a child, as vLLM's engine core does) before it serves
``/health``, one that sleeps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from openai_server import Server, wait_ready
from ports import free_port

pytestmark = pytest.mark.pure

# Computes CPU_S seconds of CPU time in a child process (wall time grows with
# a slow machine), then answers /health.
SLOW_SERVER = """
import http.server, subprocess, sys
cpu_s, port = sys.argv[1], int(sys.argv[2])
subprocess.run([sys.executable, "-c",
                "import time\\nend = time.process_time() + " + cpu_s + "\\nwhile time.process_time() < end: pass"])

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _server(tmp_path: Path, code: str, *args: str) -> Server:
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-c", code, *args, str(port)], stdout=lf, stderr=subprocess.STDOUT)
    return Server("fake", proc, port, log)


def _stop(srv: Server) -> None:
    srv.proc.kill()
    srv.proc.wait()


def test_a_server_whose_processes_work_is_waited_for_past_the_idle_limit(tmp_path):
    srv = _server(tmp_path, SLOW_SERVER, "4")  # 4 CPU-s in a child: past the 2 s idle limit
    try:
        wait_ready(srv, idle_s=2.0, cap_s=300.0)
        assert srv.proc.poll() is None
    finally:
        _stop(srv)


def test_a_server_that_uses_no_cpu_is_given_up_after_the_idle_limit(tmp_path):
    srv = _server(tmp_path, "import sys, time; print('starting', flush=True); time.sleep(600)")
    try:
        with pytest.raises(AssertionError, match=r"used no CPU in the last 2 s(.|\n)*starting"):
            wait_ready(srv, idle_s=2.0, cap_s=300.0)
    finally:
        _stop(srv)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    srv = _server(tmp_path, "import sys; print('bad option', flush=True); sys.exit(3)")
    with pytest.raises(AssertionError, match=r"fake exited \(3\)(.|\n)*bad option"):
        wait_ready(srv, idle_s=60.0, cap_s=300.0)
