"""The pool secret: what every entry this connector writes to disk or a
shared store (Redis, Mooncake) is authenticated with (``chunk_io``: a keyed
BLAKE3 MAC in each chunk's trailer).

One setting, from one of two places, never from the command line:

* ``ascend_pool_secret_file`` (an LMCache config key: yaml,
  ``LMCACHE_ASCEND_POOL_SECRET_FILE`` or ``kv_connector_extra_config``)
  names a file whose bytes are the secret (one trailing newline is dropped);
* ``LMCACHE_ASCEND_POOL_SECRET`` (environment only) is the secret itself. It
  is deliberately no config key, so it cannot travel in
  ``kv_connector_extra_config`` on a command line.

Both set, an unreadable file, or a secret shorter than ``MIN_SECRET_BYTES``
stop startup with an error naming the setting. Neither the secret nor its
length is ever logged or put in an error message. Imports neither LMCache
nor vLLM.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Any, Mapping, Optional

import blake3

logger = logging.getLogger(__name__)

SECRET_FILE_KEY = "ascend_pool_secret_file"
SECRET_ENV = "LMCACHE_ASCEND_POOL_SECRET"
MIN_SECRET_BYTES = 16
# BLAKE3 key derivation context: the MAC key is never the secret itself, and
# a secret reused elsewhere yields another key here.
MAC_KEY_CONTEXT = "lmcache-ascend pool entry MAC v1"

_announce_lock = threading.Lock()
_announced = False


class PoolSecretError(ValueError):
    """The pool secret is configured wrongly; the message names the setting,
    never the secret."""


def _file_setting(config: Any) -> str:
    value = getattr(config, SECRET_FILE_KEY, None)
    return "" if value is None else str(value).strip()


def read_secret(config: Any, environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[bytes], str]:
    """The configured secret and the name of the setting it came from, or
    ``(None, "")`` when none is configured."""
    environ = os.environ if environ is None else environ
    path = _file_setting(config)
    from_env = environ.get(SECRET_ENV)
    if path and from_env is not None:
        raise PoolSecretError(
            f"both {SECRET_FILE_KEY} and {SECRET_ENV} are set; set only one of them "
            "(the pool secret comes from exactly one place)"
        )
    if from_env is not None:
        secret, source = os.fsencode(from_env), SECRET_ENV
    elif path:
        source = f"{SECRET_FILE_KEY} ({path})"
        full = os.path.expanduser(path)
        try:
            with open(full, "rb") as f:
                secret = f.read()
                mode = os.fstat(f.fileno()).st_mode
        except OSError as exc:
            raise PoolSecretError(
                f"{SECRET_FILE_KEY}: cannot read the pool secret file {path!r}: "
                f"{exc.strerror or type(exc).__name__}"
            ) from None
        if stat.S_ISREG(mode) and mode & 0o077:
            logger.warning(
                "lmcache-ascend: the pool secret file %s can be read by other users (mode %o); "
                "restrict it (chmod 600)",
                path,
                stat.S_IMODE(mode),
            )
        if secret.endswith(b"\r\n"):
            secret = secret[:-2]
        elif secret.endswith(b"\n"):
            secret = secret[:-1]
    else:
        return None, ""
    if not secret:
        raise PoolSecretError(f"{source}: the pool secret is empty; it must be at least {MIN_SECRET_BYTES} bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise PoolSecretError(
            f"{source}: the pool secret is too short; it must be at least {MIN_SECRET_BYTES} bytes "
            "(e.g. the output of `openssl rand -base64 32`)"
        )
    return secret, source


def derive_mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key pool entries are MAC'd with."""
    return blake3.blake3(secret, derive_key_context=MAC_KEY_CONTEXT).digest()


def _leaves_process(config: Any) -> bool:
    # As engine.checksums_enabled: entries on disk or in a remote store.
    return bool(getattr(config, "local_disk", None) or getattr(config, "remote_url", None))


def load_mac_key(config: Any, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The MAC key for pool entries (None without a secret), read at
    startup; says once per process whether pool entries are authenticated."""
    global _announced
    secret, source = read_secret(config, environ)
    key = None if secret is None else derive_mac_key(secret)
    del secret
    with _announce_lock:
        if _announced:
            return key
        _announced = True
    if key is not None:
        logger.info("lmcache-ascend: pool entries are authenticated (keyed BLAKE3 MAC; secret from %s)", source)
    elif _leaves_process(config):
        logger.warning(
            "lmcache-ascend: pool entries are not authenticated: anyone who can write to the pool can "
            "inject KV; set %s or %s",
            SECRET_FILE_KEY,
            SECRET_ENV,
        )
    return key
