"""Interleaved 1F1B with two chunks per device: the least bottleneck, exactly, and a proven bound.

Torch-free. With p devices and v = 2 chunks, stage d (first chunk) and stage p + d (second chunk)
run on device d. The chain [0, n) is cut at m = b_p into two halves of p stages each; device d
runs [b_d, b_{d+1}) of the first half and [b_{p+d}, b_{p+d+1}) of the second. Its time is
L_d = T(d, b_d, b_{d+1}) + T(p + d, b_{p+d}, b_{p+d+1}), where T(s, i, j) is stage s's least
time on blocks [i, j) within its memory (the DP's frontiers: exact, since stages are independent
given their cut points). The objective (solver.problem) is

    M max_d L_d + c sum_d L_d,   c = (p - 1) / (p v).

The first term dominates (M >= p), and no per-stage quantity sees it: the pairing of a first-half
stage with a second-half stage is what an LP relaxation loses (the path-formulation ILP's root
bound was 6% below the optimum on InternVL 6+34B, 16 devices x 2 chunks, and branching did not
close it in 90 s). Here:

    decision   "is there a plan with every L_d <= tau?" is a reachability DP over devices d with
               state (m, b_d, b_{p+d}): from (m, 0, m) at d = 0 to (m, m, n) at d = p; numpy over
               the box of states reached so far, O(p x box x L^2) for intervals of <= L blocks;
    bottleneck a search on tau between the average bound and the best plan's bottleneck (galloping
               down from it, then bisecting), jumping down to each plan's actual bottleneck,
               brackets the least bottleneck tau* to a relative tolerance; every plan found is
               polished by a local search over its cut points;
    bound      any plan has max_d L_d >= tau_lo (the largest tau found infeasible) and
               sum_d L_d >= Sigma_min (a chain DP over the same intervals), so
               M tau_lo + c Sigma_min is a lower bound; the plans found are evaluated exactly.

Data-parallel sync terms (D) and v != 2 are left to the ILP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from omnibal_compile.planning.dp import Frontiers
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    Solution,
    evaluate,
    stage_shared,
    stage_transient,
)

__all__ = ["TwoChunkResult", "two_chunk_search", "applies"]

def applies(problem: PartitionProblem) -> bool:
    """Whether :func:`two_chunk_search` handles ``problem`` (interleaved, two chunks, no data-parallel terms)."""
    return problem.schedule == "interleaved" and problem.virtual_stages == 2 and not problem.sync


@dataclass(frozen=True, kw_only=True)
class TwoChunkResult:
    """The best plan found and what is proven about it."""

    solution: Solution
    """The best plan found (exact accounting of :func:`evaluate`)."""
    lower_bound: float
    """No plan's iteration time is below this."""
    bottleneck: float
    """Least largest device time found feasible (tau*, to the bisection tolerance)."""
    decisions: int
    """Reachability DPs run."""

    @property
    def gap(self) -> float:
        """Proven relative gap (iteration time - bound) / iteration time."""
        it = self.solution.iteration_time
        return max(0.0, (it - self.lower_bound) / it) if it > 0 else 0.0


class _Intervals:
    """T[s, a, i]: least time of stage s on [i, i + a) (inf when it does not fit or is too slow).

    The same choice as :meth:`Frontiers.best_stage`, for every stage at once per interval.
    """

    def __init__(self, problem: PartitionProblem, max_time: float) -> None:
        P = problem
        self.frontiers = F = Frontiers(P, max_time=max_time)
        n, S = P.n, P.num_stages
        self.L = L = max((len(a) for a in F.acts), default=1)
        self.T = np.full((S, L + 1, n + 1), np.inf)
        self.point = np.full((S, L + 1, n + 1), -1, dtype=np.int64)
        budget = np.array(F.budget)
        in_flight = np.array(F.in_flight)
        for i in range(n):
            for a in range(1, min(len(F.acts[i]), n - i) + 1):
                j = i + a
                # Frontiers.best_stage's memory for every stage at once (stage_io's k_s differs by stage)
                fixed = (
                    F.prefix_static[j]
                    - F.prefix_static[i]
                    - stage_shared(P, i, j)
                    + stage_transient(P, i, j)
                    + (P.cut_bytes[i] if i > 0 else 0)
                )
                out = in_flight * (P.cut_bytes[j] if j < n else 0)
                cap = (budget - fixed - out) / in_flight
                acts = F.acts[i][a - 1]
                k = np.searchsorted(acts, cap * (1 + 1e-12) + 1e-9, side="right") - 1
                ok = (cap >= 0) & (k >= 0)
                t = F.times[i][a - 1][np.maximum(k, 0)] + P.cut_time[i] + P.cut_time[j]
                ok &= t <= max_time * (1 + 1e-9)
                self.T[ok, a, i] = t[ok]
                self.point[ok, a, i] = k[ok]

    def options(self, s: int, i: int, j: int) -> list[int]:
        return self.frontiers.options(i, j, int(self.point[s, j - i, i]))

    def plan(self, P: PartitionProblem, bounds: list[int]) -> Solution:
        """The plan with these cut points, each stage at its least time (exact accounting)."""
        opts: list[int] = []
        for s in range(P.num_stages):
            opts += self.options(s, bounds[s], bounds[s + 1])
        return evaluate(P, bounds, [OPTIONS[o] for o in opts], planner="ilp")


def _least_sum(P: PartitionProblem, iv: _Intervals) -> float:
    """Sigma_min: least sum of stage times over every cut path (chain DP)."""
    n, S, L = P.n, P.num_stages, iv.L
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for s in range(S):
        nxt = np.full(n + 1, np.inf)
        for a in range(1, L + 1):
            cand = best[: n + 1 - a] + iv.T[s, a, : n + 1 - a]
            np.minimum(nxt[a:], cand, out=nxt[a:])
        best = nxt
    return float(best[n])


def _reachable(P: PartitionProblem, iv: _Intervals, tau: float) -> list[np.ndarray] | None:
    """R[d][m, i, j]: after devices 0..d-1, the halves can stand at i (first) and j (second) with every
    device time <= tau, for split point m. None when no plan has every device time <= tau."""
    n, p, L = P.n, P.num_devices, iv.L
    fast = np.concatenate(([0.0], np.cumsum([min(P.time[b][o] for o in P.option_indices()) for b in range(n)])))
    R = np.zeros((n + 1, n + 1, n + 1), dtype=bool)
    ms = np.arange(p, n - p + 1)
    R[ms, 0, ms] = True
    history = [R]
    for d in range(p):
        mm, ii, jj = (np.flatnonzero(R.any(axis=ax)) for ax in ((1, 2), (0, 2), (0, 1)))
        if not len(mm):
            return None
        m0, m1, i0, i1, j0, j1 = mm[0], mm[-1] + 1, ii[0], ii[-1] + 1, jj[0], jj[-1] + 1
        src = R[m0:m1, i0:i1, j0:j1]
        nxt = np.zeros_like(R)
        for a in range(1, L + 1):
            A = iv.T[d, a, i0:i1]
            if i0 + a > n or not np.isfinite(A).any():
                continue
            ia = min(i1, n + 1 - a) - i0  # source rows whose end stays inside the chain
            for b in range(1, L + 1):
                jb = min(j1, n + 1 - b) - j0
                if jb <= 0:
                    continue
                fits = (A[:ia, None] + iv.T[p + d, b, j0 : j0 + jb][None, :]) <= tau
                if not fits.any():
                    continue
                nxt[m0:m1, i0 + a : i0 + a + ia, j0 + b : j0 + b + jb] |= src[:, :ia, :jb] & fits[None]
        # Keep only states whose remaining blocks can still fit the remaining devices: their
        # fastest work fast[i, m) + fast[j, n) within (p - d - 1) tau, and a block per stage.
        left = p - d - 1
        hi_i, hi_j = min(i1 + L, n + 1), min(j1 + L, n + 1)
        box = nxt[m0:m1, i0:hi_i, j0:hi_j]
        m_, i_, j_ = np.arange(m0, m1), np.arange(i0, hi_i), np.arange(j0, hi_j)
        rest = (fast[m_][:, None, None] - fast[i_][None, :, None]) + (fast[n] - fast[j_])[None, None, :]
        box &= rest <= left * tau * (1 + 1e-9)
        box &= (m_[:, None, None] - i_[None, :, None] >= left) & (n - j_ >= left)[None, None, :]
        R = nxt
        history.append(R)
    if not R[ms, ms, n].any():
        return None
    return history


def _plan(P: PartitionProblem, iv: _Intervals, tau: float, history: list[np.ndarray]) -> Solution:
    """A plan with every device time <= tau, read back from the reachability sets."""
    n, p, L = P.n, P.num_devices, iv.L
    ms = [m for m in range(p, n - p + 1) if history[p][m, m, n]]
    m = ms[0]
    first, second = [m], [n]
    i, j = m, n
    for d in range(p - 1, -1, -1):
        done = False
        for a in range(1, min(L, i) + 1):
            for b in range(1, min(L, j) + 1):
                if history[d][m, i - a, j - b] and iv.T[d, a, i - a] + iv.T[p + d, b, j - b] <= tau:
                    i, j, done = i - a, j - b, True
                    break
            if done:
                break
        assert done, "reachability sets are inconsistent"
        first.append(i)
        second.append(j)
    return iv.plan(P, first[::-1] + second[::-1][1:])


def _polish(P: PartitionProblem, iv: _Intervals, bounds: list[int]) -> list[int]:
    """Local search: shift any run of consecutive cut points by one block while that lowers
    (iteration time, sum of squared device times); the stage times come from the interval table."""
    S, p, M = P.num_stages, P.num_devices, P.num_microbatches
    c = (p - 1) / (p * P.virtual_stages)

    def score(b: list[int]) -> tuple[float, float]:
        if any(x >= y or y - x > iv.L for x, y in zip(b, b[1:])):
            return (math.inf, math.inf)
        t = [iv.T[s, b[s + 1] - b[s], b[s]] for s in range(S)]
        if not all(math.isfinite(x) for x in t):  # a stage that fits no option (inf), and c may be 0: no 0 x inf
            return (math.inf, math.inf)
        dev = [sum(t[d::p]) for d in range(p)]
        return (M * max(dev) + c * sum(t), sum(x * x for x in dev))

    best = score(bounds)
    improved = True
    while improved:
        improved = False
        for k in range(1, S):
            for last in range(k, S):
                for delta in (1, -1):
                    cand = bounds[:k] + [x + delta for x in bounds[k : last + 1]] + bounds[last + 1 :]
                    sc = score(cand)
                    if sc < best:
                        bounds, best, improved = cand, sc, True
    return bounds


def _device_max(P: PartitionProblem, sol: Solution) -> float:
    p = P.num_devices
    return max(sol.stage_time[d] + sol.stage_time[p + d] for d in range(p))


def two_chunk_search(
    problem: PartitionProblem, incumbent: Solution, *, tolerance: float = 1e-4, time_limit: float | None = None
) -> TwoChunkResult:
    """The least-bottleneck plan of ``problem`` (see the module docstring) and a proven lower bound.

    ``incumbent``: any feasible plan; its iteration time bounds which intervals are built.
    ``tolerance``: relative width of the bracket on the least bottleneck at which the search stops.
    """
    if not applies(problem):
        raise ValueError("two_chunk_search handles interleaved schedules with 2 chunks per device and no dp terms")
    start = time.perf_counter()
    P = problem
    p, M = P.num_devices, P.num_microbatches
    c = (p - 1) / (p * P.virtual_stages)
    work = sum(min(P.time[i][o] for o in P.option_indices()) for i in range(P.n))
    # A plan better than the incumbent has every device (hence every stage) time below this.
    cap = (incumbent.iteration_time - c * work) / M * (1 + 1e-9)
    iv = _Intervals(P, cap)
    sigma = _least_sum(P, iv)
    best = incumbent
    polished = iv.plan(P, _polish(P, iv, list(incumbent.boundaries)))
    if polished.feasible and polished.iteration_time < best.iteration_time:
        best = polished
    lo, hi = sigma / p * (1 - 1e-12), min(cap, _device_max(P, best))
    decisions = 0
    step = tolerance
    while hi - lo > tolerance * hi:
        if time_limit is not None and time.perf_counter() - start > time_limit:
            break
        # Gallop down from the best bottleneck (a polished plan is usually within a percent of the
        # least), then bisect: most decisions land close to tau*.
        tau = max((lo + hi) / 2, hi * (1 - step)) if step else (lo + hi) / 2
        step *= 4
        history = _reachable(P, iv, tau)
        decisions += 1
        if history is None:
            lo = tau
            step = 0.0  # bisect from now on
            continue
        sol = _plan(P, iv, tau, history)
        sol = iv.plan(P, _polish(P, iv, list(sol.boundaries)))
        if sol.feasible and sol.iteration_time < best.iteration_time:
            best = sol
        hi = min(hi, _device_max(P, sol))
    bound = min(M * lo + c * sigma, best.iteration_time)
    return TwoChunkResult(solution=best, lower_bound=bound, bottleneck=hi, decisions=decisions)
