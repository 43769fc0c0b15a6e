"""The Mooncake setup in docs/deployment-ascend.md, run as written (issue 34,
item 3: docs checked by running them).

The doc tells the user to start each pool with
``examples/mooncake/start_pool.sh`` and shows two invocations for two pools
on one host. These tests take those lines from the doc itself (so doc and
test cannot drift apart), run them with free ports and 64MB segments, and
check that both pools become ready side by side (capacity on the master's
``/metrics``), that each is a real, separate store (a put and a get of the
same key with different values through Mooncake's Python client), and that
the script fails clearly when a holder cannot start. No vLLM engine.

Every process is stopped by PID in a finalizer: the PIDs the script
prints, and any Mooncake process still running with one of this test's
ports on its command line (a failed run never printed its PIDs).

Mooncake is installed by ``make system-deps``; without it these tests fail
(mooncake_server.mooncake_bin raises), they never skip.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mooncake_server import free_port, mooncake_bin

# Marked like test_mooncake.py. It starts no vLLM engine, but `engine` keeps
# it off the compatibility stacks (Makefile: "not engine or compat"), whose
# environments have no Mooncake and would repeat a test that loads neither
# vLLM nor LMCache.
pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment-ascend.md"
SCRIPT = "examples/mooncake/start_pool.sh"
PORT_OPTIONS = ("--master-port", "--metrics-port", "--holder-port")
SCRIPT_TIMEOUT_S = 90
STOP_TIMEOUT_S = 10.0

# A put and a get through Mooncake's own Python store client, in a child
# process: Mooncake's client threads and retries die with it.
PUT_GET = r"""
import json, sys
from mooncake.store import MooncakeDistributedStore
master, key, value = sys.argv[1], sys.argv[2], sys.argv[3].encode()
store = MooncakeDistributedStore()
out = {"setup": store.setup({
    "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
    "global_segment_size": "0", "local_buffer_size": str(16 << 20), "master_server_addr": master})}
if out["setup"] == 0:
    out["put"] = store.put(key, value)
    got = store.get(key)
    out["get"] = got.decode() if got else None
print(json.dumps(out), flush=True)
store.close()
"""


def _mooncake_section() -> str:
    text = DOC.read_text()
    start = text.index("## Mooncake store")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _doc_invocations() -> list[list[str]]:
    """The distinct ``start_pool.sh`` command lines of the doc's Mooncake
    section, split as the shell would."""
    seen: list[list[str]] = []
    for line in _mooncake_section().splitlines():
        if line.startswith(SCRIPT + " "):
            argv = shlex.split(line.split("#", 1)[0])
            if argv not in seen:
                seen.append(argv)
    return seen


def _options(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv[1:])


def _on_this_host(argv: list[str], ports: dict[str, int]) -> list[str]:
    """The doc's command with this host's values: 127.0.0.1 for
    <master_ip>, free ports, a 64MB segment (Mooncake's minimum is 16MB);
    nothing else changes."""
    out = [str(ROOT / argv[0])]
    for arg in argv[1:]:
        name, value = arg.split("=", 1)
        if name in ports:
            value = str(ports[name])
        elif name == "--segment-size":
            value = "64MB"
        out.append(f"{name}={value.replace('<master_ip>', '127.0.0.1')}")
    return out


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def _state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        pass
    return ""


def _stop_pid(pid: int) -> None:
    """SIGTERM, wait, SIGKILL: the process is the script's child, so once the
    script exited nobody here can wait() for it; gone or a zombie is stopped."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _state(pid) not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    if _state(pid) not in ("", "Z"):
        os.kill(pid, signal.SIGKILL)


def _mooncake_pids_with(args: set[str]) -> list[int]:
    """PIDs of running mooncake_master/mooncake_client processes whose
    command line holds one of ``args`` (flags naming this test's ports)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and Path(argv[0]).name in ("mooncake_master", "mooncake_client") and args & set(argv):
            pids.append(int(proc.name))
    return pids


@pytest.fixture
def pools(tmp_path):
    """Runs start_pool.sh command lines; stops everything they started."""
    pids: list[int] = []
    port_args: set[str] = set()

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        for arg in argv[1:]:
            name, value = arg.split("=", 1)
            flag = {"--master-port": "--rpc_port", "--holder-port": "--port"}.get(name)
            if flag:
                port_args.add(f"{flag}={value}")
        env = dict(os.environ, PATH=f"{Path(mooncake_bin('mooncake_master')).parent}:{os.environ['PATH']}")
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT_S)
        pids.extend(int(p) for p in re.findall(r"^MOONCAKE_\w+_PID=(\d+)$", done.stdout, re.M))
        return done

    yield run
    for pid in pids + _mooncake_pids_with(port_args):
        _stop_pid(pid)
    assert not _mooncake_pids_with(port_args), "a Mooncake process of this test outlived its stop"


def _capacity(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^master_total_capacity_bytes (\S+)$", text, re.M)
    assert m, text[:500]
    return int(float(m.group(1)))


def _put_get(master_port: int, key: str, value: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PUT_GET, f"127.0.0.1:{master_port}", key, value],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, MC_STORE_CLIENT_SETUP_RETRIES="1"),
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    return json.loads(lines[-1])


def test_doc_shows_the_script_ports_and_readiness_check():
    """The doc tells the user to run the script, shows two pools with three
    distinct ports each, the readiness check, and the underlying commands
    with flags the script really passes."""
    invocations = _doc_invocations()
    assert len(invocations) >= 2, f"docs/deployment-ascend.md shows no two-pool {SCRIPT} lines"
    opts = [_options(argv) for argv in invocations]
    assert all(set(PORT_OPTIONS) <= set(o) for o in opts), opts
    used = [o[name] for o in opts for name in PORT_OPTIONS]
    assert len(used) == len(set(used)), f"two pools in the doc share a port: {opts}"
    section = _mooncake_section()
    assert "master_total_capacity_bytes" in section and "/metrics" in section
    script = (ROOT / SCRIPT).read_text()
    for line in section.splitlines():
        if line.lstrip().startswith(("mooncake_master ", "mooncake_client ", "--")):
            for flag in re.findall(r"(--\w+)=", line):
                assert f"{flag}=" in script, f"the doc's {flag} is not what {SCRIPT} passes"


def test_two_pools_side_by_side_as_documented(pools):
    invocations = _doc_invocations()[:2]
    started = []
    for i, argv in enumerate(invocations):
        ports = dict(zip(PORT_OPTIONS, _free_ports(3)))
        done = pools(_on_this_host(argv, ports))
        assert done.returncode == 0, f"pool {i}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        assert re.search(r"^MOONCAKE_MASTER_PID=\d+$", done.stdout, re.M), done.stdout
        assert re.search(r"^MOONCAKE_HOLDER_PID=\d+$", done.stdout, re.M), done.stdout
        started.append(ports)
    for ports in started:  # both still ready once the second one started
        assert _capacity(ports["--metrics-port"]) == 64 << 20
    # The same key with a different value in each pool: a put into a
    # second, separate pool succeeds and each get returns its own pool's value.
    for i, ports in enumerate(started):
        r = _put_get(ports["--master-port"], "docs-test-key", f"value-of-pool-{i}")
        assert r == {"setup": 0, "put": 0, "get": f"value-of-pool-{i}"}, (i, r)


def test_holder_that_cannot_start_fails_clearly(pools, tmp_path):
    argv = _doc_invocations()[0]
    ports = dict(zip(PORT_OPTIONS, _free_ports(3)))

    # Its port taken (a second pool with the first one's --holder-port):
    # refused before anything starts, naming the port.
    first = pools(_on_this_host(argv, ports))
    assert first.returncode == 0, first.stderr
    again = dict(zip(PORT_OPTIONS[:2], _free_ports(2)), **{"--holder-port": ports["--holder-port"]})
    taken = pools(_on_this_host(argv, again))
    assert taken.returncode == 1, taken.stdout + taken.stderr
    assert f"--holder-port={ports['--holder-port']}" in taken.stderr and "already in use" in taken.stderr
    assert "MOONCAKE_MASTER_PID" not in taken.stdout

    # A holder that starts and dies (Mooncake refuses a segment below 16MB):
    # the readiness wait reports it with the holder's log and stops the master.
    fresh = dict(zip(PORT_OPTIONS, _free_ports(3)))
    bad = [a if not a.startswith("--segment-size=") else "--segment-size=1MB"
           for a in _on_this_host(argv, fresh)]
    done = pools(bad + ["--timeout=20"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the segment holder" in done.stderr and "the pool is not ready" in done.stderr, done.stderr
    assert "INVALID_PARAMS" in done.stderr, done.stderr  # the end of the holder's log
    assert "MOONCAKE_MASTER_PID" not in done.stdout
    assert not _mooncake_pids_with({f"--rpc_port={fresh['--master-port']}"}), "the master was left running"
