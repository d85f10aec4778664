"""``omnibal-compile``: the command line. Each subcommand lives in ``omnibal_compile.cli``."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence

from omnibal_compile.errors import OmnibalError

# Subcommand modules; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "demo": ("omnibal-compile demo", "omnibal-compile demo --num-stages 2 --save-plan plan.json"),
    "plan": (
        "omnibal-compile plan tiny-vlm --num-stages 4 --num-microbatches 8 --device cpu --out plan-out",
        "omnibal-compile plan my_models.py:build --devices 8 --device h100-80gb --memory-budget 60GiB",
    ),
    "run": (
        "omnibal-compile run --plan plan.json --steps 2",
        "omnibal-compile run --plan plan.json --dp 2 --lengths lengths.json --save ckpt --save-every 50",
        "omnibal-compile run --plan plan.json --resume ckpt --steps 200",
        "omnibal-compile run --plan plan.json --model hf:base --save ckpt --export-hf hf-out",
    ),
    "data": ("omnibal-compile data omnibal_compile/data/stats/*.json --dp 8 --samples-per-pack 4",),
    "lengths": ("omnibal-compile lengths train.jsonl --tokenizer tokenizer --out lengths.json",),
    "bench": ("omnibal-compile bench kernels", "omnibal-compile bench all"),
    "export": ("omnibal-compile export ckpt hf-out", "omnibal-compile export ckpt/step-000050 hf-out --model hf:base"),
}
"""Example command lines shown at the end of each command's ``--help``."""
COMMANDS: tuple[str, ...] = ("omnibal_compile.cli.demo", "omnibal_compile.cli.plan", "omnibal_compile.cli.run",
                         "omnibal_compile.cli.data", "omnibal_compile.cli.bench",
                         "omnibal_compile.cli.lengths", "omnibal_compile.cli.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnibal-compile", description="Balanced pipeline-parallel training of vision-language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for path in COMMANDS:
        mod = importlib.import_module(path)
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES.get(mod.NAME, ()))
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=textwrap.fill(mod.HELP, 100), epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
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
    except KeyboardInterrupt:  # Ctrl-C: the launcher has ended every rank on its way out; no traceback
        print(f"omnibal-compile {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
