"""save_chunk_meta: LMCache's Mooncake connector reads into its own buffers
(batch_get_into) only with it off, so the connector turns it off for
Mooncake unless the user set it; a value spelled as text is read as the
boolean it spells; and chunk keys tell the two value encodings apart.

The reference for what LMCache does with the setting is LMCache's own rule,
run here: ``RemoteConnector.__init__`` (lmcache 0.5.6,
v1/storage_backend/connector/base_connector.py) sets ``save_chunk_meta``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from lmcache_ascend.lmcache_bridge.engine import config as bridge_config
from lmcache_ascend.lmcache_bridge.engine.chunk_io import ChunkBufferMetadata

MOONCAKE = "mooncakestore://127.0.0.1:50051/"


def _config(remote_url, extra):
    return SimpleNamespace(
        remote_url=remote_url, extra_config=extra, use_layerwise=False, save_unfull_chunk=False,
        pre_caching_hash_algorithm=bridge_config.DETERMINISTIC_HASH, enable_async_loading=False,
        enable_blending=False,
    )


def _lmcache_reads(cfg) -> bool:
    """What LMCache's remote connector decides from ``cfg``: metadata written (True) or not."""
    probe = SimpleNamespace()  # the rule reads only its arguments
    meta = ChunkBufferMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.uint8, kv_shape=(1, 1, 256, 1, 1), use_mla=False, role="worker",
                               chunk_size=256, chunk_bytes=4096)
    RemoteConnector.__init__(probe, cfg, meta)
    return bool(probe.save_chunk_meta)  # LMCache tests it with `if`


@pytest.mark.parametrize("remote_url, extra, meta, tag", [
    (MOONCAKE, None, False, "+nometa"),  # Mooncake, nothing set: off
    (MOONCAKE, {"mooncake_protocol": "tcp"}, False, "+nometa"),
    (MOONCAKE, {"save_chunk_meta": True}, True, ""),  # the user asked for LMCache's format
    ("redis://127.0.0.1:6379", None, True, ""),  # Redis keeps its metadata key either way
    ("fs:///tmp/pool", {"save_chunk_meta": False}, False, "+nometa"),  # set by the user
    (None, None, True, ""),
])
def test_mooncake_values_go_without_metadata_unless_asked(remote_url, extra, meta, tag):
    cfg = _config(remote_url, None if extra is None else dict(extra))
    before = dict(extra or {})
    bridge_config.enforce_engine_requirements(cfg, 1, connector="test")
    assert _lmcache_reads(cfg) is meta
    assert bridge_config.stores_chunk_meta(cfg) is meta
    assert bridge_config.value_encoding_tag(cfg) == tag
    # Every other extra_config entry stays as the user wrote it.
    assert {k: v for k, v in (cfg.extra_config or {}).items() if k != "save_chunk_meta"} == \
        {k: v for k, v in before.items() if k != "save_chunk_meta"}


@pytest.mark.parametrize("text, meta", [("false", False), ("0", False), ("off", False), ("true", True), ("1", True)])
def test_save_chunk_meta_text_is_read_as_a_boolean(text, meta):
    raw = _config(MOONCAKE, {"save_chunk_meta": text})
    assert _lmcache_reads(raw) is True  # LMCache alone: any non-empty text means true
    bridge_config.enforce_engine_requirements(raw, 1, connector="test")
    assert raw.extra_config["save_chunk_meta"] is meta
    assert _lmcache_reads(raw) is meta


def test_save_chunk_meta_that_spells_no_boolean_is_refused():
    cfg = _config(MOONCAKE, {"save_chunk_meta": "sometimes"})
    with pytest.raises(ValueError) as e:
        bridge_config.enforce_engine_requirements(cfg, 1, connector="test")
    assert "save_chunk_meta='sometimes'" in str(e.value) and "valid:" in str(e.value)


@pytest.mark.parametrize("meta, registered, warned", [(False, None, True), (False, 0x1000, False), (True, None, False)])
def test_an_unregistered_buffer_read_into_is_named(caplog, meta, registered, warned):
    """LMCache logs a failed buffer registration once, among its start-up
    lines; reads into that buffer then fail on rdma/ascend as misses."""
    from lmcache_ascend.lmcache_bridge.backends import mooncake

    connector = SimpleNamespace(save_chunk_meta=meta, registered_buffer_ptr=registered,
                                config=SimpleNamespace(protocol="rdma"))
    with caplog.at_level("WARNING", logger=mooncake.logger.name):
        mooncake._warn_unregistered(connector)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("not registered with Mooncake (protocol 'rdma')" in text and "save_chunk_meta: true" in text) is warned
