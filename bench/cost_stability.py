"""Run-to-run stability of the CPU cost pass: the demo's plan and predicted iteration time over repeated runs.

    python bench/cost_stability.py [--runs 5] [--quick]

Each run profiles the reference VLM of ``omnibal-compile demo`` afresh (thread clock, one torch
thread, identical layers timed once), plans it as the demo does (4 stages, 8 micro-batches, 1F1B,
16 MiB per device, ILP) and simulates the iteration. Printed: each run's plan and predicted time,
the spread of the predicted time (max - min over median), how many distinct plans the runs chose,
and each plan's predicted time under the first run's costs (how far apart the choices really are).
Every run is planned twice: with the planner's tie-break (plans predicted within 2% of the fastest
count as equal and are chosen by figures that do not depend on timings) and without (tolerance 0,
the fastest plan as predicted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from omnibal_compile._utils.tables import format_table
from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from omnibal_compile.planning import PROFILED_TIE_TOLERANCE
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.sim import simulate

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="cost passes to compare (default 5)")
    ap.add_argument("--quick", action="store_true", help="3 runs")
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs
    torch.manual_seed(0)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    batch = make_example_batch(cfg, batch=2, tiles_per_sample=2, text_tokens=48)
    graph = build_blocks(capture(model, batch), model)
    tables, plans, fastest, rows = [], [], [], []
    kw = dict(num_stages=4, num_microbatches=8, schedule="1f1b", memory_budget=16 * MiB)
    for r in range(runs):
        t0 = time.perf_counter()
        table = annotate_costs(graph, model, device="cpu")
        seconds = time.perf_counter() - t0
        plan = plan_with_costs(table, **kw)
        quick = plan_with_costs(table, **kw, tie_tolerance=0.0)
        it = simulate(plan, table).iteration_time_s
        tables.append(table)
        plans.append(plan)
        fastest.append(quick)
        timed = sum(1 for b in table.blocks if not b.profiled_as)
        worst = max(table.blocks, key=lambda b: b.time_spread)
        rows.append((str(r), f"{seconds:.1f}", f"{it * 1e3:.2f}", str(plan.boundaries[1:-1]),
                     "".join(o[0] for o in plan.recompute), str(quick.boundaries[1:-1]),
                     "".join(o[0] for o in quick.recompute), f"{timed}/{len(table.blocks)}",
                     f"{worst.time_spread:.0%} ({worst.name})"))
    print(f"reference VLM of the demo: {graph.num_blocks} blocks; 4 stages, 8 micro-batches, 1F1B, 16 MiB per device")
    print(format_table([("run", "cost s", "predicted ms", "cuts", "recompute (n/s/f per block)", "cuts, no tie-break",
                         "recompute, no tie-break", "timed", "largest spread")] + rows, "rrrlllllr"))
    for label, chosen in (
        (f"with the tie-break ({PROFILED_TIE_TOLERANCE:.0%})", plans),
        ("without it (tolerance 0)", fastest),
    ):
        times = [simulate(p, t).iteration_time_s for p, t in zip(chosen, tables)]
        med = statistics.median(times)
        distinct = {(p.boundaries, p.recompute) for p in chosen}
        base = tables[0]
        first = simulate(chosen[0], base).iteration_time_s
        under = [f"{simulate(p, base).iteration_time_s / first:.4f}" for p in chosen]
        print(f"{label}: {len(distinct)} distinct plan(s) in {runs} runs"
              f"{' (identical)' if len(distinct) == 1 else ''}; predicted iteration time median {med * 1e3:.2f} ms, "
              f"run-to-run spread (max - min) / median {(max(times) - min(times)) / med:.1%}; "
              f"each run's plan under run 0's costs, relative to run 0's plan: {', '.join(under)}")
    slower = [p.iteration_time_s / q.iteration_time_s - 1 for p, q in zip(plans, fastest)]
    print(f"tie-break's plan vs the fastest as predicted, per run: {', '.join(f'+{x:.2%}' for x in slower)}")
    spreads = [statistics.median(b.time_spread for b in t.blocks) for t in tables]
    print(f"median block spread (interquartile range / median of the repeats) per run: "
          f"{', '.join(f'{x:.0%}' for x in spreads)}")

if __name__ == "__main__":
    main()
