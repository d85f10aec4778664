"""Simulated (not measured) iteration time, bubble and peak memory of the zero-bubble schedules against 1F1B and
interleaved 1F1B, on the reference VLM's cost profile taken here (backward split into B and W by the cost pass).

1f1b gets its own DP plan over pp stages, interleaved its own (the ILP) over 2 pp stages, and interleaved-zb /
zbv / dualpipev run interleaved's 2 pp cut points unchanged (the zbv / dualpipev placement puts stages s and
2 pp - 1 - s on one device); the rows ``... planned`` are each with its own cut points and recomputation
(``plan_with_costs(schedule=...)``, :mod:`omnibal_compile.planning.zero_bubble`), no memory budget. One device per
rank (a GPU-like pipeline: a bubble is idle time). ``--freeze vision`` freezes the tower first: its blocks then
have no W.

    python bench/zero_bubble_sim.py                       # pp=2, M=4 and 8
    python bench/zero_bubble_sim.py --pp 4 --microbatches 8 16 --freeze vision
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from omnibal_compile import optimize
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from omnibal_compile.models.freeze import freeze_parameters
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.sim import simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline devices")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeats", type=int, default=9, help="profiling repeats per block (median)")
    p.add_argument("--freeze", nargs="*", default=[], help="parameter-name patterns to freeze, e.g. vision")
    args = p.parse_args()

    torch.manual_seed(0)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    frozen = freeze_parameters(model, args.freeze)
    mb = make_example_batch(cfg, batch=2, tiles_per_sample=2, text_tokens=64, seed=1)
    graph = optimize(model, mb, num_stages=1, planner="parameters").graph
    costs = annotate_costs(graph, model, device="cpu", threads=1, repeats=args.repeats, clock="thread")
    w = sum(b.weight_grad_s or 0.0 for b in costs.blocks)
    bwd = sum(b.backward_s for b in costs.blocks)
    print(f"reference VLM, {len(frozen)} frozen parameters; per micro-batch: forward "
          f"{sum(b.forward_s for b in costs.blocks) * 1e3:.2f} ms, backward {bwd * 1e3:.2f} ms of which W "
          f"{w * 1e3:.2f} ms ({w / bwd:.0%})")
    pp = args.pp
    print(f"\n{'M':>3}  {'schedule':<22} {'stages':>6}  {'iteration ms':>12}  {'bubble':>7}  {'vs 1f1b':>7}  "
          f"{'peak MiB per device':<24}  cut points")
    for M in args.microbatches:
        one = plan_with_costs(costs, num_stages=pp, num_microbatches=M, planner="dp", schedule="1f1b")
        two = plan_with_costs(costs, num_stages=2 * pp, num_microbatches=M, planner="ilp", schedule="interleaved",
                              virtual_stages=2)
        plans = {"1f1b": one, "interleaved": two}
        for kind in ("interleaved-zb", "zbv", "dualpipev"):
            if kind == "dualpipev" and M < 2 * pp:
                continue  # torch's DualPipeV needs M >= stages
            plans[kind] = dataclasses.replace(two, schedule=kind)
        for kind in ("interleaved-zb", "zbv", "dualpipev"):
            if kind in plans:
                plans[f"{kind} planned"] = plan_with_costs(costs, num_stages=2 * pp, num_microbatches=M,
                                                           planner="ilp", schedule=kind, virtual_stages=2)
        base = simulate(one, costs).iteration_time_s
        for kind, plan in plans.items():
            r = simulate(plan, costs)
            peaks = ", ".join(f"{b / 2**20:.1f}" for b in r.peak_memory_bytes)
            print(f"{M:>3}  {kind:<22} {plan.num_stages:>6}  {r.iteration_time_s * 1e3:>12.2f}  "
                  f"{r.bubble_fraction:>7.1%}  {base / r.iteration_time_s:>6.2f}x  {peaks:<24}  "
                  f"{list(plan.boundaries)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
