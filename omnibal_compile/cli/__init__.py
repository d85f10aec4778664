"""``omnibal-compile``: the command line. Each subcommand lives in ``omnibal_compile.cli``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from omnibal_compile.errors import OmnibalError

# Subcommand modules; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS: tuple[str, ...] = ("omnibal_compile.cli.demo", "omnibal_compile.cli.plan", "omnibal_compile.cli.run",
                         "omnibal_compile.cli.data", "omnibal_compile.cli.bench",
                         "omnibal_compile.cli.lengths")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnibal-compile", description="Balanced pipeline-parallel training of vision-language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for path in COMMANDS:
        mod = importlib.import_module(path)
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except OmnibalError as e:
        print(f"omnibal-compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
