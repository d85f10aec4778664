"""``omnibal-compile bench <target>``: benchmarks. Targets: ``kernels`` (the fused Triton kernels), ``all``
(every script of bench/, results written to bench/RESULTS.md; see :mod:`bench.studies.bench_all`).

Each target is one entry of :data:`TARGETS` (a function ``(args) -> exit code``), so others
(``all``, ...) can be added beside it; target-specific options are prefixed with the target name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from omnibal_compile._utils.validate import int_option, number_option

NAME = "bench"
HELP = ("benchmark parts of the library: 'kernels' times the fused kernels against eager torch; 'all' runs every "
        "bench script and writes bench/RESULTS.md")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", choices=sorted(TARGETS), help="what to benchmark")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on CPU)"
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument("--kernels-vocab", type=int_option(min=2), nargs="+", default=[32000, 128256, 151936],
                   help="loss vocab sizes timed on CUDA (default 32000 128256 151936)")
    p.add_argument("--kernels-loss-tokens", type=int_option(min=1), default=None,
                   help="tokens of the vocab-128k memory measurement (default 16384 on CUDA, 1024 on CPU)")
    p.add_argument("--kernels-loss-hidden", type=int_option(min=1), default=None,
                   help="hidden size of that measurement (default 4096 on CUDA, 256 on CPU)")
    p.add_argument("--all-quick", action="store_true", help="all: cheaper flags for scripts that have them")
    p.add_argument("--all-timeout", type=number_option(above=0), default=1200.0,
                   help="all: seconds per script before it is killed")
    p.add_argument("--all-bench-dir", default=None, help="all: the bench folder (default: the checkout's bench/)")
    p.add_argument("--all-out", default=None, help="all: results page (default: <bench dir>/RESULTS.md)")


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line that gives ``args`` again."""
    argv = [NAME, args.target, "--kernels-vocab", *map(str, args.kernels_vocab)]
    options = {
        "--dtype": args.dtype,
        "--json": args.json,
        "--kernels-loss-tokens": args.kernels_loss_tokens,
        "--kernels-loss-hidden": args.kernels_loss_hidden,
    }
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _kernels(args: argparse.Namespace) -> int:
    import torch

    from omnibal_compile.kernels import bench, ops

    cuda = torch.cuda.is_available()
    if not cuda and ops.triton_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before triton is imported, and importing torch.export
        # already imported it here: run again in a fresh process with the variable set.
        print("no GPU: re-running under TRITON_INTERPRET=1 so the Triton kernels run in the interpreter", flush=True)
        env = dict(os.environ, TRITON_INTERPRET="1")
        from omnibal_compile.runtime.processes import python_module

        return subprocess.call(python_module("omnibal_compile.cli", *_argv(args)), env=env)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    if cuda:
        ops.check_triton_installed()
        liger = bench.liger_functions() is not None
        backends = ["triton", "liger"] if liger else ["triton"]
        print(f"speed run on {torch.cuda.get_device_name(device)}: triton.testing.do_bench medians, {dtype}")
        print("Liger-Kernel installed: its functions timed as backend liger, against the same reference" if liger
              else "Liger-Kernel not installed: no comparison with it (pip install liger-kernel to add one)")
    else:
        backends = ["eager", "triton"] if ops.triton_runs_on("cpu") else ["eager"]
        print(
            f"CORRECTNESS RUN on CPU at small shapes ({dtype}), not a speed measurement: times are the "
            f"eager reference vs the ops ({', '.join(backends)}"
            + ("; Triton through its interpreter)" if "triton" in backends else "; triton is not installed)")
        )
    torch.manual_seed(0)
    case_list = bench.cases(device, dtype, small=not cuda, loss_vocab=args.kernels_vocab)
    rows = bench.run_bench(case_list, device, backends)
    print(bench.format_rows(rows))
    tokens = args.kernels_loss_tokens or (16384 if cuda else 1024)
    hidden = args.kernels_loss_hidden or (4096 if cuda else 256)
    # On CPU the eager op runs the same chunked algorithm; the interpreter would take minutes at 128k.
    mem = bench.loss_memory(device, dtype, tokens=tokens, hidden=hidden, vocab=128 * 1024, backend=backends[0])
    print(bench.format_loss_memory(mem))
    if args.json:
        payload = {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "kind": "speed" if cuda else "correctness",
            "dtype": str(dtype),
            "rows": [dict(asdict(r), speedup=r.speedup) for r in rows],
            "loss_memory": dict(asdict(mem), ratio=mem.ratio),
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"results written to {args.json}")
    return 0


def _all(args: argparse.Namespace) -> int:
    run_all = _checkout_bench_runner(args.all_bench_dir)

    command = "omnibal-compile bench all" + (" --all-quick" if args.all_quick else "")
    results = run_all(args.all_bench_dir, out=args.all_out, quick=args.all_quick, timeout=args.all_timeout,
                      command=command)
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in results) else 1


def _checkout_bench_runner(bench_dir: str | None) -> Callable[..., Any]:
    """``bench all`` runs the scripts of a source checkout's bench/ folder, which the wheel does not ship."""
    import importlib
    from pathlib import Path

    from omnibal_compile.errors import InputError

    folder = Path(bench_dir) if bench_dir else Path(__file__).resolve().parents[2] / "bench"
    if not (folder / "studies" / "bench_all.py").is_file():
        raise InputError(f"`bench all` runs the scripts of a source checkout's bench/ folder, and {folder} has none: "
                         "clone the repository and run it there, or pass --all-bench-dir")
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("bench.studies.bench_all").run_all


TARGETS: dict[str, Callable[[argparse.Namespace], int]] = {"kernels": _kernels, "all": _all}
"""Benchmark targets by name; add new ones here."""


def run(args: argparse.Namespace) -> int:
    return TARGETS[args.target](args)
