"""lmcache-ascend's LMCache configuration: our keys registered with
LMCache's config, kv_connector_extra_config applied, values LMCache accepts
silently refused, and the settings our chunk path needs enforced.

Our keys (``ascend_*``, defined in ``planning/settings.py``) are first-class
LMCache config keys, so they are set like any other: yaml
(``LMCACHE_CONFIG_FILE``), environment (``LMCACHE_ASCEND_*``) and
``kv_connector_extra_config`` (``lmcache.<key>``). LMCache's ``extra_config``
dict cannot carry that (its yaml and environment forms hold one JSON dict),
so the keys are registered into LMCache's config definitions and config
class: a patch, gated like every other (see ``patching/patches.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Mapping

from lmcache_ascend.lmcache_bridge.patching import overrides
from lmcache_ascend.planning.settings import BOOL_WORDS_TEXT, KEYS, KEY_NAMES, parse_bool

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig

# LMCache is imported inside the functions: the patch that registers our
# keys runs while LMCache's config module is still being imported (patching/hook.py),
# and it imports this module.

logger = logging.getLogger(__name__)

# Non-cryptographic LMCache hash algorithms seed their chain randomly per
# process unless PYTHONHASHSEED is set; the scheduler and the worker are
# different processes, so their chunk keys would never meet.
_NON_CRYPTO_HASHES = ("builtin", "xxhash", "xxhash_cbor")
DETERMINISTIC_HASH = "sha256_cbor"


_register_lock = threading.Lock()


def register_config_keys() -> None:
    """Add our keys to LMCache's config definitions and config class.

    Idempotent and thread-safe; call it before LMCache loads its config (the
    package's connector entry does). Configs created earlier get the defaults
    through class attributes.
    """
    from lmcache.v1 import config as lmc_config
    from lmcache.v1.config_base import create_config_class

    with _register_lock:
        defs = lmc_config._CONFIG_DEFINITIONS
        for spec in KEYS:
            defs.setdefault(
                spec.key,
                {
                    "type": spec.type_,
                    "default": spec.default,
                    "env_converter": spec.convert,
                    "description": spec.description,
                },
            )
        cls = lmc_config.LMCacheEngineConfig
        if all(k in cls.__dataclass_fields__ for k in KEY_NAMES):
            return
        # A throw-away class built from the widened definitions supplies the
        # dataclass machinery (fields, __init__, __repr__, __eq__); moving it
        # onto the existing class keeps `isinstance` and every import valid.
        # The loaders (from_file/from_env/from_dict/update_config_from_env)
        # already iterate `defs`, the same dict object.
        wide = create_config_class(
            config_name=cls.__name__,
            config_definitions=defs,
            config_aliases=getattr(lmc_config, "_CONFIG_ALIASES", None),
            deprecated_configs=getattr(lmc_config, "_DEPRECATED_CONFIGS", None),
        )
        for attr in ("__init__", "__repr__", "__eq__", "__dataclass_fields__", "__match_args__"):
            if attr in wide.__dict__:
                overrides.apply(overrides.CONFIG_KEYS, cls, attr, wide.__dict__[attr])
        for spec in KEYS:
            overrides.apply(overrides.CONFIG_KEYS, cls, spec.key, spec.default)


class ExtraConfigError(ValueError):
    """A kv_connector_extra_config entry that cannot be applied."""


def apply_extra_config(config: "LMCacheEngineConfig", extra: Mapping[str, Any] | None) -> None:
    """Apply ``kv_connector_extra_config`` to an LMCache config.

    Keys are LMCache config keys, optionally prefixed with ``lmcache.`` (the
    convention of LMCache's own vLLM adapter). Unknown keys and values that
    do not convert are errors: a typo must not silently run with defaults.
    """
    if not extra:
        return
    from lmcache.v1.config_base import validate_and_set_config_value

    from lmcache_ascend.lmcache_bridge.backends import credentials

    known = set(config._config_definitions)  # type: ignore[attr-defined]
    for raw_key, value in extra.items():
        key = raw_key[len("lmcache.") :] if raw_key.startswith("lmcache.") else raw_key
        if key == "remote_url" and credentials.url_password(value):
            credentials.register([credentials.url_password(value)])
            _warn_password_in_args(raw_key)
        if key not in known:
            close = sorted(k for k in known if k.split("_")[0] == key.split("_")[0])
            raise ExtraConfigError(
                f"kv_connector_extra_config key {raw_key!r} is not an LMCache or "
                f"lmcache-ascend config key"
                + (f"; did you mean one of {close[:8]}?" if close else "")
            )
        if config._config_definitions[key]["type"] is bool and not _is_bool_word(value):  # type: ignore[attr-defined]
            raise ExtraConfigError(
                f"kv_connector_extra_config {raw_key!r}={value!r} is not a boolean; "
                f"valid: {BOOL_WORDS_TEXT}"
            )
        if not validate_and_set_config_value(config, key, value):
            raise ExtraConfigError(
                f"kv_connector_extra_config {raw_key!r}={value!r} could not be "
                f"applied: expected a value of type "
                f"{config._config_definitions[key]['type'].__name__}"  # type: ignore[attr-defined]
            )


_warned_args: set[str] = set()


def _warn_password_in_args(raw_key: str) -> None:
    # Our logs mask it; the command line (ps) and vLLM's own "non-default
    # args" line, printed before any connector runs, do not.
    if raw_key in _warned_args:
        return
    _warned_args.add(raw_key)
    logger.warning(
        "lmcache-ascend: kv_connector_extra_config %r carries a password. It is masked in this "
        "connector's and LMCache's logs, but vLLM prints its arguments and the process list shows "
        "them: put remote_url in LMCache's config file (LMCACHE_CONFIG_FILE) or the "
        "LMCACHE_REMOTE_URL environment variable instead (docs/security.md)", raw_key)


VALID_HASHES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin")
VALID_SERDES = ("naive",)


def _is_bool_word(value: Any) -> bool:
    return parse_bool(value) is not None


def validate_engine_config(config: "LMCacheEngineConfig", environ: Mapping[str, str]) -> None:
    """Refuse values LMCache 0.5.6 accepts silently or fails on obscurely
    (some of them after starting a thread that keeps the process alive)."""
    from lmcache_ascend.lmcache_bridge.backends import credentials

    credentials.register_config(config, environ)
    defs = config._config_definitions  # type: ignore[attr-defined]
    for key, spec in defs.items():
        env_name = "LMCACHE_" + key.upper()
        raw = environ.get(env_name)
        if raw is None or raw.strip() == "":
            continue
        if spec["type"] is bool and not _is_bool_word(raw):
            raise ValueError(
                f"{env_name}={raw!r} ({key}) is not a boolean; valid: {BOOL_WORDS_TEXT}"
            )
        if getattr(config, key, None) is None:
            raise ValueError(
                f"{env_name}={raw!r} ({key}) could not be converted to "
                f"{getattr(spec['type'], '__name__', spec['type'])}"
            )
    if config.chunk_size is None or int(config.chunk_size) <= 0:
        raise ValueError(f"chunk_size={config.chunk_size!r} is not valid; it must be an integer > 0")
    size = config.max_local_cpu_size
    if size is None or float(size) <= 0:
        raise ValueError(
            f"max_local_cpu_size={size!r} GB is not valid; it must be > 0 "
            "(lmcache-ascend stages every chunk in LMCache's CPU memory, even with local_cpu: false)"
        )
    if config.local_disk and (config.max_local_disk_size is None or float(config.max_local_disk_size) <= 0):
        raise ValueError(
            f"max_local_disk_size={config.max_local_disk_size!r} GB is not valid with "
            f"local_disk={config.local_disk!r}; it must be > 0"
        )
    algo = str(config.pre_caching_hash_algorithm)
    if algo not in VALID_HASHES:
        raise ValueError(
            f"pre_caching_hash_algorithm={algo!r} is not valid; use one of {list(VALID_HASHES)} "
            "(LMCache 0.5.6 silently falls back to Python's per-process hash)"
        )
    if config.remote_url and str(config.remote_serde) not in VALID_SERDES:
        raise ValueError(
            f"remote_serde={config.remote_serde!r} is not valid; lmcache-ascend stores opaque "
            f"byte buffers, use one of {list(VALID_SERDES)}"
        )
    # Mooncake ignores keys it does not know and LMCache ignores its setup
    # result: without this an unusable pool retries ~90 s, then no-ops. A
    # pool that is down is not a misconfiguration: the engine starts
    # without it unless ascend_require_remote is set (backends/remote_pool.py).
    from lmcache_ascend.lmcache_bridge.backends.remote_pool import check_at_startup
    from lmcache_ascend.planning.settings import AscendConfig

    check_at_startup(config, environ, AscendConfig.from_lmcache(config).require_remote)


# LMCache's extra_config key that decides whether its Mooncake and fs://
# connectors write their per-value metadata ahead of each value.
SAVE_CHUNK_META = "save_chunk_meta"


def stores_chunk_meta(config: "LMCacheEngineConfig") -> bool:
    """Whether LMCache's remote connector writes its per-value metadata:
    LMCache's own rule (``RemoteConnector.__init__``, base_connector.py)."""
    extra = config.extra_config
    return extra is None or bool(extra.get(SAVE_CHUNK_META, True)) or bool(config.use_layerwise)


def value_encoding_tag(config: "LMCacheEngineConfig") -> str:
    """What chunk keys carry after the layout fingerprint about how a remote
    value is encoded. Values written without LMCache's metadata are another
    byte format: instances that disagree on it must never read each other's
    entries (each read would fail as unreadable, and the entry would stay)."""
    return "" if not config.remote_url or stores_chunk_meta(config) else "+nometa"


def _settle_chunk_meta(config: "LMCacheEngineConfig") -> None:
    """``save_chunk_meta`` as a real boolean, and off by default for Mooncake.

    LMCache reads the key by truthiness, so ``"false"`` from yaml or JSON
    text would mean true. Mooncake reads are LMCache's ``batch_get_into``
    straight into its own buffers only with the metadata off; with it on,
    every value is fetched into Mooncake's buffer and copied (a remote hit's
    reads 1.2-1.7x slower here, docs/benchmarks.md). The metadata only
    says a value's shape, and every chunk of ours has one size (whole chunks
    only, one flat buffer), so nothing is lost."""
    from lmcache_ascend.lmcache_bridge.backends.mooncake import uses_mooncake

    extra = dict(config.extra_config or {})
    if SAVE_CHUNK_META in extra:
        raw = extra[SAVE_CHUNK_META]
        value = parse_bool(raw)
        if value is None:
            raise ValueError(
                f"extra_config {SAVE_CHUNK_META}={raw!r} is not a boolean; valid: {BOOL_WORDS_TEXT} "
                "(LMCache would read any non-empty text as true)"
            )
        if value is not raw:
            overrides.apply(overrides.CHUNK_META_SETTING, config, "extra_config", {**extra, SAVE_CHUNK_META: value})
        return
    if uses_mooncake(config) and not config.use_layerwise:
        overrides.apply(overrides.CHUNK_META_SETTING, config, "extra_config", {**extra, SAVE_CHUNK_META: False})
        logger.info(
            "lmcache-ascend: Mooncake values hold the chunk alone (extra_config %s -> false; every chunk has "
            "one size): reads land in LMCache's buffers (batch_get_into), puts send from them "
            "(batch_put_from). Entries written with %s: true are keyed apart; set it to true to keep "
            "LMCache's format.",
            SAVE_CHUNK_META, SAVE_CHUNK_META,
        )


def enforce_engine_requirements(
    config: "LMCacheEngineConfig", num_groups: int, connector: str = "LMCacheAscendConnectorV1Dynamic"
) -> None:
    """Settings our chunk path relies on, applied with a log line each;
    ``connector`` names the route in the errors."""
    if config.use_layerwise:
        raise ValueError(
            f"use_layerwise=True is not supported by {connector} "
            "(chunks move whole, all kernel groups per chunk); set use_layerwise: false"
        )
    if config.enable_blending:
        raise ValueError(
            f"enable_blending=True is not supported by {connector}; "
            "set enable_blending: false"
        )
    if config.enable_async_loading:
        # The async lookup client answers "not yet" (None) and expects the
        # connector to ask again later; our loads complete inside the step.
        raise ValueError(
            f"enable_async_loading=True is not supported by {connector} "
            "(loads complete inside the step that schedules them); set "
            "enable_async_loading: false"
        )
    if config.save_unfull_chunk:
        # Every chunk buffer has one fixed geometry; a partial tail chunk of a
        # multi-group model cannot be restored exactly in every group.
        logger.info(
            "lmcache-ascend: storing whole chunks only (save_unfull_chunk -> False, "
            "%d KV cache group(s))",
            num_groups,
        )
        overrides.apply(overrides.WHOLE_CHUNKS_ONLY, config, "save_unfull_chunk", False)
    algo = str(config.pre_caching_hash_algorithm)
    if algo in _NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        logger.warning(
            "lmcache-ascend: pre_caching_hash_algorithm=%r seeds chunk hashes randomly "
            "per process (PYTHONHASHSEED unset), so vLLM's scheduler and worker "
            "processes could never agree on chunk keys; using %r instead. Set "
            "PYTHONHASHSEED or pre_caching_hash_algorithm explicitly to silence this.",
            algo,
            DETERMINISTIC_HASH,
        )
        overrides.apply(overrides.DETERMINISTIC_CHUNK_HASH, config, "pre_caching_hash_algorithm", DETERMINISTIC_HASH)
    _settle_chunk_meta(config)
