"""Why no plan fits: the stage that cannot fit, by how much, and the smallest budget that works.

The least memory any plan can use comes from the most memory-saving allowed option on every block
and a contiguous split minimising the largest stage's memory relative to its share of the device
(an exact min-max dynamic program; stage memory depends on the stage's position via k_s).
"""

from __future__ import annotations

import numpy as np

from omnibal_compile._utils.tables import counted
from omnibal_compile._utils.units import format_size
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    in_flight,
    stage_io,
    stage_shared,
    stage_static,
)

__all__ = ["least_memory_split", "explain_infeasible"]


def least_memory_split(problem: PartitionProblem) -> tuple[list[int], list[float], float]:
    """(boundaries, stage memory, smallest per-device budget) of the least-memory plan."""
    P = problem
    n, S, v = P.n, P.num_stages, P.virtual_stages
    least = min((OPTIONS.index(o) for o in P.allowed), key=lambda o: sum(a[o] for a in P.act))
    act = np.concatenate(([0.0], np.cumsum([a[least] for a in P.act])))
    static = np.concatenate(([0.0], np.cumsum(P.static, dtype=np.float64)))
    recv = np.asarray([P.cut_bytes[i] if i > 0 else 0 for i in range(n + 1)], dtype=np.float64)
    # Device budget needed by stage s on [i, j): v chunks share a device, each gets budget / v.
    best = np.full((S + 1, n + 1), np.inf)
    arg = np.zeros((S + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(S):
        k = in_flight(P, s)
        for j in range(s + 1, n - (S - s - 1) + 1):
            i = np.arange(s, j)
            transient = _suffix_max(P.gathered, s, j) + _suffix_max(
                P.workspace, s, j
            )  # stage_transient(P, i, j) for each i
            out = k * P.cut_bytes[j] if j < n else 0.0  # outputs held per micro-batch in flight (stage_io)
            shared = np.asarray([stage_shared(P, int(a), j) for a in i]) if P.shared else 0.0
            need = v * (static[j] - static[i] - shared + transient + k * (act[j] - act[i]) + recv[i] + out)
            cand = np.maximum(best[s, i], need)
            q = int(np.argmin(cand))
            best[s + 1, j], arg[s + 1, j] = cand[q], i[q]
    boundaries = [n]
    for s in range(S, 0, -1):
        boundaries.append(int(arg[s, boundaries[-1]]))
    boundaries = boundaries[::-1]
    mems = [
        float(
            stage_static(P, boundaries[s], boundaries[s + 1])
            + in_flight(P, s) * (act[boundaries[s + 1]] - act[boundaries[s]])
            + stage_io(P, s, boundaries[s], boundaries[s + 1])
        )
        for s in range(S)
    ]
    return boundaries, mems, float(best[S, n])


def _suffix_max(values: tuple[float, ...], s: int, j: int) -> np.ndarray:
    """max(values[i:j]) for i = s..j-1 (zeros when ``values`` is empty)."""
    return np.maximum.accumulate(np.asarray(values[s:j] or [0.0] * (j - s), dtype=np.float64)[::-1])[::-1]


def explain_infeasible(problem: PartitionProblem) -> str:
    """A message naming the stage that cannot fit, the overflow, and the smallest budget that fits."""
    P = problem
    boundaries, mems, needed = least_memory_split(P)
    over = [(mems[s] - P.stage_budget(s), s) for s in range(P.num_stages)]
    excess, s = max(over)
    least = min(P.allowed, key=lambda o: sum(a[OPTIONS.index(o)] for a in P.act))
    where = f"blocks {P.names[boundaries[s]]} .. {P.names[boundaries[s + 1] - 1]}"
    device = f"device {P.device_of(s)}" + (f" (chunk {s // P.num_devices})" if P.virtual_stages > 1 else "")
    hint = "" if "full" in P.allowed else " Allowing recomputation (recompute='auto' or 'full') would save memory."
    return (
        f"no plan fits the memory budget: even the least-memory plan "
        f"({'no' if least == 'none' else least} recomputation everywhere, "
        f"{P.schedule} with {counted(P.num_microbatches, 'micro-batch')}) needs {format_size(mems[s])} on stage {s} "
        f"({where}, on {device}) whose budget is {format_size(P.stage_budget(s))}: over by {format_size(excess)}. "
        f"The smallest per-device budget that fits is {format_size(needed)}; or use more stages or fewer "
        f"micro-batches in flight.{hint}"
    )
