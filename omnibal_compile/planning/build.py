"""The planning pass: cut a block graph into stages, with or without measured costs.

:func:`plan_stages` is the one planning path (``optimize()``, the demo and the ``plan`` command's
sweeps use it). Planners are named in :data:`omnibal_compile.planning.PLANNERS`; with a
``CostTable`` every one runs on the solver's problem through :func:`plan_with_costs`, which also
fills the plan's predictions; without costs only the planners that need none (``uniform``,
``parameters``) apply. A callable ``planner(graph: BlockGraph, num_stages: int) -> Plan`` works too.

Glossary:
    uniform      equal numbers of layer blocks per stage (Megatron/torchtitan default).
    parameters   contiguous split minimising the largest stage's parameter count (DeepSpeed's
                 ``partition_method="parameters"``), solved exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import NO_DATA_PARALLEL, CostTable, DataParallel
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.planning import (
    PartitionProblem,
    Solution,
    evaluate,
    min_max_partition,
    planner_info,
    problem_from_costs,
    solve,
)
from omnibal_compile.planning.ties import describe as describe_tie_break

__all__ = [
    "uniform",
    "parameters",
    "Planner",
    "check_costs",
    "check_num_stages",
    "min_max_partition",
    "plan_stages",
    "plan_with_costs",
    "plan_from_solution",
]

if TYPE_CHECKING:  # the planning functions are torch-free; only the block graph they cut needs torch
    from omnibal_compile.compile.blocks import BlockGraph

Planner = Callable[["BlockGraph", int], Plan]


def check_num_stages(graph: BlockGraph, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise PlanError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > graph.num_blocks:
        raise PlanError(
            f"num_stages={num_stages} exceeds the {graph.num_blocks} blocks of {graph.captured.model_name}: "
            "use fewer stages, or finer blocks (block_prefixes=...)"
        )


def check_costs(graph: BlockGraph, costs: CostTable, source: str) -> None:
    """Raise unless ``costs`` (from ``source``, e.g. a file name) holds exactly ``graph``'s blocks, in order."""
    if tuple(costs.names) == tuple(graph.names):
        return
    diff = [f"#{i}: model '{a}' vs costs '{b}'" for i, (a, b) in enumerate(zip(graph.names, costs.names)) if a != b]
    raise InputError(
        f"{source} does not hold the {graph.num_blocks} blocks of {graph.captured.model_name} (it has "
        f"{len(costs.names)}{'; first differences: ' + str(diff[:3]) if diff else ''}): cost this model "
        "(device=...) or give its own cost table"
    )


def _plan(graph: BlockGraph, boundaries: Sequence[int], planner: str, **notes: object) -> Plan:
    return Plan(
        block_names=graph.names,
        boundaries=tuple(boundaries),
        planner=planner,
        block_params=tuple(b.num_params for b in graph.blocks),
        block_kinds=tuple(b.kind for b in graph.blocks),
        stage_send_bytes=tuple(graph.cut_bytes(j) if j < graph.num_blocks else 0 for j in boundaries[1:]),
        notes=dict(notes),
    )


def _cost_free(graph: BlockGraph, num_stages: int, planner: str) -> Plan:
    """The plan of a registered planner that needs no costs: cut points from block kinds and parameters."""
    check_num_stages(graph, num_stages)
    cut_points = planner_info(planner).cut_points
    if cut_points is None:
        raise InputError(
            f"planner {planner!r} needs block costs: pass device='cpu' to profile here, a target such as "
            "'a100-80gb' for the roofline model, or costs=... (a CostTable)"
        )
    params = [b.num_params for b in graph.blocks]
    try:
        b = list(cut_points([blk.kind for blk in graph.blocks], params, num_stages))
    except PlanError as e:
        raise PlanError(f"{graph.captured.model_name}: {e}") from None
    return _plan(graph, b, planner, max_stage_params=max(sum(params[i:j]) for i, j in zip(b, b[1:])))


def uniform(graph: BlockGraph, num_stages: int) -> Plan:
    """Equal numbers of layer blocks per stage; the first stages take the remainder."""
    return _cost_free(graph, num_stages, "uniform")


def parameters(graph: BlockGraph, num_stages: int) -> Plan:
    """Contiguous stages with the smallest possible largest parameter count."""
    return _cost_free(graph, num_stages, "parameters")


def plan_from_solution(
    sol: Solution, costs: CostTable, problem: PartitionProblem, *, notes: dict[str, object] | None = None
) -> Plan:
    """Wrap a solver solution of ``problem`` (built from ``costs``) as a Plan carrying its predicted figures.

    ``notes`` replace the solver's (binding constraint, status, solve time, gap).
    """
    if notes is None:
        notes = {"binding": sol.binding, "status": sol.status, "solve seconds": round(sol.solve_seconds, 3)}
        if sol.gap is not None:
            notes["gap"] = sol.gap
        if "tie_break" in sol.extra:
            notes["tie-break"] = describe_tie_break(sol.extra["tie_break"])
    return Plan(
        block_names=costs.names,
        boundaries=sol.boundaries,
        planner=sol.planner,
        block_params=tuple(b.num_params for b in costs.blocks),
        block_kinds=tuple(b.kind for b in costs.blocks),
        recompute=sol.recompute,
        schedule=problem.schedule,
        num_microbatches=problem.num_microbatches,
        virtual_stages=problem.virtual_stages,
        stage_time_s=sol.stage_time,
        stage_memory_bytes=tuple(int(m) for m in sol.stage_memory),
        stage_peak_bytes=tuple(int(m) for m in sol.stage_peak) if problem.peak else (),
        memory_budget_bytes=(
            tuple(int(problem.stage_budget(s)) for s in range(problem.num_stages)) if problem.budget else ()
        ),
        iteration_time_s=sol.iteration_time,
        stage_send_bytes=tuple(costs.cut_bytes[j] if j < len(costs.blocks) else 0 for j in sol.boundaries[1:]),
        **_dp_fields(problem.data_parallel),
        notes=notes,
    )


def _dp_fields(dp: DataParallel) -> dict[str, Any]:
    """The plan fields that record ``dp``."""
    return {
        "data_parallel": dp.size,
        "data_parallel_shard": dp.shard,
        "reshard_after_forward": dp.reshard_after_forward,
    }


def plan_with_costs(
    costs: CostTable,
    *,
    num_stages: int,
    num_microbatches: int,
    planner: str = "ilp",
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    memory_budget: float | Sequence[float] | None = None,
    recompute: str = "auto",
    solver: str = "auto",
    time_limit: float | None = 60.0,
    data_parallel: DataParallel = NO_DATA_PARALLEL,
    tie_tolerance: float | None = None,
) -> Plan:
    """Plan from measured or modelled costs with any planner of :mod:`omnibal_compile.planning`.

    ``memory_budget`` is bytes per device (one number or one per device); ``recompute`` is
    ``auto`` (the planner chooses per block) or one option forced everywhere; ``data_parallel``
    replicates the pipeline (memory per device and iteration time follow its layout).
    ``tie_tolerance``: plans predicted within this fraction of the fastest count as equal
    (:mod:`omnibal_compile.planning.ties`); None: 2% for measured costs, 0 for modelled ones.
    """
    problem = problem_from_costs(
        costs,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        budget=memory_budget,
        recompute=recompute,
        data_parallel=data_parallel,
        tie_tolerance=tie_tolerance,
    )
    sol = solve(problem, planner, solver=solver, time_limit=time_limit)
    return plan_from_solution(sol, costs, problem)


def plan_stages(
    graph: BlockGraph,
    *,
    num_stages: int,
    schedule: Schedule,
    planner: str | Planner | None = None,
    costs: CostTable | None = None,
    memory_budget: float | Sequence[float] | None = None,
    recompute: str = "auto",
    solver: str = "auto",
    time_limit: float | None = 60.0,
    data_parallel: DataParallel = NO_DATA_PARALLEL,
) -> Plan:
    """The planning pass: cut ``graph`` into ``num_stages`` stages for ``schedule``, replicated by ``data_parallel``.

    ``planner`` is a name in :data:`omnibal_compile.planning.PLANNERS` (default ``ilp`` with costs,
    ``parameters`` without) or a callable ``(graph, num_stages) -> Plan``. Every plan carries
    ``schedule``; with ``costs`` (a table of ``graph``'s blocks, see :func:`check_costs`) it also
    carries its predicted stage times, memory and iteration time by the solver's accounting.
    ``memory_budget`` is bytes per device and needs costs.
    """
    check_num_stages(graph, num_stages)
    schedule.check(num_stages)
    if costs is None and memory_budget is not None:
        raise InputError(
            "memory_budget needs block costs: pass device='cpu', a target such as 'a100-80gb', or costs=..."
        )
    planner = planner or ("ilp" if costs is not None else "parameters")
    if isinstance(planner, str) and costs is not None:
        planner_info(planner)  # an unknown name fails here, before the problem is built
        return plan_with_costs(
            costs, num_stages=num_stages, num_microbatches=schedule.num_microbatches, planner=planner,
            schedule=schedule.kind, virtual_stages=schedule.virtual_stages, memory_budget=memory_budget,
            recompute=recompute, solver=solver, time_limit=time_limit, data_parallel=data_parallel,
        )
    if isinstance(planner, str):
        plan = _cost_free(graph, num_stages, planner)
    elif callable(planner):
        plan = planner(graph, num_stages)
        if not isinstance(plan, Plan):
            raise InputError(
                f"planner {getattr(planner, '__name__', planner)!r} returned {type(plan).__name__}, not a Plan"
            )
    else:
        raise InputError(f"planner must be a name or a callable, got {type(planner).__name__}")
    plan = dataclasses.replace(
        plan,
        schedule=schedule.kind,
        num_microbatches=schedule.num_microbatches,
        virtual_stages=schedule.virtual_stages,
        **_dp_fields(data_parallel),
    )
    if costs is None:
        # Without costs nothing chooses per block ("auto" keeps none); a forced option is applied as asked.
        return plan if recompute == "auto" else dataclasses.replace(plan, recompute=(recompute,) * plan.num_blocks)
    # A callable's plan, predicted by the same accounting as the solvers' plans.
    problem = problem_from_costs(
        costs, num_stages=num_stages, num_microbatches=schedule.num_microbatches, schedule=schedule.kind,
        virtual_stages=schedule.virtual_stages, budget=memory_budget, recompute=recompute, data_parallel=data_parallel,
    )
    sol = evaluate(problem, plan.boundaries, plan.block_recompute, planner=plan.planner)
    return plan_from_solution(sol, costs, problem, notes={**plan.notes, "binding": sol.binding})
