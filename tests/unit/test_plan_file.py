"""The plan as data: ``ascend_plan_file`` (its value and the per-rank file
name), the worker's writer (wiring.write_plan_file, wiring.plan_record) and
the one reader the CLI, the benches and the tests use (cli.plan_file)."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from lmcache_ascend.cli.plan_file import PLAN_FILE_ENV, PlanFileError, plan_env, read_plan
from lmcache_ascend.integration.vllm.wiring import ConnectorSetup, plan_record, write_plan_file
from lmcache_ascend.planning.agreement import HalfAgreement
from lmcache_ascend.planning.settings import AscendConfig, ConfigValueError, plan_file_for

RECORD = {
    "rank": 0,
    "text": "scheduler groups (vLLM KV cache groups):\n  g0  FullAttentionSpec",
    "plan": {"chunk_size": 256, "chunk_bytes": 4096, "groups": [{"group": 0, "stored": True}]},
    "groups": [{"index": 0, "block_size": 128}],
    "agreement": "0123456789abcdef",
    "state": None,
    "replication": {"tp": 1, "single_copy": False, "replicated": [], "sharded": [0], "stripe": False},
}


def test_the_env_variable_is_the_keys_lmcache_name():
    assert PLAN_FILE_ENV == "LMCACHE_ASCEND_PLAN_FILE"


def test_each_rank_has_its_own_file_beside_the_path():
    assert plan_file_for("/d/plan.json", 0) == "/d/plan.rank0.json"
    assert plan_file_for("/d/plan.json", 3) == "/d/plan.rank3.json"
    assert plan_file_for("/d/plan", 1) == "/d/plan.rank1"


def test_a_written_plan_reads_back_equal(tmp_path):
    base = str(tmp_path / "plan.json")
    path = write_plan_file(base, 0, RECORD)
    assert path == tmp_path / "plan.rank0.json"
    assert read_plan(base) == RECORD
    # Another rank: another file, read by its rank.
    write_plan_file(base, 1, dict(RECORD, rank=1))
    assert read_plan(base, rank=1) == dict(RECORD, rank=1)
    assert read_plan(base) == RECORD
    # Nothing but the two files is left beside them (no temporary file).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.rank0.json", "plan.rank1.json"]


def test_a_rewritten_plan_replaces_the_old_one(tmp_path):
    base = str(tmp_path / "plan.json")
    write_plan_file(base, 0, dict(RECORD, agreement="old"))
    write_plan_file(base, 0, RECORD)
    assert read_plan(base) == RECORD
    assert len(list(tmp_path.iterdir())) == 1


def test_the_plan_file_is_readable_by_others(tmp_path):
    path = write_plan_file(str(tmp_path / "plan.json"), 0, RECORD)
    assert path.stat().st_mode & 0o777 == 0o644


def test_the_record_built_at_startup_reads_back_equal(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Description:
        chunk_size: int
        chunk_bytes: int

    ascend = AscendConfig(plan_file=str(tmp_path / "plan.json"))
    setup = ConnectorSetup(
        lmcache_config=None,
        ascend_config=ascend,
        groups=(),
        chunk_size=256,
        engine=SimpleNamespace(rank=2),
        agreement=HalfAgreement.of((), 256, ascend),
    )
    plan = SimpleNamespace(describe=lambda: Description(256, 4096))
    rep = SimpleNamespace(tp=4, single_copy=True, replicated_groups=(0,), sharded_groups=())
    record = plan_record(setup, plan, rep, "the plan text", striped=True)
    assert record["rank"] == 2 and record["plan"] == {"chunk_size": 256, "chunk_bytes": 4096}
    assert record["replication"]["stripe"] is True and record["state"] is None
    write_plan_file(ascend.plan_file, record["rank"], record)
    assert read_plan(ascend.plan_file, rank=2) == record


@pytest.mark.parametrize("value", ["plan.json", "relative/dir/plan.json", "/tmp/plans/", "/tmp/\x00plan"])
def test_a_bad_path_is_refused_naming_the_value(value):
    with pytest.raises(ConfigValueError) as err:
        AscendConfig(plan_file=value)
    message = str(err.value)
    assert "ascend_plan_file" in message and repr(value)[:20] in message


def test_a_bad_path_from_the_environment_stops_the_config(monkeypatch):
    from lmcache.v1 import config as lmc_config

    from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys

    register_config_keys()
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.setenv(PLAN_FILE_ENV, "plans/plan.json")
    with pytest.raises(ConfigValueError, match=r"ascend_plan_file.*'plans/plan.json'.*absolute"):
        AscendConfig.from_lmcache(lmc_config.LMCacheEngineConfig.from_env())


def test_an_absolute_path_or_nothing_is_accepted(tmp_path, monkeypatch):
    from lmcache.v1 import config as lmc_config

    from lmcache_ascend.lmcache_bridge.engine.config import register_config_keys

    assert AscendConfig().plan_file == ""
    assert AscendConfig(plan_file="  ").plan_file == ""
    register_config_keys()
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.setenv(PLAN_FILE_ENV, str(tmp_path / "plan.json"))
    cfg = lmc_config.LMCacheEngineConfig.from_env()
    assert AscendConfig.from_lmcache(cfg).plan_file == str(tmp_path / "plan.json")


def test_a_plan_that_cannot_be_written_stops_startup_naming_the_path(tmp_path):
    base = str(tmp_path / "missing-dir" / "plan.json")
    with pytest.raises(ConfigValueError, match=r"ascend_plan_file.*missing-dir/plan\.rank0\.json"):
        write_plan_file(base, 0, RECORD)


def test_a_missing_plan_file_is_a_clear_error(tmp_path):
    base = tmp_path / "plan.json"
    with pytest.raises(PlanFileError) as err:
        read_plan(base, rank=1)
    message = str(err.value)
    assert str(tmp_path / "plan.rank1.json") in message and PLAN_FILE_ENV in message


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"text": "only text"})])
def test_a_file_without_a_plan_record_is_a_clear_error(tmp_path, content):
    (tmp_path / "plan.rank0.json").write_text(content)
    with pytest.raises(PlanFileError, match="plan.rank0.json"):
        read_plan(tmp_path / "plan.json")


def test_plan_env_names_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = plan_env("plan.json")
    assert env == {PLAN_FILE_ENV: os.path.join(str(tmp_path), "plan.json")}
    # What the environment names is what the key accepts.
    assert AscendConfig(plan_file=env[PLAN_FILE_ENV]).plan_file == env[PLAN_FILE_ENV]
