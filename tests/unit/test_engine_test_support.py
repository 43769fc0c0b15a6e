"""The engine tests' support: the error report of a failed engine run and
the comparison of the steps two engines ran (tests/support)."""

from __future__ import annotations

import json

import engine_errors
import sched_trace
import pytest

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

# An engine log as vLLM writes it: the processes' lines interleaved, the
# worker's own error far above the last lines (which only show the engine
# core's reaction to the dead worker).
LOG = "\n".join(
    ["(EngineCore pid=10) INFO 11-24 20:32:43 [core.py:133] Initializing a V1 LLM engine"]
    + ["(Worker pid=11) INFO step"] * 5
    + [
        "Fatal Python error: Segmentation fault",
        "",
        "Thread 0x00007f (most recent call first):",
        '  File "/x/vllm/v1/attention/backends/cpu_attn.py", line 88 in forward',
        '  File "/x/vllm/v1/worker/gpu_model_runner.py", line 3940 in execute_model',
        "",
        "(EngineCore pid=10) ERROR 11-24 20:33:00 [core.py:900] Worker proc VllmWorker-0 died unexpectedly",
        "(EngineCore pid=10) Traceback (most recent call last):",
        '(EngineCore pid=10)   File "/x/vllm/v1/executor/multiproc_executor.py", line 500, in collective_rpc',
        "(EngineCore pid=10)     raise RuntimeError('cancelled')",
        "(EngineCore pid=10) RuntimeError: cancelled",
    ]
    + ["(MainProcess pid=9) INFO noise"] * 70
)


def test_report_puts_the_workers_own_error_first_even_when_it_is_not_in_the_tail():
    found = engine_errors.errors(LOG)
    assert found[0].startswith("Fatal Python error: Segmentation fault")
    assert "cpu_attn.py" in found[0]  # with the stack the fault handler printed
    assert any("died unexpectedly" in f for f in found)
    tb = next(f for f in found if "Traceback" in f)
    assert tb.splitlines()[-1].endswith("RuntimeError: cancelled")
    report = engine_errors.report(LOG)
    assert report.index("Segmentation fault") < report.index("=== last 60 log lines ===")
    assert "Segmentation fault" not in report.split("=== last 60 log lines ===")[1]


def test_report_says_when_there_is_no_error_line():
    assert engine_errors.errors("(Worker pid=1) INFO fine\n" * 3) == []
    assert engine_errors.report("x\n" * 3).startswith("no traceback, fatal signal or ERROR line")


def _write(tmp_path, steps):
    (tmp_path / "sched-1.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return sched_trace.read(tmp_path)


def test_steps_of_two_runs_compare_batches_positions_and_threads(tmp_path):
    a = [{"threads": 2, "batch": [["4", 0, 868], ["5", 0, 800]]}, {"threads": 2, "batch": [["4", 868, 1]]}]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    got = _write(tmp_path / "a", a)
    assert sched_trace.first_difference(got, got) is None
    # The second request one step later: another batch shape.
    later = _write(tmp_path / "b", [{"threads": 2, "batch": [["4", 0, 868]]}] + a[1:])
    assert sched_trace.first_difference(got, later).startswith("step 0:")
    fewer_threads = _write(tmp_path / "c", [{**s, "threads": 1} for s in a])
    assert sched_trace.first_difference(got, fewer_threads) is not None
    assert "no steps recorded" in sched_trace.first_difference(got, [])


def test_steps_of_requests_from_a_token_on(tmp_path):
    steps = _write(tmp_path, [
        {"threads": 2, "batch": [["0", 0, 384], ["1", 0, 100]]},
        {"threads": 2, "batch": [["0", 384, 384]]},
        {"threads": 2, "batch": [["0", 768, 1], ["1", 100, 1]]},
    ])
    only_0 = sched_trace.of_requests(steps, range(0, 1), from_token=384)
    assert [s.batch for s in only_0] == [(("0", 384, 384),), (("0", 768, 1),)]
    assert [s.batch for s in sched_trace.of_requests(steps, range(1, 2))] == [(("1", 0, 100),), (("1", 100, 1),)]
