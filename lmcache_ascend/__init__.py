"""lmcache-ascend: multi-group (hybrid) KV-cache offload for vLLM through LMCache.

``import lmcache_ascend`` is deliberately light: it exposes the version, gives
the package's loggers a handler (vLLM only configures its own) and installs
the LMCache adapter shim hook, which imports nothing until LMCache's vLLM
adapter is imported (see ``lmcache_ascend._lmcache_hook``): from then on our
config keys are registered with LMCache and vLLM's own ``LMCacheConnectorV1``
works on the CPU and on NPUs for single-group models. LMCache config keys are
also registered when our connector starts (or by calling
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

from lmcache_ascend import _lmcache_hook  # noqa: E402

_lmcache_hook.install()
