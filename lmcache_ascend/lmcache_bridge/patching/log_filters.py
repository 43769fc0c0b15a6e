"""LMCache log lines that do not apply under this connector.

Each is dropped by a ``logging.Filter`` on the LMCache logger that emits it
(logging's own hook: LMCache's messages are not patched), and the first
time it would have appeared in a process, a line of ours says what
happened instead. Everything else LMCache logs passes unchanged.

* ``token_database``: "Centralized cache sharing detected but
  PYTHONHASHSEED not set ... export PYTHONHASHSEED=0". This connector's
  chunk keys start from a seed every process derives alike whether or not
  PYTHONHASHSEED is set (``engine.pin_init_hash``), and with PYTHONHASHSEED
  unset it never hashes them with Python's per-process ``hash``
  (``config.enforce_engine_requirements``): the advice would only make users
  change their environment for nothing.
* ``mooncakestore_connector``: the ERROR "Single get operation is not
  supported. Use batched_get instead." LMCache's own code calls that
  single-key read (its remote backend's ``get_blocking``, e.g. from its
  health check once a holder is gone); the connector raises, LMCache counts
  the read as a miss, and the tokens are computed. Nothing the user did or
  can change; the replacement says so once, at WARNING.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

logger = logging.getLogger(__name__)

MOONCAKE_CONNECTOR = "lmcache.v1.storage_backend.connector.mooncakestore_connector"


@dataclass(frozen=True)
class Rule:
    module: str  # the LMCache module whose logger emits the line (0.5.6 name)
    starts: str  # LMCache's message starts with this
    instead: str  # what this connector logs once per process in its place
    level: int


RULES: tuple[Rule, ...] = (
    Rule(
        lmcache_modules.TOKEN_DATABASE,
        "Centralized cache sharing detected but PYTHONHASHSEED not set",
        "lmcache-ascend: chunk keys are seeded alike in every process with or without "
        "PYTHONHASHSEED; LMCache's advice to export PYTHONHASHSEED=0 does not apply to this "
        "connector and is not shown",
        logging.INFO,
    ),
    Rule(
        MOONCAKE_CONNECTOR,
        "Single get operation is not supported",
        "lmcache-ascend: LMCache read one key from Mooncake with its single-key get, which "
        "LMCache's Mooncake connector does not implement; that read counts as a miss and its "
        "tokens are computed (LMCache's ERROR 'Single get operation is not supported' is not "
        "shown; batched reads, which serve requests, are unaffected)",
        logging.WARNING,
    ),
)


class _DropInapplicable(logging.Filter):
    def __init__(self, rules: tuple[Rule, ...]):
        super().__init__()
        self.rules = rules
        self.seen: set[Rule] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is LMCache's to report
            return True
        for rule in self.rules:
            if message.startswith(rule.starts):
                with self._lock:
                    first = rule not in self.seen
                    self.seen.add(rule)
                if first:
                    logger.log(rule.level, rule.instead)
                return False
        return True


_installed: dict[str, _DropInapplicable] = {}
_install_lock = threading.Lock()


def install() -> dict[str, logging.Filter]:
    """Adds the filters to LMCache's loggers (by this release's module
    names), once per process. LMCache's ``init_logger`` replaces a logger's
    handlers, not its filters, so this works before or after LMCache
    imported the module. Returns the filters by logger name."""
    with _install_lock:
        for module in sorted({r.module for r in RULES}):
            name = lmcache_modules.resolve(module)
            if name in _installed:
                continue
            f = _DropInapplicable(tuple(r for r in RULES if r.module == module))
            logging.getLogger(name).addFilter(f)
            _installed[name] = f
        return dict(_installed)
