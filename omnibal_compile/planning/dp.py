"""Exact dynamic program for the joint problem (GPipe and 1F1B), the ILP's oracle and upper bound.

Two facts make it exact:
1. Given a stage's block range, its best recompute choice is independent of other stages: the
   objective sum_s T_s + (M - 1) max_s T_s grows with every T_s and memory is per stage. So each
   stage takes the fastest option vector whose activations fit its capacity
   (budget - static - receive buffer) / k_s: a multiple-choice knapsack, solved exactly from the
   Pareto frontier of (activation bytes, time) over the range's option vectors.
2. Over cut points, the objective is monotone in (sum, max) of stage times, so keeping the Pareto
   set of (sum, max) for every prefix (s stages covering blocks [0, j)) loses no optimum. With data
   parallelism the objective adds D, the largest stage's once-per-iteration communication, so the
   Pareto set is over (sum, max, D); without it D = 0 and the set is the 2-D one.
Interleaved schedules couple non-adjacent stages on one device, so the DP is not exact for them;
``interleaved_incumbent`` uses it for a good starting plan and bound, and the ILP proves or improves it.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from omnibal_compile.errors import PlanError
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    Solution,
    evaluate,
    in_flight,
    pipeline_time,
    stage_io,
    stage_shared,
    stage_time_bound,
    stage_transient,
)

__all__ = ["solve_dp", "interleaved_incumbent", "Frontiers"]


class Frontiers:
    """Pareto frontiers of (activation bytes, time) for every block range [i, j).

    Built left to right: the frontier of [i, j + 1) is the pruned union of the frontier of [i, j)
    shifted by each option of block j (numpy; a point survives if no other is both smaller and faster).
    """

    def __init__(self, problem: PartitionProblem, *, max_time: float = math.inf, slack: float = 0.0) -> None:
        """``max_time``: ranges whose fastest time exceeds it can never be a stage; they are not built.

        ``slack`` > 0 keeps near-optimal points too (for :mod:`omnibal_compile.planning.ties`): a point
        is dropped only when one with no more activation is more than ``slack`` (relative) faster,
        or when it repeats an earlier point exactly. Times then need not fall along a frontier.
        """
        self.problem = problem
        self.prefix_static = [0.0]
        for w in problem.static:
            self.prefix_static.append(self.prefix_static[-1] + w)
        self.in_flight = [in_flight(problem, s) for s in range(problem.num_stages)]
        self.budget = [problem.memory_limit(s) for s in range(problem.num_stages)]
        n = problem.n
        opts = [np.array(problem.useful_options(b)) for b in range(n)]  # dominated options never help
        fastest = [min(problem.time[b][o] for o in opts[b]) for b in range(n)]
        act = [np.asarray(problem.act[b], dtype=np.float64)[opts[b]] for b in range(n)]
        tim = [np.asarray(problem.time[b], dtype=np.float64)[opts[b]] for b in range(n)]
        grid = 1e9 / max(sum(fastest), 1e-300)
        self.acts: list[list[np.ndarray]] = []
        self.times: list[list[np.ndarray]] = []
        self.back: list[list[tuple[np.ndarray, np.ndarray]]] = []
        for i in range(n):
            acts_i, times_i, back_i = [], [], []
            pa, pt = np.zeros(1), np.zeros(1)
            work = 0.0
            for j in range(i, n):
                work += fastest[j]
                if work > max_time * (1 + 1e-9) and j > i:
                    break
                m = len(pa)
                ca = (pa[None, :] + act[j][:, None]).ravel()  # option-major: [o * m + k]
                ct = (pt[None, :] + tim[j][:, None]).ravel()
                # Slack: times on a grid of 1e-9 of the total work, so that sums of the same times
                # in another order (the same vectors of identical blocks, permuted) sort and repeat
                # alike whatever their last bits; lexsort is stable, so the first built is kept.
                qt = np.round(ct * grid) if slack > 0 else ct
                order = np.lexsort((qt, ca))
                ca, ct, qt = ca[order], ct[order], qt[order]
                prev_best = np.minimum.accumulate(np.concatenate(([np.inf], ct[:-1])))
                if slack > 0:  # within slack of every point with no more activation, and no repeat
                    repeat = np.concatenate(([False], (ca[1:] == ca[:-1]) & (qt[1:] == qt[:-1])))
                    keep = (ct * (1 - slack) <= prev_best) & ~repeat
                else:  # keep strictly faster than every point with no more activation
                    keep = ct < prev_best - 1e-15 * np.maximum(1.0, np.abs(ct))
                sel = order[keep]
                pa, pt = ca[keep], ct[keep]
                acts_i.append(pa)
                times_i.append(pt)
                back_i.append((sel % m, opts[j][sel // m]))
            self.acts.append(acts_i)
            self.times.append(times_i)
            self.back.append(back_i)

    def fastest_within(self, i: int, j: int, cap: float) -> int | None:
        """Index of the fastest frontier point of [i, j) with activations <= cap, or None."""
        if j - i > len(self.acts[i]):
            return None  # longer than any stage can be
        acts = self.acts[i][j - i - 1]
        k = int(np.searchsorted(acts, cap * (1 + 1e-12) + 1e-9, side="right")) - 1
        return k if k >= 0 else None

    def best_stage(self, s: int, i: int, j: int) -> tuple[float, int] | None:
        """(T_s, frontier point) of stage ``s`` running [i, j) with its fastest option vector that fits
        its memory (budget - static - receive buffer, shared by k_s micro-batches), or None."""
        P = self.problem
        cap = self.capacity(s, i, j)
        k = self.fastest_within(i, j, cap) if cap >= 0 else None
        if k is None:
            return None
        return float(self.times[i][j - i - 1][k]) + P.cut_time[i] + P.cut_time[j], k

    def capacity(self, s: int, i: int, j: int) -> float:
        """Activation bytes per micro-batch stage ``s`` can keep on [i, j): (budget - static - transient
        - receive buffer - outputs held) / k_s; negative when even no activations fit."""
        P = self.problem
        fixed = (self.prefix_static[j] - self.prefix_static[i] - stage_shared(P, i, j) + stage_transient(P, i, j)
                 + stage_io(P, s, i, j))
        return (self.budget[s] - fixed) / self.in_flight[s]

    def options(self, i: int, j: int, k: int) -> list[int]:
        """Option index of every block of [i, j) at frontier point k."""
        out = []
        for jj in range(j, i, -1):
            parents, options = self.back[i][jj - i - 1]
            out.append(int(options[k]))
            k = int(parents[k])
        return out[::-1]


def solve_dp(problem: PartitionProblem, *, frontiers: Frontiers | None = None) -> Solution:
    """Exact optimum of the joint problem for GPipe / 1F1B; raises PlanError when nothing fits."""
    if problem.schedule == "interleaved":
        raise PlanError("the dynamic program handles gpipe and 1f1b; use the ILP for interleaved schedules")
    start = time.perf_counter()
    P = problem
    if frontiers is None:
        frontiers = Frontiers(P, max_time=_max_stage_time(P))
    states = _pareto_states(P, frontiers)
    final = states[-1][P.n]
    best = min(range(len(final)), key=lambda q: pipeline_time(P, final[q][0], final[q][1]) + final[q][2])
    boundaries, opts = _plan_of(P, frontiers, states, best)
    return evaluate(
        P, boundaries, [OPTIONS[o] for o in opts], planner="dp", status="optimal",
        solve_seconds=time.perf_counter() - start, gap=0.0,
    )


def interleaved_incumbent(problem: PartitionProblem) -> Solution:
    """A good plan for the interleaved schedule, not proven optimal (a start and bound for the ILP).

    Stages of one device are not adjacent, so the DP's state cannot carry device times. It keeps
    every plan that is Pareto-optimal in (sum, max) of stage times, with each stage's recompute
    chosen for its own interleaved in-flight count and budget, and returns the one whose
    interleaved iteration time is least. Raises PlanError when nothing fits.
    """
    start = time.perf_counter()
    P = problem
    F = Frontiers(P, max_time=_max_stage_time(P))
    states = _pareto_states(P, F)
    best: Solution | None = None
    for q in range(len(states[-1][P.n])):
        boundaries, opts = _plan_of(P, F, states, q)
        sol = evaluate(P, boundaries, [OPTIONS[o] for o in opts], planner="dp-incumbent", status="heuristic")
        if best is None or sol.iteration_time < best.iteration_time:
            best = sol
    assert best is not None  # _pareto_states raised if nothing fits
    return dataclasses.replace(best, solve_seconds=time.perf_counter() - start)


def _max_stage_time(P: PartitionProblem) -> float:
    """An upper bound on any stage's time in an optimal plan, from a quick baseline (inf if none fits)."""
    from omnibal_compile.planning.baselines import BASELINES

    feasible = [b.iteration_time for b in (BASELINES[name](P) for name in ("flops", "parameters")) if b.feasible]
    return stage_time_bound(P, min(feasible)) if feasible else math.inf


State = tuple[float, float, float, int, int, int]
"""(sum of stage times, max stage time, max stage sync D, start block i of the last stage, parent state, frontier
point)."""


def _pareto_states(P: PartitionProblem, F: Frontiers) -> list[list[list[State]]]:
    """states[s][j]: the Pareto set of (sum, max, D) over plans of blocks [0, j) in s stages."""
    n, S = P.n, P.num_stages
    sync = [0.0]
    for d in P.sync or (0.0,) * n:
        sync.append(sync[-1] + d)
    states: list[list[list[State]]] = [[[] for _ in range(n + 1)] for _ in range(S + 1)]
    states[0][0] = [(0.0, 0.0, 0.0, -1, -1, -1)]
    for s in range(S):
        for j in range(s + 1, n - (S - s - 1) + 1):
            cands = []
            for i in range(s, j):
                prev = states[s][i]
                best = F.best_stage(s, i, j) if prev else None
                if best is None:
                    continue
                T, k = best
                D = sync[j] - sync[i]
                for idx, (sm, mx, dmx, _, _, _) in enumerate(prev):
                    cands.append((sm + T, max(mx, T), max(dmx, D), i, idx, k))
            if not cands:
                continue
            cands.sort(key=lambda c: (c[1], c[0], c[2]))
            front: list[State] = []
            for c in cands:  # sorted by max: keep c unless a kept state is no worse in sum and D too
                tol = 1e-15 * max(1.0, abs(c[0]))
                if not P.sync:  # D = 0 everywhere: kept sums fall, so the last kept one decides
                    if front and c[0] >= front[-1][0] - tol:
                        continue
                elif any(f[0] <= c[0] + tol and f[2] <= c[2] for f in front):
                    continue
                front.append(c)
            states[s + 1][j] = front
    if not states[S][n]:
        raise PlanError("no partition fits the memory budget")  # explained by planner.explain_infeasible
    return states


def _plan_of(P: PartitionProblem, F: Frontiers, states: list[list[list[State]]], q: int) -> tuple[list[int], list[int]]:
    """(boundaries, option per block) of final state q."""
    boundaries = [P.n]
    opts: list[int] = []
    s, j = P.num_stages, P.n
    while s > 0:
        _, _, _, i, parent, k = states[s][j][q]
        opts = F.options(i, j, k) + opts
        boundaries.append(i)
        s, j, q = s - 1, i, parent
    return boundaries[::-1], opts
