"""The serving bench's ratios over several servers per configuration
(``bench_serving.py --repeats``), against numpy on the same figures, and the
validation of the options that choose those servers."""

import numpy as np
import pytest

import bench_modules

bench_serving = bench_modules.load("bench_serving")
serving_report = bench_modules.load("serving_report")

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure


def _run(conn: str, repeat: int, ttft: float, tok_s: float, kv: str = "fit") -> dict:
    return {"model": "llama", "kv": kv, "connector": conn, "repeat": repeat,
            "figures": {"ttft_mean_s": ttft, "output_tok_s": tok_s}}


def test_ratios_pool_servers_and_report_pair_range():
    rng = np.random.default_rng(7)
    none_tt, asc_tt = rng.uniform(0.5, 0.7, 4), rng.uniform(0.5, 0.7, 4)
    none_tps, asc_tps = rng.uniform(40, 50, 4), rng.uniform(40, 50, 4)
    runs = []
    for k in range(4):  # ABBA order, as the bench runs them
        pair = [_run("none", k, none_tt[k], none_tps[k]), _run("ascend", k, asc_tt[k], asc_tps[k])]
        runs += pair if k % 2 == 0 else pair[::-1]
    (q,) = serving_report.ratios(runs)
    assert q["servers"] == q["reference_servers"] == 4
    assert q["ttft_ratio"] == pytest.approx(asc_tt.mean() / none_tt.mean())
    assert q["tok_s_ratio"] == pytest.approx(asc_tps.mean() / none_tps.mean())
    per_pair = asc_tt / none_tt
    assert q["ttft_ratio_range"] == pytest.approx([per_pair.min(), per_pair.max()])
    per_pair = asc_tps / none_tps
    assert q["tok_s_ratio_range"] == pytest.approx([per_pair.min(), per_pair.max()])
    max_tt, min_tps = serving_report.GOALS["fit"]
    assert q["ttft_goal_held"] == (asc_tt.mean() / none_tt.mean() <= max_tt)
    assert q["tok_s_goal_held"] == (asc_tps.mean() / none_tps.mean() >= min_tps)


def test_ratios_of_a_saved_run_without_repeats():
    # --json files written before --repeats existed have no "repeat" field.
    runs = [_run("none", 0, 2.0, 10.0, "pressure"), _run("ascend", 0, 0.8, 20.0, "pressure")]
    for r in runs:
        del r["repeat"]
    (q,) = serving_report.ratios(runs)
    assert (q["ttft_ratio"], q["tok_s_ratio"]) == pytest.approx((0.4, 2.0))
    assert q["ttft_goal_held"] and q["tok_s_goal_held"]
    assert q["servers"] == 1


def test_goal_missed_when_one_server_pair_is_slow():
    runs = [_run("none", 0, 1.0, 10.0), _run("ascend", 0, 1.0, 10.0),
            _run("ascend", 1, 1.2, 8.0), _run("none", 1, 1.0, 10.0)]
    (q,) = serving_report.ratios(runs)
    assert q["ttft_ratio"] == pytest.approx(1.1) and not q["ttft_goal_held"]
    assert q["tok_s_ratio"] == pytest.approx(0.9) and not q["tok_s_goal_held"]
    assert q["ttft_ratio_range"] == pytest.approx([1.0, 1.2])


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats 0"),
    (["--connectors", "none,ascend,none"], "names a configuration twice"),
])
def test_bad_server_options_are_refused(argv, message, capsys):
    ap = bench_serving.build_parser()
    with pytest.raises(SystemExit):
        bench_serving.prepare(ap.parse_args(argv), ap)
    assert message in capsys.readouterr().err
