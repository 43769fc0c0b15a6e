"""tests/support/ports.py: the ports test servers get lie outside the kernel's
ephemeral range, are never handed to two test processes at once, and skip a
port something already listens on."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import ports


class _Offer(random.Random):
    """Offers the given ports in order, then draws as usual."""

    def __init__(self, offers: list[int]) -> None:
        super().__init__(0)
        self.offers = list(offers)

    def randrange(self, start, stop=None, step=1):  # type: ignore[override]
        if self.offers:
            return self.offers.pop(0)
        return super().randrange(start, stop, step)


def test_ports_lie_outside_the_kernels_ephemeral_range(tmp_path):
    low, high = ports.ephemeral_range()
    got = [ports.free_port(claims=tmp_path) for _ in range(50)]
    assert len(set(got)) == 50
    assert all(not (low <= p <= high) and p >= ports.LOWEST for p in got), (low, high, got)


def test_candidates_take_the_larger_side_of_the_ephemeral_range():
    assert ports.candidate_range((32768, 60999)) == range(10000, 32768)
    assert ports.candidate_range((12000, 50000)) == range(50001, 65536)
    assert len(ports.candidate_range((1024, 65535))) == 0
    assert ports.ephemeral_range(Path("/nonexistent")) == (32768, 60999)


def test_a_port_claimed_by_a_live_process_is_not_handed_out_again(tmp_path):
    first = ports.free_port(claims=tmp_path)
    # Another test process, with its own claims file check, asked for ports
    # while this one holds `first`: it is offered `first` and must pass it by.
    code = ("import random, sys, ports\n"
            "from pathlib import Path\n"
            "class R(random.Random):\n"
            "    offers = [int(sys.argv[2])]\n"
            "    def randrange(self, a, b=None, s=1):\n"
            "        return self.offers.pop(0) if self.offers else super().randrange(a, b, s)\n"
            "print(ports.free_port(claims=Path(sys.argv[1]), rng=R(1)))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(ports.__file__).parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(first)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert int(out) != first
    assert (tmp_path / str(first)).read_text().split()[0] == str(os.getpid())


def test_a_listening_port_is_skipped(tmp_path):
    with socket.socket() as server:
        pool = ports.candidate_range(ports.ephemeral_range())
        for port in range(pool.start + 1234, pool.stop):
            try:
                server.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        server.listen()
        taken = server.getsockname()[1]
        got = ports.free_port(claims=tmp_path, rng=_Offer([taken]))
        assert got != taken
        assert not (tmp_path / str(taken)).exists()


def test_lapsed_claims_are_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pool = ports.candidate_range(ports.ephemeral_range())
    by_dead, old, live = pool.start + 4321, pool.start + 4322, pool.start + 4323
    (tmp_path / str(by_dead)).write_text(f"{dead} {time.time()}")
    (tmp_path / str(old)).write_text(f"{os.getpid()} {time.time() - ports.CLAIM_S - 1}")
    (tmp_path / str(live)).write_text(f"{os.getpid()} {time.time()}")
    got = [ports.free_port(claims=tmp_path, rng=_Offer([live, by_dead])),
           ports.free_port(claims=tmp_path, rng=_Offer([live, old]))]
    assert got == [by_dead, old]
    for port in got:
        assert (tmp_path / str(port)).read_text().split()[0] == str(os.getpid())


def test_no_room_outside_the_ephemeral_range_falls_back_to_the_kernel_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ports, "_warned", False)
    got = [ports.free_port(claims=tmp_path, ephemeral=(1024, 65535)) for _ in range(3)]
    assert all(1024 <= p <= 65535 for p in got)
    err = capsys.readouterr().err
    assert err.count("no room outside the ephemeral range (1024, 65535)") == 1, err
