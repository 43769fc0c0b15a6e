"""``lmcache-ascend explain``: start vLLM with the connector on a model and
print the transfer plan its worker wrote (groups, bytes per chunk against
naive sizing, kernel groups, op calls per chunk, skipped groups).

The plan is read from the file the worker writes when ``ascend_plan_file``
is set (spawn.py sets it for the engine it starts), so no engine setting
that serves requests is changed for it (in particular no insecure RPC
serialization).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from lmcache_ascend.cli.engine_run import Scenario
from lmcache_ascend.cli.plan_file import PlanFileError, read_plan
from lmcache_ascend.cli.spawn import run_scenario


def engine_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


_REFUSALS = ("LayoutError: ", "ValueError: ")


def startup_refusal(log: str) -> str:
    """The last layout refusal in an engine log ("layer '…': why"), or ""."""
    found = ""
    for line in log.splitlines():
        for marker in _REFUSALS:
            if marker in line and "layer" in line:
                found = line.split(marker, 1)[1].strip()
    return found


def run(args: argparse.Namespace) -> int:
    scenario = Scenario(
        model=args.model,
        phases=[],
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        engine_kwargs=engine_args(args.engine_arg or []),
    )
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-explain-") as tmp:
        run = run_scenario(scenario, "explain", Path(tmp), quiet=True)
        try:
            record = read_plan(run.plan_file)
        except PlanFileError as e:
            refusal = startup_refusal(run.log)
            if refusal:
                # A layout the connector cannot move exactly stops it at startup
                # (e.g. vLLM-Ascend 0.30.0rc2's TurboQuant or LI-C4 caches, KVPP
                # scratch buffers): say which layer and why, as the engine did.
                raise SystemExit(f"the connector refused this model's KV layout at startup: {refusal}") from None
            raise SystemExit(f"the connector wrote no plan: {e}") from None
    print(json.dumps(record, indent=2) if args.json else record["text"])
    return 0
