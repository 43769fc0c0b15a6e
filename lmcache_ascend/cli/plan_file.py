"""Reads the plan a worker wrote to ``ascend_plan_file``: the one reader of
the plan record for the CLI, the benches and the tests.

The connector writes the file only when asked (``LMCACHE_ASCEND_PLAN_FILE``
or the ``ascend_plan_file`` key; see ``wiring.write_plan_file``). Tools that
start an engine in a subprocess put :func:`plan_env` into its environment
and call :func:`read_plan` once it has started or exited. The plan is data,
not log text: the log's wording and format may change freely.

Imports neither vLLM nor LMCache: readers run outside the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

from lmcache_ascend.planning.settings import PLAN_FILE_KEY, plan_file_for

# The environment variable LMCache's config loader reads the key from.
PLAN_FILE_ENV = f"LMCACHE_{PLAN_FILE_KEY.upper()}"

PathLike = Union[str, "os.PathLike[str]"]


class PlanFileError(RuntimeError):
    """No readable plan record where a worker should have written one."""


def plan_env(base: PathLike) -> dict[str, str]:
    """The environment that makes an engine's workers write their plans for
    ``base`` (made absolute: the key refuses a relative path, and the engine
    may run in another working directory)."""
    return {PLAN_FILE_ENV: os.path.abspath(base)}


def read_plan(base: PathLike, rank: int = 0) -> dict[str, Any]:
    """The plan record worker ``rank`` wrote for an ``ascend_plan_file`` of
    ``base`` (``wiring.PlanRecord``: ``text``, ``plan``, ``groups``,
    ``agreement``, ``state``, ``replication``, ``rank``).

    Raises :class:`PlanFileError`, naming the file, when it is missing or
    is not a plan record."""
    path = Path(plan_file_for(os.path.abspath(base), rank))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanFileError(
            f"no plan file {str(path)!r} for worker {rank}: the connector writes it at worker "
            f"startup when {PLAN_FILE_ENV} (or {PLAN_FILE_KEY}) is {str(base)!r}; did the worker "
            "start with the connector?"
        ) from None
    except OSError as e:
        raise PlanFileError(f"cannot read the plan file {str(path)!r}: {e.strerror or e}") from e
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"the plan file {str(path)!r} is not JSON: {e}") from None
    if not isinstance(record, dict) or not {"text", "plan", "groups"} <= record.keys():
        raise PlanFileError(f"the plan file {str(path)!r} holds no plan record (keys text, plan, groups)")
    return record
