"""lmcache-ascend: multi-group (hybrid) KV-cache offload for vLLM through LMCache.

``import lmcache_ascend`` is deliberately light: it exposes the version and
gives the package's loggers a handler (vLLM only configures its own). LMCache
config keys are registered when the connector starts (or by calling
:func:`lmcache_ascend.v1.config.register_config_keys`).
"""

import logging as _logging
import os as _os

__version__ = "0.1.0"

__all__ = ["__version__"]


def _configure_logging() -> None:
    log = _logging.getLogger("lmcache_ascend")
    if log.handlers:
        return
    handler = _logging.StreamHandler()
    handler.setFormatter(
        _logging.Formatter(
            "[%(asctime)s] lmcache-ascend %(levelname)s: %(message)s (%(filename)s:%(lineno)d)"
        )
    )
    log.addHandler(handler)
    # Same switch as LMCache's own logs, so one variable controls both.
    level = _os.environ.get("LMCACHE_LOG_LEVEL", "INFO").upper()
    log.setLevel(getattr(_logging, level, _logging.INFO))
    log.propagate = False


_configure_logging()
