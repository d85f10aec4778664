"""Cut points and recomputation for ZB-V (``zbv``): the simulator's iteration time, exactly, by a pruned search.

Torch-free. ZB-V runs S = 2D stages on D devices in a V: device d runs stage d and stage 2D - 1 - d
(:meth:`omnibal_compile.ir.schedule.ScheduleRule.device_of`). Each backward is split into its
input-gradient part I and its weight-gradient part W, which the schedule defers.

    objective  the iteration time :func:`omnibal_compile.sim.stage_schedule_time` finds for the stages'
               F, I (recomputation included) and W and their sends, in torch's own ZB-V operation order:
               the simulator's model itself, not a closed form (ZB-V's has none for unequal stages).
    memory     per device, its two stages: sum of (static bytes - shared + largest transient + receive
               buffer) + the peak over its operation order of n_0 A_0 + n_1 A_1, where A_s is stage s's
               activations per micro-batch (its outputs included) and n_s the micro-batches alive on it, a
               micro-batch being alive from its F until its W (a deferred W keeps them). The order fixes
               the counts (both ends of a lifetime run on the device), so the peak is the largest n_0 A_0 +
               n_1 A_1 over the count pairs :func:`live_pairs` lists. This bounds the simulator's peak
               from above (it adds one stage's transient, not both, and no receive buffer).
    search     every cut vector, in increasing order of a lower bound (the busiest device's M (F + I + W)
               and micro-batch 0's forward and input-gradient chain, fastest options), until the bound
               reaches the best time found: exact. Per cut vector, each stage's recompute choices are
               the Pareto frontier of (recompute time, activation bytes); each device keeps the choice
               pairs that fit its budget and that no other fitting pair beats in both stages' times (the
               iteration time is monotone in each operation's duration), and every combination of those
               is simulated. Meant for small problems: at most :data:`MAX_CUT_VECTORS` cut vectors.

Data parallelism is not planned here (the runtime runs zbv at dp = 1).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from omnibal_compile._utils.units import format_size
from omnibal_compile.errors import PlanError
from omnibal_compile.ir.schedule import SCHEDULES
from omnibal_compile.planning.problem import OPTIONS, PartitionProblem, Solution, stage_shared, stage_transient
from omnibal_compile.sim.simulate import operation_order, stage_schedule_time

__all__ = ["MAX_CUT_VECTORS", "VFigures", "live_pairs", "v_figures", "solve_zbv"]

MAX_CUT_VECTORS = 2_000_000
"""Most cut vectors :func:`solve_zbv` enumerates (C(n - 1, S - 1)); beyond it the problem is refused."""


@lru_cache(maxsize=64)
def live_pairs(num_devices: int, num_microbatches: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per device, the (n_0, n_1) micro-batches alive on its first and second stage (F started, W not
    done) at each point of its ZB-V order where a forward starts, keeping only pairs no other pair
    dominates: the peak of n_0 A_0 + n_1 A_1 is attained at one of them for any A_0, A_1 >= 0."""
    D = num_devices
    out = []
    for d, ops in enumerate(operation_order("zbv", D, 2, num_microbatches)):
        first = d
        n = [0, 0]
        pairs: set[tuple[int, int]] = set()
        for kind, s, _ in ops:
            c = 0 if s == first else 1
            if kind == "F":
                n[c] += 1
                pairs.add((n[0], n[1]))
            elif kind in ("W", "B"):
                n[c] -= 1
        kept = [p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)]
        out.append(tuple(sorted(kept)))
    return tuple(out)


def _block_parts(P: PartitionProblem, b: int, o: int) -> tuple[float, float, float]:
    """(forward, backward with recomputation, weight-gradient part) seconds of block ``b`` under option ``o``."""
    f, w = P.forward[b], P.weight[b]
    return f, P.time[b][o] - f, w


@dataclass(frozen=True, kw_only=True)
class VFigures:
    """A zbv plan's figures by this module's accounting."""

    stage_time: tuple[float, ...]
    """F + I + W per stage and micro-batch."""
    stage_memory: tuple[float, ...]
    """Each stage's share of its device's memory at the device's peak (the two of a device sum to it)."""
    device_memory: tuple[float, ...]
    """Per device: the memory bound fitted under its budget."""
    iteration_time: float
    """The simulator's iteration time."""


def _stage_fixed(P: PartitionProblem, i: int, j: int) -> float:
    """Bytes stage [i, j) holds whatever is alive: static - shared + transient + its receive buffer."""
    return (sum(P.static[i:j]) - stage_shared(P, i, j) + stage_transient(P, i, j)
            + (P.cut_bytes[i] if i > 0 else 0))


def _stage_act(P: PartitionProblem, i: int, j: int, acts: float) -> float:
    """Bytes one micro-batch keeps alive on stage [i, j): its activations and its outputs."""
    return acts + (P.cut_bytes[j] if j < P.n else 0)


def _peak(pairs: Sequence[tuple[int, int]], a0: float, a1: float) -> tuple[float, tuple[int, int]]:
    return max(((n0 * a0 + n1 * a1, (n0, n1)) for n0, n1 in pairs), key=lambda x: x[0])


def v_figures(P: PartitionProblem, boundaries: Sequence[int], options: Sequence[int]) -> VFigures:
    """Stage times, memory and iteration time of the zbv plan with these cut points and option indices."""
    b = boundaries
    D, S = P.num_devices, P.num_stages
    F, B, W, A = [], [], [], []
    for s in range(S):
        parts = [_block_parts(P, k, options[k]) for k in range(b[s], b[s + 1])]
        F.append(sum(x[0] for x in parts))
        B.append(sum(x[1] for x in parts))
        W.append(sum(x[2] for x in parts))
        A.append(_stage_act(P, b[s], b[s + 1], sum(P.act[k][options[k]] for k in range(b[s], b[s + 1]))))
    send = [P.cut_time[b[s + 1]] for s in range(S)]
    it = stage_schedule_time("zbv", D, P.num_microbatches, forward_s=F, backward_s=B, weight_s=W, send_s=send,
                             virtual_stages=2)
    pairs = live_pairs(D, P.num_microbatches)
    mem = [0.0] * S
    for d in range(D):
        s0, s1 = d, 2 * D - 1 - d
        _, (n0, n1) = _peak(pairs[d], A[s0], A[s1])
        mem[s0] = _stage_fixed(P, b[s0], b[s0 + 1]) + n0 * A[s0]
        mem[s1] = _stage_fixed(P, b[s1], b[s1 + 1]) + n1 * A[s1]
    return VFigures(
        stage_time=tuple(f + x for f, x in zip(F, B)),
        stage_memory=tuple(mem),
        device_memory=tuple(mem[d] + mem[2 * D - 1 - d] for d in range(D)),
        iteration_time=it,
    )


def device_limit(P: PartitionProblem, d: int) -> float:
    """The most memory device ``d`` may be predicted to use (its budget and the rounding allowance)."""
    return P.budget[d] * (1 + 1e-9) + 1e-6 if P.budget else math.inf


def evaluate_zbv(P: PartitionProblem, boundaries: Sequence[int], recompute: Sequence[str], **fields) -> Solution:
    """:func:`omnibal_compile.planning.problem.evaluate` for zbv (it calls this)."""
    opts = [OPTIONS.index(r) for r in recompute]
    fig = v_figures(P, boundaries, opts)
    over = [d for d in range(P.num_devices) if fig.device_memory[d] > device_limit(P, d)]
    busiest = max(range(P.num_devices), key=lambda d: fig.stage_time[d] + fig.stage_time[2 * P.num_devices - 1 - d])
    binding = (f"memory of device {over[0]}" if over else
               f"time of device {busiest} (stages {busiest} and {2 * P.num_devices - 1 - busiest})")
    return Solution(
        boundaries=tuple(int(x) for x in boundaries),
        recompute=tuple(recompute),
        stage_time=fig.stage_time,
        stage_memory=fig.stage_memory,
        iteration_time=fig.iteration_time,
        feasible=not over,
        binding=binding,
        stage_peak=fig.stage_memory,
        **fields,
    )


def _frontier(P: PartitionProblem, i: int, j: int) -> list[tuple[float, float, tuple[int, ...]]]:
    """(backward seconds with recomputation, activation bytes, options) of stage [i, j), Pareto-pruned,
    fastest first."""
    points: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for k in range(i, j):
        grown = [(t + P.time[k][o] - P.forward[k], a + P.act[k][o], opts + (o,))
                 for t, a, opts in points for o in P.useful_options(k)]
        grown.sort(key=lambda x: (x[0], x[1]))
        points = []
        for p in grown:  # fastest first: keep a point only if it keeps less than every faster one
            if not points or p[1] < points[-1][1]:
                points.append(p)
    return points


def solve_zbv(P: PartitionProblem, *, time_limit: float | None = None) -> Solution:
    """The zbv plan (cut points and per-block recomputation) of least simulated iteration time within the
    budget; see the module docstring. Raise a :class:`PlanError` when the problem is too large or nothing fits."""
    if P.schedule != "zbv":
        raise PlanError(f"solve_zbv plans schedule 'zbv', not {P.schedule!r}")
    SCHEDULES["zbv"].require(("zbv",), "solve_zbv")
    start = time.perf_counter()
    n, S, D, M = P.n, P.num_stages, P.num_devices, P.num_microbatches
    count = math.comb(n - 1, S - 1)
    if count > MAX_CUT_VECTORS:
        raise PlanError(
            f"zbv planning searches every cut vector and {n} blocks into {S} stages have {count:,} "
            f"(more than {MAX_CUT_VECTORS:,}): use fewer stages or coarser blocks"
        )
    fast = [min(P.time[k][o] for o in P.useful_options(k)) for k in range(n)]
    pre_t = list(itertools.accumulate(fast, initial=0.0))
    pre_f = list(itertools.accumulate(P.forward, initial=0.0))
    pre_w = list(itertools.accumulate(P.weight, initial=0.0))

    def bound(b: tuple[int, ...]) -> float:
        t = [pre_t[b[s + 1]] - pre_t[b[s]] for s in range(S)]
        chain = sum(t) - (pre_w[n] - pre_w[0]) + sum(P.cut_time[b[s]] for s in range(1, S) if s != D) * 2
        return max(M * max(t[d] + t[S - 1 - d] for d in range(D)), chain)

    vectors = sorted(((bound(b), b) for c in itertools.combinations(range(1, n), S - 1)
                      for b in [(0, *c, n)]))
    pairs = live_pairs(D, M)
    frontiers: dict[tuple[int, int], list[tuple[float, float, tuple[int, ...]]]] = {}
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    simulated = 0
    status = "optimal"
    for lb, b in vectors:
        if best is not None and lb >= best[0] * (1 - 1e-12):
            break
        if time_limit is not None and time.perf_counter() - start > time_limit:
            status = "time limit"
            break
        per_device: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
        for d in range(D):
            s0, s1 = d, S - 1 - d
            f0 = frontiers.setdefault((b[s0], b[s0 + 1]), _frontier(P, b[s0], b[s0 + 1]))
            f1 = frontiers.setdefault((b[s1], b[s1 + 1]), _frontier(P, b[s1], b[s1 + 1]))
            fixed = _stage_fixed(P, b[s0], b[s0 + 1]) + _stage_fixed(P, b[s1], b[s1 + 1])
            fit = [(p0, p1) for p0 in f0 for p1 in f1
                   if fixed + _peak(pairs[d], _stage_act(P, b[s0], b[s0 + 1], p0[1]),
                                    _stage_act(P, b[s1], b[s1 + 1], p1[1]))[0] <= device_limit(P, d)]
            keep = [(p0[2], p1[2]) for p0, p1 in fit
                    if not any(q0[0] <= p0[0] and q1[0] <= p1[0] and (q0[0], q1[0]) != (p0[0], p1[0])
                               for q0, q1 in fit)]
            if not keep:
                break
            per_device.append(keep)
        if len(per_device) < D:
            continue
        for combo in itertools.product(*per_device):
            opts = [0] * n
            for d, (o0, o1) in enumerate(combo):
                for s, o in ((d, o0), (S - 1 - d, o1)):
                    opts[b[s] : b[s + 1]] = o
            it = v_figures(P, b, opts).iteration_time
            simulated += 1
            if best is None or it < best[0] * (1 - 1e-12):
                best = (it, b, tuple(opts))
    if best is None:
        budgets = ", ".join(format_size(x) for x in P.budget)
        raise PlanError(
            f"no zbv plan of {n} blocks into {S} stages fits the memory budget ({budgets} per device) even with "
            f"recomputation {list(P.allowed)}: raise the budget, allow more recomputation, or use more devices"
        )
    _, b, opts = best
    return evaluate_zbv(
        P, b, [OPTIONS[o] for o in opts], planner="zbv-search", status=status,
        solve_seconds=time.perf_counter() - start, gap=0.0 if status == "optimal" else None,
        extra={"solver": "zbv search", "cut vectors": count, "simulated": simulated},
    )
