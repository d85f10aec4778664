"""The cold ILP (no DP bound, no warm start) against an exact oracle on many random problems.

    python bench/ilp_cold.py [--draws N] [--interleaved] [--solver auto|cbc]

Draws problems from the solver tests' strategy (``tests/test_solver.py::problems``: two in three
memory-bound and multi-stage), solves each with ``solve_ilp`` alone and compares its iteration time
with the DP's optimum (GPipe/1F1B) or brute force (interleaved, up to 5 blocks). Prints every
mismatch (the problem, both plans) and the count; exits 1 when there is one. This is how the
HiGHS tolerance bugs fixed in issue 20 were found: the property tests see 40 draws a run, this sees
thousands.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=2000, help="problems to draw (default 2000)")
    ap.add_argument(
        "--interleaved", action="store_true", help="interleaved schedules (v in {1, 2}) against brute force"
    )
    ap.add_argument("--solver", default="auto", choices=("auto", "cbc"))
    args = ap.parse_args(argv)
    if args.draws < 1:
        ap.error("--draws must be at least 1")
    sys.path.insert(0, str(ROOT / "tests"))
    warnings.filterwarnings("ignore")
    from hypothesis import HealthCheck, Phase, given, settings
    from test_solver import brute_force, problems

    from omnibal_compile import PlanError
    from omnibal_compile.planning import solve_dp, solve_ilp

    strategy = problems(max_n=5, schedules=("interleaved",), virtual=(1, 2)) if args.interleaved else problems()
    seen = {"draws": 0, "compared": 0, "mismatches": 0}
    start = time.perf_counter()

    @given(strategy)
    @settings(max_examples=args.draws, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate], database=None)
    def compare(P):
        seen["draws"] += 1
        if seen["draws"] % 500 == 0:
            print(f"  {seen['draws']} drawn, {seen['mismatches']} mismatches, {time.perf_counter() - start:.0f} s",
                  flush=True)
        oracle = brute_force(P) if args.interleaved else None
        if args.interleaved and oracle is None:
            return
        if not args.interleaved:
            try:
                oracle = solve_dp(P)
            except PlanError:
                return  # nothing fits
        seen["compared"] += 1
        try:
            got = solve_ilp(P, time_limit=30, gap=1e-9, solver=args.solver)
            ok = got.feasible and math.isclose(got.iteration_time, oracle.iteration_time, rel_tol=1e-5, abs_tol=1e-9)
        except PlanError as e:
            got, ok = e, False
        if not ok:
            seen["mismatches"] += 1
            print(f"MISMATCH {P!r}\n  ilp:    {got}\n  oracle: {oracle.iteration_time} {oracle.boundaries} "
                  f"{oracle.recompute}", flush=True)

    compare()
    kind = "interleaved, against brute force" if args.interleaved else "GPipe/1F1B, against the DP"
    print(f"{seen['draws']} problems drawn ({kind}), {seen['compared']} with a plan that fits: "
          f"{seen['mismatches']} where the cold ILP ({args.solver}) differs; {time.perf_counter() - start:.0f} s")
    return 1 if seen["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
