"""Mooncake configuration checks that need no running store: keys Mooncake
0.3.13 would ignore, missing keys, bad sizes, unreachable addresses, and the
run-time result checks of the store wrapper. The checks against a real
master and segment holder are in tests/integration/test_mooncake.py.

The expected setup keys are Mooncake 0.3.13's own list (the docstring of
``MooncakeDistributedStore.setup`` in its store.so), compared with ours
where Mooncake is installed.
"""

from __future__ import annotations

import socket

import pytest

from lmcache_ascend.lmcache_bridge.backends import mooncake as mc
from ports import free_port as unused_port

GOOD = {
    "mooncake_master_server_addr": "127.0.0.1:50051",
    "mooncake_metadata_server": "P2PHANDSHAKE",
    "mooncake_local_hostname": "127.0.0.1",
    "mooncake_global_segment_size": 0,
    "save_chunk_meta": True,  # LMCache's own, never sent to Mooncake
    "some_other_lmcache_feature": 1,  # extra_config serves other LMCache features too
}


def test_good_keys_pass_and_reach_mooncake_under_its_names():
    mc.check_keys(GOOD, "extra_config")
    setup = mc.setup_dict(GOOD)
    assert setup["master_server_addr"] == "127.0.0.1:50051"
    assert "master_server_address" not in setup


@pytest.mark.parametrize(
    "key,value,names",
    [
        # LMCache's legacy name: forwarded, and Mooncake 0.3.13 ignores it.
        ("master_server_address", "127.0.0.1:50051", ["'master_server_address'", "'mooncake_master_server_addr'"]),
        ("mooncake_master_server_address", "127.0.0.1:50051", ["mooncake_master_server_addr"]),
        ("device_name", "mlx5_0", ["'device_name'", "'mooncake_rdma_devices'"]),
        # Misspelled: the suggestion names the real key.
        ("mooncake_master_sever_addr", "127.0.0.1:50051", ["'mooncake_master_sever_addr'", "mooncake_master_server_addr"]),
        ("mooncake_protocl", "tcp", ["'mooncake_protocl'", "mooncake_protocol"]),
        # A Mooncake key without the prefix: LMCache does not forward it.
        ("rdma_devices", "mlx5_0", ["'rdma_devices'", "'mooncake_rdma_devices'"]),
        ("master_server_addr", "127.0.0.1:50051", ["'master_server_addr'", "'mooncake_master_server_addr'"]),
    ],
)
def test_ignored_keys_are_refused_naming_the_valid_key(key, value, names):
    raw = dict(GOOD, **{key: value})
    with pytest.raises(mc.MooncakeConfigError) as err:
        mc.check_keys(raw, "extra_config")
    for n in names:
        assert n in str(err.value), str(err.value)


def test_lmcache_default_device_name_is_not_an_error():
    # LMCache fills device_name="" itself; only a set value is lost.
    mc.check_keys(dict(GOOD, device_name=""), "extra_config")


@pytest.mark.parametrize("missing", ["mooncake_master_server_addr", "mooncake_metadata_server", "mooncake_local_hostname"])
def test_missing_required_key_is_named(missing):
    raw = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(mc.MooncakeConfigError, match=missing):
        mc.check_keys(raw, "extra_config")


@pytest.mark.parametrize("value", [-1, "4GB", "lots"])
def test_bad_segment_size_is_refused(value):
    with pytest.raises(mc.MooncakeConfigError, match="mooncake_global_segment_size.*bytes >= 0"):
        mc.check_keys(dict(GOOD, mooncake_global_segment_size=value), "extra_config")


def test_unreachable_master_is_an_outage_found_within_seconds():
    """Not a misconfiguration: the engine may start without the pool
    (remote_pool.check_at_startup decides)."""
    import time

    from lmcache_ascend.lmcache_bridge.backends.remote_pool import PoolUnavailableError

    setup = mc.setup_dict(dict(GOOD, mooncake_master_server_addr=f"127.0.0.1:{unused_port()}"))
    t = time.monotonic()
    with pytest.raises(PoolUnavailableError, match="'mooncake_master_server_addr'.*no mooncake_master"):
        mc.check_reachable(setup, "extra_config")
    assert time.monotonic() - t < 5


def test_bad_master_address_form():
    setup = mc.setup_dict(dict(GOOD, mooncake_master_server_addr="localhost"))
    with pytest.raises(mc.MooncakeConfigError, match="is not host:port"):
        mc.check_reachable(setup, "extra_config")


def test_unreachable_or_invalid_metadata_server_is_refused():
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen()
        addr = f"127.0.0.1:{master.getsockname()[1]}"
        url = f"http://127.0.0.1:{unused_port()}/metadata"
        setup = mc.setup_dict(dict(GOOD, mooncake_master_server_addr=addr, mooncake_metadata_server=url))
        from lmcache_ascend.lmcache_bridge.backends.remote_pool import PoolUnavailableError

        with pytest.raises(PoolUnavailableError, match="'mooncake_metadata_server'.*nothing accepts"):
            mc.check_reachable(setup, "extra_config")
        setup = mc.setup_dict(dict(GOOD, mooncake_master_server_addr=addr, mooncake_metadata_server="ftp://x:1"))
        with pytest.raises(mc.MooncakeConfigError, match="P2PHANDSHAKE"):
            mc.check_reachable(setup, "extra_config")


def test_mooncake_config_path_wins_and_bad_file_is_named(tmp_path):
    class Cfg:
        remote_url = "mooncakestore://127.0.0.1:1/"
        extra_config = {"mooncake_master_server_addr": "ignored:1"}

    f = tmp_path / "mc.json"
    f.write_text('{"mooncake_master_server_addr": "127.0.0.1:7"}')
    raw, source = mc.raw_config(Cfg(), {"MOONCAKE_CONFIG_PATH": str(f)})
    assert raw["mooncake_master_server_addr"] == "127.0.0.1:7" and str(f) in source
    f.write_text("{not json")
    with pytest.raises(mc.MooncakeConfigError, match="MOONCAKE_CONFIG_PATH"):
        mc.raw_config(Cfg(), {"MOONCAKE_CONFIG_PATH": str(f)})


def test_other_backends_are_left_alone():
    class Cfg:
        remote_url = "redis://127.0.0.1:1"
        extra_config = {"master_server_address": "x"}

    mc.check_config(Cfg(), {})  # not Mooncake: nothing checked


class _FakeStore:
    def is_exist(self, key):
        return {"hit": 1, "miss": 0}.get(key, -600)

    def put_parts(self, key, *parts):
        return 0 if key == "ok" else -800

    def batch_put_from(self, keys, *rest):
        return [0 if k == "ok" else -800 for k in keys]

    def batch_get_buffer(self, keys):
        return [b"x" if k == "ok" else None for k in keys]

    def get_hostname(self):
        return "h"


def test_checked_store_counts_failures_and_reads_errors_as_misses(caplog):
    mc.FAILURES.clear()
    s = mc.CheckedStore(_FakeStore())
    assert (s.is_exist("hit"), s.is_exist("miss"), s.is_exist("down")) == (1, 0, 0)
    assert s.put_parts("ok", b"m", b"d") == 0 and s.put_parts("full", b"m", b"d") == -800
    assert s.batch_put_from(["ok", "a", "b"], [], []) == [0, -800, -800]
    assert s.batch_get_buffer(["ok", "gone"]) == [b"x", None]
    assert s.get_hostname() == "h"  # everything else passes through
    assert mc.failure_counts() == {"lookup": 1, "put": 3, "get": 1}
    # Logged once per kind, not per failure.
    assert sum("Mooncake put failed" in r.getMessage() for r in caplog.records) == 1
    mc.FAILURES.clear()


def test_setup_keys_match_the_installed_mooncake():
    store = pytest.importorskip("mooncake.store", reason="Mooncake is not installed on this stack")
    doc = store.MooncakeDistributedStore.setup.__doc__ or ""
    for key in mc.SETUP_KEYS:
        assert f"{key}:" in doc or f"{key} (" in doc, key


def test_probe_runs_for_tcp_only(monkeypatch):
    """An ascend/rdma client needs its device context: no child-process probe."""
    def no_child(*a, **k):
        raise AssertionError("the probe must not start a child process for this protocol")

    monkeypatch.setattr(mc.subprocess, "run", no_child)
    for protocol in ("ascend", "rdma"):
        mc.probe(mc.setup_dict(dict(GOOD, mooncake_protocol=protocol)), "extra_config")
