"""Torch-free planning: the joint partition + recomputation problem, its exact solvers and baselines.

``solve(problem, planner)`` runs any planner by name: ``ilp`` (PuLP; HiGHS or CBC, bounded and
warm-started by the DP when the schedule allows), ``dp`` (exact dynamic program), or a baseline
(``uniform``, ``parameters``, ``flops``, ``omnibal``). Interleaved schedules have no exact DP: the
ILP starts from the best of the baselines and the DP's interleaved incumbent. Infeasible budgets
raise ``PlanError`` with an explanation.
"""

from __future__ import annotations

from omnibal_compile.errors import PlanError
from omnibal_compile.solver.baselines import BASELINES, min_max_partition, uniform_boundaries
from omnibal_compile.solver.dp import interleaved_incumbent, solve_dp
from omnibal_compile.solver.explain import explain_infeasible, least_memory_split
from omnibal_compile.solver.ilp import solve_ilp
from omnibal_compile.solver.problem import PartitionProblem, Solution, evaluate, in_flight, lower_bound, problem_from_costs

__all__ = [
    "PartitionProblem",
    "Solution",
    "evaluate",
    "in_flight",
    "lower_bound",
    "problem_from_costs",
    "solve",
    "solve_dp",
    "solve_ilp",
    "BASELINES",
    "PLANNER_NAMES",
    "explain_infeasible",
    "least_memory_split",
    "min_max_partition",
    "uniform_boundaries",
]

PLANNER_NAMES: tuple[str, ...] = ("ilp", "dp", *BASELINES)


def solve(
    problem: PartitionProblem,
    planner: str = "ilp",
    *,
    solver: str = "auto",
    time_limit: float | None = 60.0,
    gap: float = 1e-6,
) -> Solution:
    """Plan ``problem`` with ``planner``; raise an explained ``PlanError`` when nothing fits."""
    if planner not in PLANNER_NAMES:
        raise PlanError(f"unknown planner {planner!r}; choose one of {list(PLANNER_NAMES)}")
    if problem.budget:
        _, _, needed = least_memory_split(problem)
        if any(needed > b * (1 + 1e-9) for b in problem.budget):
            raise PlanError(explain_infeasible(problem))
    if planner in BASELINES:
        sol = BASELINES[planner](problem)
        if not sol.feasible:
            over = [s for s, m in enumerate(sol.stage_memory) if m > problem.stage_budget(s)]
            raise PlanError(
                f"the {planner} split does not fit the memory budget on stages {over} even with the most "
                f"recomputation allowed ({problem.allowed[-1]}); a plan that fits exists: use planner='ilp'"
            )
        return sol
    if planner == "dp":
        return solve_dp(problem)
    # ILP: bound and warm-start it by an incumbent, the DP optimum where the DP applies.
    if problem.schedule == "interleaved":
        feasible = []
        for baseline in BASELINES.values():
            try:
                candidate = baseline(problem)
            except PlanError:  # e.g. uniform with fewer layers than stages
                continue
            if candidate.feasible:
                feasible.append(candidate)
        try:
            feasible.append(interleaved_incumbent(problem))
        except PlanError:
            pass
        incumbent = min(feasible, key=lambda s: s.iteration_time) if feasible else None
    else:
        incumbent = solve_dp(problem)
    bound = incumbent.iteration_time if incumbent is not None else None
    return solve_ilp(problem, upper_bound=bound, warm=incumbent, solver=solver, time_limit=time_limit, gap=gap)
