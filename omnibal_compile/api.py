"""``optimize()``: run the passes in order and return stages with the plan that made them."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile import progress
from omnibal_compile._utils.units import parse_size
from omnibal_compile._utils.validate import read_text
from omnibal_compile.compile.blocks import BlockGraph, build_blocks
from omnibal_compile.compile.capture import (
    Captured,
    capture,
    differentiated_name,
    normalize_example_inputs,
    scalar_to_differentiate,
    split_batch,
    training_config,
)
from omnibal_compile.compile.codegen import StageInfo, generate_stages, run_stages, stage_info
from omnibal_compile.config import Config, find_field, precision_for
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.data.data_plan import DataOptions, DataPlan, plan_data
from omnibal_compile.errors import InputError, OmnibalError, PassError, PlanError
from omnibal_compile.ir.costs import (
    BF16_ADAM,
    DEFAULT_DP_SHARD,
    CostTable,
    DataParallel,
    Precision,
    precision_named,
)
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.models.examples import ExampleInputs, describe_batch, example_inputs_for
from omnibal_compile.planning.build import check_costs, check_num_stages, plan_stages

if TYPE_CHECKING:  # the kernel pass imports Triton glue; load it only when kernels= is asked for
    from omnibal_compile.compile.fuse import KernelReport
    from omnibal_compile.planning.layout import LayoutSearch

__all__ = ["optimize", "compile_for_microbatches", "OptimizeResult", "ParityReport", "PassError", "Config"]


@dataclass(frozen=True, kw_only=True)
class ParityReport:
    """How closely the stages, run one after another, reproduce the unsplit model."""

    max_output_diff: float
    """Largest absolute difference over every output element."""
    max_grad_diff: float
    """Largest absolute difference over every parameter-gradient element."""
    worst_param: str | None
    """Parameter with the largest gradient difference."""
    num_params: int
    """Parameters whose gradients were compared."""
    loss: float
    """The scalar that was differentiated, from the unsplit model: its loss, or the sum of its outputs."""
    loss_name: str = "loss"
    """What ``loss`` is: "loss" when the model returns a scalar loss, else "sum of the outputs"."""
    tolerance: float
    """Bound that ``ok`` checks both differences against."""

    @property
    def ok(self) -> bool:
        return self.max_output_diff <= self.tolerance and self.max_grad_diff <= self.tolerance

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        worst = f" ({self.worst_param})" if self.worst_param else ""
        return (
            f"Parity {verdict}: {self.loss_name} {self.loss:.5g}, max |output diff| {self.max_output_diff:.2e}, "
            f"max |grad diff| {self.max_grad_diff:.2e}{worst} over {self.num_params} parameters "
            f"(tolerance {self.tolerance:.0e})"
        )


@dataclass(frozen=True, kw_only=True)
class OptimizeResult:
    """What :func:`optimize` built: the plan, one module per stage, and the intermediate results."""

    model: nn.Module = field(repr=False)
    """The user's model (unchanged; the stages share its parameters)."""
    captured: Captured = field(repr=False)
    """The captured graph."""
    graph: BlockGraph = field(repr=False)
    """Blocks and the values crossing every cut."""
    plan: Plan
    """Where the model is cut."""
    stages: tuple[fx.GraphModule, ...] = field(repr=False)
    """One module per stage; ``stages[s+1](*stages[s](...))`` chains, stage 0 takes flat inputs."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each pass."""
    costs: CostTable | None = None
    """Per-block costs when ``optimize(device=...)`` or ``optimize(costs=...)`` gave them; None otherwise."""
    data: DataPlan | None = None
    """Balanced micro-batch shape, sampler and collator when ``optimize(lengths=...)`` was given; None otherwise."""
    kernels: KernelReport | None = None
    """What the kernel pass rewrote when ``optimize(kernels=...)`` was given; None otherwise."""
    layout: LayoutSearch | None = None
    """The layout search (chosen layout and every candidate) when optimize() chose the layout; None otherwise."""
    example: ExampleInputs | None = None
    """The batch the model was captured with and where it came from (``example.synthesized``: optimize() built it)."""

    def stage_info(self, index: int) -> StageInfo:
        """Inputs, outputs, blocks and parameter names of stage ``index``."""
        return stage_info(self.stages[index])

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """A batch shaped like the example one -> stage 0's positional inputs."""
        return self.captured.flatten_inputs(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run every stage in turn on a batch like the example one; returns the model's output."""
        return self.captured.unflatten_output(run_stages(self.stages, self.flatten_inputs(*args, **kwargs)))

    def check_parity(self, example_inputs: Any = None, *, tolerance: float = 1e-5) -> ParityReport:
        """Compare outputs and parameter gradients of the stages against the unsplit model.

        Uses ``torch.autograd.grad``, so no ``.grad`` field of the model is touched. The model must
        be deterministic (no dropout in train mode) for the comparison to mean anything.
        """
        args, kwargs = (
            normalize_example_inputs(example_inputs) if example_inputs is not None else _unflat(self.captured)
        )
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        with training_config(self.model):  # as captured: no KV cache in the output
            ref_out = self.model(*args, **kwargs)
        ref_flat = pytree.tree_leaves(ref_out)
        ref_loss = scalar_to_differentiate(ref_flat)
        ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
        flat = run_stages(self.stages, self.flatten_inputs(*args, **kwargs))
        flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        if len(flat) != len(ref_flat):
            raise OmnibalError(f"stages returned {len(flat)} outputs, the model {len(ref_flat)}")
        loss = scalar_to_differentiate(flat)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        # Outputs the capture dropped (data-dependent shapes next to the loss) come back as None.
        out_diff = max(
            (float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0)
            for a, b in zip(flat, ref_flat)
            if isinstance(a, torch.Tensor)
        )
        worst, grad_diff = None, 0.0
        for (name, _), g, r in zip(named, grads, ref_grads):
            if g is None and r is None:
                continue
            g = torch.zeros_like(r) if g is None else g
            r = torch.zeros_like(g) if r is None else r
            d = float((g.double() - r.double()).abs().max()) if g.numel() else 0.0
            if d > grad_diff or worst is None:
                worst, grad_diff = name, max(d, grad_diff)
        return ParityReport(
            max_output_diff=out_diff,
            max_grad_diff=grad_diff,
            worst_param=worst,
            num_params=len(named),
            loss=float(ref_loss.detach()),
            loss_name=differentiated_name(ref_flat),
            tolerance=tolerance,
        )

    def summary(self) -> str:
        """The block table, the cost table (when costed) and the plan table."""
        costs = f"\n\n{self.costs.summary()}" if self.costs is not None else ""
        layout = f"\n\n{self.layout.summary(limit=12)}" if self.layout is not None else ""
        example = f"{self.example.summary()}\n\n" if self.example is not None else ""
        return f"{example}{self.graph.summary()}{costs}{layout}\n\n{self.plan.summary()}"


def _unflat(captured: Captured) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = pytree.tree_unflatten(list(captured.example_flat_inputs), captured.in_spec)
    return tuple(args), dict(kwargs)


def _run_pass(name: str, done: list[str], timings: dict[str, float], fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    try:
        result = fn()
    except OmnibalError:
        raise
    except Exception as e:  # noqa: BLE001 - unexpected failure inside a pass: name it
        before = ", ".join(done) or "none"
        raise PassError(f"pass '{name}' failed (passes run before it: {before}): {type(e).__name__}: {e}") from e
    timings[name] = time.perf_counter() - start
    done.append(name)
    return result


def _load_costs(costs: CostTable | str | os.PathLike[str], graph: BlockGraph) -> CostTable:
    """``optimize(costs=...)``: a CostTable, or the path of its JSON, checked against the model's blocks."""
    if isinstance(costs, CostTable):
        check_costs(graph, costs, "costs=CostTable")
        return costs
    path = Path(costs)
    text = read_text(path, "cost table file (costs=)", hint="write one with CostTable.to_json() or drop costs=")
    try:
        table = CostTable.from_json(text)
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(f"costs={str(path)!r} is not a CostTable JSON ({e})") from None
    check_costs(graph, table, f"cost table {path}")
    return table


def _parse_budget(budget: Any) -> float | list[float] | None:
    if budget is None:
        return None
    if isinstance(budget, (list, tuple)):
        return [float(parse_size(b, f"memory_budget[{i}]")) for i, b in enumerate(budget)]
    return float(parse_size(budget, "memory_budget"))


INPUTS: tuple[str, ...] = ("plan", "costs", "lengths", "data", "precision")
"""``optimize()`` keywords that may be objects rather than settings: a Plan, a CostTable, LengthStats,
DataOptions, a Precision. ``plan``, ``costs`` and ``lengths`` are also settings (file paths)."""


@dataclass(kw_only=True)
class _Work:
    """What the passes of one ``optimize()`` call share: the settings, the inputs, and what each pass made."""

    model: nn.Module
    config: Config
    example_inputs: Any
    plan: Plan | None
    costs: CostTable | str | os.PathLike[str] | None
    lengths: Any
    data: DataOptions | None
    precision: Precision
    layout: DataParallel
    precision_name: str | None = None
    """The precision setting costed (after auto, ``config.precision_for``); None: a Precision given, or no costs."""
    precision_given: bool = False
    """``precision=`` was a Precision object (it is costed as given)."""
    timings: dict[str, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    budget: float | list[float] | None = None
    data_plan: DataPlan | None = None
    example: ExampleInputs | None = None
    captured: Captured | None = None
    kernel_report: KernelReport | None = None
    graph: BlockGraph | None = None
    schedule: Schedule | None = None
    table: CostTable | None = None
    layout_search: LayoutSearch | None = None
    chosen: Plan | None = None

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        return _run_pass(name, self.done, self.timings, fn)

    @property
    def search_layout(self) -> bool:
        return self.plan is None and (self.config.num_stages is None or self.config.devices is not None)


def _settings(config: Config | None, overrides: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """(the config with the setting overrides applied, the object inputs); an unknown keyword is an InputError."""
    if config is not None and not isinstance(config, Config):
        raise InputError(f"config= must be an omnibal_compile.config.Config, got {type(config).__name__}")
    base = config if config is not None else Config()
    if isinstance(overrides.get("precision"), str):  # precision="bf16": the setting; a Precision: the input
        base = base.replace(precision=overrides.pop("precision"))
    inputs = {k: overrides.pop(k) for k in INPUTS if k in overrides}
    for name in overrides:
        find_field(name, Config)  # a typo names the closest setting
    for name in ("plan", "costs", "lengths"):  # object or path given: the override; else the config's path
        if name not in inputs:
            value = getattr(base, name)
            # the config holds paths: a tuple of length files is a list of paths to plan_data
            # (a (tiles, tokens) pair given as lengths= stays as it is)
            inputs[name] = (list(value) if name == "lengths" else value) if value not in (None, ()) else None
    return base.replace(**overrides), inputs


def _validate(work: _Work) -> None:
    """The one check of the settings and inputs together: refuse a value the others would make optimize() ignore."""
    cfg, plan = work.config, work.plan
    work.precision.bytes_per_param_on(work.layout)  # raises when ZeRO-1's optimizer_shards disagree with dp
    costed = cfg.device is not None or work.costs is not None
    if cfg.device is None and (cfg.cost_cache is not None or cfg.refresh_costs or work.precision != BF16_ADAM):
        given = [k for k, v in (("cost_cache", cfg.cost_cache is not None), ("refresh_costs", cfg.refresh_costs),
                                ("precision", work.precision != BF16_ADAM)) if v]
        why = "a cost table given as costs= keeps what it was costed with" if costed else "nothing is costed"
        raise InputError(f"{', '.join(given)} only apply when device= costs the blocks, and {why}: "
                         "pass device=... or drop them")
    if not costed and cfg.solver != "auto":
        raise InputError(
            f"solver={cfg.solver!r} picks the ILP backend, which needs block costs: pass device=... or costs=..."
        )
    if plan is not None:
        # A given plan fixes the split and the schedule; a planning setting that differs would be dropped.
        fixed = {
            "num_microbatches": (cfg.num_microbatches, plan.num_microbatches),
            "schedule": (cfg.schedule, plan.schedule),
            "virtual_stages": (cfg.virtual_stages, plan.virtual_stages),
            "dp": (None if cfg.dp in (None, 1) else cfg.dp, plan.data_parallel),
        }
        for name, (given_value, planned) in fixed.items():
            if given_value is not None and given_value != planned:
                raise InputError(
                    f"{name}={given_value!r} differs from the given plan's {planned!r}: plan= fixes it; drop {name}=, "
                    f"or pass dataclasses.replace(plan, {'data_parallel' if name == 'dp' else name}={given_value!r})"
                )
        planning = {"planner": cfg.planner is not None, "memory_budget": cfg.memory_budget is not None,
                    "recompute": cfg.recompute != "auto", "solver": cfg.solver != "auto"}
        dropped = [k for k, v in planning.items() if v]
        if dropped:
            raise InputError(f"{', '.join(dropped)} choose a new plan, but plan= was given: drop one or the other")
    work.budget = _parse_budget(cfg.memory_budget)
    if plan is None:  # a malformed schedule setting fails at once (its rules over the stages are checked after blocks)
        Schedule(kind=cfg.schedule or "1f1b", num_microbatches=cfg.num_microbatches or 1,
                 virtual_stages=cfg.virtual_stages or 1)
    dp = cfg.dp or 1
    if work.data is not None and dp > 1 and work.data.dp != dp:
        raise InputError(
            f"dp={dp} disagrees with data=DataOptions(dp={work.data.dp}): give both the same data-parallel size"
        )
    if cfg.device is not None and work.costs is not None:
        raise InputError("give device= (cost the blocks) or costs= (reuse a cost table), not both")
    if work.lengths is None and work.data is not None:
        raise InputError("optimize(data=...) needs lengths=... (the dataset's length statistics)")


# -- the passes, in order -------------------------------------------------------------------------
def _example_pass(work: _Work) -> None:
    """The batch to capture with: given, one balanced pack of ``lengths``, or synthesized from the model."""
    if work.lengths is not None:
        work.data_plan = work.run("data", lambda: plan_data(work.lengths, work.data, model=work.model))
        if work.example_inputs is None:
            dp = work.data_plan
            shape = f"{dp.shape.tiles} tiles, {dp.shape.tokens} tokens"
            work.example = describe_batch(dp.example_batch(), synthesized=True,
                                          source=f"one balanced pack of lengths= ({shape}, row {dp.seq_len})")
    if work.example is None and work.example_inputs is None:
        work.example = example_inputs_for(work.model)
    if work.example is not None:
        progress.info(work.example.summary())
        work.example_inputs = work.example.batch
    else:
        work.example = describe_batch(work.example_inputs, source="given as example_inputs", synthesized=False)


def _capture_pass(work: _Work) -> None:
    """Capture the model, rewrite kernels when asked, group the graph into blocks."""
    cfg, model = work.config, work.model
    captured = work.run("capture", lambda: capture(model, work.example_inputs, method=cfg.capture_method))  # type: ignore[arg-type]
    if cfg.kernels is not None:
        from omnibal_compile.compile.fuse import substitute_kernels

        captured, work.kernel_report = work.run(
            "kernels", lambda: substitute_kernels(captured, model, backend=cfg.kernels)  # type: ignore[arg-type]
        )
    work.captured = captured
    work.graph = work.run("blocks", lambda: build_blocks(captured, model, block_prefixes=cfg.block_prefixes))


def _cost_pass(work: _Work) -> None:
    """Check the fixed layout before costing (a bad stage count fails fast), then cost or load the costs."""
    cfg, graph = work.config, work.graph
    assert graph is not None
    if work.search_layout and cfg.device is None and work.costs is None:  # the search needs costs: profile here
        work.config = cfg = cfg.replace(device="cuda" if torch.cuda.is_available() else "cpu")
        if not work.precision_given:  # auto's choice follows the device it now costs on
            work.precision_name = precision_for(cfg.precision, cfg.device)
            work.precision = precision_named(work.precision_name)
    if work.plan is None and not work.search_layout:
        assert cfg.num_stages is not None  # no layout search: num_stages was given
        check_num_stages(graph, cfg.num_stages)
        work.schedule = Schedule.for_stages(
            cfg.num_stages,
            kind=cfg.schedule or "1f1b",
            num_microbatches=cfg.num_microbatches,
            virtual_stages=cfg.virtual_stages or 1,
        )
    work.table = _load_costs(work.costs, graph) if work.costs is not None else None
    if cfg.device is not None:
        work.table = work.run("cost", lambda: annotate_costs(
            graph, work.model, device=cfg.device, precision=work.precision,  # type: ignore[arg-type]
            cache=cfg.cost_cache, refresh=cfg.refresh_costs,
        ))


def _layout_pass(work: _Work) -> None:
    """Choose pipeline depth, chunks, data parallelism and micro-batches (when the layout is not fixed)."""
    if not work.search_layout:
        return
    from omnibal_compile.costs.devices import PROFILED_DEVICES, get_device
    from omnibal_compile.planning.layout import choose_layout, job_devices

    cfg, table = work.config, work.table
    assert table is not None
    count, where = (cfg.devices, f"{cfg.devices} as given") if cfg.devices is not None else job_devices()
    # a roofline target gives the links (NVLink in a node, InfiniBand across); profiled costs keep the table's
    device = cfg.device
    spec = get_device(device) if device is not None and str(device).lower() not in PROFILED_DEVICES else None
    if isinstance(work.budget, list):
        raise InputError("optimize(devices=...) takes one memory_budget for every device, not a list")
    budget, layout = work.budget, work.layout
    search = work.run(
        "layout",
        lambda: choose_layout(
            table,
            devices=count,
            device=spec,
            global_batch=cfg.global_batch,
            num_stages=cfg.num_stages,
            schedule=cfg.schedule,
            virtual_stages=cfg.virtual_stages,
            num_microbatches=cfg.num_microbatches,
            data_parallel=layout,
            memory_budget=budget,
            recompute=cfg.recompute,
        ),
    )
    search = dataclasses.replace(search, notes=(f"devices: {where}", *search.notes))
    progress.info(search.summary(limit=12))
    best = search.best.layout
    work.config = cfg.replace(num_stages=best.num_stages, num_microbatches=best.num_microbatches,
                              virtual_stages=best.virtual_stages, schedule=best.schedule)
    work.layout, work.table, work.layout_search = best.data_parallel, search.costs, search
    if cfg.planner is None:  # the search's plan is the planner's (exact for 1F1B); another planner re-plans
        work.plan = search.plan
    else:
        work.schedule = Schedule.for_stages(best.num_stages, kind=best.schedule, num_microbatches=best.num_microbatches,
                                            virtual_stages=best.virtual_stages)


def _plan_pass(work: _Work) -> None:
    """The given plan (checked against the stage count), or a new one from the planner."""
    cfg = work.config
    if cfg.num_stages is None:
        raise InputError("optimize() needs num_stages=, or devices= to choose the layout")
    if work.plan is not None:
        if work.plan.num_stages != cfg.num_stages:
            raise PlanError(f"the given plan has {work.plan.num_stages} stages but num_stages={cfg.num_stages}")
        work.chosen = work.plan
        return
    assert work.schedule is not None and work.graph is not None
    graph, schedule, num_stages = work.graph, work.schedule, cfg.num_stages
    work.chosen = work.run("plan", lambda: plan_stages(
        graph, num_stages=num_stages, schedule=schedule, planner=cfg.planner, costs=work.table,
        memory_budget=work.budget, recompute=cfg.recompute, solver=cfg.solver, time_limit=cfg.solver_time_limit,
        data_parallel=work.layout,
    ))


PASSES: tuple[tuple[str, Callable[[_Work], None]], ...] = (
    ("example", _example_pass), ("capture", _capture_pass), ("cost", _cost_pass), ("layout", _layout_pass),
    ("plan", _plan_pass),
)
"""optimize()'s passes in order (each names the work it times through ``_run_pass``); codegen comes last."""


def optimize(
    model: nn.Module, example_inputs: Any = None, config: Config | None = None, **overrides: Any
) -> OptimizeResult:
    """Capture ``model`` on ``example_inputs``, cut it into pipeline stages, emit them.

    Args:
        model: any ``nn.Module``; it is not modified, except that ``freeze=`` turns ``requires_grad`` off for the
            parameters it names (as the run does), so that the stages and costs are those of the frozen model;
            ``lora=`` adapts a copy (:func:`omnibal_compile.models.lora.apply_lora`, the result's ``model``).
        example_inputs: one batch: a tuple (positional), a dict (keyword) or ``(args, kwargs)``. None
            (default): one balanced pack when ``lengths`` is given, else synthesized from the model
            (:func:`omnibal_compile.models.examples.example_inputs_for`). What was synthesized is told
            through :func:`omnibal_compile.progress.info` (stderr; silence it with ``progress.quiet()``
            or ``OMNIBAL_QUIET=1``) and kept as ``result.example``.
        config: the settings (:class:`omnibal_compile.config.Config`); None: the defaults.
        **overrides: settings by field name (``num_stages=4``, ``planner="ilp"``, ``device="cpu"``,
            ``memory_budget="20MiB"``, ``dp=2``, ...: every field of :class:`~omnibal_compile.config.Config`,
            described there), applied over ``config``; an unknown name is an InputError naming the closest.
            Besides settings: ``plan=`` a Plan (or its file) to use instead of planning, ``costs=`` a
            CostTable (or its JSON file), ``lengths=`` dataset length statistics (files, a LengthStats or a
            ``(tiles, tokens)`` pair: balance them into packs and capture on one), ``data=`` DataOptions
            (how to balance), ``precision=`` a Precision (bytes per parameter, costing only).

    ``num_stages=None`` (default) or ``devices=N`` choose the layout (``result.layout``); the rest is
    as the fields of :class:`~omnibal_compile.config.Config` say.
    """
    cfg, inputs = _settings(config, dict(overrides))
    plan = inputs["plan"]
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.from_file(plan)
    dp = cfg.dp or 1
    layout = DataParallel(
        size=dp,
        shard=cfg.dp_shard or DEFAULT_DP_SHARD,
        reshard_after_forward=True if cfg.reshard_after_forward is None else cfg.reshard_after_forward,
    )
    # costed: in the precision the run will use (auto: bf16 on a GPU, fp32 on cpu); not costed: nothing to cost
    named = precision_for(cfg.precision, cfg.device) if cfg.device is not None else cfg.precision
    precision = inputs.get("precision", precision_named(named) if named else BF16_ADAM)
    work = _Work(model=model, config=cfg, example_inputs=example_inputs, plan=plan, costs=inputs["costs"],
                 lengths=inputs["lengths"], data=inputs.get("data"), precision=precision, layout=layout,
                 precision_name=None if "precision" in inputs else named, precision_given="precision" in inputs)
    if cfg.lora is not None:  # on a copy: the user's model keeps its modules; the result's model is the adapted copy
        from omnibal_compile.models.lora import apply_lora, lora_names

        if lora_names(model):
            raise InputError("optimize(lora=...): the model already holds LoRA adapters (lora_ parameters); "
                             "give the base model, or leave lora out")
        model = apply_lora(copy.deepcopy(model), cfg.lora, seed=cfg.seed)
        work.model = model
    _validate(work)
    if cfg.freeze:  # the stages share the model's parameters: frozen there, frozen in every stage and cost
        from omnibal_compile.models.freeze import freeze_parameters

        freeze_parameters(model, cfg.freeze)
    for _, step in PASSES:
        step(work)
    assert work.graph is not None and work.chosen is not None and work.captured is not None
    graph, chosen = work.graph, work.chosen
    if plan is None and work.table is not None:  # what the run compares its own settings with
        notes = {**chosen.notes, "compute dtype": work.table.activation_dtype or work.precision.compute_dtype}
        notes |= ({"freeze": list(cfg.freeze)} if cfg.freeze else {}) | ({"lora": str(cfg.lora)} if cfg.lora else {})
        notes |= {"precision": work.precision_name} if work.precision_name else {}  # its parameter bytes' setting
        notes |= {"kernels": cfg.kernels or "none", "compiled": "no"}  # the cost pass runs the graph eagerly
        chosen = dataclasses.replace(chosen, notes=notes)
    stages = work.run("codegen", lambda: generate_stages(graph, chosen, model))
    return OptimizeResult(
        model=model, captured=work.captured, graph=graph, plan=chosen, stages=stages, timings=work.timings,
        costs=work.table, data=work.data_plan, kernels=work.kernel_report, layout=work.layout_search,
        example=work.example,
    )


def compile_for_microbatches(model: nn.Module, batch: Any, plan: Plan, **optimize_kwargs: Any) -> OptimizeResult:
    """Capture ``model`` at the micro-batch shape of ``batch`` under ``plan`` and emit its stages.

    Stage modules are specialised to the shapes they are captured with; the pipeline runs them on
    micro-batches, so they are captured on the first micro-batch of ``batch``.
    """
    args, kwargs = normalize_example_inputs(batch)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first = split_batch(leaves, plan.num_microbatches or 1)[0]
    mb_args, mb_kwargs = pytree.tree_unflatten(list(first), spec)
    return optimize(model, (tuple(mb_args), dict(mb_kwargs)), num_stages=plan.num_stages, plan=plan, **optimize_kwargs)
