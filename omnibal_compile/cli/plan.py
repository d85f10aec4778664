"""``omnibal-compile plan``: plan a model's pipeline split, simulate it, and draw it.

MODEL is one of:
    tiny-vlm                    the built-in reference VLM (``omnibal_compile.models.TinyVLM``);
    hf:ClassName:config.json    a Hugging Face ``transformers`` class built offline from a config
                                file with random weights (``hf:LlavaForConditionalGeneration:cfg.json``);
    module.path:factory         a function returning a model, or ``(model, example_batch)`` (the
                                current directory is importable).

Planning is ``optimize()``'s (costs from the cost pass, or ``--costs FILE``); the sweeps re-plan
with the planning pass it uses. Artefacts written to ``--out``: plan.json, plan.txt, costs.json,
blocks.png + blocks.svg (block graph), torchtitan.json and megatron.txt (the split in other
frameworks' formats), timeline.png, trace.json (chrome://tracing, ui.perfetto.dev), stages.png
and, with a sweep, sweep.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnibal_compile._utils.validate import MAX_SEED, int_option
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import DEFAULT_DP_SHARD, DP_SHARDS
from omnibal_compile.ir.schedule import SCHEDULE_KINDS, Schedule
from omnibal_compile.planning import PLANNERS, planner_help
from omnibal_compile.progress import Progress

NAME = "plan"
HELP = "plan a model's pipeline stages, simulate an iteration, and write the plan, pictures and a trace"

DEFAULT_OUT = "omnibal-plan"
LENGTH_ITERATIONS = 16
"""Iterations simulated per packing for --lengths."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="tiny-vlm | hf:ClassName:config.json | module.path:factory (returning a model or (model, example_batch))")
    p.add_argument("--stages", type=int_option(min=1), default=None,
                   help="pipeline stages, chunks included (default 4; with --devices, searched)")
    p.add_argument("--devices", type=int_option(min=1), default=None,
                   help="choose the layout for this many devices: pipeline depth and chunks, data parallelism, micro-batches "
                        "(prints the candidates; --stages, --microbatches, --dp pin what they name)")
    p.add_argument("--global-batch", type=int_option(min=1), default=None,
                   help="with --devices: micro-batches of the example's shape per optimizer step (default 2 per device)")
    p.add_argument("--virtual-stages", type=int_option(min=1), default=1,
                   help="stage chunks per device, for --schedule interleaved (default 1)")
    p.add_argument("--microbatches", type=int_option(min=1), default=None,
                   help="micro-batches per iteration (default 8; with --devices, searched)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_KINDS, help="pipeline schedule (default 1f1b)")
    p.add_argument("--memory", default=None, help="memory budget per device, e.g. 80GiB or 40GB (default: unconstrained)")
    p.add_argument("--dp", type=int_option(min=1), default=1, help="data-parallel replicas of the pipeline (default 1)")
    p.add_argument("--dp-shard", default=DEFAULT_DP_SHARD, choices=DP_SHARDS,
                   help="how the replicas hold weights, gradients and optimizer states: fsdp (sharded, default) or ddp (replicated)")
    p.add_argument("--device", default="cpu", help="device the costs are for: cpu (profile here) or a target such as a100-80gb")
    p.add_argument("--planner", default="auto", choices=["auto", *PLANNERS], help="auto = ilp; " + planner_help("auto"))
    p.add_argument("--costs", metavar="FILE", default=None, help="use this CostTable JSON instead of running the cost pass")
    p.add_argument("--lengths", metavar="FILE", nargs="+", default=None,
                   help="dataset length statistics (JSON lists of {vit_num, token_num}) to simulate micro-batches that differ")
    p.add_argument("--batch", type=int_option(min=1), default=2,
                   help="samples per micro-batch of the example batch (default 2)")
    p.add_argument("--tiles", type=int_option(min=0), default=2,
                   help="image tiles per sample of the example batch (tiny-vlm; default 2)")
    p.add_argument("--text", type=int_option(min=2), default=32,
                   help="text tokens per sample of the example batch (default 32)")
    p.add_argument("--sweep-memory", metavar="SIZES", default=None, help="what-if: comma-separated budgets, e.g. 20GiB,40GiB,80GiB")
    p.add_argument("--sweep-stages", metavar="COUNTS", default=None, help="what-if: comma-separated stage counts, e.g. 2,4,8")
    p.add_argument("--meta", action="store_true",
                   help="hf: models: build the model and example batch on the meta device in bf16 (no weights allocated; "
                        "cost with a target --device such as a100-80gb)")
    p.add_argument("--seed", type=int_option(min=0, max=MAX_SEED), default=0, help="seed for weights and data")
    p.add_argument("--no-pictures", action="store_true", help="write JSON and text only (no matplotlib needed)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")


# -- models ---------------------------------------------------------------------------------------
def load_model(spec: str, *, batch: int, tiles: int, text: int, seed: int, meta: bool = False) -> tuple[Any, Any, str]:
    """(model, example batch, display name) for a MODEL argument (``omnibal_compile.models.load``); ``meta``: on meta."""
    from omnibal_compile.models.load import load_model as load

    loaded = load(spec, seed=seed, batch=batch, tiles=tiles, text=text, meta=meta)
    if loaded.example_batch is None:
        raise InputError(
            f"MODEL {spec!r} returned a model without an example batch, and it is not a Hugging Face model whose "
            "config gives one: return (model, example_batch) from the factory"
        )
    return loaded.model, loaded.example_batch, loaded.name


# -- planning -------------------------------------------------------------------------------------
PlanMaker = Callable[[int, "int | None"], Any]
"""(number of stages, memory budget per device or None) -> a Plan with predictions."""


def plan_maker(args: argparse.Namespace, result: Any, planner: str) -> PlanMaker:
    """Re-plan ``result``'s model as optimize() does, for another stage count or budget (the sweeps)."""
    from omnibal_compile.planning.build import plan_stages

    def make(stages: int, budget: int | None) -> Any:
        schedule = Schedule.for_stages(
            stages, kind=args.schedule, num_microbatches=args.microbatches, virtual_stages=args.virtual_stages
        )
        return plan_stages(result.graph, num_stages=stages, schedule=schedule, planner=planner,
                           costs=result.costs, memory_budget=budget, data_parallel=result.plan.dp)

    return make


def _parse_list(text: str, item: Callable[[str], Any], flag: str) -> list[Any]:
    try:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise InputError(f"{flag} {text!r}: {e}") from None
    if not values:
        raise InputError(f"{flag} needs at least one value")
    return values


# -- the command ----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import omnibal_compile as oc
    from omnibal_compile._utils.units import format_size, parse_size
    from omnibal_compile.ir.interop import megatron_layout, torchtitan_module_names
    from omnibal_compile.sim import simulate

    if args.devices is None:  # a fixed layout: the defaults, checked before any work
        args.stages = 4 if args.stages is None else args.stages
        args.microbatches = 8 if args.microbatches is None else args.microbatches
    try:
        if args.devices is None:
            Schedule.for_stages(args.stages, kind=args.schedule, num_microbatches=args.microbatches,
                                virtual_stages=args.virtual_stages)
    except PlanError as e:
        raise InputError(
            f"--stages {args.stages} --schedule {args.schedule} --microbatches {args.microbatches} "
            f"--virtual-stages {args.virtual_stages}: {e}"
        ) from None
    budget = parse_size(args.memory, "--memory") if args.memory else None
    planner = "ilp" if args.planner == "auto" else args.planner
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pictures, no_pictures_note = not args.no_pictures, None
    if pictures:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # the base install: write everything else and say how to get the pictures
            pictures = False
            no_pictures_note = ("no pictures: they need matplotlib (pip install 'omnibal-compile[viz]'); "
                                "pass --no-pictures to skip them without this note")

    steps = 5 + bool(args.sweep_memory) + bool(args.sweep_stages) + bool(args.lengths)
    written: list[Path] = []
    with Progress(steps) as progress:
        step = progress.step
        step("building the model")
        model, batch, name = load_model(args.model, batch=args.batch, tiles=args.tiles, text=args.text, seed=args.seed,
                                        meta=args.meta)
        step(f"capture, blocks, costs, planning ({planner})")
        result = oc.optimize(
            model, batch, num_stages=args.stages, planner=None if args.devices and args.planner == "auto" else planner,
            num_microbatches=args.microbatches, schedule=args.schedule, virtual_stages=args.virtual_stages,
            memory_budget=budget, device=None if args.costs else args.device, costs=args.costs, dp=args.dp,
            dp_shard=args.dp_shard, devices=args.devices, global_batch=args.global_batch,
        )
        plan, costs = result.plan, result.costs
        if result.layout is not None:  # the sweeps re-plan the chosen layout
            args.stages, args.microbatches = plan.num_stages, plan.num_microbatches
            args.schedule, args.virtual_stages = plan.schedule, plan.virtual_stages
            (out / "layout.txt").write_text(result.layout.summary(limit=None) + "\n")
            written.append(out / "layout.txt")
        cost_note = (f"costs from {args.costs} ({costs.device}, {costs.source})" if args.costs
                     else f"costs from the cost pass on {costs.device} ({costs.source})")
        if costs.activation_dtype:
            cost_note += f", activations in {costs.activation_dtype}"
        if costs.attention:
            cost_note += f"\nattention: {costs.attention}"
        step("simulating")
        sim = simulate(plan, costs)
        (out / "costs.json").write_text(costs.to_json())
        written.append(out / "costs.json")
        step("writing plan and exports")
        (out / "plan.json").write_text(plan.to_json())
        (out / "plan.txt").write_text(plan.summary() + "\n")
        (out / "torchtitan.json").write_text(json.dumps(torchtitan_module_names(plan), indent=2) + "\n")
        written += [out / "plan.json", out / "plan.txt", out / "torchtitan.json"]
        layout = None
        try:
            layout = megatron_layout(plan)
            (out / "megatron.txt").write_text(layout + "\n")
            written.append(out / "megatron.txt")
        except InputError as e:
            cost_note += f"\nno Megatron layout: {e}"
        step("drawing")
        from omnibal_compile.sim.draw import write_chrome_trace

        written.append(write_chrome_trace(sim, out / "trace.json"))
        if pictures:
            from omnibal_compile.sim import draw

            written.append(draw.draw_block_graph(plan, out / "blocks.png", dag=result.graph.dag))
            written.append(draw.draw_block_graph(plan, out / "blocks.svg", dag=result.graph.dag))
            written.append(draw.draw_timeline(sim, out / "timeline.png"))
            written.append(draw.draw_stage_bars(plan, costs, out / "stages.png", result=sim))
        lengths_report = None
        if args.lengths:
            step("micro-batches from --lengths")
            lengths_report = _lengths_report(args, plan, costs, result)
        sweeps: list[str] = []
        for flag, kind in ((args.sweep_memory, "memory"), (args.sweep_stages, "stages")):
            if not flag:
                continue
            step(f"what-if sweep over {kind}")
            sweeps.append(_sweep(kind, flag, args, plan_maker(args, result, planner), budget, costs, out, pictures, written, planner))

    print(f"{name}: {plan.summary()}")
    print(cost_note)
    print()
    print(sim.summary())
    predicted = plan.iteration_time_s
    if predicted is not None:
        print(f"planner '{plan.planner}' predicted {predicted * 1e3:.3f} ms per iteration; simulated "
              f"{sim.iteration_time_s * 1e3:.3f} ms ({sim.iteration_time_s / predicted - 1:+.1%})")
    if budget is not None:
        over = [d for d, m in enumerate(sim.peak_memory_bytes) if m > budget]
        if over:
            print(f"devices {over} exceed the {format_size(budget)} budget")
    if layout is not None:
        print(f"\nMegatron layout: {layout}")
    if lengths_report:
        print(f"\n{lengths_report}")
    for text in sweeps:
        print(f"\n{text}")
    print(f"\nwrote {', '.join(p.name for p in written)} to {out}/")
    if no_pictures_note:
        print(no_pictures_note)
    return 0


def _sweep(kind: str, text: str, args: argparse.Namespace, make_plan: PlanMaker, budget: int | None, costs: Any,
           out: Path, pictures: bool, written: list[Path], planner: str) -> str:
    from omnibal_compile._utils.units import format_size, parse_size
    from omnibal_compile.sim import sweep, sweep_table

    if kind == "memory":
        values = _parse_list(text, parse_size, "--sweep-memory")
        make = lambda b: make_plan(args.stages, b)  # noqa: E731
        label, fmt, xs, xlabel = "budget", format_size, [v / 2**30 for v in values], "memory budget per device (GiB)"
    else:
        values = _parse_list(text, int, "--sweep-stages")
        make = lambda s: make_plan(s, budget)  # noqa: E731
        label, fmt, xs, xlabel = "stages", str, values, "pipeline stages"
    points = sweep(make, values, costs)
    # A plan whose simulated peak exceeds its budget does not fit (baseline planners ignore budgets).
    limit = {p.value: (p.value if kind == "memory" else budget) for p in points}
    points = tuple(
        p if p.result is None or limit[p.value] is None or max(p.result.peak_memory_bytes) <= limit[p.value]
        else dataclasses.replace(p, plan=None, result=None, error=f"peak {format_size(max(p.result.peak_memory_bytes))} exceeds the budget")
        for p in points
    )
    if pictures:
        from omnibal_compile.sim.draw import draw_sweep

        ys = [p.iteration_time_s * 1e3 if p.iteration_time_s is not None else None for p in points]
        written.append(draw_sweep(xs, ys, out / f"sweep_{kind}.png", xlabel=xlabel, title=f"what-if: {kind} ({planner})"))
    return f"what-if over {kind} (planner {planner}):\n" + sweep_table(points, label=label, fmt=fmt)


def _lengths_report(args: argparse.Namespace, plan: Any, costs: Any, result: Any) -> str:
    """Simulate micro-batches drawn from real length statistics: random batches vs balanced packs."""
    from omnibal_compile.costs.mix import packing_shapes, shape_costs
    from omnibal_compile.data import balance_pack, load_lengths, random_batches
    from omnibal_compile.sim import simulate

    stats = load_lengths(args.lengths)
    M = plan.num_microbatches
    # The cost table counts as the average micro-batch of --batch samples.
    reference = (float(stats.tiles.mean()) * args.batch, float(stats.tokens.mean()) * args.batch)
    vision = _vision_blocks(result)
    lines = [f"micro-batches of {args.batch} samples from {stats.source} ({len(stats):,} samples), {M} per iteration:"]
    even = simulate(plan, costs)
    lines.append(f"  {'identical (the cost table)':<28} iteration {even.iteration_time_s * 1e3:9.3f} ms, bubble {even.bubble_fraction:.1%}")
    for label, packing in (
        ("random batches (padded)", random_batches(stats, dp=M, batch_size=args.batch, seed=args.seed)),
        ("balanced packs (ours)", balance_pack(stats, dp=M, samples_per_pack=args.batch, seed=args.seed)),
    ):
        # One packing step = one iteration's M micro-batches; average over the first few iterations.
        runs = [
            simulate(plan, costs, microbatch_costs=shape_costs(
                costs, packing_shapes(stats, packing, step=k), vision_blocks=vision, reference=reference))
            for k in range(min(LENGTH_ITERATIONS, packing.num_steps))
        ]
        t = sum(r.iteration_time_s for r in runs) / len(runs)
        bubble = sum(r.bubble_fraction for r in runs) / len(runs)
        lines.append(f"  {label:<28} iteration {t * 1e3:9.3f} ms, bubble {bubble:.1%} (mean of {len(runs)} iterations)")
    return "\n".join(lines)


def _vision_blocks(result: Any) -> int:
    """Blocks before the language model's token embedding: the vision side of a VLM (0 for a text model)."""
    for b in result.graph.blocks:
        if b.kind == "module" and "embed_tokens" in b.name:
            return b.index
    return 0
