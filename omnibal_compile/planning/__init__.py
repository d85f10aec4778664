"""Torch-free planning: the joint partition + recomputation problem, its exact solvers and baselines.

``solve(problem, planner)`` runs any planner by name: ``ilp`` (PuLP; HiGHS or CBC, bounded and
warm-started by the DP when the schedule allows), ``dp`` (exact dynamic program), or a baseline
(``uniform``, ``parameters``, ``flops``, ``omnibal``). Interleaved schedules have no exact DP: the
ILP starts from the best of the baselines and the DP's interleaved incumbent. Infeasible budgets
raise ``PlanError`` with an explanation. ``PLANNERS`` is the one table of planners: name, help line,
and how to call each with costs (``solve``) and, for the baselines that need none, without.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.planning import interleaved as two_chunks
from omnibal_compile.planning.baselines import BASELINES, min_max_partition, uniform_boundaries
from omnibal_compile.planning.dp import interleaved_incumbent, solve_dp
from omnibal_compile.planning.explain import explain_infeasible, least_memory_split
from omnibal_compile.planning.ilp import _status_note, solve_ilp
from omnibal_compile.planning.problem import (
    PROFILED_TIE_TOLERANCE,
    PartitionProblem,
    Solution,
    evaluate,
    in_flight,
    lower_bound,
    problem_from_costs,
)
from omnibal_compile.planning.ties import break_ties
from omnibal_compile.planning.zero_bubble import solve_zero_bubble

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
    "PLANNERS",
    "PlannerInfo",
    "planner_help",
    "planner_info",
    "explain_infeasible",
    "least_memory_split",
    "min_max_partition",
    "uniform_boundaries",
    "break_ties",
    "PROFILED_TIE_TOLERANCE",
]


@dataclass(frozen=True, kw_only=True)
class PlannerInfo:
    """One planner: its name, what it does, and how to call it with and without costs."""

    name: str
    """Name accepted by ``optimize(planner=...)`` and ``--planner``."""
    about: str
    """One line for help text."""
    solve: Callable[..., Solution]
    """With costs: ``solve(problem, *, solver, time_limit, gap) -> Solution``."""
    cut_points: Callable[[Sequence[str], Sequence[int], int], Sequence[int]] | None = None
    """Without costs: ``(block kinds, parameters per block, stages) -> boundaries``; None when it needs costs."""

    @property
    def needs_costs(self) -> bool:
        return self.cut_points is None


def _ilp(problem: PartitionProblem, *, solver: str, time_limit: float | None, gap: float) -> Solution:
    """The ILP, bounded and warm-started by an incumbent (the DP optimum where the DP applies)."""
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
        if incumbent is not None and two_chunks.applies(problem):
            # Two chunks per device: the least bottleneck is found exactly by a search of its own, with
            # a lower bound the ILP's relaxation cannot reach; the ILP runs only if the gap is too wide.
            start = time.perf_counter()
            found = two_chunks.two_chunk_search(problem, incumbent, tolerance=max(gap / 2, 1e-4), time_limit=time_limit)
            seconds = time.perf_counter() - start
            if found.gap <= gap:
                return dataclasses.replace(
                    found.solution,
                    planner="ilp",
                    status=_status_note("Optimal", found.gap),
                    gap=found.gap,
                    solve_seconds=seconds,
                    extra={
                        "solver": "two-chunk search",
                        "lower_bound": found.lower_bound,
                        "decisions": found.decisions,
                    },
                )
            if time_limit is not None:
                time_limit = max(1.0, time_limit - seconds)
            return solve_ilp(problem, upper_bound=found.solution.iteration_time, proven_bound=found.lower_bound,
                             warm=found.solution, solver=solver, time_limit=time_limit, gap=gap)
    else:
        incumbent = solve_dp(problem)
    bound = incumbent.iteration_time if incumbent is not None else None
    return solve_ilp(problem, upper_bound=bound, warm=incumbent, solver=solver, time_limit=time_limit, gap=gap)


def _baseline(name: str) -> Callable[..., Solution]:
    return lambda problem, **_: BASELINES[name](problem)


PLANNERS: dict[str, PlannerInfo] = {
    p.name: p
    for p in (
        PlannerInfo(name="ilp", about="cut points and per-block recomputation, jointly optimal (PuLP)", solve=_ilp),
        PlannerInfo(name="dp", about="the same optimum by dynamic programming (gpipe, 1f1b)",
                    solve=lambda problem, **_: solve_dp(problem)),
        PlannerInfo(name="uniform", about="equal numbers of layer blocks per stage (Megatron, torchtitan)",
                    solve=_baseline("uniform"), cut_points=lambda kinds, params, S: uniform_boundaries(kinds, S)),
        PlannerInfo(name="parameters", about="the smallest largest stage parameter count (DeepSpeed)",
                    solve=_baseline("parameters"), cut_points=lambda kinds, params, S: min_max_partition(params, S)[0]),
        PlannerInfo(name="flops", about="the smallest largest stage forward FLOPs", solve=_baseline("flops")),
        PlannerInfo(name="omnibal", about="OmniBal's anchor-and-search heuristic", solve=_baseline("omnibal")),
    )
}
"""Every planner by name: the one table optimize(), the commands and the benches read."""


EXACT_PLANNERS = ("ilp", "dp")
"""Planners that minimise the predicted iteration time; their plans go through the tie-break."""


def planner_help(default: str) -> str:
    """Help text of a ``--planner`` option: every planner, what it does, whether it needs costs."""
    lines = [f"{p.name}: {p.about}{'' if p.needs_costs else ' (no costs needed)'}" for p in PLANNERS.values()]
    return "; ".join(lines) + f" (default {default})"


def planner_info(name: str) -> PlannerInfo:
    """The registered planner ``name``; an InputError lists the names when it is unknown."""
    if name not in PLANNERS:
        raise InputError(f"unknown planner {name!r}; choose one of {list(PLANNERS)}")
    return PLANNERS[name]


def solve(
    problem: PartitionProblem,
    planner: str = "ilp",
    *,
    solver: str = "auto",
    time_limit: float | None = 60.0,
    gap: float = 1e-6,
) -> Solution:
    """Plan ``problem`` with ``planner``; raise an explained ``PlanError`` when nothing fits.

    The split-backward schedules (interleaved-zb, zbv, dualpipev): the exact planners run
    :func:`~omnibal_compile.planning.zero_bubble.solve_zero_bubble`, whose solution names that search
    (``zero-bubble search``) as its planner.
    The exact planners' plan goes through :func:`~omnibal_compile.planning.ties.break_ties`: with
    ``problem.tie_tolerance`` > 0 it is the deterministic choice among the plans within that
    tolerance of the fastest (the fastest itself when the tolerance is 0).
    """
    info = planner_info(planner)
    split = problem.pipeline_schedule.rule.split_backward
    if split and planner in EXACT_PLANNERS:
        # the split-backward schedules' own exact search (it explains an infeasible budget itself); its objective
        # is the simulator's, which the closed-form tie-break does not know. The plan names that search as its
        # planner (planning.zero_bubble.PLANNER_LABEL), not the name asked for.
        return solve_zero_bubble(problem, time_limit=time_limit)
    if problem.budget and not split:
        _, _, needed = least_memory_split(problem)
        if any(needed / problem.virtual_stages > problem.memory_limit(s) for s in range(problem.num_stages)):
            raise PlanError(explain_infeasible(problem))
    sol = info.solve(problem, solver=solver, time_limit=time_limit, gap=gap)
    if planner in EXACT_PLANNERS:  # near-equal plans: the one deterministic choice (solver.ties)
        sol = break_ties(problem, sol)
    if planner in BASELINES and not sol.feasible:  # the exact planners raise when nothing fits
        over = [s for s, m in enumerate(sol.stage_memory) if m > problem.memory_limit(s)]
        raise PlanError(
            f"the {planner} split does not fit the memory budget on stages {over} even with the most "
            f"recomputation allowed ({problem.allowed[-1]}); a plan that fits exists: use planner='ilp'"
        )
    return sol
