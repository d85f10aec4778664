"""Cut points and recomputation for the split-backward schedules (interleaved-zb, zbv, dualpipev): the simulator's
iteration time, exactly, by a pruned search.

Torch-free. Each backward is split into its input-gradient part I and its weight-gradient part W, which the
schedule defers. ZB-V (``zbv``) and DualPipe-V run S = 2D stages on D devices in a V: device d runs stage d and
stage 2D - 1 - d; interleaved-zb loops them (stage s on device s mod D)
(:meth:`omnibal_compile.ir.schedule.ScheduleRule.stages_of`).

    objective  the iteration time :func:`omnibal_compile.sim.stage_schedule_time` finds for the stages'
               F, I (recomputation included) and W and their sends, in torch's own operation order:
               the simulator's model itself, not a closed form (none holds for unequal stages).
    memory     per device, its stages: sum of (static bytes - shared + largest transient + receive buffer)
               + the peak over its operation order of sum_k n_k A_k, where A_k is stage k's activations per
               micro-batch (its outputs included) and n_k the micro-batches alive on it, a micro-batch being
               alive from its F until its W (a deferred W keeps them; a whole backward B frees at once). The
               order fixes the counts (both ends of a lifetime run on the device), so the peak is the largest
               sum over the count tuples :func:`live_counts` lists. This bounds the simulator's peak from
               above (it adds one stage's transient, not each one's, and no receive buffer). Under ZB-V no
               forward runs between a micro-batch's I and its W, so there the deferral never raises the peak;
               under ZB-H1 (interleaved-zb) device d holds d of them back while forwards go on.
    search     every cut vector, in increasing order of a lower bound (the busiest device's M (F + I + W)
               and micro-batch 0's forward and input-gradient chain, fastest options), until the bound
               reaches the best time found: exact. Per cut vector, each stage's recompute choices are
               the Pareto frontier of (recompute time, activation bytes); each device keeps the choices
               that fit its budget and that no other fitting choice beats on every one of its stages' times
               (the iteration time is monotone in each operation's duration), and every combination of those
               is simulated. Meant for small problems: at most :data:`MAX_CUT_VECTORS` cut vectors.

Data parallelism is not planned here (the runtime runs these schedules at dp = 1).
"""

from __future__ import annotations

import itertools
import math
import time

from omnibal_compile._utils.units import format_size
from omnibal_compile.errors import PlanError
from omnibal_compile.planning.problem import (
    OPTIONS,
    PartitionProblem,
    PlanFigures,
    Solution,
    device_limit,
    evaluate_zero_bubble,
    plan_figures,
    zero_bubble_devices,
    zero_bubble_peak,
    zero_bubble_stage_act,
    zero_bubble_stage_fixed,
)
from omnibal_compile.sim.simulate import live_counts

__all__ = [
    "MAX_CUT_VECTORS", "PLANNER_LABEL", "PlanFigures", "live_counts", "plan_figures", "search_refusal",
    "solve_zero_bubble",
]

MAX_CUT_VECTORS = 2_000_000
"""Most cut vectors :func:`solve_zero_bubble` enumerates (C(n - 1, S - 1)); beyond it the problem is refused."""


PLANNER_LABEL = "zero-bubble search"
"""The planner a plan of :func:`solve_zero_bubble` names (whichever exact planner was asked for)."""


def search_refusal(P: PartitionProblem) -> str:
    """Why :func:`solve_zero_bubble` refuses ``P`` as too large (more than :data:`MAX_CUT_VECTORS` cut vectors);
    empty when it takes it."""
    count = math.comb(P.n - 1, P.num_stages - 1)
    if count <= MAX_CUT_VECTORS:
        return ""
    return (f"{P.schedule} planning searches every cut vector and {P.n} blocks into {P.num_stages} stages have "
            f"{count:,} (more than {MAX_CUT_VECTORS:,}): use fewer stages or coarser blocks")


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


def solve_zero_bubble(P: PartitionProblem, *, time_limit: float | None = None) -> Solution:
    """The plan (cut points and per-block recomputation) of least simulated iteration time within the budget, for a
    schedule that splits the backward; see the module docstring. Raise a :class:`PlanError` when the problem is
    too large or nothing fits."""
    rule = P.pipeline_schedule.rule
    if not rule.split_backward:
        raise PlanError(f"solve_zero_bubble plans the split-backward schedules, not {P.schedule!r}")
    start = time.perf_counter()
    n, S, D, M = P.n, P.num_stages, P.num_devices, P.num_microbatches
    refusal = search_refusal(P)
    if refusal:
        raise PlanError(refusal)
    count = math.comb(n - 1, S - 1)
    stages = [zero_bubble_devices(P, d) for d in range(D)]
    crossing = [s for s in range(1, S) if P.device_of(s - 1) != P.device_of(s)]  # cuts whose sends cost
    fast = [min(P.time[k][o] for o in P.useful_options(k)) for k in range(n)]
    pre_t = list(itertools.accumulate(fast, initial=0.0))
    total_w = sum(P.weight)

    def bound(b: tuple[int, ...]) -> float:
        """The busiest device's work, and micro-batch 0's forwards and input gradients through every stage."""
        t = [pre_t[b[s + 1]] - pre_t[b[s]] for s in range(S)]
        chain = sum(t) - total_w + 2 * sum(P.cut_time[b[s]] for s in crossing)
        return max(M * max(sum(t[s] for s in st) for st in stages), chain)

    vectors = sorted((bound(b), b) for c in itertools.combinations(range(1, n), S - 1) for b in [(0, *c, n)])
    counts = live_counts(P.schedule, D, P.virtual_stages, M)
    frontiers: dict[tuple[int, int], list[tuple[float, float, tuple[int, ...]]]] = {}
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    simulated = 0
    status = "optimal"
    for lb, b in vectors:
        if best is not None and lb >= best[0] * (1 - 1e-12):
            break
        # the time limit stops a search that has a plan (before one, a cut vector that does not fit costs no
        # simulation, and there are at most MAX_CUT_VECTORS)
        if best is not None and time_limit is not None and time.perf_counter() - start > time_limit:
            status = "time limit"
            break
        per_device: list[list[tuple[tuple[int, ...], ...]]] = []
        for d in range(D):
            fronts = [frontiers.setdefault((b[s], b[s + 1]), _frontier(P, b[s], b[s + 1])) for s in stages[d]]
            fixed = sum(zero_bubble_stage_fixed(P, b[s], b[s + 1]) for s in stages[d])
            fit = [c for c in itertools.product(*fronts)
                   if fixed + zero_bubble_peak(counts[d], [zero_bubble_stage_act(P, b[s], b[s + 1], p[1])
                                                           for s, p in zip(stages[d], c)])[0]
                   <= device_limit(P, d)]
            # the iteration time is monotone in each operation's duration: a choice slower on every stage than
            # another that fits never helps
            times = [tuple(p[0] for p in c) for c in fit]
            keep = [tuple(p[2] for p in c) for c, t in zip(fit, times)
                    if not any(u != t and all(x <= y for x, y in zip(u, t)) for u in times)]
            if not keep:
                break
            per_device.append(keep)
        if len(per_device) < D:
            continue
        for combo in itertools.product(*per_device):
            opts = [0] * n
            for d, choice in enumerate(combo):
                for s, o in zip(stages[d], choice):
                    opts[b[s] : b[s + 1]] = o
            it = plan_figures(P, b, opts).iteration_time
            simulated += 1
            if best is None or it < best[0] * (1 - 1e-12):
                best = (it, b, tuple(opts))
    if best is None:
        budgets = ", ".join(format_size(x) for x in P.budget)
        raise PlanError(
            f"no {P.schedule} plan of {n} blocks into {S} stages fits the memory budget ({budgets} per device) even "
            f"with recomputation {list(P.allowed)}: raise the budget, allow more recomputation, or use more devices"
        )
    _, cuts, chosen = best
    return evaluate_zero_bubble(
        P, cuts, [OPTIONS[o] for o in chosen], planner=PLANNER_LABEL, status=status,
        solve_seconds=time.perf_counter() - start, gap=0.0 if status == "optimal" else None,
        extra={"solver": f"{P.schedule} search", "cut vectors": count, "simulated": simulated},
    )
