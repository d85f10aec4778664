"""The joint ILP in PuLP: cut points and one recompute option per block, under per-device memory.

GPipe and 1F1B (one stage per device) use the block-level model below; interleaved schedules use
the path model of :func:`_solve_paths`.

Variables (n blocks i, S stages s, options o):
    w[i, s, o] in {0, 1}   block i runs on stage s with option o; x[i, s] = sum_o w[i, s, o]
    z[i, j, s] in {0, 1}   stage s runs exactly blocks [i, j)   (only under a memory budget)
    T[s] >= 0 stage time;  Tmax >= T[s]
    D >= 0 data-parallel time: D >= sum_i x[i, s] d_i per stage; only with data parallelism, where
           the objective adds D once (see solver.problem)
    shared_work >= sum_s T[s] + (M - 1) Tmax and >= M sum_s T[s] / P: only when the devices share
           P < S processors (problem.pipeline_time); it replaces the closed form in the objective
Constraints:
    assignment   sum_{s, o} w[i, s, o] = 1
    stages       with a budget: the z form a path (one interval starts stage 0 at block 0; the
                 interval ending stage s at k is followed by one starting stage s + 1 at k) and
                 x[i, s] = sum of the z[a, b, s] with a <= i < b; without one, the prefix form
                 y[i, s] = sum_{t <= s} x[i, t] <= y[i - 1, s], every stage non-empty
    cut k ends stage s  e[k, s] = sum_a z[a, k, s]  (or y[k - 1, s] - y[k, s]; linear either way)
    time         T[s] = sum_{i, o} w t_io + sum_k e[k, s] c_k + sum_k e[k, s - 1] c_k
    floor        T[s] >= sum z[i, j, s] * (least time of [i, j) on stage s within its memory)
    memory       sum_i x w_i + sum z[i, j, s] (max_{[i, j)} u + max_{[i, j)} q) + k_s sum_{i, o} w a_io
                 + sum_k e[k, s - 1] bytes_k <= budget_s
    bound        objective <= DP optimum (when given): prunes variables and the search
Objective: the schedule's iteration time (see solver.problem), then, lexicographically, the number
of recomputed blocks (``TIE_WEIGHT`` per block, far below any time difference that matters), so
ties among recompute choices are not arbitrary.
Why the intervals: the block-level relaxation lets a stage take fractions of recompute options
that exactly fill its memory, a ~5% root gap that cost thousands of branch-and-bound nodes (6-9 s
on bench/solver.py at 60 GiB). The floor of an interval is its exact multiple-choice knapsack
optimum (the DP's Pareto frontiers), so the relaxation only has the choice of cuts left to relax.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from omnibal_compile.errors import PlanError
from omnibal_compile.planning.dp import Frontiers
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    Solution,
    evaluate,
    in_flight,
    lower_bound,
    stage_figures,
    stage_shared,
    stage_time_bound,
    stage_transient,
)

__all__ = ["solve_ilp", "make_solver"]

TIE_WEIGHT = 1e-6
"""The objective's cost per recomputed block, in units of the bottleneck's lower bound (the models'
unit): far below a time difference that matters (a 100-block plan's tie-breaks sum to 1e-4 of one
stage), yet above HiGHS's cost tolerance (1e-7), below which the tie-break was not decided at all."""

NEGLIGIBLE = 1e-6
"""Times under this share of the bottleneck's lower bound (fast sends, tiny blocks) are 0 in the
model. HiGHS's presolve mishandles coefficients near its tolerances: with sends of 2e-9 to 8e-8
of the bottleneck it reported a plan 3% slower than the optimum as optimal (tests/test_ilp.py).
The plan is evaluated with the exact times; what the model leaves out is at most a few millionths."""

BOUND_MARGIN = 1e-5
"""Relative slack on an upper bound: an incumbent exactly at the bound must stay feasible under the
solver's feasibility tolerances (a bound equal to the optimum made HiGHS report infeasible)."""


@contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null for a while (what C libraries print included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def make_solver(name: str = "auto", *, time_limit: float | None = None, gap: float = 1e-4, msg: bool = False):
    """A PuLP solver: HiGHS when highspy is installed (or asked for), CBC otherwise.

    ``gap`` (relative, default 1e-4) is the only stopping rule: the models are in units of the bottleneck's lower
    bound, where HiGHS's default absolute gap (1e-6, as large as ``TIE_WEIGHT``) could stop before
    the recompute tie-break is decided.
    """
    import pulp

    if name not in ("auto", "highs", "cbc"):
        raise PlanError(f"solver must be 'auto', 'highs' or 'cbc', got {name!r}")
    if name in ("auto", "highs"):
        try:
            import highspy

            class WarmHiGHS(pulp.HiGHS):
                """HiGHS that starts from the variables' initial values when all are set."""

                def actualSolve(self, lp, **kwargs):  # noqa: N802 - PuLP's name
                    # highspy prints a copyright banner from C whenever a model is made, whatever
                    # the options say: keep it out of the user's output unless msg asks for the log.
                    if self.msg:
                        return super().actualSolve(lp, **kwargs)
                    with _stdout_silenced():
                        return super().actualSolve(lp, **kwargs)

                def callSolver(self, lp):  # noqa: N802 - PuLP's name
                    values = [v.varValue for v in lp.variables()]
                    if values and all(x is not None for x in values):
                        sol = highspy.HighsSolution()
                        sol.col_value = [float(x) for x in values]
                        sol.value_valid = True
                        lp.solverModel.setSolution(sol)
                    lp.solverModel.run()
                    if lp.solverModel.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
                        # HiGHS's presolve calls some feasible models infeasible, e.g. a plan that
                        # fills a stage's memory to within the budget's 1e-9 allowance
                        # (tests/test_ilp.py); without presolve they solve. Only such a model pays twice.
                        lp.solverModel.setOptionValue("presolve", "off")
                        lp.solverModel.run()

            return WarmHiGHS(msg=msg, timeLimit=time_limit, gapRel=gap, gapAbs=0.0)
        except ImportError:
            if name == "highs":
                raise PlanError("solver='highs' needs highspy: pip install 'omnibal-compile[highs]'") from None
    return pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, gapRel=gap, gapAbs=0.0)


def _gap(prob, solver) -> float | None:
    model = getattr(prob, "solverModel", None)
    if model is not None and hasattr(model, "getInfo"):
        try:
            return float(model.getInfo().mip_gap)
        except Exception:  # noqa: BLE001 - the gap is informative only
            return None
    return None


def solve_ilp(
    problem: PartitionProblem,
    *,
    upper_bound: float | None = None,
    solver: str = "auto",
    time_limit: float | None = 60.0,
    warm: Solution | None = None,
    gap: float = 1e-6,
    proven_bound: float | None = None,
) -> Solution:
    """Solve the joint problem; ``upper_bound`` (e.g. the DP optimum) speeds it up.

    ``proven_bound``: an iteration time no plan beats, proven elsewhere (interleaved schedules only:
    a row of the path formulation, so the solver's gap starts from it).

    ``gap`` is the relative optimality gap at which the solver may stop. With a time limit the
    best plan found is returned with its optimality gap in ``status``.
    """
    import pulp

    # Solve in units of the bottleneck's lower bound: solvers' absolute tolerances (~1e-6) would
    # otherwise swamp objectives measured in microseconds.
    unit = lower_bound(problem) or 1.0
    original = problem

    def scaled(t: float) -> float:
        return t / unit if t / unit >= NEGLIGIBLE else 0.0

    problem = dataclasses.replace(
        problem,
        time=tuple(tuple(scaled(t) for t in row) for row in problem.time),  # type: ignore[misc]
        cut_time=tuple(scaled(c) for c in problem.cut_time),
        sync=tuple(scaled(d) for d in problem.sync),
    )
    if upper_bound is not None:
        upper_bound /= unit
    if proven_bound is not None:
        proven_bound /= unit
    if warm is not None:
        warm = dataclasses.replace(
            warm, stage_time=tuple(t / unit for t in warm.stage_time), sync_time=warm.sync_time / unit
        )
    P = problem
    n, S = P.n, P.num_stages
    opts = P.option_indices()
    start = time.perf_counter()
    tau = stage_time_bound(P, upper_bound * (1 + BOUND_MARGIN)) if upper_bound is not None else None
    lo, hi = _stage_windows(P, tau)
    if P.schedule == "interleaved":
        return _solve_paths(
            P,
            original,
            unit,
            lo,
            hi,
            tau,
            upper_bound=upper_bound,
            proven_bound=proven_bound,
            warm=warm,
            solver=solver,
            time_limit=time_limit,
            gap=gap,
            start=start,
        )
    model = _joint_model(P, lo, hi, tau, upper_bound=upper_bound)
    prob, w, z, T, Tmax, D, objective = model.prob, model.w, model.z, model.T, model.Tmax, model.D, model.objective
    useful, frontiers = model.useful, model.frontiers
    if warm is not None and not all(OPTIONS.index(r) in useful[i] for i, r in enumerate(warm.recompute)):
        warm = None  # the incumbent uses a dominated option: start cold rather than from a partial point
    if warm is not None:
        # A complete starting point (including stage times), so the solver only has to prove it.
        for (i, s, o), var in w.items():
            on = warm.boundaries[s] <= i < warm.boundaries[s + 1] and OPTIONS.index(warm.recompute[i]) == o
            var.setInitialValue(1 if on else 0)
        for (i, j, s), var in z.items():
            var.setInitialValue(1 if (warm.boundaries[s], warm.boundaries[s + 1]) == (i, j) else 0)
        for s in range(S):
            T[s].setInitialValue(warm.stage_time[s])
        Tmax.setInitialValue(max(warm.stage_time))
        if P.sync:
            D.setInitialValue(warm.sync_time)

    status = _solve(prob, solver, time_limit, bool(warm), gap)
    chosen = [sum(1 for (i, _, _), var in w.items() if i == b and (var.value() or 0) > 0.5) for b in range(n)]
    if any(c != 1 for c in chosen):
        raise PlanError(f"the ILP found no plan that fits the memory budget (solver status {status})")
    found_gap = _gap(prob, solver)
    note = _status_note(status, found_gap)
    boundaries, recompute = _read(w, n, S, opts)
    if frontiers is not None:  # under a budget: decide each stage's fit exactly, not within tolerance
        recompute = _fastest_fitting(P, frontiers, boundaries, recompute)
    return _solution(
        original, boundaries, recompute, note, found_gap, start, solver, (pulp.value(objective) or 0.0) * unit
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _JointModel:
    """The block-level model of a GPipe/1F1B plan (module docstring), built and not yet solved."""

    prob: Any
    w: dict[tuple[int, int, int], Any]
    """(block, stage, option) -> binary"""
    z: dict[tuple[int, int, int], Any]
    """(first block, end, stage) -> binary; only under a memory budget"""
    T: list[Any]
    Tmax: Any
    D: Any
    objective: Any
    """The iteration time in the model's units, without the tie-break."""
    useful: list[list[int]]
    """Per block, the options that have variables (the others are dominated)."""
    frontiers: Frontiers | None


def _joint_model(
    P: PartitionProblem, lo: list[int], hi: list[int], tau: float | None, *, upper_bound: float | None
) -> _JointModel:
    """The ILP of GPipe/1F1B ``P`` (already in the model's units) with blocks on the stages ``lo``..``hi`` allow."""
    import pulp

    n, S, M = P.n, P.num_stages, P.num_microbatches
    opts = P.option_indices()
    prob = pulp.LpProblem("omnibal_partition", pulp.LpMinimize)
    fastest = [min(P.time[i][o] for o in opts) for i in range(n)]
    useful = [list(P.useful_options(i)) for i in range(n)]
    w = {
        (i, s, o): pulp.LpVariable(f"w_{i}_{s}_{o}", cat="Binary")
        for i in range(n)
        for s in range(lo[i], hi[i] + 1)
        for o in useful[i]
    }

    def x(i: int, s: int):
        return pulp.lpSum(w[i, s, o] for o in opts if (i, s, o) in w)

    for i in range(n):
        prob += pulp.lpSum(w[i, s, o] for s in range(lo[i], hi[i] + 1) for o in useful[i]) == 1, f"assign_{i}"
    z: dict[tuple[int, int, int], pulp.LpVariable] = {}
    frontiers: Frontiers | None = None
    if P.budget:
        # Interval variables z[i, j, s] (stage s runs exactly blocks [i, j)) make this an extended
        # formulation with a far tighter LP relaxation under a memory budget: the stages form a
        # path of intervals, and a stage's time is at least the exact multiple-choice knapsack
        # optimum of its interval, which the block-level relaxation undercuts with fractional
        # recompute options (a ~5% root gap and thousands of nodes on the bench instance).
        floor, frontiers = _interval_floors(P, lo, hi, tau)
        z = {key: pulp.LpVariable("z_{}_{}_{}".format(*key), cat="Binary") for key in floor}
        finishes = _path_rows(prob, z, n, S)
        covering: dict[tuple[int, int], list] = {}
        for (i, j, s), var in z.items():
            for blk in range(i, j):
                covering.setdefault((blk, s), []).append(var)
        for i in range(n):
            for s in range(lo[i], hi[i] + 1):
                prob += x(i, s) == pulp.lpSum(covering.get((i, s), [])), f"link_{i}_{s}"

        def ends(k: int, s: int):
            """Cut k (1 <= k < n) is the end of stage s."""
            return pulp.lpSum(finishes.get((k, s), []))
    else:
        # Without a budget the fastest option is always best and the block-level model is tight.

        def y(i: int, s: int):
            """Block i on a stage <= s (constant 1 past the block's last possible stage)."""
            if s >= hi[i]:
                return 1
            return pulp.lpSum(x(i, t) for t in range(lo[i], s + 1))

        def ends(k: int, s: int):
            """Cut k (1 <= k < n) is the end of stage s."""
            return y(k - 1, s) - y(k, s)

        for i in range(1, n):
            for s in range(S - 1):
                rule = y(i, s) - y(i - 1, s)
                if isinstance(rule, pulp.LpAffineExpression) and rule.keys():  # constants are decided already
                    prob += rule <= 0, f"contig_{i}_{s}"
        for s in range(S):
            prob += pulp.lpSum(x(i, s) for i in range(n) if lo[i] <= s <= hi[i]) >= 1, f"nonempty_{s}"

    T = [pulp.LpVariable(f"T_{s}", lowBound=0) for s in range(S)]
    cuts = range(1, n)
    for s in range(S):
        compute = pulp.lpSum(w[i, s, o] * P.time[i][o] for i in range(n) for o in opts if (i, s, o) in w)
        send_fwd = pulp.lpSum(ends(k, s) * P.cut_time[k] for k in cuts) if s < S - 1 else 0
        send_bwd = pulp.lpSum(ends(k, s - 1) * P.cut_time[k] for k in cuts) if s > 0 else 0
        # a send entry at cut 0 or cut n counts as the other planners count it (problem.stage_figures)
        ends_sent = (P.cut_time[0] if s == 0 else 0.0) + (P.cut_time[n] if s == S - 1 else 0.0)
        prob += T[s] == compute + send_fwd + send_bwd + ends_sent, f"time_{s}"
        if z:
            prob += T[s] >= pulp.lpSum(var * floor[key] for key, var in z.items() if key[2] == s), f"floor_{s}"
        budget = P.memory_limit(s)
        if budget != float("inf"):
            mem = (
                pulp.lpSum(x(i, s) * P.static[i] for i in range(n) if lo[i] <= s <= hi[i])
                + in_flight(P, s)
                * pulp.lpSum(w[i, s, o] * P.act[i][o] for i in range(n) for o in opts if (i, s, o) in w)
                + (pulp.lpSum(ends(k, s - 1) * P.cut_bytes[k] for k in cuts) if s > 0 else 0)
                # the outputs each micro-batch in flight holds until its backward (problem.stage_io)
                + (in_flight(P, s) * pulp.lpSum(ends(k, s) * P.cut_bytes[k] for k in cuts) if s < S - 1 else 0)
                # the largest transient bytes, less the copies of tied weights counted twice (h_s), of its interval
                + pulp.lpSum(var * (stage_transient(P, key[0], key[1]) - stage_shared(P, key[0], key[1]))
                             for key, var in z.items() if key[2] == s)
            )
            # As a share of the budget, so coefficients stay in a range the solver handles well at any
            # scale (in GiB, the bytes of a small problem fell below HiGHS's smallest matrix value).
            # Every term is a non-negative multiple of a binary, so one over the whole budget is a
            # choice never taken: fix it at 0 rather than keep a coefficient HiGHS refuses (over 1e15
            # under a budget near 0); a row left without terms is dropped (PuLP's HiGHS interface
            # fails on one).
            share = (1 / budget) * mem
            for var, c in share.items():
                if c > 1:
                    var.upBound = 0
            fits = pulp.LpAffineExpression(
                [(var, c) for var, c in share.items() if 0 < c <= 1], constant=share.constant
            )
            if fits:
                prob += fits <= 1, f"memory_{s}"
    Tmax = pulp.LpVariable("Tmax", lowBound=0)
    for s in range(S):
        prob += Tmax >= T[s], f"max_{s}"
    objective = pulp.lpSum(T) + (M - 1) * Tmax
    if P.shares_processors:  # problem.pipeline_time: the shared work's bound when it is larger
        shared = pulp.LpVariable("shared_work", lowBound=0)
        prob += shared >= objective, "closed_form"
        prob += shared >= (M / P.processors) * pulp.lpSum(T), "shared_processors"  # type: ignore[operator]
        objective = shared
    D = pulp.LpVariable("D", lowBound=0)
    if P.sync:
        for s in range(S):  # one stage per device
            prob += D >= pulp.lpSum(x(i, s) * P.sync[i] for i in range(n) if lo[i] <= s <= hi[i]), f"sync_{s}"
        objective = objective + D
    # Valid cuts that tighten the LP relaxation: the bottleneck is at least max(work / S, largest block).
    if tau is not None:
        for s in range(S):
            T[s].upBound = tau
    prob += Tmax >= max(sum(fastest) / S, max(fastest)), "bottleneck_lower_bound"
    prob += pulp.lpSum(T) >= sum(fastest), "total_work_lower_bound"
    if upper_bound is not None and not P.shares_processors:  # with it, HiGHS stopped unsolved at an exact bound
        prob += objective <= upper_bound * (1 + BOUND_MARGIN), "dp_bound"
    # Phase 2 folded in lexicographically: a tie-break weight far below any time difference that
    # matters makes the solver prefer less recomputation among plans of equal iteration time.
    recomp = [k for k in w if k[2] != 0]
    if recomp:
        prob += objective + TIE_WEIGHT * pulp.lpSum(w[k] for k in recomp)
    else:
        prob += objective
    return _JointModel(
        prob=prob, w=w, z=z, T=T, Tmax=Tmax, D=D, objective=objective, useful=useful, frontiers=frontiers
    )


def _solution(
    problem: PartitionProblem, boundaries: Sequence[int], recompute: Sequence[str], status: str, gap: float | None,
    start: float, solver: str, objective: float,
) -> Solution:
    """The plan the ILP found, evaluated exactly on the original problem, with what the solver reported."""
    return evaluate(
        problem,
        boundaries,
        recompute,
        planner="ilp",
        status=status,
        solve_seconds=time.perf_counter() - start,
        gap=gap,
        extra={"solver": type(make_solver(solver)).__name__, "objective": objective},
    )


def _status_note(status: str, found_gap: float | None) -> str:
    if found_gap is None or found_gap <= 1e-6:
        return status
    if math.isfinite(found_gap):
        return f"{status}, gap {found_gap:.2%}"
    return f"{status}, no lower bound yet"


def _solve_paths(
    P: PartitionProblem,
    original: PartitionProblem,
    unit: float,
    lo: list[int],
    hi: list[int],
    tau: float | None,
    *,
    upper_bound: float | None,
    proven_bound: float | None,
    warm: Solution | None,
    solver: str,
    time_limit: float | None,
    gap: float,
    start: float,
) -> Solution:
    """Interleaved schedules: the plan as a path of intervals, each stage at its exact least time.

    z[i, j, s] = 1 when stage s runs exactly blocks [i, j); its time T(i, j, s) is the interval's
    fastest recompute vector that fits the stage's memory (the DP's frontiers), which is exact
    because stages are independent given their cut points (each chunk has its share of the
    device budget). So no per-block variables are needed:
        path     sum_j z[0, j, 0] = 1;  sum_i z[i, k, s] = sum_j z[k, j, s + 1]  (stage s + 1 starts where s ends)
        device   Tmax >= sum_{s on d} sum z[i, j, s] T(i, j, s);  D >= sum_{s on d} sum z d_[i, j)
        minimise M Tmax + (p - 1) / (p v) sum z T + D  (+ a tie-break on recomputed blocks)
    Its LP relaxation is the Lagrangian bound of the device maxima over all cut paths, far tighter
    than the block-level model's (which mixes fractional recompute options and stage overlaps):
    on InternVL 6+34B, 16 devices x 2 chunks, the block-level model stopped at its time limit with a
    91% gap, while this one proves a plan within its gap in seconds (bench/solver.py).
    """
    import pulp

    model = _paths_model(P, lo, hi, tau, upper_bound=upper_bound, proven_bound=proven_bound)
    prob, z, Tmax, D, objective = model.prob, model.z, model.Tmax, model.D, model.objective
    floor, vectors, sync = model.floor, model.vectors, model.sync
    S, p = P.num_stages, P.num_devices
    if warm is not None:
        path = {(warm.boundaries[s], warm.boundaries[s + 1], s) for s in range(S)}
        if path <= z.keys():
            for key, var in z.items():
                var.setInitialValue(1 if key in path else 0)
            Tmax.setInitialValue(max(sum(floor[k] for k in path if P.device_of(k[2]) == d) for d in range(p)))
            D.setInitialValue(max(
                sum(sync[k[1]] - sync[k[0]] for k in path if P.device_of(k[2]) == d) for d in range(p)
            ))
    status = _solve(prob, solver, time_limit, warm is not None, gap)
    chosen = sorted((key for key, var in z.items() if (var.value() or 0) > 0.5), key=lambda k: k[2])
    if [k[2] for k in chosen] != list(range(S)) or any(a[1] != b[0] for a, b in zip(chosen, chosen[1:])):
        raise PlanError(f"the ILP found no plan that fits the memory budget (solver status {status})")
    found_gap = _gap(prob, solver)
    boundaries = [0] + [k[1] for k in chosen]
    recompute = [OPTIONS[o] for key in chosen for o in vectors[key]]
    return _solution(original, boundaries, recompute, _status_note(status, found_gap), found_gap, start, solver,
                     (pulp.value(objective) or 0.0) * unit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PathModel:
    """The path model of an interleaved plan (see :func:`_solve_paths`), built and not yet solved."""

    prob: Any
    z: dict[tuple[int, int, int], Any]
    """(first block, end, stage) -> binary"""
    Tmax: Any
    D: Any
    objective: Any
    """The iteration time in the model's units, without the tie-break."""
    floor: dict[tuple[int, int, int], float]
    """Each interval's least time on its stage within its memory."""
    vectors: dict[tuple[int, int, int], list[int]]
    """Each interval's option vector at that time."""
    sync: list[float]
    """Prefix sums of the blocks' data-parallel sync times."""


def _paths_model(
    P: PartitionProblem, lo: list[int], hi: list[int], tau: float | None, *, upper_bound: float | None,
    proven_bound: float | None,
) -> _PathModel:
    """The path ILP of interleaved ``P`` (already in the model's units)."""
    import pulp

    n, S, M = P.n, P.num_stages, P.num_microbatches
    p, v = P.num_devices, P.virtual_stages
    floor, frontiers = _interval_floors(P, lo, hi, tau)
    vectors = {}
    for (i, j, s) in floor:
        best = frontiers.best_stage(s, i, j)
        assert best is not None  # _interval_floors kept only intervals that fit
        vectors[i, j, s] = frontiers.options(i, j, best[1])
    sync = [0.0]
    for d in P.sync or (0.0,) * n:
        sync.append(sync[-1] + d)
    prob = pulp.LpProblem("omnibal_partition_paths", pulp.LpMinimize)
    z = {key: pulp.LpVariable("z_{}_{}_{}".format(*key), cat="Binary") for key in floor}
    _path_rows(prob, z, n, S)
    Tmax = pulp.LpVariable("Tmax", lowBound=0)
    D = pulp.LpVariable("D", lowBound=0)
    for d in range(p):
        on_d = [(key, var) for key, var in z.items() if P.device_of(key[2]) == d]
        prob += Tmax >= pulp.lpSum(var * floor[key] for key, var in on_d), f"max_dev_{d}"
        if P.sync:
            prob += D >= pulp.lpSum(var * (sync[key[1]] - sync[key[0]]) for key, var in on_d), f"sync_{d}"
    objective = M * Tmax + (p - 1) / (p * v) * pulp.lpSum(var * floor[key] for key, var in z.items())
    if P.sync:
        objective = objective + D
    if upper_bound is not None:
        prob += objective <= upper_bound * (1 + BOUND_MARGIN), "bound"
    if proven_bound is not None:
        prob += objective >= proven_bound * (1 - BOUND_MARGIN), "proven_lower_bound"
    prob += objective + TIE_WEIGHT * pulp.lpSum(var * sum(o != 0 for o in vectors[key]) for key, var in z.items())
    return _PathModel(prob=prob, z=z, Tmax=Tmax, D=D, objective=objective, floor=floor, vectors=vectors, sync=sync)


def _path_rows(prob, z: dict[tuple[int, int, int], Any], n: int, S: int) -> dict[tuple[int, int], list]:
    """The rows that make the intervals z[i, j, s] a path: one interval starts stage 0 at block 0, and
    the intervals ending stage s at k are as many as those starting stage s + 1 there. Returns the
    intervals ending at each (k, s)."""
    import pulp

    starts: dict[tuple[int, int], list] = {}
    finishes: dict[tuple[int, int], list] = {}
    for (i, j, s), var in z.items():
        starts.setdefault((i, s), []).append(var)
        finishes.setdefault((j, s), []).append(var)
    prob += pulp.lpSum(starts.get((0, 0), [])) == 1, "path_start"
    for s in range(S - 1):
        for k in range(1, n):
            if (k, s) in finishes or (k, s + 1) in starts:
                prob += pulp.lpSum(finishes.get((k, s), [])) == pulp.lpSum(starts.get((k, s + 1), [])), f"path_{k}_{s}"
    return finishes


def _stage_windows(P: PartitionProblem, tau: float | None) -> tuple[list[int], list[int]]:
    """lo[i], hi[i]: the stages block i can lie on.

    Every stage is non-empty, and, given a bound ``tau`` on every stage's time, stages 0..s must
    hold the work of blocks 0..i ((s + 1) tau >= prefix) and stages s..S-1 that of blocks i..n-1.
    """
    n, S = P.n, P.num_stages
    fastest = [min(P.time[i][o] for o in P.option_indices()) for i in range(n)]
    lo = [max(0, S - (n - i)) for i in range(n)]
    hi = [min(S - 1, i) for i in range(n)]
    if tau is not None and tau > 0:
        prefix = 0.0
        suffix = sum(fastest)
        for i in range(n):
            prefix += fastest[i]
            lo[i] = max(lo[i], math.ceil(prefix / tau - 1e-9) - 1)
            hi[i] = min(hi[i], S - math.ceil(suffix / tau - 1e-9))
            suffix -= fastest[i]
            if lo[i] > hi[i]:
                raise PlanError(f"the bound on stage time {tau} leaves block {i} no stage: it is below the optimum")
    return lo, hi


def _interval_floors(
    P: PartitionProblem, lo: list[int], hi: list[int], tau: float | None
) -> tuple[dict[tuple[int, int, int], float], Frontiers]:
    """Least time of stage s on blocks [i, j) under its memory, for every interval it can run (and
    the frontiers that found them).

    Block b can lie on stages lo[b]..hi[b]; an interval slower than ``tau`` (when given) or whose
    fastest fitting option vector does not exist is left out.
    """
    n, S = P.n, P.num_stages
    frontiers = Frontiers(P, max_time=tau if tau is not None and tau > 0 else math.inf)
    floor: dict[tuple[int, int, int], float] = {}
    for s in range(S):
        for i in range(n):
            if (i == 0) != (s == 0) or not lo[i] <= s <= hi[i] or (i > 0 and not lo[i - 1] <= s - 1 <= hi[i - 1]):
                continue
            for j in range(i + 1, n + 1):
                if s < lo[j - 1]:
                    break  # lo is non-decreasing: no longer interval fits on stage s either
                if (j == n) != (s == S - 1) or (j < n and not lo[j] <= s + 1 <= hi[j]) or s > hi[j - 1]:
                    continue
                best = frontiers.best_stage(s, i, j)
                if best is not None and (tau is None or best[0] <= tau * (1 + 1e-9)):
                    # a hair under the exact value, so float rounding cannot put a floor above the
                    # time row it bounds (the rows hold no time under NEGLIGIBLE, which HiGHS would drop)
                    floor[i, j, s] = best[0] * (1 - 1e-9)
    if not floor:
        raise PlanError("no stage range fits the memory budget within the bound: the ILP has no plan")
    return floor, frontiers


def _fastest_fitting(
    P: PartitionProblem, frontiers: Frontiers, boundaries: Sequence[int], recompute: Sequence[str]
) -> list[str]:
    """Each stage's options, replaced by its interval's fastest option vector that fits exactly where
    that one is faster.

    The solver decides the memory rows within its feasibility tolerance, far coarser than a byte
    at these scales, so it may turn down a vector that fits to the byte (a plan exactly at the
    budget); the frontiers decide fitting exactly. Equal times keep the solver's choice, which
    also minimised recomputation.
    """
    out = list(recompute)
    for s in range(P.num_stages):
        i, j = boundaries[s], boundaries[s + 1]
        best = frontiers.best_stage(s, i, j)
        if best is None:
            continue
        mine = [OPTIONS.index(o) for o in out[i:j]]
        # the same tolerance can also accept a vector a few bytes over the budget: replace it too
        over = stage_figures(P, s, i, j, mine)[1] > P.memory_limit(s)
        mine_time = sum(P.time[b][o] for b, o in zip(range(i, j), mine))
        if over or best[0] - P.cut_time[i] - P.cut_time[j] < mine_time * (1 - 1e-9):
            out[i:j] = [OPTIONS[o] for o in frontiers.options(i, j, best[1])]
    return out


def _solve(prob, solver: str, time_limit: float | None, warm: bool, gap: float) -> str:
    import pulp

    s = make_solver(solver, time_limit=time_limit, gap=gap)
    if warm and isinstance(s, pulp.PULP_CBC_CMD):
        s.optionsDict["warmStart"] = True
    prob.solve(s)
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        # PuLP reports 'Optimal' for a solver stopped by its limits with a plan in hand; say which.
        return "Feasible (stopped at the time limit)"
    return pulp.LpStatus[prob.status]


def _read(w, n: int, S: int, opts: Sequence[int]) -> tuple[list[int], list[str]]:
    stage_of = [0] * n
    option = ["none"] * n
    for (i, s, o), var in w.items():
        if (var.value() or 0) > 0.5:
            stage_of[i] = s
            option[i] = OPTIONS[o]
    boundaries = [0] + [i for i in range(1, n) if stage_of[i] != stage_of[i - 1]] + [n]
    if len(boundaries) != S + 1 or any(stage_of[i] > stage_of[i + 1] for i in range(n - 1)):
        raise PlanError(f"internal error: the ILP returned stages {stage_of}, not {S} contiguous ones")
    return boundaries, option
