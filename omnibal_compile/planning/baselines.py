"""Baseline planners with the same signature as the ILP: ``planner(problem) -> Solution``.

Glossary:
    uniform     equal numbers of layer blocks per stage (Megatron / torchtitan default); other
                blocks ride with the layer before them (or the first layer, if they lead).
    parameters  contiguous split minimising the largest stage parameter count (DeepSpeed).
    flops       the same, balancing forward FLOPs.
    omnibal     OmniBal's heuristic (paper, Sec. 3.2): a greedy anchor partition by time, then
                every partition whose cuts lie within ``radius`` of the anchor's, ranked by the
                spread (max - min) of stage times; recomputation set per stage afterwards.
Baselines that only choose cut points set recomputation the way users do: the least option
(none < selective < full) that fits, for all stages at once (``uniform_recompute``) or per stage.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

from omnibal_compile.errors import PlanError
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    Solution,
    evaluate,
    in_flight,
    stage_io,
    stage_static,
)

__all__ = [
    "min_max_partition",
    "uniform_boundaries",
    "uniform",
    "parameters",
    "flops",
    "omnibal",
    "BASELINES",
    "least_recompute",
]


def min_max_partition(weights: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """Exact contiguous split of ``weights`` into ``num_stages`` non-empty parts minimising the max sum.

    Returns (boundaries, max part sum). O(n^2 S) dynamic programming; ties prefer earlier cuts.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot split {n} blocks into {num_stages} non-empty stages")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=np.float64))))
    inf = float("inf")
    best = np.full((num_stages + 1, n + 1), inf)
    arg = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            j = np.arange(s - 1, i)
            cand = np.maximum(best[s - 1, j], prefix[i] - prefix[j])
            k = int(np.argmin(cand))
            best[s, i], arg[s, i] = cand[k], j[k]
    boundaries = [n]
    for s in range(num_stages, 0, -1):
        boundaries.append(int(arg[s, boundaries[-1]]))
    return boundaries[::-1], float(best[num_stages, n])


def uniform_boundaries(kinds: Sequence[str], num_stages: int) -> list[int]:
    """Cut points giving each stage an equal number of ``layer`` blocks (the first take the remainder)."""
    n = len(kinds)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot split {n} blocks into {num_stages} non-empty stages")
    layers = [i for i, k in enumerate(kinds) if k == "layer"] or list(range(n))
    if len(layers) < num_stages:
        raise PlanError(
            f"uniform planner needs at least num_stages={num_stages} layer blocks, the model has {len(layers)}; "
            "use planner='parameters' or fewer stages"
        )
    per, extra = divmod(len(layers), num_stages)
    boundaries, first = [0], 0
    for s in range(num_stages - 1):
        first += per + (1 if s < extra else 0)
        boundaries.append(layers[first])
    boundaries.append(n)
    return boundaries


def least_recompute(problem: PartitionProblem, boundaries: Sequence[int], *, per_stage: bool) -> list[str]:
    """The least recompute option that fits: one for the whole model, or one per stage."""
    allowed = [o for o in OPTIONS if o in problem.allowed]

    def fits(s: int, option: str) -> bool:
        i, j = boundaries[s], boundaries[s + 1]
        o = OPTIONS.index(option)
        mem = (
            stage_static(problem, i, j)
            + in_flight(problem, s) * sum(problem.act[b][o] for b in range(i, j))
            + stage_io(problem, s, i, j)
        )
        return mem <= problem.memory_limit(s)

    S = problem.num_stages
    if per_stage:
        choice = []
        for s in range(S):
            option = next((o for o in allowed if fits(s, o)), allowed[-1])
            choice.extend([option] * (boundaries[s + 1] - boundaries[s]))
        return choice
    option = next((o for o in allowed if all(fits(s, o) for s in range(S))), allowed[-1])
    return [option] * problem.n


def _finish(problem: PartitionProblem, boundaries: Sequence[int], name: str, start: float, per_stage: bool) -> Solution:
    recompute = least_recompute(problem, boundaries, per_stage=per_stage)
    return evaluate(
        problem, boundaries, recompute, planner=name, status="heuristic", solve_seconds=time.perf_counter() - start
    )


def uniform(problem: PartitionProblem) -> Solution:
    start = time.perf_counter()
    return _finish(problem, uniform_boundaries(problem.kinds, problem.num_stages), "uniform", start, False)


def parameters(problem: PartitionProblem) -> Solution:
    start = time.perf_counter()
    b, _ = min_max_partition(problem.num_params, problem.num_stages)
    return _finish(problem, b, "parameters", start, False)


def flops(problem: PartitionProblem) -> Solution:
    start = time.perf_counter()
    b, _ = min_max_partition(problem.flops, problem.num_stages)
    return _finish(problem, b, "flops", start, False)


def omnibal(problem: PartitionProblem, *, radius: int = 2, max_candidates: int = 200_000) -> Solution:
    """OmniBal's anchor-and-search partition, costed by this problem's times instead of profiling runs."""
    start = time.perf_counter()
    P = problem
    n, S = P.n, P.num_stages
    t = np.array([row[0] for row in P.time])  # recomputation is chosen afterwards, per stage
    if S == 1:
        return _finish(P, [0, n], "omnibal", start, True)
    # Greedy anchor: close a stage once it reaches the average load.
    target = t.sum() / S
    anchor, acc = [0], 0.0
    for i in range(n):
        must_cut = n - i == S - len(anchor)  # exactly one block left per remaining stage
        if len(anchor) < S and i > anchor[-1] and (acc + t[i] / 2 > target or must_cut):
            anchor.append(i)
            acc = 0.0
        acc += t[i]
    anchor.append(n)
    while radius > 0 and (2 * radius + 1) ** (S - 1) > max_candidates:
        radius -= 1
    prefix = np.concatenate(([0.0], np.cumsum(t)))
    cut_time = np.asarray(P.cut_time)
    offsets = np.array(list(itertools.product(range(-radius, radius + 1), repeat=S - 1)), dtype=np.int64).reshape(
        -1, S - 1
    )
    inner = np.asarray(anchor[1:-1])[None, :] + offsets
    cands = np.concatenate([np.zeros((len(inner), 1), np.int64), inner, np.full((len(inner), 1), n, np.int64)], axis=1)
    ok = np.all(np.diff(cands, axis=1) > 0, axis=1)
    cands = cands[ok]
    stage = prefix[cands[:, 1:]] - prefix[cands[:, :-1]] + cut_time[cands[:, 1:]] + cut_time[cands[:, :-1]]
    spread = stage.max(axis=1) - stage.min(axis=1)
    best = int(np.lexsort((stage.max(axis=1), spread))[0])
    sol = _finish(P, cands[best].tolist(), "omnibal", start, True)
    return sol


BASELINES = {"uniform": uniform, "parameters": parameters, "flops": flops, "omnibal": omnibal}
"""Baselines by name; each ``(problem) -> Solution``."""
