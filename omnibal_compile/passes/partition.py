"""Planners over a block graph: cut it into stages, with or without measured costs.

Every graph-level planner has the signature ``planner(graph: BlockGraph, num_stages: int) -> Plan``.
Without costs only the baselines ``uniform`` and ``parameters`` apply; with a ``CostTable`` every
planner of :mod:`omnibal_compile.solver` (``ilp``, ``dp``, ``uniform``, ``parameters``, ``flops``,
``omnibal``) runs through :func:`plan_with_costs`, which also fills the plan's predictions.

Glossary:
    uniform      equal numbers of layer blocks per stage (Megatron/torchtitan default).
    parameters   contiguous split minimising the largest stage's parameter count (DeepSpeed's
                 ``partition_method="parameters"``), solved exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omnibal_compile.costs import CostTable
from omnibal_compile.errors import PlanError
from omnibal_compile.passes.blocks import BlockGraph
from omnibal_compile.plan import Plan
from omnibal_compile.solver import PLANNER_NAMES, PartitionProblem, Solution, min_max_partition, problem_from_costs, solve, uniform_boundaries

__all__ = [
    "uniform",
    "parameters",
    "PLANNERS",
    "COST_PLANNERS",
    "Planner",
    "check_num_stages",
    "min_max_partition",
    "plan_with_costs",
    "plan_from_solution",
]

Planner = Callable[[BlockGraph, int], Plan]


def check_num_stages(graph: BlockGraph, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise PlanError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > graph.num_blocks:
        raise PlanError(
            f"num_stages={num_stages} exceeds the {graph.num_blocks} blocks of {graph.captured.model_name}: "
            "use fewer stages, or finer blocks (block_prefixes=...)"
        )


def _plan(graph: BlockGraph, boundaries: Sequence[int], planner: str, **notes: object) -> Plan:
    return Plan(
        block_names=graph.names,
        boundaries=tuple(boundaries),
        planner=planner,
        block_params=tuple(b.num_params for b in graph.blocks),
        block_kinds=tuple(b.kind for b in graph.blocks),
        notes=dict(notes),
    )


def uniform(graph: BlockGraph, num_stages: int) -> Plan:
    """Equal numbers of layer blocks per stage; the first stages take the remainder."""
    check_num_stages(graph, num_stages)
    try:
        boundaries = uniform_boundaries([b.kind for b in graph.blocks], num_stages)
    except PlanError as e:
        raise PlanError(f"{graph.captured.model_name}: {e}") from None
    return _plan(graph, boundaries, "uniform")


def parameters(graph: BlockGraph, num_stages: int) -> Plan:
    """Contiguous stages with the smallest possible largest parameter count."""
    check_num_stages(graph, num_stages)
    boundaries, worst = min_max_partition([b.num_params for b in graph.blocks], num_stages)
    return _plan(graph, boundaries, "parameters", max_stage_params=int(worst))


PLANNERS: dict[str, Planner] = {"uniform": uniform, "parameters": parameters}
"""Planners that need no costs, selectable by name in :func:`omnibal_compile.optimize`."""

COST_PLANNERS: tuple[str, ...] = PLANNER_NAMES
"""Planners that run on a CostTable (see :func:`plan_with_costs`)."""


def plan_from_solution(sol: Solution, costs: CostTable, problem: PartitionProblem) -> Plan:
    """Wrap a solver solution of ``problem`` (built from ``costs``) as a Plan carrying its predicted figures."""
    notes: dict[str, object] = {"binding": sol.binding, "status": sol.status, "solve seconds": round(sol.solve_seconds, 3)}
    if sol.gap is not None:
        notes["gap"] = sol.gap
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
        memory_budget_bytes=(
            tuple(int(problem.stage_budget(s)) for s in range(problem.num_stages)) if problem.budget else ()
        ),
        iteration_time_s=sol.iteration_time,
        notes=notes,
    )


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
) -> Plan:
    """Plan from measured or modelled costs with any planner of :mod:`omnibal_compile.solver`.

    ``memory_budget`` is bytes per device (one number or one per device); ``recompute`` is
    ``auto`` (the planner chooses per block) or one option forced everywhere.
    """
    problem = problem_from_costs(
        costs,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        budget=memory_budget,
        recompute=recompute,
    )
    sol = solve(problem, planner, solver=solver, time_limit=time_limit)
    return plan_from_solution(sol, costs, problem)
