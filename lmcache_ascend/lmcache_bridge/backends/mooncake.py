"""Mooncake store (``remote_url: mooncakestore://...``): startup validation
and run-time failure accounting.

Why this exists. LMCache 0.5.6's Mooncake connector builds Mooncake's setup
dict from ``extra_config`` (``mooncake_<key>`` -> ``<key>``, plus a few
unprefixed legacy keys) and calls ``store.setup`` without looking at its
result, and it ignores the result codes of ``put_parts`` /
``batch_put_from`` and reads ``is_exist``'s error codes (negative, so
truthy) as hits. Mooncake 0.3.13 ignores setup keys it does not know, among
them LMCache's own legacy ``master_server_address`` (it wants
``master_server_addr``): the client then retries for ~90 s against its
default master, LMCache logs "setup completed successfully", and every
operation fails with "Client is not initialized", silently. So:

* :func:`check_config` (called through ``remote_pool.check_at_startup``)
  refuses, within seconds and naming the key and what is valid: keys
  Mooncake would ignore (misspelled, legacy, or unprefixed), a missing
  master or metadata address, and, through a probe round trip in a child
  process, a metadata-server mismatch (data put but not readable back).
  A pool that is down or empty (no master or metadata server accepting
  connections, no segment to write to) raises
  ``remote_pool.PoolUnavailableError``: the engine starts without it
  unless ``ascend_require_remote`` is set.
* :func:`install_failure_accounting` wraps the connector's store so every
  failed operation is counted and the first of each kind logged, and an
  ``is_exist`` error is a miss, not a hit.

``python -m lmcache_ascend.lmcache_bridge.backends.mooncake '<setup json>'`` is the
probe (a child process, so Mooncake's retries and threads die with it).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlparse

from lmcache_ascend.lmcache_bridge.backends.remote_pool import PoolUnavailableError
from lmcache_ascend.lmcache_bridge.backends.remote_pool import unreachable as _connect
from lmcache_ascend.lmcache_bridge.patching import overrides

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig

logger = logging.getLogger(__name__)

URL_SCHEME = "mooncakestore://"
TESTED_MOONCAKE = "mooncake-transfer-engine(-non-cuda) 0.3.13"
# The keys Mooncake 0.3.13's dict setup reads (its pybind docstring); it
# ignores every other key without a word.
SETUP_KEYS = (
    "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
    "protocol", "rdma_devices", "master_server_addr", "ipc_socket_path",
    "enable_ssd_offload", "ssd_offload_path", "tenant_id",
    "enable_client_http_server", "client_http_port",
)
# Read by LMCache's connector itself, never sent to Mooncake.
LMCACHE_ONLY_KEYS = (
    "transfer_timeout", "storage_root_dir", "prefer_local_alloc", "save_chunk_meta",
    "mooncake_transfer_timeout", "mooncake_storage_root_dir", "mooncake_prefer_local_alloc",
)
# Unprefixed keys LMCache forwards as they are (its legacy API).
LEGACY_FORWARDED = (
    "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
    "protocol", "device_name", "master_server_address",
)
# Keys LMCache sends (or fills in) that Mooncake 0.3.13 ignores, and the key
# that does what was meant.
RENAMED = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
REQUIRED = ("master_server_addr", "metadata_server", "local_hostname")
PROBE_TIMEOUT_S = 20.0
PROBE_BYTES = 4096


class MooncakeConfigError(ValueError):
    """A Mooncake configuration that cannot work."""


def uses_mooncake(config: "LMCacheEngineConfig") -> bool:
    return str(getattr(config, "remote_url", None) or "").startswith(URL_SCHEME)


def raw_config(config: "LMCacheEngineConfig", environ: Mapping[str, str]) -> tuple[dict, str]:
    """The dict LMCache's connector builds Mooncake's setup from, and where
    it comes from (``MOONCAKE_CONFIG_PATH`` wins over ``extra_config``, as in
    LMCache)."""
    path = environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path) as f:
                return json.load(f), f"MOONCAKE_CONFIG_PATH={path}"
        except (OSError, ValueError) as e:
            raise MooncakeConfigError(f"MOONCAKE_CONFIG_PATH={path!r} cannot be read as JSON: {e}") from e
    return dict(getattr(config, "extra_config", None) or {}), "extra_config"


def setup_dict(raw: Mapping[str, Any]) -> dict[str, str]:
    """Mooncake's setup dict exactly as LMCache's connector builds it."""
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakeStoreConfig

    return MooncakeStoreConfig._build_setup_dict(dict(raw))


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, SETUP_KEYS, n=1, cutoff=0.6)
    return f" (did you mean 'mooncake_{close[0]}'?)" if close else ""


def check_keys(raw: Mapping[str, Any], source: str) -> None:
    """Every key that looks meant for Mooncake must reach it under a name it reads."""
    valid = [f"mooncake_{k}" for k in SETUP_KEYS]
    for key, value in raw.items():
        if key in LMCACHE_ONLY_KEYS or value is None:
            continue
        if key.startswith("mooncake_"):
            name = key[len("mooncake_"):]
            if name in RENAMED:
                raise MooncakeConfigError(
                    f"{source} key {key!r} is ignored by {TESTED_MOONCAKE}; use 'mooncake_{RENAMED[name]}'"
                )
            if name not in SETUP_KEYS:
                raise MooncakeConfigError(
                    f"{source} key {key!r} is passed to Mooncake as {name!r}, which {TESTED_MOONCAKE} "
                    f"ignores{_suggest(name)}; valid: {valid}"
                )
        elif key in RENAMED and (key != "device_name" or str(value) != ""):
            raise MooncakeConfigError(
                f"{source} key {key!r}={value!r} is forwarded by LMCache but ignored by "
                f"{TESTED_MOONCAKE}; use 'mooncake_{RENAMED[key]}'"
            )
        elif key in SETUP_KEYS and key not in LEGACY_FORWARDED:
            raise MooncakeConfigError(
                f"{source} key {key!r} is not forwarded to Mooncake by LMCache (only 'mooncake_*' "
                f"keys are); use 'mooncake_{key}'"
            )
    setup = setup_dict(raw)
    for key in REQUIRED:
        if not setup.get(key):
            raise MooncakeConfigError(
                f"{source} has no 'mooncake_{key}'; Mooncake needs it (example: "
                + {"master_server_addr": "'127.0.0.1:50051', the mooncake_master's RPC address",
                   "metadata_server": "'P2PHANDSHAKE' or 'http://host:port/metadata'",
                   "local_hostname": "this host's address the segment holders can reach"}[key]
                + ")"
            )
    for key in ("global_segment_size", "local_buffer_size"):
        try:
            if int(setup[key]) < 0:
                raise ValueError
        except ValueError:
            raise MooncakeConfigError(
                f"{source} 'mooncake_{key}'={setup[key]!r} is not valid; it must be a number of bytes >= 0"
            ) from None



def _host_port(addr: str, key: str, source: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise MooncakeConfigError(f"{source} 'mooncake_{key}'={addr!r} is not host:port")
    return host.strip("[]"), int(port)


def check_reachable(setup: Mapping[str, str], source: str) -> None:
    host, port = _host_port(setup["master_server_addr"], "master_server_addr", source)
    why = _connect(host, port)
    if why:
        raise PoolUnavailableError(
            f"Mooncake store ({source})",
            f"'mooncake_master_server_addr'={setup['master_server_addr']!r}: no mooncake_master accepts "
            f"connections there ({why}); start it or fix the address",
        )
    meta = setup["metadata_server"]
    if meta.upper() == "P2PHANDSHAKE":
        return
    url = urlparse(meta if "://" in meta else f"etcd://{meta}")
    if url.scheme not in ("http", "https", "etcd", "redis") or not url.hostname:
        raise MooncakeConfigError(
            f"{source} 'mooncake_metadata_server'={meta!r} is not valid; use 'P2PHANDSHAKE', "
            "'http://host:port/metadata', 'etcd://host:port' or 'redis://host:port'"
        )
    default = {"http": 80, "https": 443, "etcd": 2379, "redis": 6379}[url.scheme]
    why = _connect(url.hostname, url.port or default)
    if why:
        raise PoolUnavailableError(
            f"Mooncake store ({source})",
            f"'mooncake_metadata_server'={meta!r}: nothing accepts connections there ({why}); start the "
            "metadata server (mooncake_master --enable_http_metadata_server) or use the one the segment "
            "holders use",
        )


def probe(setup: Mapping[str, str], source: str) -> None:
    """A put and a get of a small probe object, from a child process with
    the same setup but no segment of its own. TCP only: an `ascend` or
    `rdma` client needs the device context of the process that owns it,
    which a child process does not have (not verified here: no NPU or RDMA
    NIC), so for those the keys and addresses are checked and the probe is
    skipped with a log line."""
    protocol = str(setup.get("protocol", "tcp")).lower()
    if protocol != "tcp":
        logger.info(
            "lmcache-ascend: Mooncake probe skipped for protocol %r (runs for tcp only); keys and "
            "addresses were checked", protocol,
        )
        return
    child = dict(setup, global_segment_size="0", local_buffer_size=str(16 << 20))
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, json.dumps(child)],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
            env=dict(os.environ, MC_STORE_CLIENT_SETUP_RETRIES="1"),
        )
    except subprocess.TimeoutExpired:
        raise PoolUnavailableError(
            f"Mooncake store ({source})",
            f"the probe (setup, put, get of {PROBE_BYTES} bytes) did not finish within {PROBE_TIMEOUT_S:.0f} s "
            f"with master {setup['master_server_addr']!r} and metadata server {setup['metadata_server']!r}",
        ) from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise MooncakeConfigError(
            f"{source}: the Mooncake probe failed (exit {done.returncode}): {done.stderr.strip()[-600:]}"
        )
    r = json.loads(lines[-1])
    where = f"master {setup['master_server_addr']!r}, metadata server {setup['metadata_server']!r}"
    if r["setup"] != 0:
        raise MooncakeConfigError(
            f"{source}: Mooncake setup failed (code {r['setup']}) with {where}; check "
            "'mooncake_master_server_addr', 'mooncake_metadata_server' and 'mooncake_protocol'"
        )
    if r["put"] != 0:
        if int(setup["global_segment_size"]) > 0:
            return  # this process will contribute the segment its own puts need
        # Mooncake answers the same when no holder is mounted and when the
        # holders registered with another metadata server: name both.
        raise PoolUnavailableError(
            f"Mooncake store ({source})",
            f"'mooncake_global_segment_size'=0 and the store at {where} has no segment this "
            f"engine can write to (put failed, code {r['put']}; Mooncake's -200, NO_AVAILABLE_HANDLE, means "
            "no mounted segment has room): either no segment holder is running "
            "(start mooncake_client --global_segment_size=<bytes> with the same master and metadata "
            "server, or give this engine a segment: mooncake_global_segment_size > 0), or the holders "
            "registered with another metadata server than 'mooncake_metadata_server'="
            f"{setup['metadata_server']!r} (every client of one master must use the same one)",
        )
    if r["get"] != PROBE_BYTES:
        raise MooncakeConfigError(
            f"{source}: Mooncake accepted a put but could not read it back (code {r['get']}): the segment "
            f"holders use another metadata server than this engine's 'mooncake_metadata_server'="
            f"{setup['metadata_server']!r}; every client of one master must use the same one"
        )


def master_address(config: "LMCacheEngineConfig") -> tuple[str, int] | None:
    """The master's host and port from an engine's config (None if unreadable)."""
    try:
        raw, source = raw_config(config, os.environ)
        return _host_port(setup_dict(raw)["master_server_addr"], "master_server_addr", source)
    except (MooncakeConfigError, KeyError, TypeError):
        return None


def check_config(config: "LMCacheEngineConfig", environ: Mapping[str, str]) -> None:
    """Refuse a Mooncake configuration that cannot work; install the
    run-time accounting for one that can. Does nothing for other backends."""
    if not uses_mooncake(config):
        return
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise MooncakeConfigError(
            f"remote_url={config.remote_url!r} needs Mooncake: pip install 'lmcache-ascend[mooncake]' "
            f"(or mooncake-transfer-engine-non-cuda) and its libraries libibverbs1, libnl-3-200, "
            f"libnl-route-3-200 ({e})"
        ) from e
    raw, source = raw_config(config, environ)
    check_keys(raw, source)
    setup = setup_dict(raw)
    # Before the checks that find the pool down: an engine that starts
    # without the pool still counts failures and fails fast on reconnects.
    install_failure_accounting()
    check_reachable(setup, source)
    probe(setup, source)
    logger.info(
        "lmcache-ascend: Mooncake store checked (master %s, metadata %s, segment here %s bytes)",
        setup["master_server_addr"], setup["metadata_server"], setup["global_segment_size"],
    )


# ---- run time ---------------------------------------------------------------

_lock = threading.Lock()
FAILURES: Counter = Counter()


def failure_counts() -> dict[str, int]:
    with _lock:
        return dict(FAILURES)


SUMMARY_EVERY_S = 60.0
_last_summary = [0.0]


def _failed(op: str, code: Any, n: int = 1) -> None:
    """Count a failed store operation. The first of each kind is logged
    with its code; after that the counts, at most once a minute (an outage
    fails every request: one line per failure would drown the log), and at
    close."""
    now = time.monotonic()
    with _lock:
        FAILURES[op] += n
        first = FAILURES[op] == n
        summary = not first and now - _last_summary[0] >= SUMMARY_EVERY_S
        if first or summary:
            _last_summary[0] = now
        counts = dict(FAILURES)
    if first:
        logger.warning(
            "lmcache-ascend: Mooncake %s failed (code %s); served as a miss, nothing is lost. Further "
            "%s failures are counted and summed up at most once a minute", op, code, op,
        )
    elif summary:
        logger.warning("lmcache-ascend: Mooncake failures so far: %s", counts)


class CheckedStore:
    """The store LMCache's connector calls, with every result checked."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def is_exist(self, key: str) -> int:
        r = self._store.is_exist(key)
        if r < 0:  # an error code: LMCache would read it as a hit
            _failed("lookup", r)
            return 0
        return r

    def put_parts(self, key: str, *parts: Any) -> int:
        r = self._store.put_parts(key, *parts)
        if r != 0:
            _failed("put", r)
        return r

    def put_from(self, *args: Any) -> int:
        r = self._store.put_from(*args)
        if r != 0:
            _failed("put", r)
        return r

    def batch_put_from(self, *args: Any) -> list:
        r = self._store.batch_put_from(*args)
        bad = [c for c in r if c != 0]
        if bad:
            _failed("put", bad[0], len(bad))
        return r

    def batch_get_buffer(self, keys: list) -> list:
        r = self._store.batch_get_buffer(keys)
        bad = sum(b is None for b in r)
        if bad:
            _failed("get", None, bad)
        return r

    def batch_get_into(self, *args: Any) -> list:
        r = self._store.batch_get_into(*args)
        bad = [c for c in r if c <= 0]
        if bad:
            _failed("get", bad[0], len(bad))
        return r


def _warn_unregistered(connector: Any) -> None:
    """Reads into LMCache's buffers (``save_chunk_meta`` off,
    engine/config.py) need them registered with Mooncake for transports
    that move memory directly (``rdma``, ``ascend``); LMCache only logs a
    registration that failed, and every get would then fail as a miss."""
    if getattr(connector, "save_chunk_meta", True) or getattr(connector, "registered_buffer_ptr", 0) is not None:
        return
    protocol = str(getattr(getattr(connector, "config", None), "protocol", "") or "")
    logger.warning(
        "lmcache-ascend: LMCache's CPU buffer is not registered with Mooncake (protocol %r) while values are "
        "read into it (save_chunk_meta false); transports that move memory directly (rdma, ascend) need it "
        "registered. If Mooncake gets fail, set extra_config save_chunk_meta: true on every instance of "
        "this pool.",
        protocol,
    )


def install_failure_accounting() -> None:
    """Wrap the store of every MooncakestoreConnector created from now on
    (idempotent), refuse a setup that returned an error, and log the counts
    at close."""
    from lmcache.v1.storage_backend.connector import mooncakestore_connector as mod

    if getattr(mod, "_lmcache_ascend_checked", False):
        return
    setup = mod.setup_mooncake_store

    def checked_setup(store: Any, config: Any) -> None:
        # A master that accepts no connection: fail now (LMCache keeps the
        # backend without a connector and remote_pool.Reconnector tries
        # again), not after Mooncake's ~90 s of retries, with a client that
        # then fails every operation.
        addr = dict(config.setup_config).get("master_server_addr") if hasattr(config, "setup_config") else None
        if addr:
            host, _, port = str(addr).rpartition(":")
            why = _connect(host.strip("[]"), int(port)) if port.isdigit() else None
            if why:
                raise PoolUnavailableError("Mooncake store", f"master {addr!r} accepts no connections ({why})")
        try:
            r = store.setup(config.setup_config)
        except TypeError:  # a Mooncake before the dict API: LMCache's own fallback
            return setup(store, config)
        if r not in (None, 0):
            raise MooncakeConfigError(f"Mooncake setup returned {r} for {config!r}")

    original_init, original_close = mod.MooncakestoreConnector.__init__, mod.MooncakestoreConnector.close

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        overrides.apply(overrides.MOONCAKE_CHECKED_STORE, self, "store", CheckedStore(self.store))
        _warn_unregistered(self)

    async def close(self) -> None:
        counts = failure_counts()
        if counts:
            logger.warning("lmcache-ascend: Mooncake failures during this run: %s", counts)
        await original_close(self)

    entry = overrides.MOONCAKE_ACCOUNTING
    overrides.apply(entry, mod, "setup_mooncake_store", checked_setup)
    overrides.apply(entry, mod.MooncakestoreConnector, "__init__", __init__)
    overrides.apply(entry, mod.MooncakestoreConnector, "close", close)
    overrides.apply(entry, mod, "_lmcache_ascend_checked", True)


def _probe_main(setup_json: str) -> int:
    from mooncake.store import MooncakeDistributedStore

    setup = json.loads(setup_json)
    store = MooncakeDistributedStore()
    out: dict[str, Any] = {"setup": store.setup(setup), "put": None, "get": None}
    if out["setup"] == 0:
        key = f"lmcache-ascend-probe-{socket.gethostname()}-{os.getpid()}"
        data = os.urandom(PROBE_BYTES)
        out["put"] = store.put(key, data)
        if out["put"] == 0:
            got = store.get(key)
            out["get"] = len(got) if got == data else (-1 if not got else len(got) * -1)
            store.remove(key)
    print(json.dumps(out), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main(sys.argv[1]))
