"""Credentials of the remote store never reach a log line or an error.

Redis takes its user and password in ``remote_url``
(``redis://USER:PASSWORD@host:port``, ``rediss://`` for TLS: LMCache's
Redis connector hands the URL to redis-py as is), LMCache's RESP connector
in ``extra_config`` ``username``/``password`` or ``LMCACHE_RESP_*``. LMCache
itself prints both: its configuration dump (``LMCache Configuration: {...}``
with ``remote_url`` and ``extra_config``) and "Creating Redis connector for
URL: ..." at every connector creation.

:func:`install` wraps logging's record factory (logging's own hook, one
place that sees every record of every logger: LMCache's loggers do not
propagate, so a filter on a handler of ours would miss them). A record whose
text carries a password is rewritten before any handler formats it:

* the password in a URL's user info: ``scheme://user:***@host``;
* the value of a ``password``/``passwd``/``secret`` field as a dict or a
  keyword prints it (``'password': '***'``, ``password=***``);
* any value :func:`register` was given (the password of the configured
  ``remote_url`` and RESP password, once the config is read), wherever it
  appears.

Records without any of them are left as they are (their arguments
unformatted, as logging does).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable, Iterable, Optional
from urllib.parse import unquote, urlsplit

MASK = "***"
# Shorter values are not registered: masking every "ab" in every log line
# would garble the log for no gain (no real password is that short).
MIN_REGISTERED = 4

# scheme://user:password@  (user may be empty: redis://:password@host)
_URL_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]*:)(?P<pw>[^\s@/'\"]+)(?P<tail>@)")
# 'password': 'x'  "password": "x"  password=x  password: x
_FIELD = re.compile(
    r"(?P<head>['\"]?\b(?:password|passwd|secret|pool_secret)['\"]?\s*[:=]\s*)"
    r"(?P<q>['\"]?)(?P<pw>[^'\"\s,}{)]+)(?P=q)",
    re.IGNORECASE,
)

# Re-entrant: a log record can be made while this thread holds it (the
# garbage collector runs a finalizer that logs, e.g. asyncio's "Task was
# destroyed", in the middle of a match), and the record factory takes it
# again. A plain Lock hung the process there.
_lock = threading.RLock()
_secrets: set[str] = set()
_installed = False
_previous_factory: Optional[Callable[..., logging.LogRecord]] = None


def register(values: Iterable[Optional[str]]) -> None:
    """Mask these exact values in every later log record (the configured
    passwords; URL-quoted forms too)."""
    with _lock:
        for v in values:
            if v and len(v) >= MIN_REGISTERED:
                _secrets.add(v)
                _secrets.add(unquote(v))


def url_password(url: Any) -> Optional[str]:
    """The password in a URL's user info, None where there is none."""
    try:
        return urlsplit(str(url)).password
    except ValueError:
        return None


def redact(text: str) -> str:
    """``text`` with every password it shows replaced by ``***``."""
    out = _URL_USERINFO.sub(lambda m: m.group("head") + MASK + m.group("tail"), text)
    out = _FIELD.sub(lambda m: m.group("head") + m.group("q") + MASK + m.group("q"), out)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for s in secrets:
        if s in out:
            out = out.replace(s, MASK)
    return out


def redact_url(url: Any) -> str:
    """``url`` fit for a log line or an error message."""
    return redact(str(url))


def _shows_secret(text: str) -> bool:
    if "@" in text and _URL_USERINFO.search(text):
        return True
    lowered = text.lower()
    if ("pass" in lowered or "secret" in lowered) and _FIELD.search(text):
        return True
    with _lock:
        secrets = tuple(_secrets)
    return any(s in text for s in secrets)


def _factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
    assert _previous_factory is not None
    record = _previous_factory(*args, **kwargs)
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is its logger's to report
        return record
    if _shows_secret(text):
        record.msg = redact(text)
        record.args = None
    return record


def install() -> None:
    """Wrap logging's record factory, once per process (before LMCache reads
    and prints its configuration)."""
    global _installed, _previous_factory
    with _lock:
        if _installed:
            return
        _previous_factory = logging.getLogRecordFactory()
        logging.setLogRecordFactory(_factory)
        _installed = True


def register_config(config: Any, environ: Any) -> None:
    """Register the passwords an LMCache config (and the environment LMCache
    reads them from) carries."""
    extra = getattr(config, "extra_config", None) or {}
    register([
        url_password(getattr(config, "remote_url", None) or ""),
        str(extra.get("password", "") or ""),
        environ.get("LMCACHE_RESP_PASSWORD", ""),
    ])
