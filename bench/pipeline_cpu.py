"""Measured pipeline step time of plans on 2 CPU ranks: a balanced plan vs the uniform and parameter splits.

Every plan runs for real (torchrun, gloo, one thread per rank) on the same model and batches, in
one invocation; the script prints the median step time of each and the ratios against the
balanced plan. The reference VLM is configured so that ViT and LLM layers differ in cost (many
image tokens through narrow ViT layers, few text tokens through wide LLM layers): counting layers
(``uniform``) or parameters (``parameters``) then mis-balances the stages.

Planners: ``uniform`` and ``parameters`` (no costs); ``measured`` (the exact min-max split of the
blocks' profiled forward+backward time on this machine, from the cost pass); any other planner of
``omnibal_compile.planning.PLANNERS`` (``ilp``, ...) on the profiled cost table through
``plan_with_costs``. The first planner listed is the baseline of the ratios.

    python bench/pipeline_cpu.py                      # default: 10 steps per plan
    python bench/pipeline_cpu.py --steps 20 --repeats 2 --planners uniform parameters measured
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import omnibal_compile as oc
from omnibal_compile.compile.blocks import BlockGraph
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from omnibal_compile.planning import PLANNERS
from omnibal_compile.planning import build as partition
from omnibal_compile.planning.build import min_max_partition
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig

CONFIG = TinyVLMConfig(
    image_size=64, patch_size=4, vit_hidden=64, vit_layers=8, vit_heads=4, vit_mlp=256,
    llm_hidden=256, llm_layers=8, llm_heads=8, llm_kv_heads=4, llm_mlp=768, vocab_size=1024, image_token_id=1023,
)
"""ViT: 256 patches per tile at width 64; LLM: 64 image tokens per tile + text at width 256."""


def measured_planner(costs: CostTable, graph: BlockGraph, num_stages: int) -> Plan:
    """Contiguous split minimising the slowest stage's profiled forward+backward time (exact DP)."""
    times = [b.forward_s + b.backward_s for b in costs.blocks]
    boundaries, worst = min_max_partition(times, num_stages)
    return Plan(
        block_names=graph.names,
        boundaries=tuple(boundaries),
        planner="measured",
        block_params=tuple(b.num_params for b in graph.blocks),
        block_kinds=tuple(b.kind for b in graph.blocks),
        notes={"predicted slowest stage ms": round(worst * 1e3, 2)},
    )


def make_plans(
    names: list[str], model: torch.nn.Module, microbatch: dict[str, torch.Tensor], stages: int, microbatches: int
) -> dict[str, Plan]:
    graph = oc.optimize(model, microbatch, num_stages=1).graph
    costs: CostTable | None = None
    plans: dict[str, Plan] = {}
    for name in names:
        if name != "measured" and name not in PLANNERS:
            raise SystemExit(f"unknown planner {name!r}; available: {', '.join(['measured', *PLANNERS])}")
        if name in PLANNERS and not PLANNERS[name].needs_costs:
            schedule = Schedule.for_stages(stages, num_microbatches=microbatches)
            plans[name] = partition.plan_stages(graph, num_stages=stages, schedule=schedule, planner=name)
            continue
        if costs is None:  # profiled once, on this machine, at the micro-batch shape
            costs = annotate_costs(graph, model, device="cpu", threads=1, warmup=1, repeats=5, clock="thread")
        if name == "measured":
            plans[name] = measured_planner(costs, graph, stages)
        else:
            plans[name] = partition.plan_with_costs(
                costs, num_stages=stages, num_microbatches=microbatches, planner=name
            )
    return plans


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["ilp", "measured", "uniform", "parameters"]
    p.add_argument(
        "--planners",
        nargs="+",
        default=default,
        help=f"default: {' '.join(default)}; the first is the baseline of the ratios",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps per plan (the first 2 are not timed)")
    p.add_argument("--repeats", type=int, default=1, help="run every plan this many times, interleaved")
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--tiles", type=int, default=2, help="image tiles per sample")
    p.add_argument("--text", type=int, default=64, help="text tokens per sample")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    args = p.parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3 (the first 2 steps are warm-up)")

    torch.manual_seed(0)
    model = TinyVLM(CONFIG)
    batch = make_example_batch(CONFIG, batch=args.batch, tiles_per_sample=args.tiles, text_tokens=args.text)
    microbatch = {k: v[: v.shape[0] // args.microbatches] for k, v in batch.items()}
    t0 = time.perf_counter()
    plans = make_plans(args.planners, model, microbatch, stages=2, microbatches=args.microbatches)
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    for plan in plans.values():
        print(plan.summary(), "\n")

    times: dict[str, list[float]] = {n: [] for n in plans}
    rank_cpu: dict[str, list[tuple[float, ...]]] = {n: [] for n in plans}
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, plan in plans.items():
                path = Path(tmp) / f"{name}.json"
                plan = dataclasses.replace(
                    plan, schedule=args.schedule, num_microbatches=args.microbatches, virtual_stages=1
                )
                path.write_text(plan.to_json())
                config = RunConfig(
                    plan=str(path), model="tinyvlm", model_config=dataclasses.asdict(CONFIG), batch_size=args.batch,
                    tiles_per_sample=args.tiles, text_tokens=args.text, steps=args.steps, optimizer="adamw", lr=1e-4,
                    nproc=2, threads=1,
                )
                logs = launch(config, timeout_s=600, quiet=True)
                step_times = [s.step_time_s for s in logs[2:]]
                times[name].extend(step_times)
                rank_cpu[name].extend(s.rank_cpu_s for s in logs[2:])
                losses[name] = logs[0].loss
                print(
                    f"[{r + 1}/{args.repeats}] {name:>10}: median step {statistics.median(step_times) * 1e3:8.1f} ms, "
                    f"min {min(step_times) * 1e3:8.1f} ms",
                    flush=True,
                )

    base = args.planners[0]
    med = {n: statistics.median(t) for n, t in times.items()}
    low = {n: min(t) for n, t in times.items()}
    print(
        f"\nstep time on 2 CPU ranks ({args.schedule}, {args.microbatches} micro-batches of "
        f"{args.batch // args.microbatches} "
        f"samples x {args.tiles} tiles + {args.text} text tokens), {len(times[base])} timed steps per plan:"
    )
    print(f"  {'plan':>10}  {'median ms':>9}  {'min ms':>8}  {'median ratio':>12}  {'min ratio':>9}  cut before block")
    for name in plans:
        cuts = plans[name].boundaries[1:-1]
        print(f"  {name:>10}  {med[name] * 1e3:9.1f}  {low[name] * 1e3:8.1f}  {med[name] / med[base]:12.2f}  "
              f"{low[name] / low[base]:9.2f}  {cuts}")
    print("CPU time per step of each rank (its own compute; a rank waiting for its neighbour sleeps), median:")
    for name in plans:
        per_rank = [statistics.median(c[r] for c in rank_cpu[name]) * 1e3 for r in range(2)]
        print(f"  {name:>10}  " + "  ".join(f"rank {r}: {t:7.1f} ms" for r, t in enumerate(per_rank))
              + f"   max/mean {max(per_rank) / statistics.mean(per_rank):.2f}")
    print(f"ratios are step time / step time of '{base}' (above 1: '{base}' is that much faster); min is the "
          "least disturbed by other processes on the machine")
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on {os.cpu_count()} cores; "
          "a waiting rank sleeps in gloo, so other processes on the cores shrink the measured differences")
    first_losses = {round(v, 5) for v in losses.values()}
    print(f"first-step loss of every plan: {sorted(first_losses)} (same model and batches, so it must be one value)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
