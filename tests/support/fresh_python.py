"""``python -c CODE`` in a fresh interpreter, for tests of what happens when
a module is first imported (patches installed, modules loaded, keys agreed
across hash secrets, log filters set up).

The code runs with Python's cyclic GC off. Importing vLLM builds about two
million objects, and the GC ran about ten full collections over them while
it did: 0.9-1.8 s of each probe's start-up on 2 cores, two dozen probes per
unit suite, on every stack. What these probes check (which modules are
loaded, what a class defines, what a key is, what a log line says) does not
depend on when unreachable cycles are freed; a probe lives seconds.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

GC_OFF = "import gc; gc.disable()\n"


def run(code: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run of ``[python, -c, code, *args]`` with ``kwargs``."""
    return subprocess.run([sys.executable, "-c", GC_OFF + code, *args], **kwargs)
