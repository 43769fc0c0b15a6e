"""Waiting on a process that may be slow but is working (a test engine's
zygote, a vLLM server starting): the wait lasts while its CPU time changes
and ends when it has not changed for ``idle_s`` (hung) or after ``cap_s``
in all. A fixed time fits one machine: a zygote's imports took 10-20 s on
one and 13 minutes on another. Shared by engine_zygote.py and
openai_server.py, each with its own CPU reading."""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

Reading = Optional[Union[int, float]]


class Progress:
    def __init__(self, read_cpu: Callable[[], Reading], idle_s: float, cap_s: float) -> None:
        self.read_cpu, self.idle_s, self.cap_s = read_cpu, idle_s, cap_s
        self.start = self.changed = time.monotonic()
        self.cpu = read_cpu()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def gave_up(self) -> Optional[str]:
        """None while the wait may go on; "idle" (no CPU used for idle_s) or
        "cap" (cap_s in all) when it must end."""
        now = time.monotonic()
        seen = self.read_cpu()
        # A reading that cannot be had counts as a change: the cap alone applies.
        if seen is None or seen != self.cpu:
            self.cpu, self.changed = seen, now
        if now - self.changed > self.idle_s:
            return "idle"
        if now - self.start > self.cap_s:
            return "cap"
        return None
