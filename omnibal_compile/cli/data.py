"""``omnibal-compile data LENGTHS...``: compare random, length-grouped, ISF and our batching."""

from __future__ import annotations

import argparse

from omnibal_compile._utils.validate import MAX_SEED, int_option
from omnibal_compile.config import OVERSIZED_POLICIES

NAME = "data"
HELP = "balance dataset length statistics and print Pad/Dist Ratios of random, length-grouped, ISF and ours"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("lengths", nargs="+", metavar="LENGTHS", help="length files (.json OmniBal format, .jsonl, .csv)")
    p.add_argument("--dp", type=int_option(min=1), default=8, help="data-parallel ranks (default 8)")
    p.add_argument("--samples-per-pack", type=int_option(min=1), default=4,
                   help="target samples per micro-batch (default 4)")
    p.add_argument("--iterations", type=int_option(min=1), default=50,
                   help="ISF iterations T (default 50, as the reference)")
    p.add_argument("--seed", type=int_option(min=0, max=MAX_SEED), default=0, help="seed (default 0)")
    p.add_argument("--resample", type=int_option(min=1), default=None, metavar="N",
                   help="draw N samples with replacement first")
    p.add_argument("--methods", default="random,length-grouped,isf,ours", help="comma-separated subset to run")
    p.add_argument("--oversized", choices=OVERSIZED_POLICIES, default="error",
                   help="a sample larger than ISF's and our pack shape: refused and named (error, the default), cut "
                        "to the shape (truncate) or given a pack of its own (own-pack)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.data.compare import METHODS, compare_balancers, format_comparison
    from omnibal_compile.data.lengths import load_lengths
    from omnibal_compile.errors import InputError
    from omnibal_compile.progress import Progress

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise InputError(f"--methods has unknown {unknown}; choose from {list(METHODS)}")
    stats = load_lengths(list(args.lengths))
    if args.resample:
        stats = stats.resample(args.resample, seed=args.seed)
    with Progress(len(methods), enabled=not args.no_progress, unit="method") as progress:
        result = compare_balancers(stats, dp=args.dp, samples_per_pack=args.samples_per_pack, seed=args.seed,
                                   iterations=args.iterations, methods=methods, progress=progress,
                                   oversized=args.oversized)
    print(f"statistics: {stats.source}")
    print(format_comparison(result))
    return 0
