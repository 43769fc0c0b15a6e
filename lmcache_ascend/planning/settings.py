"""lmcache-ascend's settings: the ``ascend_*`` keys, their types, converters
and defaults, and :class:`AscendConfig`, the typed record read from them.

The keys are set through LMCache's own config (see
``lmcache_bridge/engine/config.py``, which registers them); this module is pure: it
imports neither LMCache nor vLLM and never reads the environment.
"""

from __future__ import annotations

import json
import os.path
from dataclasses import dataclass
from typing import Any, Callable, Iterable

# The skip lists are empty by default: no group is left out unless a user
# asks for it. The former defaults named six DeepSeek-V4 "*State" spec
# classes of an unreleased vLLM-Ascend build (no released vLLM-Ascend or vLLM
# has them) and the ".compressor.state_cache" layers, whose state a resumed
# prefill reads for compress-4 layers: skipping them can garble output
# (docs/configuration.md). DeepSeek-V4's compressor state is stored window-only
# instead (planning/state_skip.py, groups.CompressorState).
DEFAULT_SKIP_STATE_SPECS: tuple[str, ...] = ()
DEFAULT_SKIP_STATE_LAYER_SUFFIXES: tuple[str, ...] = ()

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
BOOL_WORDS_TEXT = "true/false (also 1/0, yes/no, on/off)"


def parse_bool(value: Any) -> bool | None:
    """The boolean a config value spells, or None if it spells none (the one
    boolean parser of the package: our keys and LMCache's are read alike)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None


class ConfigValueError(Exception):
    """A bad value for one of our keys.

    Deliberately not a ``ValueError``: LMCache's loaders swallow ValueError
    from converters and silently fall back to ``None``; a bad flag must stop
    startup instead.
    """


def _to_bool(key: str) -> Callable[[Any], bool]:
    def convert(value: Any) -> bool:
        parsed = parse_bool(value)
        if parsed is None:
            raise ConfigValueError(f"config key {key!r}: invalid value {value!r}; valid: {BOOL_WORDS_TEXT}")
        return parsed

    return convert


def _to_names(key: str) -> Callable[[Any], tuple[str, ...]]:
    def convert(value: Any) -> tuple[str, ...]:
        items: Iterable[Any]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    items = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigValueError(
                        f"config key {key!r}: invalid JSON list {value!r}: {exc}"
                    ) from None
                if not isinstance(items, list):
                    raise ConfigValueError(f"config key {key!r}: {value!r} is not a list")
            else:
                items = text.split(",") if text else []
        elif isinstance(value, (list, tuple)):
            items = value
        else:
            raise ConfigValueError(
                f"config key {key!r}: invalid value {value!r}; valid: a list of "
                "names, a comma-separated string or a JSON list"
            )
        out = []
        for item in items:
            if not isinstance(item, str):
                raise ConfigValueError(
                    f"config key {key!r}: entry {item!r} in {value!r} is not a string"
                )
            if item.strip():
                out.append(item.strip())
        return tuple(out)

    return convert


# Longest model identity accepted: an identifier, not a document.
MAX_IDENTITY_CHARS = 256
# Longest path accepted for a file setting.
MAX_PATH_CHARS = 4096


def _to_text(key: str, what: str, max_chars: int, echo: bool) -> Callable[[Any], str]:
    """A printable string of at most ``max_chars`` (None: empty). ``echo``:
    whether an error may quote the value (not for a path to a secret)."""

    def convert(value: Any) -> str:
        if value is None:
            return ""
        shown = f"{value!r}" if echo else f"of type {type(value).__name__}"
        if not isinstance(value, str):
            raise ConfigValueError(f"config key {key!r}: invalid value {shown}; valid: {what}")
        text = value.strip()
        if len(text) > max_chars or not text.isprintable():
            shown = f" {value[:40]!r}..." if echo else ""
            raise ConfigValueError(
                f"config key {key!r}: invalid value{shown}; valid: {what} of at most {max_chars} printable characters"
            )
        return text

    return convert


AUTO_ON_OFF = ("auto", "on", "off")
ASYNC_LOOKUP_MODES = AUTO_ON_OFF


def _to_auto_on_off(key: str) -> Callable[[Any], str]:
    """``auto`` / ``on`` / ``off``; a boolean word means on or off."""

    def convert(value: Any) -> str:
        text = str(value).strip().lower() if value is not None else "auto"
        if text in AUTO_ON_OFF:
            return text
        parsed = parse_bool(value)
        if parsed is None:
            raise ConfigValueError(
                f"config key {key!r}: invalid value {value!r}; valid: {', '.join(AUTO_ON_OFF)} "
                f"(or {BOOL_WORDS_TEXT})"
            )
        return "on" if parsed else "off"

    return convert


def _to_identity(key: str) -> Callable[[Any], str]:
    return _to_text(key, "a string", MAX_IDENTITY_CHARS, echo=True)


def _to_path(key: str) -> Callable[[Any], str]:
    return _to_text(key, "a path", MAX_PATH_CHARS, echo=False)


PLAN_FILE_KEY = "ascend_plan_file"


def _to_plan_file(key: str) -> Callable[[Any], str]:
    """An absolute file path, or empty (off). Absolute, because the engine's
    processes need not share the working directory of whoever reads the
    file; a trailing separator names a directory, which is not a file."""
    as_text = _to_text(key, "a path", MAX_PATH_CHARS, echo=True)

    def convert(value: Any) -> str:
        text = as_text(value)
        if text and (not os.path.isabs(text) or text.endswith(os.sep)):
            raise ConfigValueError(
                f"config key {key!r}: invalid value {value!r}; valid: an absolute path of a file "
                "(each worker writes <stem>.rank<N><suffix> beside it), or empty (off)"
            )
        return text

    return convert


def plan_file_for(base: str, rank: int) -> str:
    """The file worker ``rank`` writes its plan to, for an ``ascend_plan_file``
    of ``base``: the rank goes into the name (``/d/plan.json`` ->
    ``/d/plan.rank0.json``), so the workers of a tensor-parallel engine do not
    overwrite each other's plan. The one rule writer and readers share."""
    head, name = os.path.split(base)
    stem, suffix = os.path.splitext(name)
    return os.path.join(head, f"{stem}.rank{rank}{suffix}")


@dataclass(frozen=True)
class KeySpec:
    key: str
    type_: type
    default: Any
    convert: Callable[[Any], Any]
    description: str


KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        "ascend_bundle_multi_spec",
        bool,
        True,
        _to_bool("ascend_bundle_multi_spec"),
        "Move every plane of a multi-plane layer with one multi-plane op call per "
        "kernel group and chunk; false = one call per homogeneous plane group.",
    ),
    KeySpec(
        "ascend_flatten_multi_spec",
        bool,
        True,
        _to_bool("ascend_flatten_multi_spec"),
        "Accept layers that several scheduler groups address (multi-spec layers, "
        "e.g. DeepSeek-V4 on vLLM-Ascend); false refuses them at plan time.",
    ),
    KeySpec(
        "ascend_skip_state_groups",
        bool,
        True,
        _to_bool("ascend_skip_state_groups"),
        "Neither store nor load the groups matched by the two skip lists.",
    ),
    KeySpec(
        "ascend_skip_state_spec_allowlist",
        tuple,
        DEFAULT_SKIP_STATE_SPECS,
        _to_names("ascend_skip_state_spec_allowlist"),
        "KV cache spec class names whose groups are skipped (default: none). A "
        "skipped group is not restored on a hit: only for state a resume never reads.",
    ),
    KeySpec(
        "ascend_skip_state_layer_suffixes",
        tuple,
        DEFAULT_SKIP_STATE_LAYER_SUFFIXES,
        _to_names("ascend_skip_state_layer_suffixes"),
        "Layer-name suffixes; a group all of whose layers end with one is skipped "
        "(default: none).",
    ),
    KeySpec(
        "ascend_model_identity",
        str,
        "",
        _to_identity("ascend_model_identity"),
        "The identity of the weights behind the KV (a registry digest, a release "
        "tag), used in chunk keys instead of sampling the checkpoint's files; "
        "needed where the weights are not in a local directory (default: read "
        "them). Every instance sharing a pool must set the same value for the same weights.",
    ),
    KeySpec(
        "ascend_require_remote",
        bool,
        False,
        _to_bool("ascend_require_remote"),
        "Stop startup when the remote store (remote_url) is unreachable or has no room. Default "
        "false: the engine starts without it (one ERROR, counted in remote_unavailable) and uses it "
        "once it is back. A misconfigured store stops startup either way.",
    ),
    KeySpec(
        "ascend_redis_sync_reads",
        bool,
        True,
        _to_bool("ascend_redis_sync_reads"),
        "redis:// and rediss:// pools (one server), with hiredis installed: the staged lookups read "
        "LMCache's entries on redis-py's synchronous client on their own threads (a staged hit 1.8-2.5x "
        "faster than LMCache's asyncio reads, docs/benchmarks.md); false reads them through LMCache's "
        "connector. Writes and every other operation stay LMCache's.",
    ),
    KeySpec(
        "ascend_async_lookup",
        str,
        "auto",
        _to_auto_on_off("ascend_async_lookup"),
        "Look requests up beside vLLM's steps: the scheduler answers 'not yet' (None) while a "
        "lookup runs on a thread of its own, and keeps scheduling the other requests. auto: on "
        "when LMCache has a disk or remote store (where a lookup fetches and verifies chunks), "
        "off for the local CPU cache alone; on; off (every lookup inside the step).",
    ),
    KeySpec(
        "ascend_layerwise_load",
        str,
        "auto",
        _to_auto_on_off("ascend_layerwise_load"),
        "Copy a hit's chunks into vLLM's KV cache layer by layer on a thread while the forward "
        "computes the layers before (vLLM's wait_for_layer_load), instead of all of them before the "
        "forward. Only for chunks a lookup staged, KV on the CPU. auto: off (measured not to pay on a "
        "2-core vLLM-CPU, docs/benchmarks.md); on; off.",
    ),
    KeySpec(
        "ascend_pool_secret_file",
        str,
        "",
        _to_path("ascend_pool_secret_file"),
        "A file holding the pool secret (at least 16 bytes; one trailing newline is dropped): every "
        "entry written to disk or a remote store then carries a keyed MAC and lookups refuse entries "
        "whose MAC does not verify. The environment variable LMCACHE_ASCEND_POOL_SECRET (the secret "
        "itself) is the alternative; setting both stops startup. Default: no secret.",
    ),
    KeySpec(
        PLAN_FILE_KEY,
        str,
        "",
        _to_plan_file(PLAN_FILE_KEY),
        "An absolute path: at startup each worker writes its transfer plan there as JSON, the rank "
        "in the name (/d/plan.json -> /d/plan.rank0.json), replacing the file atomically; for tools "
        "(lmcache-ascend explain, the benches). Default: no file.",
    ),
)
KEY_NAMES: tuple[str, ...] = tuple(k.key for k in KEYS)


@dataclass(frozen=True)
class AscendConfig:
    """Our settings, read once from an LMCache config."""

    bundle_multi_spec: bool = True
    flatten_multi_spec: bool = True
    skip_state_groups: bool = True
    skip_state_spec_allowlist: tuple[str, ...] = DEFAULT_SKIP_STATE_SPECS
    skip_state_layer_suffixes: tuple[str, ...] = DEFAULT_SKIP_STATE_LAYER_SUFFIXES
    model_identity: str = ""
    require_remote: bool = False
    redis_sync_reads: bool = True
    async_lookup: str = "auto"
    layerwise_load: str = "auto"
    pool_secret_file: str = ""
    plan_file: str = ""

    def __post_init__(self) -> None:
        # Re-run the converters so a hand-built config is validated the same
        # way as one read from yaml or the environment.
        for spec in KEYS:
            field = spec.key.removeprefix("ascend_")
            object.__setattr__(self, field, spec.convert(getattr(self, field)))

    @classmethod
    def from_lmcache(cls, config: Any) -> "AscendConfig":
        """Read our keys from an ``LMCacheEngineConfig`` (defaults where absent).

        Values set directly with ``setattr`` bypass LMCache's converters, so
        every value is validated again here.
        """
        values = {}
        for spec in KEYS:
            raw = getattr(config, spec.key, spec.default)
            values[spec.key.removeprefix("ascend_")] = spec.default if raw is None else raw
        return cls(**values)
