"""``omnibal-compile plan``: plan a model's pipeline split, simulate it, and draw it.

MODEL is one of:
    tinyvlm                     the built-in reference VLM (``omnibal_compile.models.TinyVLM``; tiny-vlm also
                                accepted);
    hf:DIR                      a folder saved by ``save_pretrained``, its weights loaded (the class its
                                config's ``architectures`` names; ``hf:ClassName:DIR`` names it);
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

from omnibal_compile import progress as progress_info
from omnibal_compile._utils.files import atomic_write_text, writable_folder
from omnibal_compile.cli._settings import add_settings, settings_from_args
from omnibal_compile.config import (
    Config,
    DataConfig,
    LayoutConfig,
    MemoryConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    PlannerConfig,
    ScheduleConfig,
)
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.progress import Progress

NAME = "plan"
HELP = "plan a model's pipeline stages, simulate an iteration, and write the plan, pictures and a trace"

LENGTH_ITERATIONS = 16
"""Iterations simulated per packing for --lengths."""


PLAN_SECTIONS = (ModelConfig, DataConfig, LayoutConfig, ParallelConfig, ScheduleConfig, MemoryConfig, PlannerConfig,
                 OutputConfig)
"""The config sections ``plan`` takes (every field a flag, see :mod:`omnibal_compile.cli._settings`)."""
PLAN_EXCLUDE = ("batches", "batching", "batch_size", "samples_per_pack", "dataset", "image_root", "processor",
                "skip_bad_records", "data_workers", "oversized", "eval_data", "eval_every")
"""Fields of those sections only a training run reads."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", metavar="MODEL", nargs="?", default=None,
                   help="the model, as --model (tinyvlm | hf:DIR | hf:ClassName:config.json | module.path:factory)")
    add_settings(p, Config, sections=PLAN_SECTIONS, exclude=PLAN_EXCLUDE)
    p.add_argument(
        "--sweep-memory", metavar="SIZES", default=None, help="what-if: comma-separated budgets, e.g. 20GiB,40GiB,80GiB"
    )
    p.add_argument(
        "--sweep-stages", metavar="COUNTS", default=None, help="what-if: comma-separated stage counts, e.g. 2,4,8"
    )


def plan_settings(args: argparse.Namespace) -> Config:
    """The plan command's settings: defaults, ``--config``, flags, the MODEL argument; costed (cpu by default)."""
    given = {"model": args.model_arg} if args.model_arg is not None else {}
    config = settings_from_args(args, Config, **given)
    if config.device is None and config.costs is None:  # plan simulates, so it always costs
        config = dataclasses.replace(config, device="cpu")
    return config


# -- models ---------------------------------------------------------------------------------------
def load_model(spec: str, *, batch: int, tiles: int, text: int, seed: int, meta: bool = False,
               config: Any = None) -> tuple[Any, Any, str]:
    """(model, example batch, display name) for a MODEL argument (``omnibal_compile.models.load``); ``meta``:
    on meta."""
    from omnibal_compile.models.load import load_model as load

    loaded = load(spec, config=config or None, seed=seed, batch=batch, tiles=tiles, text=text, meta=meta)
    if loaded.example_batch is None:
        raise InputError(
            f"MODEL {spec!r} returned a model without an example batch, and it is not a Hugging Face model whose "
            "config gives one: return (model, example_batch) from the factory"
        )
    return loaded.model, loaded.example_batch, loaded.name


def in_run_precision(cfg: Config, model: Any, batch: Any) -> tuple[Any, Any]:
    """The model and batch as the run computes them, for costs profiled here (``--device cpu`` / ``cuda``): in a
    16-bit precision (``--precision``, or auto's bf16 on cuda) its parameters and float inputs cast to that dtype, as
    the runtime captures them (``runtime.precision.compile_in_precision``), so activations, the bytes sent across cuts
    and step times are measured in it; on cuda, moved there (the cost pass profiles where they live), TF32 on. Roofline
    targets cost on a meta copy in the precision already; ``--costs`` keeps its table's."""
    from omnibal_compile.config import precision_for
    from omnibal_compile.costs.devices import PROFILED_DEVICES

    if cfg.costs or not isinstance(cfg.device, str) or cfg.device.strip().lower() not in PROFILED_DEVICES:
        return model, batch
    import torch
    from torch.utils import _pytree as pytree

    from omnibal_compile.runtime.precision import cast_for_capture, cast_inputs, compute_dtype

    low = compute_dtype(precision_for(cfg.precision, cfg.device))
    if low is not None:
        cast_for_capture(model, low)  # the CLI's own model: cast in place, the values before it are not needed
        batch = cast_inputs(batch, low)
    if cfg.device.strip().lower() == "cuda":  # the cost pass profiles where the model and its inputs live
        from omnibal_compile.runtime.precision import enable_tf32

        enable_tf32("cuda")  # its fp32 matmuls timed as the run's ranks run them
        model = model.to("cuda")
        batch = pytree.tree_map(lambda x: x.to("cuda") if isinstance(x, torch.Tensor) else x, batch)
    return model, batch


# -- planning -------------------------------------------------------------------------------------
PlanMaker = Callable[[int, "int | None"], Any]
"""(number of stages, memory budget per device or None) -> a Plan with predictions."""


def plan_maker(result: Any, planner: str) -> PlanMaker:
    """Re-plan ``result``'s model as optimize() did (its plan's schedule), for another stage count or budget (the
    sweeps)."""
    from omnibal_compile.planning.build import plan_stages

    chosen = result.plan

    def make(stages: int, budget: int | None) -> Any:
        schedule = Schedule.for_stages(
            stages, kind=chosen.schedule, num_microbatches=chosen.num_microbatches, virtual_stages=chosen.virtual_stages
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

    cfg = plan_settings(args)
    out = writable_folder(cfg.out, "--out", "the plan and its pictures")  # before any work, not after it
    if cfg.num_stages is not None and cfg.devices is None:  # a fixed layout: checked before any work
        kind, chunks = cfg.schedule or "1f1b", cfg.virtual_stages or 1
        try:
            Schedule.for_stages(cfg.num_stages, kind=kind, num_microbatches=cfg.num_microbatches, virtual_stages=chunks)
        except PlanError as e:
            raise InputError(
                f"--num-stages {cfg.num_stages} --schedule {kind} --num-microbatches "
                f"{cfg.num_microbatches or cfg.num_stages} --virtual-stages {chunks}: {e}"
            ) from None
    if isinstance(cfg.memory_budget, tuple):
        raise InputError("plan takes one --memory-budget for every device, not a list")
    budget = parse_size(cfg.memory_budget, "--memory-budget") if cfg.memory_budget is not None else None
    planner = cfg.planner if isinstance(cfg.planner, str) else "ilp"  # the command line names planners
    pictures, no_pictures_note = cfg.pictures, None
    if pictures:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # the base install: write everything else and say how to get the pictures
            pictures = False
            no_pictures_note = ("no pictures: they need matplotlib (pip install 'omnibal-compile[viz]'); "
                                "pass --no-pictures to skip them without this note")

    steps = 5 + bool(args.sweep_memory) + bool(args.sweep_stages) + bool(cfg.lengths)
    written: list[Path] = []
    with Progress(steps) as progress:
        step = progress.step
        step("building the model")
        model, batch, name = load_model(cfg.model, batch=cfg.microbatch_size, tiles=cfg.tiles_per_sample,
                                        text=cfg.text_tokens, seed=cfg.seed, meta=cfg.meta, config=cfg.model_config)
        model, batch = in_run_precision(cfg, model, batch)
        stats = _plan_lengths(cfg, model) if cfg.lengths else None  # a file in other units fails before any work
        step(f"capture, blocks, costs, planning ({planner})")
        with progress_info.quiet():  # the command prints the layout search itself, on stdout
            result = oc.optimize(model, batch, config=dataclasses.replace(
                cfg, device=None if cfg.costs else cfg.device, lengths=()))  # plan's --lengths: the report below
        plan, costs = result.plan, result.costs
        assert costs is not None  # plan always costs (--device, default cpu, or --costs)
        if result.layout is not None:  # the sweeps re-plan the chosen layout
            atomic_write_text(out / "layout.txt", result.layout.summary(limit=None) + "\n")
            written.append(out / "layout.txt")
        cost_note = (f"costs from {cfg.costs} ({costs.device}, {costs.source})" if cfg.costs
                     else f"costs from the cost pass on {costs.device} ({costs.source})")
        if costs.activation_dtype:
            cost_note += f", activations in {costs.activation_dtype}"
        if costs.attention:
            cost_note += f"\nattention: {costs.attention}"
        step("simulating")
        sim = simulate(plan, costs)
        atomic_write_text(out / "costs.json", costs.to_json())
        written.append(out / "costs.json")
        step("writing plan and exports")
        atomic_write_text(out / "plan.json", plan.to_json())
        atomic_write_text(out / "plan.txt", plan.summary() + "\n")
        atomic_write_text(out / "torchtitan.json", json.dumps(torchtitan_module_names(plan), indent=2) + "\n")
        written += [out / "plan.json", out / "plan.txt", out / "torchtitan.json"]
        layout = None
        try:
            layout = megatron_layout(plan)
            atomic_write_text(out / "megatron.txt", layout + "\n")
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
        if cfg.lengths:
            step("micro-batches from --lengths")
            assert stats is not None
            lengths_report = _lengths_report(cfg, stats, plan, costs, result)
        sweeps: list[str] = []
        # re-plan as the plan was made: its planner when registered (the layout search's "dp"), else the one asked
        # for (a zero-bubble plan names its search, which the exact planners run for those schedules)
        from omnibal_compile.planning import PLANNERS

        replanner = plan.planner if plan.planner in PLANNERS else planner
        for flag, kind in ((args.sweep_memory, "memory"), (args.sweep_stages, "stages")):
            if not flag:
                continue
            step(f"what-if sweep over {kind}")
            sweeps.append(
                _sweep(
                    kind,
                    flag,
                    plan.num_stages,
                    plan_maker(result, replanner),
                    budget,
                    costs,
                    out,
                    pictures,
                    written,
                    replanner,
                )
            )

    if result.layout is not None:
        print(result.layout.summary(limit=12))
        print()
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


def _sweep(kind: str, text: str, num_stages: int, make_plan: PlanMaker, budget: int | None, costs: Any,
           out: Path, pictures: bool, written: list[Path], planner: str) -> str:
    from omnibal_compile._utils.units import format_size, parse_size
    from omnibal_compile.sim import sweep, sweep_table

    if kind == "memory":
        values = _parse_list(text, parse_size, "--sweep-memory")
        make = lambda b: make_plan(num_stages, b)  # noqa: E731
        label, fmt, xs, xlabel = "budget", lambda v: format_size(v), [v / 2**30 for v in values], \
            "memory budget per device (GiB)"
    else:
        values = _parse_list(text, int, "--sweep-stages")
        make = lambda s: make_plan(s, budget)  # noqa: E731
        label, fmt, xs, xlabel = "stages", lambda v: str(v), values, "pipeline stages"
    points = sweep(make, values, costs)
    # A plan whose simulated peak exceeds its budget does not fit (baseline planners ignore budgets).
    limit = {p.value: (p.value if kind == "memory" else budget) for p in points}
    points = tuple(
        p
        if p.result is None or (cap := limit[p.value]) is None or max(p.result.peak_memory_bytes) <= cap
        else dataclasses.replace(
            p, plan=None, result=None, error=f"peak {format_size(max(p.result.peak_memory_bytes))} exceeds the budget"
        )
        for p in points
    )
    if pictures:
        from omnibal_compile.sim.draw import draw_sweep

        ys = [p.iteration_time_s * 1e3 if p.iteration_time_s is not None else None for p in points]
        written.append(
            draw_sweep(xs, ys, out / f"sweep_{kind}.png", xlabel=xlabel, title=f"what-if: {kind} ({planner})")
        )
    return f"what-if over {kind} (planner {planner}):\n" + sweep_table(points, label=label, fmt=fmt)


def _plan_lengths(cfg: Config, model: Any) -> Any:
    """--lengths as the report balances them: a file with a units header in the model's units, as ``run`` takes it
    (``model_lengths``: another model's file is an error); a file without one as it is (its shapes' spread)."""
    from omnibal_compile.data import load_lengths
    from omnibal_compile.data.data_plan import DataOptions, model_lengths
    from omnibal_compile.models.load import hf_data_facts

    stats = load_lengths(list(cfg.lengths))
    if stats.header is None:
        return stats
    return model_lengths(stats, DataOptions(**hf_data_facts(model)), model=model, model_spec=cfg.model)


def _lengths_report(cfg: Config, stats: Any, plan: Any, costs: Any, result: Any) -> str:
    """Simulate micro-batches drawn from real length statistics: random batches vs balanced packs."""
    from omnibal_compile.costs.mix import packing_shapes, shape_costs
    from omnibal_compile.data import balance_pack, random_batches
    from omnibal_compile.sim import simulate

    M = plan.num_microbatches
    # The cost table counts as the average micro-batch of --microbatch-size samples.
    size = cfg.microbatch_size
    reference = (float(stats.tiles.mean()) * size, float(stats.tokens.mean()) * size)
    vision = _vision_blocks(result)
    lines = [f"micro-batches of {size} samples from {stats.source} ({len(stats):,} samples), {M} per iteration:"]
    even = simulate(plan, costs)
    lines.append(
        f"  {'identical (the cost table)':<28} iteration {even.iteration_time_s * 1e3:9.3f} ms, "
        f"bubble {even.bubble_fraction:.1%}"
    )
    for label, packing in (
        ("random batches (padded)", random_batches(stats, dp=M, batch_size=size, seed=cfg.seed)),
        ("balanced packs (ours)", balance_pack(stats, dp=M, samples_per_pack=size, seed=cfg.seed)),
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
