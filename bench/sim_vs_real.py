"""Simulated vs measured iteration time of real pipeline runs on this machine (CPU, gloo, torchrun).

For the reference VLM, each planner's plan is (1) simulated from one cost profile taken here at
the micro-batch shape (one thread, as every rank uses) plus the runtime's own overheads measured
in the same run on a near-empty model (``omnibal_compile.runtime.measure_overhead``: time per
forward/backward action beyond compute, and per step), and (2) trained for a few steps on N local
ranks by the runtime; the median step time (first step dropped) is compared with the simulated
iteration time. The errors without the overhead terms, and without core sharing, are printed too. With more ranks
than cores (4 ranks on this 2-core machine) the simulator shares the cores among the ranks that compute at
once (``simulate(processors=...)``), and the overheads are fitted under the same sharing.

The split-backward schedules (interleaved-zb, zbv, dualpipev) run two stages per rank (``--virtual-stages``) with no
recomputation (the runtime refuses it under them) and the simulator runs torch's operation order for them, each
input-gradient (I) and weight-gradient (W) part an action of its own; their overheads are fitted with the same
schedule, counting those actions (``calibrate.overhead.action_depth``).

    python bench/sim_vs_real.py                  # 2 ranks, 1f1b, 4 micro-batches
    python bench/sim_vs_real.py --ranks 2 4      # 2 and 4 ranks
    python bench/sim_vs_real.py --schedule gpipe --microbatches 8
    python bench/sim_vs_real.py --schedule interleaved-zb zbv dualpipev --ranks 2 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from omnibal_compile import optimize
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.ir.schedule import SCHEDULE_KINDS, schedule_rule
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from omnibal_compile.planning import PLANNERS
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.runtime import fit_overhead, measure_overhead
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from omnibal_compile.sim import simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--schedule", nargs="+", default=["1f1b"], choices=list(SCHEDULE_KINDS),
                   help="schedules to check, each with every planner")
    p.add_argument("--virtual-stages", type=int, default=2,
                   help="stages per rank of the schedules that take any (interleaved, interleaved-zb)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--mb-samples", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steps per run (the first is dropped)")
    p.add_argument("--rounds", type=int, default=3, help="runs per plan, interleaved with the other plans'")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="profiling clock: wall (contended like the run) or thread (CPU time, ignores contention)")
    p.add_argument("--repeats", type=int, default=15, help="profiling repeats per block (median)")
    p.add_argument("--processors", type=int, default=os.cpu_count(),
                   help="cores the ranks share, for the simulator (default: this machine's; 0: one per rank)")
    p.add_argument("--planners", nargs="+", default=["ilp", "uniform", "parameters"],
                   choices=list(PLANNERS))
    args = p.parse_args()
    procs = args.processors or None
    chunks = {k: schedule_rule(k).stages_per_device or args.virtual_stages for k in args.schedule}

    torch.manual_seed(0)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    mb = make_example_batch(cfg, batch=args.mb_samples, tiles_per_sample=args.tiles, text_tokens=args.text, seed=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            graph = optimize(model, mb, num_stages=ranks, planner="parameters").graph
            over, own = {}, {}
            for kind in args.schedule:
                over[kind] = measure_overhead(ranks=ranks, schedule=kind, processors=procs, rounds=args.rounds,
                                              virtual_stages=chunks[kind],
                                              microbatches=(2 * ranks, 2 * ranks + 4) if kind == "dualpipev"
                                              else (4, 8))
                # The same runs read as if every rank had a core of its own, for comparison.
                own[kind] = fit_overhead(over[kind].samples, ranks=ranks, schedule=kind, virtual_stages=chunks[kind])
                print(f"ranks {ranks} {kind}: runtime overhead {over[kind].op_s * 1e3:.2f} ms per action (F, B, I "
                      f"or W), {over[kind].step_s * 1e3:.2f} ms per step (near-empty model, median steps "
                      f"{', '.join(f'M={m}: {t * 1e3:.1f} ms' for m, t in over[kind].samples)})", flush=True)
            # One profile for every plan: separate profiles differ by their own noise, which would
            # then read as simulation error. More repeats than the default for a stable median.
            costs = annotate_costs(graph, model, device="cpu", threads=1, repeats=args.repeats, clock=args.clock)
            plans, steps = {}, {}
            for kind in args.schedule:
                split = schedule_rule(kind).split_backward
                for name in args.planners:
                    # the runtime runs the split-backward schedules without recomputation
                    plans[kind, name] = plan_with_costs(
                        costs, num_stages=ranks * chunks[kind], num_microbatches=args.microbatches, planner=name,
                        schedule=kind, virtual_stages=chunks[kind], **({"recompute": "none"} if split else {}))
                    (Path(tmp) / f"plan_{ranks}_{kind}_{name}.json").write_text(plans[kind, name].to_json())
                    steps[kind, name] = []
            # Rounds over the plans in rotating order: the machine's speed drifts (a shared VM), and
            # drift must not read as a difference between plans or as simulation error.
            order = list(plans)
            for r in range(args.rounds):
                for kind, name in order[r % len(order):] + order[: r % len(order)]:
                    logs = launch(
                        RunConfig(
                            plan=str(Path(tmp) / f"plan_{ranks}_{kind}_{name}.json"),
                            batch_size=args.mb_samples * args.microbatches, tiles_per_sample=args.tiles,
                            text_tokens=args.text, steps=args.steps, optimizer="sgd", threads=1, apply_recompute=True,
                        ),
                        timeout_s=600, quiet=True,
                    )
                    steps[kind, name] += [s.step_time_s for s in logs[1:]]  # the first step warms up
            for (kind, name), plan in plans.items():
                o, u = over[kind], own[kind]
                raw = simulate(plan, costs, processors=procs)
                sim = simulate(plan, costs, op_overhead_s=o.op_s, step_overhead_s=o.step_s, processors=procs)
                unshared = simulate(plan, costs, op_overhead_s=u.op_s, step_overhead_s=u.step_s)
                measured = statistics.median(steps[kind, name])
                err = sim.iteration_time_s / measured - 1
                rows.append((ranks, kind, name, list(plan.boundaries), sim.iteration_time_s, measured, err,
                             raw.iteration_time_s / measured - 1, unshared.iteration_time_s / measured - 1))
                q = statistics.quantiles(steps[kind, name], n=4) if len(steps[kind, name]) > 1 else [measured] * 3
                print(
                    f"ranks {ranks} {kind} {name:<10} boundaries {list(plan.boundaries)}: simulated "
                    f"{sim.iteration_time_s * 1e3:8.2f} ms, measured {measured * 1e3:8.2f} ms (quartiles "
                    f"{q[0] * 1e3:.0f}-{q[2] * 1e3:.0f} ms over {len(steps[kind, name])} steps), error {err:+.1%}",
                    flush=True,
                )
    print(f"\n{'ranks':>5}  {'schedule':<14}  {'planner':<10}  {'simulated ms':>12}  {'measured ms':>11}  "
          f"{'error':>7}  {'without overhead':>16}  {'core per rank':>13}")
    for ranks, kind, name, _, s, m, e, e_raw, e_own in rows:
        print(f"{ranks:>5}  {kind:<14}  {name:<10}  {s * 1e3:>12.2f}  {m * 1e3:>11.2f}  {e:>+7.1%}  {e_raw:>+16.1%}  "
              f"{e_own:>+13.1%}")
    print(f"(simulated with the ranks sharing {procs or 'one core each of'} cores; 'core per rank': the same "
          "overhead runs and costs simulated as if every rank had a core of its own)")
    for kind in args.schedule:
        worst = max(abs(r[6]) for r in rows if r[1] == kind)
        print(f"{kind}: worst |error| {worst:.1%} ({'within' if worst <= 0.15 else 'OUTSIDE'} 15%)")
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs" + (
        ": other processes compete for the cores, so profiled and measured times are both perturbed"
        if load > (os.cpu_count() or 1) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
