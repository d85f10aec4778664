"""``optimize()``: run the passes in order and return stages with the plan that made them."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile._utils.units import parse_size
from omnibal_compile._utils.validate import check_choice, check_number, read_text
from omnibal_compile.compile.blocks import BlockGraph, build_blocks
from omnibal_compile.compile.capture import (
    Captured,
    CaptureMethod,
    capture,
    differentiated_name,
    normalize_example_inputs,
    scalar_to_differentiate,
    split_batch,
    training_config,
)
from omnibal_compile.compile.codegen import StageInfo, generate_stages, run_stages, stage_info
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.costs.devices import DeviceSpec
from omnibal_compile.data.data_plan import DataOptions, DataPlan, plan_data
from omnibal_compile.errors import InputError, OmnibalError, PassError, PlanError
from omnibal_compile.ir.costs import (
    BF16_ADAM,
    DEFAULT_DP_SHARD,
    RECOMPUTE_OPTIONS,
    CostTable,
    DataParallel,
    Precision,
)
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.models.examples import ExampleInputs, describe_batch, example_inputs_for
from omnibal_compile.planning.build import Planner, check_costs, check_num_stages, plan_stages

if TYPE_CHECKING:  # the kernel pass imports Triton glue; load it only when kernels= is asked for
    from omnibal_compile.compile.fuse import KernelReport
    from omnibal_compile.planning.layout import LayoutSearch

__all__ = ["optimize", "compile_for_microbatches", "OptimizeResult", "ParityReport", "PassError"]


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
            f"Parity {verdict}: {self.loss_name} {self.loss:.6f}, max |output diff| {self.max_output_diff:.2e}, "
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
        args, kwargs = normalize_example_inputs(example_inputs) if example_inputs is not None else _unflat(self.captured)
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


def _check_keywords(
    *, plan: Plan | None, planner: Any, num_microbatches: int | None, schedule: str | None, virtual_stages: int | None,
    memory_budget: Any, recompute: str, solver: str, solver_time_limit: float | None, costed: bool,
    device: Any, precision: Precision, cost_cache: Any, refresh_costs: bool, dp: int,
) -> None:
    """Refuse a keyword whose value is malformed, or that the other keywords would make ``optimize`` ignore."""
    check_choice(recompute, "recompute", ("auto", *RECOMPUTE_OPTIONS))
    check_choice(solver, "solver", ("auto", "highs", "cbc"))
    if solver_time_limit is not None:
        check_number(solver_time_limit, "solver_time_limit", above=0, hint="give seconds, or None for no limit")
    if device is None and (cost_cache is not None or refresh_costs or precision != BF16_ADAM):
        given = [k for k, v in (("cost_cache", cost_cache is not None), ("refresh_costs", refresh_costs),
                                ("precision", precision != BF16_ADAM)) if v]
        why = "a cost table given as costs= keeps what it was costed with" if costed else "nothing is costed"
        raise InputError(f"{', '.join(given)} only apply when device= costs the blocks, and {why}: "
                         "pass device=... or drop them")
    if not costed and solver != "auto":
        raise InputError(
            f"solver={solver!r} picks the ILP backend, which needs block costs: pass device=... or costs=..."
        )
    if plan is None:
        return
    # A given plan fixes the split and the schedule; a planning keyword that differs would be dropped.
    fixed = {"num_microbatches": (num_microbatches, plan.num_microbatches), "schedule": (schedule, plan.schedule),
             "virtual_stages": (virtual_stages, plan.virtual_stages),
             "dp": (None if dp == 1 else dp, plan.data_parallel)}
    for name, (given, planned) in fixed.items():
        if given is not None and given != planned:
            raise InputError(
                f"{name}={given!r} differs from the given plan's {planned!r}: plan= fixes it; drop {name}=, or pass "
                f"dataclasses.replace(plan, {'data_parallel' if name == 'dp' else name}={given!r})"
            )
    planning = {"planner": planner is not None, "memory_budget": memory_budget is not None,
                "recompute": recompute != "auto", "solver": solver != "auto"}
    dropped = [k for k, v in planning.items() if v]
    if dropped:
        raise InputError(f"{', '.join(dropped)} choose a new plan, but plan= was given: drop one or the other")


def optimize(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    num_stages: int | None = None,
    devices: int | None = None,
    global_batch: int | None = None,
    planner: str | Planner | None = None,
    plan: Plan | None = None,
    num_microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    memory_budget: str | float | Sequence[str | float] | None = None,
    recompute: str = "auto",
    solver: str = "auto",
    solver_time_limit: float | None = 60.0,
    block_prefixes: Sequence[str] | None = None,
    capture_method: CaptureMethod = "export",
    kernels: str | None = None,
    device: str | DeviceSpec | None = None,
    costs: CostTable | str | os.PathLike[str] | None = None,
    precision: Precision = BF16_ADAM,
    cost_cache: str | os.PathLike[str] | None = None,
    refresh_costs: bool = False,
    lengths: Any = None,
    data: DataOptions | None = None,
    dp: int = 1,
    dp_shard: str = DEFAULT_DP_SHARD,
    dp_reshard_after_forward: bool = True,
) -> OptimizeResult:
    """Capture ``model`` on ``example_inputs``, cut it into ``num_stages`` pipeline stages, emit them.

    Args:
        model: any ``nn.Module``; it is not modified.
        example_inputs: one batch: a tuple (positional), a dict (keyword) or ``(args, kwargs)``. None
            (default): one balanced pack when ``lengths`` is given, else synthesized from the model
            (:func:`omnibal_compile.models.examples.example_inputs_for`: the reference VLM's own
            example, the model's ``example_inputs()``, or a batch built from a Hugging Face config as
            the family's processor lays it out). What was synthesized is printed and kept as
            ``result.example``.
        num_stages: pipeline stages to emit; None (default) lets the layout search choose them.
        devices, global_batch: choose the layout for ``devices`` devices (default: the job's, see
            :func:`omnibal_compile.planning.layout.job_devices`): pipeline depth and chunks, data-parallel degree
            and layout, micro-batch count, with the least predicted time per micro-batch that fits
            ``memory_budget`` (:func:`omnibal_compile.planning.layout.choose_layout`); ``global_batch`` counts
            micro-batches of the example's shape per optimizer step (default two per device). What the
            caller fixes (``num_stages``, an interleaved ``schedule``, ``num_microbatches``, ``dp`` > 1)
            is pinned. The candidates are printed and kept as ``result.layout``. Needs costs: without
            ``device`` or ``costs`` the blocks are profiled here.
        planner: a name in :data:`omnibal_compile.planning.PLANNERS`: ``"ilp"`` (default when costs are
            known: cut points and per-block recomputation chosen jointly and optimally), ``"dp"``,
            ``"uniform"``, ``"parameters"`` (default without costs), ``"flops"``, ``"omnibal"`` (the
            paper's heuristic); or a callable ``(BlockGraph, S) -> Plan``. All but uniform/parameters
            need costs (``device`` or ``costs``). With costs every plan carries its predicted figures.
        plan: use this plan instead of planning (it must match the model's blocks).
        num_microbatches, schedule, virtual_stages: the pipeline schedule planned for
            (``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` with ``virtual_stages`` chunks per device);
            ``num_microbatches=None`` (default) means one per stage, ``schedule=None`` ``"1f1b"``,
            ``virtual_stages=None`` 1 (with ``plan=``: the plan's; a value that differs is an error).
            The rules torch sets on them are checked by :class:`omnibal_compile.ir.schedule.Schedule`.
        memory_budget: per device, e.g. ``"40GiB"`` (one value or one per device); needs costs.
        recompute: ``"auto"`` (the planner chooses per block), ``"none"``, ``"selective"`` or ``"full"``.
        solver, solver_time_limit: ILP backend (``"auto"``: HiGHS if installed, else CBC) and limit (s).
        block_prefixes: module paths that each form one block, overriding the default grouping.
        capture_method: ``"export"`` (torch.export, non-strict) or ``"fx"`` (symbolic_trace).
        kernels: rewrite norms, SwiGLU, rotary and the LM-head loss into fused ops before cutting:
            ``"triton"`` (Triton kernels; eager torch where Triton cannot run), ``"eager"``, or
            None (default: no substitution).
        device: cost the blocks: ``"cpu"``/``"cuda"`` profile here, ``"a100-80gb"``, ``"h100-80gb"``,
            ``"h200"`` (or a DeviceSpec) use the roofline model; None (default) skips costing.
        costs: reuse block costs instead of costing: a CostTable or the path of its JSON; it must
            hold the model's blocks. Not together with ``device``.
        precision: bytes per parameter for weights, gradients and optimizer states (costing only).
        cost_cache: JSON file caching profiled costs; ``refresh_costs=True`` ignores cached entries.
        lengths: dataset length statistics (files, a LengthStats or a ``(tiles, tokens)`` pair):
            balance them into packs of one fixed shape; with ``example_inputs=None`` the model is
            captured, costed and planned on a micro-batch of that shape. ``result.data`` holds the
            shape, the per-rank sampler and the collator.
        data: how to balance (``DataOptions``: data-parallel size, samples per pack, method...).
        dp, dp_shard, dp_reshard_after_forward: data-parallel replicas of the pipeline and how they
            hold weights, gradients and optimizer states: ``"fsdp"`` (default; sharded, gathered weights
            freed after each forward unless ``dp_reshard_after_forward`` is False) or ``"ddp"``
            (replicated). Planning divides static memory per device accordingly and adds the gradient
            reduction (and FSDP's all-gathers) to the iteration time; the plan records it.
    """
    layout = DataParallel(size=dp, shard=dp_shard, reshard_after_forward=dp_reshard_after_forward)
    precision.bytes_per_param_on(layout)  # raises when ZeRO-1's optimizer_shards disagree with dp
    _check_keywords(
        plan=plan, planner=planner, num_microbatches=num_microbatches, schedule=schedule, virtual_stages=virtual_stages,
        memory_budget=memory_budget, recompute=recompute, solver=solver, solver_time_limit=solver_time_limit,
        costed=device is not None or costs is not None, device=device, precision=precision, cost_cache=cost_cache,
        refresh_costs=refresh_costs, dp=dp,
    )
    budget = _parse_budget(memory_budget)  # before any pass runs: a NaN budget fails at once
    kind, chunks = "1f1b" if schedule is None else schedule, 1 if virtual_stages is None else virtual_stages
    if plan is None:  # so does a malformed schedule keyword (its rules over the stages are checked after blocks)
        Schedule(kind=kind, num_microbatches=1 if num_microbatches is None else num_microbatches, virtual_stages=chunks)
    if data is not None and dp > 1 and data.dp != dp:
        raise InputError(f"dp={dp} disagrees with data=DataOptions(dp={data.dp}): give both the same data-parallel size")
    timings: dict[str, float] = {}
    done: list[str] = []
    if device is not None and costs is not None:
        raise InputError("give device= (cost the blocks) or costs= (reuse a cost table), not both")
    data_plan, example = None, None
    if lengths is not None:
        data_plan = _run_pass("data", done, timings, lambda: plan_data(lengths, data, model=model))
        if example_inputs is None:
            shape = f"{data_plan.shape.tiles} tiles, {data_plan.shape.tokens} tokens"
            example = describe_batch(data_plan.example_batch(), synthesized=True,
                                     source=f"one balanced pack of lengths= ({shape}, row {data_plan.seq_len})")
    elif data is not None:
        raise InputError("optimize(data=...) needs lengths=... (the dataset's length statistics)")
    if example is None and example_inputs is None:
        example = example_inputs_for(model)
    if example is not None:
        print(example.summary())
        example_inputs = example.batch
    else:
        example = describe_batch(example_inputs, source="given as example_inputs", synthesized=False)
    captured = _run_pass("capture", done, timings, lambda: capture(model, example_inputs, method=capture_method))
    kernel_report = None
    if kernels is not None:
        from omnibal_compile.compile.fuse import substitute_kernels

        captured, kernel_report = _run_pass(
            "kernels", done, timings, lambda: substitute_kernels(captured, model, backend=kernels)
        )
    graph = _run_pass("blocks", done, timings, lambda: build_blocks(captured, model, block_prefixes=block_prefixes))
    chosen_schedule = None
    search_layout = plan is None and (num_stages is None or devices is not None)
    if search_layout and device is None and costs is None:  # the search needs costs: profile here
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if plan is None and not search_layout:  # before costing: a bad stage count or schedule should fail fast
        check_num_stages(graph, num_stages)
        chosen_schedule = Schedule.for_stages(
            num_stages, kind=kind, num_microbatches=num_microbatches, virtual_stages=chunks
        )
    table = _load_costs(costs, graph) if costs is not None else None
    if device is not None:
        table = _run_pass(
            "cost", done, timings,
            lambda: annotate_costs(graph, model, device=device, precision=precision, cache=cost_cache, refresh=refresh_costs),
        )
    layout_search = None
    if search_layout:
        from omnibal_compile.costs.devices import PROFILED_DEVICES, get_device
        from omnibal_compile.planning.layout import choose_layout, job_devices

        assert table is not None
        count, where = (devices, f"{devices} as given") if devices is not None else job_devices()
        # a roofline target gives the links (NVLink in a node, InfiniBand across); profiled costs keep the table's
        spec = get_device(device) if device is not None and str(device).lower() not in PROFILED_DEVICES else None
        budget_one = _parse_budget(memory_budget)
        if isinstance(budget_one, list):
            raise InputError("optimize(devices=...) takes one memory_budget for every device, not a list")
        layout_search = _run_pass("layout", done, timings, lambda: choose_layout(
            table, devices=count, device=spec, global_batch=global_batch, num_stages=num_stages, schedule=schedule,
            virtual_stages=virtual_stages, num_microbatches=num_microbatches, dp=dp,
            dp_layout=None if dp == 1 else ("ddp" if dp_shard == "ddp" else "fsdp" if dp_reshard_after_forward else "fsdp-kept"),
            memory_budget=budget_one, recompute=recompute,
        ))
        layout_search = dataclasses.replace(layout_search, notes=(f"devices: {where}", *layout_search.notes))
        print(layout_search.summary(limit=12))
        best = layout_search.best.layout
        num_stages, num_microbatches, virtual_stages = best.num_stages, best.num_microbatches, best.virtual_stages
        schedule, layout, table = best.schedule, best.data_parallel, layout_search.costs
        if planner is None:  # the search's plan is the planner's (exact for 1F1B); another planner re-plans
            plan = layout_search.plan
        else:
            chosen_schedule = Schedule.for_stages(num_stages, kind=schedule, num_microbatches=num_microbatches,
                                                  virtual_stages=virtual_stages)
            memory_budget = budget_one
    if num_stages is None:
        raise InputError("optimize() needs num_stages=, or devices= to choose the layout")
    if plan is not None:
        if plan.num_stages != num_stages:
            raise PlanError(f"the given plan has {plan.num_stages} stages but num_stages={num_stages}")
        chosen = plan
    else:
        assert chosen_schedule is not None
        chosen = _run_pass(
            "plan", done, timings,
            lambda: plan_stages(
                graph, num_stages=num_stages, schedule=chosen_schedule, planner=planner, costs=table,
                memory_budget=budget, recompute=recompute, solver=solver, time_limit=solver_time_limit,
                data_parallel=layout,
            ),
        )
    stages = _run_pass("codegen", done, timings, lambda: generate_stages(graph, chosen, model))
    return OptimizeResult(
        model=model, captured=captured, graph=graph, plan=chosen, stages=stages, timings=timings, costs=table,
        data=data_plan, kernels=kernel_report, layout=layout_search, example=example,
    )


def compile_for_microbatches(model: nn.Module, batch: Any, plan: Plan, **optimize_kwargs: Any) -> OptimizeResult:
    """Capture ``model`` at the micro-batch shape of ``batch`` under ``plan`` and emit its stages.

    Stage modules are specialised to the shapes they are captured with; the pipeline runs them on
    micro-batches, so they are captured on the first micro-batch of ``batch``.
    """
    args, kwargs = normalize_example_inputs(batch)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first = split_batch(leaves, plan.num_microbatches)[0]
    mb_args, mb_kwargs = pytree.tree_unflatten(list(first), spec)
    return optimize(model, (tuple(mb_args), dict(mb_kwargs)), num_stages=plan.num_stages, plan=plan, **optimize_kwargs)
