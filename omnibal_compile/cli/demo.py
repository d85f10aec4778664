"""``omnibal-compile demo``: the whole flow on the built-in tiny VLM, on CPU.

capture -> blocks -> costs (profiled here) -> ILP plan (cut points + recomputation under a memory
budget) compared with the uniform and parameter-balanced splits -> simulated iteration -> codegen
-> parity of the stages against the unsplit model.
"""

from __future__ import annotations

import argparse
import time

from omnibal_compile._utils.validate import MAX_SEED, int_option
from omnibal_compile.ir.schedule import SCHEDULE_KINDS
from omnibal_compile.planning import PLANNERS, planner_help

NAME = "demo"
HELP = "plan the built-in tiny VLM into balanced pipeline stages and check they reproduce it (CPU, ~30 s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int_option(min=1), default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int_option(min=1), default=8, help="micro-batches per iteration (default 8)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_KINDS, help="pipeline schedule")
    p.add_argument("--planner", default="ilp", choices=list(PLANNERS), help=planner_help("ilp"))
    p.add_argument(
        "--device", default="cpu", help="cost source: 'cpu' profiles here (default), or a roofline target such as a100-80gb"
    )
    p.add_argument(
        "--memory", default=None,
        help="memory budget per device (default 64MiB / stages: 16MiB for 4 stages, tight enough that some blocks recompute)"
    )
    p.add_argument("--batch", type=int_option(min=1), default=2, help="samples in the example micro-batch (default 2)")
    p.add_argument("--tiles", type=int_option(min=0), default=2, help="image tiles per sample (default 2)")
    p.add_argument("--text", type=int_option(min=2), default=48, help="text tokens per sample (default 48)")
    p.add_argument("--seed", type=int_option(min=0, max=MAX_SEED), default=0, help="seed for weights and data")
    p.add_argument("--show-code", type=int_option(min=0), metavar="STAGE", default=None,
                   help="print the generated code of a stage")
    p.add_argument("--save-plan", metavar="PATH", default=None, help="write the plan as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    import omnibal_compile as oc
    from omnibal_compile._utils.tables import counted, format_table
    from omnibal_compile._utils.units import parse_size
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
    from omnibal_compile.planning.build import plan_stages

    if args.memory is None:  # a device holds about 1/stages of the model: a fixed default would not fit 2 stages
        args.memory = f"{64 / args.stages:g}MiB"
    torch.manual_seed(args.seed)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    batch = make_example_batch(cfg, batch=args.batch, tiles_per_sample=args.tiles, text_tokens=args.text, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyVLM: {cfg.vit_layers} ViT layers (width {cfg.vit_hidden}) + {cfg.llm_layers} LLM layers "
        f"(width {cfg.llm_hidden}), {n_params:,} parameters"
    )
    print(
        f"micro-batch: {batch['pixel_values'].shape[0]} tiles, input_ids {tuple(batch['input_ids'].shape)} "
        f"({cfg.tokens_per_tile} image tokens per tile)\n"
    )
    t0 = time.perf_counter()
    print(f"capturing, grouping blocks and costing them on '{args.device}' ...")
    virtual = 2 if args.schedule == "interleaved" else 1
    result = oc.optimize(
        model, batch, num_stages=args.stages, planner=args.planner, device=args.device,
        num_microbatches=args.microbatches, schedule=args.schedule, virtual_stages=virtual,
        memory_budget=args.memory,
    )
    print(result.summary())
    print()
    budget = float(parse_size(args.memory, "--memory")) if args.memory else None
    best = oc.simulate(result.plan, result.costs)
    rows = [["planner", "planned ms", "simulated ms", "bubble", f"vs {args.planner}"]]
    for name in dict.fromkeys(("uniform", "parameters", "omnibal", args.planner)):
        if name == args.planner:
            other = result.plan
        else:
            try:
                other = plan_stages(
                    result.graph, num_stages=args.stages, schedule=result.plan.pipeline_schedule, planner=name,
                    costs=result.costs, memory_budget=budget,
                )
            except oc.PlanError as e:
                rows.append([name, "-", "-", "-", f"no plan: {e}"])
                continue
        sim = oc.simulate(other, result.costs)
        planned = f"{other.iteration_time_s * 1e3:.2f}" if other.iteration_time_s is not None else "-"
        rows.append([
            name, planned, f"{sim.iteration_time_s * 1e3:.2f}", f"{sim.bubble_fraction:.1%}",
            f"{sim.iteration_time_s / best.iteration_time_s:.2f}x",
        ])
    print(
        f"One iteration ({args.schedule}, {counted(args.microbatches, 'micro-batch')}) of each planner's split: "
        "planned by the schedule's closed form, simulated event by event."
    )
    print(format_table(rows, "lrrrr"))
    print()
    rows = [["stage", "receives", "sends"]]
    for s in range(len(result.stages)):
        info = result.stage_info(s)
        rows.append([str(s), ", ".join(info.input_names), ", ".join(info.output_names)])
    print("What each stage receives and sends (values of the captured graph):")
    print(format_table(rows, "rll"))
    report = result.check_parity(batch)
    print(f"\n{report}")
    passes = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    print(f"Time taken: {passes}; {time.perf_counter() - t0:.1f} s in all.")
    if args.show_code is not None:
        if not 0 <= args.show_code < len(result.stages):
            raise oc.InputError(f"--show-code must be a stage index in [0, {len(result.stages)})")
        print(result.stages[args.show_code].code)
    if args.save_plan:
        with open(args.save_plan, "w") as f:
            f.write(result.plan.to_json())
        print(f"plan written to {args.save_plan}")
    return 0 if report.ok else 1
