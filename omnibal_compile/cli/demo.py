"""``omnibal-compile demo``: the whole flow on the built-in tiny VLM, on CPU.

capture -> blocks -> costs (profiled here) -> ILP plan (cut points + recomputation under a memory
budget) compared with the uniform and parameter-balanced splits -> simulated iteration -> codegen
-> parity of the stages against the unsplit model.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from omnibal_compile import progress
from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile._utils.validate import int_option
from omnibal_compile.cli._settings import add_settings, settings_from_args
from omnibal_compile.config import (
    Config,
    DataConfig,
    LayoutConfig,
    MemoryConfig,
    ModelConfig,
    PlannerConfig,
    ScheduleConfig,
)

NAME = "demo"
HELP = ("plan the built-in tiny VLM into balanced pipeline stages (4 unless --num-stages says otherwise) and check "
        "they reproduce it (CPU, ~30 s)")


DEMO_SECTIONS = (ModelConfig, DataConfig, LayoutConfig, ScheduleConfig, MemoryConfig, PlannerConfig)
"""The config sections ``demo`` takes (every field a flag, see :mod:`omnibal_compile.cli._settings`)."""
DEMO_FIELDS = ("seed", "device", "tiles_per_sample", "text_tokens", "num_stages", "microbatch_size", "schedule",
               "num_microbatches", "virtual_stages", "memory_budget", "recompute", "planner")
"""The fields of those sections the demo reads (it builds the tiny VLM itself)."""
DEMO_STAGES = 4
"""Stages the demo plans when neither --num-stages nor --devices is given (the layout search on one CPU
would pick 1)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = [n for sec in DEMO_SECTIONS for n in sec.names()]
    add_settings(p, Config, sections=DEMO_SECTIONS, exclude=[n for n in names if n not in DEMO_FIELDS])
    p.add_argument("--show-code", type=int_option(min=0), metavar="STAGE", default=None,
                   help="print the generated code of a stage")
    p.add_argument("--save-plan", metavar="PATH", default=None, help="write the plan as JSON")


def run(args: argparse.Namespace) -> int:

    import omnibal_compile as oc
    from omnibal_compile._utils.tables import counted, format_table
    from omnibal_compile._utils.units import parse_size
    from omnibal_compile.models import TinyVLMConfig
    from omnibal_compile.models.load import load_model
    from omnibal_compile.planning.build import plan_stages

    cfg = settings_from_args(args, Config)
    given: dict[str, Any] = {
        "num_stages": cfg.num_stages or DEMO_STAGES,
        "device": cfg.device or "cpu",
        "planner": cfg.planner or "ilp",
        "schedule": cfg.schedule or "1f1b",
    }
    if cfg.virtual_stages is None and given["schedule"] == "interleaved":
        given["virtual_stages"] = 2
    if cfg.memory_budget is None:  # a device holds about 1/stages of the model: a fixed default would not fit 2 stages
        given["memory_budget"] = f"{64 / given['num_stages']:g}MiB"
    cfg = dataclasses.replace(cfg, **given)
    stages, planner_name = cfg.num_stages, cfg.planner
    assert stages is not None and isinstance(planner_name, str)
    tiny = TinyVLMConfig()
    # the seeded weights `run --model tinyvlm --seed S` starts from (models.seeded: the same on every rank)
    loaded = load_model("tinyvlm", seed=cfg.seed, batch=cfg.microbatch_size, tiles=cfg.tiles_per_sample,
                        text=cfg.text_tokens)
    model, batch = loaded.model, loaded.example_batch
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyVLM: {tiny.vit_layers} ViT layers (width {tiny.vit_hidden}) + {tiny.llm_layers} LLM layers "
        f"(width {tiny.llm_hidden}), {n_params:,} parameters"
    )
    print(
        f"micro-batch: {batch['pixel_values'].shape[0]} tiles, input_ids {tuple(batch['input_ids'].shape)} "
        f"({tiny.tokens_per_tile} image tokens per tile)\n"
    )
    t0 = time.perf_counter()
    print(f"capturing, grouping blocks and costing them on '{cfg.device}' ...")
    with progress.quiet():  # result.summary() below shows what optimize() would tell
        result = oc.optimize(model, batch, config=cfg)
    print(result.summary())
    print()
    budget = float(parse_size(cfg.memory_budget, "--memory-budget"))  # type: ignore[arg-type]
    assert result.costs is not None  # device= costs the blocks
    best = oc.simulate(result.plan, result.costs)
    rows = [["planner", "planned ms", "simulated ms", "bubble", f"vs {planner_name}"]]
    for name in dict.fromkeys(("uniform", "parameters", "omnibal", planner_name)):
        if name == planner_name:
            other = result.plan
        else:
            try:
                other = plan_stages(
                    result.graph, num_stages=stages, schedule=result.plan.pipeline_schedule, planner=name,
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
        f"One iteration ({result.plan.schedule}, {counted(result.plan.num_microbatches or 1, 'micro-batch')}) of each "
        "planner's split: "
        "planned by the schedule's closed form, simulated event by event."
    )
    print(format_table(rows, "lrrrr"))
    print()
    rows = [["stage", "receives", "shape", "dtype"]]
    graph = result.graph
    for s in range(len(result.stages) + 1):
        names = result.stage_info(s).input_names if s < len(result.stages) else result.stage_info(s - 1).output_names
        for k, name in enumerate(names):
            v = graph.value_named(name)
            what = graph.describe_value(v) if v is not None else name
            shape = "x".join(map(str, v.shape)) if v is not None and v.shape else "scalar" if v is not None else "-"
            dtype = (v.dtype or "-").removeprefix("torch.") if v is not None else "-"
            rows.append([("out" if s == len(result.stages) else str(s)) if k == 0 else "", what, shape, dtype])
    print("What each stage receives (from the stage before it), and what the last one returns (out):")
    print(format_table(rows, "rlrl"))
    report = result.check_parity(batch)
    print(f"\n{report}")
    passes = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    total = time.perf_counter() - t0
    rest = total - sum(result.timings.values())  # model build, baselines, simulation, parity check, printing
    print(f"Time taken: {passes}, the rest (baselines, simulation, parity) {rest:.2f} s; {total:.2f} s in all.")
    if args.show_code is not None:
        if not 0 <= args.show_code < len(result.stages):
            raise oc.InputError(f"--show-code must be a stage index in [0, {len(result.stages)})")
        print(result.stages[args.show_code].code)
    if args.save_plan:
        atomic_write_text(args.save_plan, result.plan.to_json())
        print(f"plan written to {args.save_plan}")
    if report.ok:
        saved = args.save_plan or "plan.json"
        again = "" if args.save_plan else f"omnibal-compile demo --save-plan {saved}, then "
        print(f"\nNext: train the plan on {counted(result.plan.num_devices, 'local process', 'local processes')}: "
              f"{again}omnibal-compile run --plan {saved} --steps 2")
    return 0 if report.ok else 1
