"""What-if sweeps: plan and simulate over a range of one setting (memory budget, stage count, ...).

Glossary:
    make_plan   a callable taking the swept value and returning a Plan, e.g.
                ``lambda budget: ilp(graph, costs, num_stages=8, memory_budget=budget)``; raising
                :class:`~omnibal_compile.errors.PlanError` marks the value infeasible.
    point       one swept value with its plan and simulated iteration, or the reason it failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omnibal_compile._utils.tables import format_table
from omnibal_compile.errors import PlanError
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.sim.simulate import SimResult, simulate

__all__ = ["SweepPoint", "sweep", "sweep_table"]


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One value of a what-if sweep."""

    value: Any
    """The swept value (bytes, stage count, ...)."""
    plan: Plan | None
    """The plan made for it; None when infeasible."""
    result: SimResult | None
    """Its simulated iteration; None when infeasible."""
    error: str = ""
    """Why no plan exists for this value (empty when feasible)."""

    @property
    def iteration_time_s(self) -> float | None:
        return self.result.iteration_time_s if self.result else None


def sweep(
    make_plan: Callable[[Any], Plan],
    values: Sequence[Any],
    costs: CostTable | Callable[[Plan], CostTable],
    *,
    progress: Callable[[Any], None] | None = None,
    **simulate_kwargs: Any,
) -> tuple[SweepPoint, ...]:
    """Plan and simulate every value; ``costs`` may depend on the plan (e.g. a micro-batch size that changes)."""
    points = []
    for value in values:
        try:
            plan = make_plan(value)
        except PlanError as e:
            points.append(SweepPoint(value=value, plan=None, result=None, error=str(e)))
        else:
            table = costs(plan) if callable(costs) else costs
            points.append(SweepPoint(value=value, plan=plan, result=simulate(plan, table, **simulate_kwargs)))
        if progress is not None:
            progress(value)
    return tuple(points)


def sweep_table(points: Sequence[SweepPoint], *, label: str, fmt: Callable[[Any], str] = str) -> str:
    """Plain-text table: value, iteration ms, bubble, peak memory of the fullest device, boundaries."""
    rows = [(label, "iteration ms", "bubble", "max peak MiB", "boundaries")]
    for p in points:
        if p.result is None or p.plan is None:
            rows.append((fmt(p.value), "infeasible", "-", "-", p.error[:60]))
        else:
            r = p.result
            rows.append((
                fmt(p.value), f"{r.iteration_time_s * 1e3:.3f}", f"{r.bubble_fraction:.1%}",
                f"{max(r.peak_memory_bytes) / 2**20:.1f}", str(list(p.plan.boundaries)),
            ))
    return format_table(rows, "rrrrl")
