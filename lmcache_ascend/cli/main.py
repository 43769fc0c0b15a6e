"""``lmcache-ascend`` command line: ``demo`` and ``explain``.

demo     builds a small random-weight hybrid model (once, cached), serves a
         long shared-prefix workload cold, resets vLLM's prefix cache, serves
         it warm from LMCache, and checks outputs against a no-cache engine.
explain  prints how the connector plans transfers for a model.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    from lmcache_ascend.cli import demo, explain

    p = argparse.ArgumentParser(prog="lmcache-ascend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="cold vs warm shared-prefix serving on a local tiny model")
    d.add_argument("--model", help="path of your own model (default: build a tiny hybrid one)")
    d.add_argument("--arch", default="gemma3", choices=["llama", "gemma2", "gemma3"])
    d.add_argument("--prefix-tokens", type=int, default=2048)
    d.add_argument("--suffix-tokens", type=int, default=64)
    d.add_argument("--requests", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=8)
    d.add_argument("--dtype", default="float32")
    d.set_defaults(func=demo.run)
    e = sub.add_parser("explain", help="print the transfer plan for a model")
    e.add_argument("--model", required=True)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="extra vLLM engine argument (repeatable), e.g. block_size=64")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=explain.run)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
