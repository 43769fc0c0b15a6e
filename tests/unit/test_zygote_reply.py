"""How long the tests wait for an engine zygote's reply
(tests/support/engine_zygote.py ``_read_reply``): as long as the zygote
works, however slow the machine; not past REPLY_IDLE_S without CPU use, nor
past a process that exited. Real processes stand in for zygotes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import engine_zygote

pytestmark = pytest.mark.pure

BUSY_THEN_REPLY = """
import json, sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:  # CPU time, not wall time: as slow as the machine is
    pass
print(json.dumps({"ready": True}), flush=True)
"""


def _proc(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_zygote_still_working_is_waited_for_past_the_idle_limit():
    proc = _proc(BUSY_THEN_REPLY, "2.5")  # 2.5 s of CPU: over 1 s of idle limit, in wall time too
    try:
        assert engine_zygote._read_reply(proc, idle_s=1.0, cap_s=300.0, slice_s=0.2) == {"ready": True}
    finally:
        proc.kill()
        proc.wait()


def test_a_zygote_that_uses_no_cpu_is_given_up_after_the_idle_limit():
    proc = _proc("import time; time.sleep(600)")
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"used no CPU in the last 2 s"):
            engine_zygote._read_reply(proc, idle_s=2.0, cap_s=300.0, slice_s=0.2)
        assert time.monotonic() - t0 < 120  # not the cap, nor the sleep
    finally:
        proc.kill()
        proc.wait()


def test_a_zygote_that_exits_without_a_reply_is_named_with_its_exit_code():
    proc = _proc("import sys; sys.exit(7)")
    with pytest.raises(RuntimeError, match=r"(exited \(7\) without a reply|closed its output without a reply)"):
        engine_zygote._read_reply(proc, idle_s=60.0, cap_s=300.0, slice_s=0.2)
    proc.wait()


def test_the_cap_ends_the_wait_even_for_a_working_zygote():
    proc = _proc(BUSY_THEN_REPLY, "600")
    try:
        with pytest.raises(RuntimeError, match=r"gave no reply within 2 s"):
            engine_zygote._read_reply(proc, idle_s=60.0, cap_s=2.0, slice_s=0.2)
    finally:
        proc.kill()
        proc.wait()


def test_cpu_ticks_read_this_process_and_grow_with_work():
    import os

    before = engine_zygote._cpu_ticks(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = engine_zygote._cpu_ticks(os.getpid())
    assert before is not None and after is not None and after > before
