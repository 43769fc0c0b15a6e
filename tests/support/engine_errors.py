"""The errors an engine run died of, for a failing test's message.

vLLM runs the model in worker processes whose output is interleaved with
the engine core's and the front end's in one log. When a worker dies, the
last lines of that log hold only the other processes' reaction ("cancelled",
"died unexpectedly"); the worker's own error is further up. So a failed run
reports every Python traceback, every fatal signal (engine processes run
with PYTHONFAULTHANDLER=1, which prints the stack of a crashed process) and
every ERROR line, then the last lines.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(r"^\(\w+ pid=\d+\) ?")  # keeps a frame line's indent
# What a process killed by a signal leaves: Python's fault handler, or the
# shell's word for it (anchored: log lines may mention these words).
_SIGNAL = re.compile(r"(Fatal Python error|Segmentation fault|Aborted|Bus error|Illegal instruction|"
                     r"Floating point exception|Killed)\b")
TAIL_LINES = 60


def errors(text: str, limit: int = 12) -> list[str]:
    """Blocks of the log that say why a process died, oldest first: Python
    tracebacks (up to their exception line), fatal-signal reports with the
    stack that follows, and ERROR lines."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines) and len(out) < limit:
        line = lines[i]
        bare = _PREFIX.sub("", line)
        if bare.startswith("Traceback (most recent call last)"):
            # Frames are indented; the first unindented line is the exception.
            j = i + 1
            while j < len(lines) and j - i < 80:
                nxt = _PREFIX.sub("", lines[j])
                j += 1
                if nxt.strip() and not nxt.startswith((" ", "\t")):
                    break
            out.append("\n".join(lines[i:j]))
            i = j
            continue
        if _SIGNAL.match(bare):
            # Python's fault handler: the error, a blank line, then each
            # thread's stack, a blank line after each.
            j = i + 1
            blanks = 0
            while j < len(lines) and j - i < 80:
                if not lines[j].strip():
                    blanks += 1
                    if blanks == 2:
                        break
                j += 1
            out.append("\n".join(lines[i:j]))
            i = j
            continue
        if " ERROR " in line or bare.startswith("ERROR"):
            out.append(line)
        i += 1
    return out


def report(text: str, tail_lines: int = TAIL_LINES) -> str:
    found = errors(text)
    tail = "\n".join(text.splitlines()[-tail_lines:])
    head = ("errors in the engine's processes:\n" + "\n---\n".join(found)) if found else \
        "no traceback, fatal signal or ERROR line in the log"
    return f"{head}\n=== last {tail_lines} log lines ===\n{tail}"
