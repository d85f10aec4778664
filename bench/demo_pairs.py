"""Do two runs of ``omnibal-compile demo`` on a loaded machine choose the same plan?

    python bench/demo_pairs.py [--pairs 10] [--load 2]

Runs the demo command as a user does (a fresh process each time, ``--save-plan``), two at a time
one after the other per pair, while ``--load`` busy processes (pure-Python loops, one core each)
compete for the cores. A pair agrees when both plans have the same cut points and the same
recomputation of every block. Prints one line per pair and the count of agreeing pairs; exits 1
when any pair disagrees. Issue "Trust at first sight" asks for 10 of 10 pairs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _busy() -> None:
    while True:  # a parallel CPU job: one core kept busy until terminated
        sum(i * i for i in range(10_000))


def _plan(folder: Path, name: str) -> tuple[tuple[int, ...], tuple[str, ...], float]:
    path = folder / f"{name}.json"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "omnibal_compile.cli", "demo", "--save-plan", str(path)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    plan = json.loads(path.read_text())
    return tuple(plan["boundaries"]), tuple(plan["recompute"]), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10, help="pairs of demo runs (default 10)")
    ap.add_argument("--load", type=int, default=2, help="busy processes running alongside (default 2)")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.load < 0:
        raise SystemExit("--pairs must be >= 1 and --load >= 0")
    load = [mp.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    agree = 0
    seen: dict[tuple[tuple[int, ...], tuple[str, ...]], int] = {}
    try:
        print(f"{args.pairs} pairs of `omnibal-compile demo`, {args.load} busy processes alongside, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.pairs):
                (cuts_a, rec_a, t_a), (cuts_b, rec_b, t_b) = _plan(Path(tmp), f"{k}a"), _plan(Path(tmp), f"{k}b")
                same = (cuts_a, rec_a) == (cuts_b, rec_b)
                agree += same
                for key in ((cuts_a, rec_a), (cuts_b, rec_b)):
                    seen[key] = seen.get(key, 0) + 1
                print(f"pair {k + 1:2d}: cuts {list(cuts_a)} / {list(cuts_b)}, recompute "
                      f"{'same' if rec_a == rec_b else 'differs'}, {'agree' if same else 'DISAGREE'} "
                      f"({t_a:.0f} s, {t_b:.0f} s; load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for p in load:
            p.terminate()
            p.join()
    print(f"{agree} of {args.pairs} pairs chose the same plan; {len(seen)} distinct plan(s) in "
          f"{2 * args.pairs} runs")
    return 0 if agree == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
