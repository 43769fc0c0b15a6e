"""vLLM's default shutdown (``shutdown_timeout`` 0, abort mode) ends the
engine processes without draining: writes to a disk or remote store still in
flight are lost, and a killed process cannot count them. The connector says
so once at startup, with the remedy; the read goes through vLLM's own
``VllmConfig`` of this stack (the field and its default are vLLM's)."""

from __future__ import annotations

import logging

import pytest

from lmcache_ascend.integration.vllm import shutdown


@pytest.fixture(scope="module")
def vllm_config_cls():
    from vllm.config import VllmConfig

    return VllmConfig


@pytest.mark.parametrize(
    "timeout, store, advised",
    [
        (None, "the remote store redis://h:1", True),  # vLLM's default
        (15, "the remote store redis://h:1", False),  # drain mode
        (None, "", False),  # nothing written outside the process
    ],
)
def test_advice_only_for_vllms_abort_default_with_a_store(vllm_config_cls, caplog, timeout, store, advised):
    config = vllm_config_cls() if timeout is None else vllm_config_cls(shutdown_timeout=timeout)
    with caplog.at_level(logging.INFO, logger=shutdown.__name__):
        assert shutdown.advise_drain(config, store) is advised
    lines = [r.getMessage() for r in caplog.records if r.name == shutdown.__name__]
    if advised:
        assert len(lines) == 1 and "--shutdown-timeout 15" in lines[0] and store in lines[0]
    else:
        assert lines == []


def test_a_vllm_without_the_setting_gets_no_advice(caplog):
    class Older:  # no shutdown_timeout attribute at all
        pass

    with caplog.at_level(logging.INFO, logger=shutdown.__name__):
        assert shutdown.advise_drain(Older(), "the local disk /tmp/x") is False
    assert not [r for r in caplog.records if r.name == shutdown.__name__]
