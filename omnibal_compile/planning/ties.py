"""A deterministic choice among plans whose predicted iteration times lie within the timing noise.

Torch-free. Profiled costs are noisy: two cost passes of the same model on a shared CPU differ by
several percent per block, while the plans a solver ranks first and second are often closer than
that (0.03-2% on the demo's reference VLM), so "the fastest plan" changes from run to run. With
``problem.tie_tolerance`` = tol > 0, :func:`break_ties` treats every plan predicted within
(1 + tol) T* of the least iteration time T* as equally fast and picks one by figures that do not
depend on timings:

    stage rule  a stage on blocks [i, j) takes, of the recompute option vectors that fit its memory
                and are within tol of the fastest one that fits, the one that keeps the most
                activation bytes (the least recomputation, measured in memory), then the fewest
                recomputed blocks, then the lexicographically least options (of identical blocks,
                the later recompute). Times only decide which vectors are candidates: the DP's
                frontiers built with slack tol (a vector is dropped only when one keeping no more
                activation is more than tol faster), so vectors whose times differ by noise all stay.
    key         of the cut points whose plan under the stage rule is predicted within (1 + tol) T*:
                the most even forward FLOPs (least sum of squared stage FLOPs), then the most even
                parameter counts, then the lexicographically earliest cut points. Exact integers.
    search      a DP over cut points whose states are Pareto-optimal in the iteration time's terms
                (sum and largest stage time and sync for GPipe/1F1B; every device's sums when
                interleaved) and ordered by the key, pruned by the bound: exact for the key.

The plan chosen is never predicted more than tol slower than the fastest. Two runs choose the
same plan unless their costs differ by more than the distance of some plan from the edge of the
tie set (nothing can remove that edge; a tolerance above the noise keeps the plans that compete
well inside it). tol = 0, the default of :class:`PartitionProblem`, leaves every solver's exact
optimum as it is; :func:`~omnibal_compile.planning.problem.tie_tolerance_for` gives measured costs
:data:`~omnibal_compile.planning.problem.PROFILED_TIE_TOLERANCE`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from omnibal_compile.planning.dp import Frontiers
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    Solution,
    evaluate,
    pipeline_time,
    stage_time_bound,
)

__all__ = ["MAX_STATES", "break_ties", "StageRule", "tie_key"]

MAX_STATES = 200_000
"""Partial plans the search may keep; beyond that it keeps the fastest plan and says so."""


class StageRule:
    """The stage rule (module docstring) for every stage and block range, cached."""

    def __init__(self, problem: PartitionProblem, max_time: float) -> None:
        self.problem = problem
        self.frontiers = Frontiers(problem, max_time=max_time, slack=problem.tie_tolerance)
        self._cache: dict[tuple[int, int, int], tuple[float, list[int]] | None] = {}

    def choose(self, s: int, i: int, j: int) -> tuple[float, list[int]] | None:
        """(T_s, option index per block) of stage ``s`` on [i, j), or None when nothing fits."""
        key = (s, i, j)
        if key not in self._cache:
            self._cache[key] = self._choose(s, i, j)
        return self._cache[key]

    def _choose(self, s: int, i: int, j: int) -> tuple[float, list[int]] | None:
        F, P = self.frontiers, self.problem
        if j - i > len(F.acts[i]):
            return None  # longer than any stage within the bound
        cap = F.capacity(s, i, j)
        if cap < 0:
            return None
        acts, times = F.acts[i][j - i - 1], F.times[i][j - i - 1]
        fits = np.flatnonzero(acts <= cap * (1 + 1e-12) + 1e-9)
        if not len(fits):
            return None
        near = fits[times[fits] <= times[fits].min() * (1 + P.tie_tolerance)]
        options = {int(k): F.options(i, j, int(k)) for k in near}
        k = min(options, key=lambda k: (-acts[k], sum(o != 0 for o in options[k]), options[k]))
        return float(times[k]) + P.cut_time[i] + P.cut_time[j], options[k]


def tie_key(problem: PartitionProblem, boundaries: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """The key the tie-break minimises: (sum of squared stage FLOPs, of squared stage parameters, cut points)."""
    P = problem
    stages = list(zip(boundaries, boundaries[1:]))
    flops = sum(int(round(sum(P.flops[i:j]))) ** 2 for i, j in stages)
    params = sum(int(sum(P.num_params[i:j])) ** 2 for i, j in stages)
    return flops, params, tuple(boundaries)


def break_ties(problem: PartitionProblem, best: Solution) -> Solution:
    """The plan the tie-break picks among those predicted within ``problem.tie_tolerance`` of ``best``.

    ``best``: the fastest plan found (the DP's or the ILP's). Returns ``best`` itself when the
    tolerance is 0; otherwise a plan evaluated by the shared accounting whose ``extra["tie_break"]``
    records the tolerance and how much slower than ``best`` it is predicted (0 when it is ``best``).
    """
    P = problem
    tol = P.tie_tolerance
    if tol <= 0:
        return best
    start = time.perf_counter()
    bound = best.iteration_time * (1 + tol) * (1 + 1e-12)
    rule = StageRule(P, stage_time_bound(P, bound) * (1 + 1e-9))
    found = _search(P, rule, bound)
    if found is None:  # too many partial plans: keep the fastest, and say so
        note = {"tolerance": tol, "skipped": f"more than {MAX_STATES:,} partial plans within the tolerance"}
        return dataclasses.replace(best, extra={**best.extra, "tie_break": note})
    options = [o for s in range(P.num_stages) for o in rule.choose(s, found[s], found[s + 1])[1]]  # type: ignore[index]
    sol = evaluate(P, found, [OPTIONS[o] for o in options], planner=best.planner, status=best.status,
                   solve_seconds=best.solve_seconds + time.perf_counter() - start, gap=best.gap)
    assert sol.feasible and sol.iteration_time <= bound * (1 + 1e-9), (sol, best)
    note = {
        "tolerance": tol,
        "fastest_s": best.iteration_time,
        "slower_by": sol.iteration_time / best.iteration_time - 1 if best.iteration_time > 0 else 0.0,
        "changed": (sol.boundaries, sol.recompute) != (best.boundaries, best.recompute),
    }
    return dataclasses.replace(sol, extra={**best.extra, "tie_break": note})


def _search(P: PartitionProblem, rule: StageRule, bound: float) -> tuple[int, ...] | None:
    """Boundaries of the least-key plan within ``bound`` (module docstring), or None past MAX_STATES."""
    n, S, M = P.n, P.num_stages, P.num_microbatches
    interleaved = P.schedule == "interleaved"
    p = P.num_devices if interleaved else 1
    c = (p - 1) / (p * P.virtual_stages)
    sync = np.concatenate(([0.0], np.cumsum(P.sync or (0.0,) * n)))
    flops = np.concatenate(([0], np.cumsum([int(round(f)) for f in P.flops], dtype=object)))
    params = np.concatenate(([0], np.cumsum([int(x) for x in P.num_params], dtype=object)))
    fastest = [min(P.time[b][o] for o in P.option_indices()) for b in range(n)]
    rest = np.concatenate((np.cumsum(fastest[::-1])[::-1], [0.0]))  # least work of blocks j..n-1

    # A state's terms: (sum of stage times, then per device: largest time (1F1B) or sum (interleaved),
    # then largest sync); the iteration time is increasing in each, so Pareto states lose no plan.
    def objective(t: tuple[float, ...], extra_work: float = 0.0) -> float:
        if interleaved:
            return M * max(t[1 : 1 + p]) + c * (t[0] + extra_work) + max(t[1 + p :])
        return pipeline_time(P, t[0] + extra_work, t[1]) + t[2]

    def extend(t: tuple[float, ...], s: int, T: float, D: float) -> tuple[float, ...]:
        if interleaved:
            d = s % p
            dev, dsync = list(t[1 : 1 + p]), list(t[1 + p :])
            dev[d] += T
            dsync[d] += D
            return (t[0] + T, *dev, *dsync)
        return (t[0] + T, max(t[1], T), max(t[2], D))

    zero = (0.0,) * (1 + 2 * p)
    Key = tuple[int, int, tuple[int, ...]]
    states: list[list[list[tuple[Key, tuple[float, ...]]]]] = [[[] for _ in range(n + 1)] for _ in range(S + 1)]
    states[0][0] = [((0, 0, ()), zero)]
    kept = 0
    for s in range(S):
        for j in range(s + 1, n - (S - s - 1) + 1):
            cands = []
            for i in range(s, j):
                if not states[s][i]:
                    continue
                chosen = rule.choose(s, i, j)
                if chosen is None:
                    continue
                T, D = chosen[0], float(sync[j] - sync[i])
                f2, p2 = (flops[j] - flops[i]) ** 2, (params[j] - params[i]) ** 2
                for key, terms in states[s][i]:
                    new = extend(terms, s, T, D)
                    if objective(new, float(rest[j])) <= bound:
                        cands.append(((key[0] + f2, key[1] + p2, (*key[2], i)), new))
            cands.sort(key=lambda cand: cand[0])
            front: list[tuple[Key, tuple[float, ...]]] = []
            for key, terms in cands:  # by key: drop a state when one no worse in key is no worse in every term
                if not any(all(a <= b for a, b in zip(f, terms)) for _, f in front):
                    front.append((key, terms))
            states[s + 1][j] = front
            kept += len(front)
            if kept > MAX_STATES:
                return None
    final = states[S][n]
    assert final, "the fastest plan lies within the bound"
    return (*final[0][0][2], n)


def describe(note: dict) -> str:
    """The tie-break note of a solution (``extra["tie_break"]``) in one sentence, for plan summaries."""
    tol = f"{note['tolerance']:.1%}"
    if "skipped" in note:
        return f"not applied ({note['skipped']}); the fastest plan as predicted was kept"
    which = f"{note['slower_by']:.2%} slower than the fastest" if note["changed"] else "also the fastest"
    return f"plans within {tol} of the fastest count as equal (timing noise); this one, the most even, is {which}"
