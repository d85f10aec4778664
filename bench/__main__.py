"""``python -m bench [--quick] [--timeout S]``: run every bench script and write bench/RESULTS.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.studies.bench_all import run_all


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="cheaper flags for scripts that have them")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per script before it is killed")
    args = ap.parse_args()
    command = "python -m bench" + (" --quick" if args.quick else "")
    results = run_all(Path(__file__).resolve().parent, quick=args.quick, timeout=args.timeout, command=command)
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
