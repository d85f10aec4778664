"""The simulator's batch form: iteration times of many pipelines at once, vectorised with numpy (torch-free).

:func:`pipeline_times` replays the schedule of :func:`omnibal_compile.sim.simulate` for ``N``
pipelines side by side (e.g. every data-parallel rank of every step of an epoch): the same
operation order (:func:`~omnibal_compile.sim.simulate.operation_order`), the same dependencies and
the same timing rules, so its times equal ``simulate(...).iteration_time_s`` on the same inputs
(tests/test_sim.py checks it over drawn plans, per-micro-batch costs, sends and data parallelism):

- an operation starts when its device is free and its input has arrived; the forward of stage s on
  micro-batch m needs the forward of s - 1 on m plus the send between them, the backward of s needs
  the backward of s + 1 on m plus the gradient send back (for the last stage: its own forward);
  sends overlap with compute; a pipeline of one device sends nothing;
- an operation lasts its gather (FSDP resharding after forward), its compute (backward: recompute +
  backward) and the per-operation overhead;
- FSDP keeping weights gathered gathers each stage's weights once, a device's stages in turn from
  the start, before the stage's first forward;
- after its last backward each stage reduces its gradients, one reduction at a time per device in
  the order its stages finish; the iteration ends with the last backward or reduction, plus the step
  overhead.

What it leaves out: shared processors (``simulate(processors=...)``), events and memory. With one
stage per device the gradient reductions overlap nothing on their device, so a stage's reduction
ends ``reduce[s]`` after its last backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from omnibal_compile.errors import InputError, SimulationError
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import CLASSIC_SCHEDULES, schedule_rule
from omnibal_compile.sim.simulate import _bandwidth_scale, _microbatch_stage_costs, operation_order

__all__ = ["pipeline_times", "plan_arrays", "replay"]


def _per_stage(values: np.ndarray | Sequence[float] | None, S: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros(S)
    out = np.asarray(values, dtype=np.float64)
    try:
        return np.broadcast_to(out, (S,))
    except ValueError:
        raise InputError(f"{name} needs one value per stage ({S}), got shape {out.shape}") from None


def pipeline_times(
    forward: np.ndarray,
    backward: np.ndarray,
    send: np.ndarray,
    *,
    gather: np.ndarray | Sequence[float] | None = None,
    reduce: np.ndarray | Sequence[float] | None = None,
    step_gather: np.ndarray | Sequence[float] | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    op_overhead_s: float = 0.0,
    step_overhead_s: float = 0.0,
) -> np.ndarray:
    """Iteration time of many pipelines at once: ``[N, M, S]`` arrays -> ``[N]`` seconds.

    ``forward[n, m, s]``: forward seconds of stage s on micro-batch m in pipeline n; ``backward``:
    its backward plus recomputation; ``send[n, m, s]``: seconds to send stage s's output on (the
    gradient comes back in the same time; ignored on one device).
    Per stage, the same in every pipeline: ``gather[s]``, the data-parallel weight gather before each
    forward and each backward (FSDP resharding after forward); ``step_gather[s]``, the one gather
    before the stage's first forward (FSDP keeping weights gathered); ``reduce[s]``, the gradient
    reduction after the stage's last backward. ``schedule`` and ``virtual_stages`` as in
    :func:`~omnibal_compile.sim.simulate.operation_order`; stage s runs on device ``s % (S / v)``.
    """
    forward, backward, send = (np.asarray(a, dtype=np.float64) for a in (forward, backward, send))
    if forward.ndim != 3 or forward.shape != backward.shape or forward.shape != send.shape:
        raise InputError(f"forward, backward and send must be [N, M, S] arrays of one shape, got {forward.shape}, "
                         f"{backward.shape}, {send.shape}")
    N, M, S = forward.shape
    v = virtual_stages
    if v < 1 or S % v:
        raise InputError(f"{S} stages do not split into {v} chunks per device")
    D = S // v
    g, r, g0 = (
        _per_stage(x, S, name) for x, name in ((gather, "gather"), (reduce, "reduce"), (step_gather, "step_gather"))
    )
    schedule_rule(schedule).require(CLASSIC_SCHEDULES, "the vectorised replay (sim.replay.pipeline_times)")
    orders = operation_order(schedule, D, v, M)
    # FSDP keeping weights gathered: each device gathers its stages' weights in turn from the start.
    gathered_at = np.zeros(S)
    for d in range(D):
        clock = 0.0
        for s in range(d, S, D):
            if g0[s] > 0:
                clock = gathered_at[s] = clock + g0[s]

    def hop(s: int, m: int) -> np.ndarray | float:
        """Send time from stage s to s + 1 (or the gradient back); 0 on one device."""
        return send[:, m, s] if D > 1 else 0.0

    f_end: dict[tuple[int, int], np.ndarray] = {}
    b_end: dict[tuple[int, int], np.ndarray] = {}
    free: list[np.ndarray | float] = [0.0] * D
    pos = [0] * D
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(D):
            while pos[d] < len(orders[d]):
                kind, s, m = orders[d][pos[d]]
                if kind == "F":
                    if s > 0 and (s - 1, m) not in f_end:
                        break
                    ready = f_end[(s - 1, m)] + hop(s - 1, m) if s > 0 else 0.0
                    if m == 0 and g0[s] > 0:
                        ready = np.maximum(ready, gathered_at[s])
                    end = np.maximum(free[d], ready) + (g[s] + op_overhead_s) + forward[:, m, s]
                    f_end[(s, m)] = end
                else:
                    if (s, m) not in f_end or (s < S - 1 and (s + 1, m) not in b_end):
                        break
                    ready = f_end[(s, m)] if s == S - 1 else b_end[(s + 1, m)] + hop(s, m)
                    end = np.maximum(free[d], ready) + (g[s] + op_overhead_s) + backward[:, m, s]
                    b_end[(s, m)] = end
                free[d] = end
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise SimulationError(f"schedule {schedule!r} deadlocks for M={M}, S={S}, v={v}")
    last = np.stack([np.max(np.stack([b_end[(s, m)] for m in range(M)]), axis=0) for s in range(S)])  # [S, N]
    finish: np.ndarray = np.max(last, axis=0)
    if np.any(r > 0):
        for d in range(D):
            stages = list(range(d, S, D))
            if len(stages) == 1:  # one stage: its reduction starts at its last backward
                finish = np.maximum(finish, last[d] + r[d])
                continue
            # the device's reductions one at a time, in the order its stages finish (ties: lower stage first)
            ends = last[stages]  # [k, N]
            order = np.lexsort((np.broadcast_to(np.arange(len(stages))[:, None], ends.shape), ends), axis=0)
            reduced = np.zeros(N)
            for k in range(len(stages)):
                idx = order[k]
                red = r[np.asarray(stages)[idx]]
                began = np.where(red > 0, np.maximum(reduced, ends[idx, np.arange(N)]), reduced)
                reduced = began + red
            finish = np.maximum(finish, reduced)
    return finish + step_overhead_s


def plan_arrays(
    plan: Plan,
    costs: CostTable,
    *,
    microbatch_costs: Sequence[float] | Sequence[CostTable] | None = None,
    num_microbatches: int | None = None,
    link_bandwidth: float | None = None,
) -> dict:
    """The inputs of :func:`pipeline_times` for one pipeline (N = 1) of ``plan``, by the simulator's
    accounting (:func:`~omnibal_compile.sim.simulate.stage_costs`); arguments as in ``simulate``."""
    if microbatch_costs is not None and num_microbatches is None:
        M = len(microbatch_costs)
    else:
        M = num_microbatches if num_microbatches is not None else cast(int, plan.num_microbatches)  # a Plan fills it in
    per_mb = _microbatch_stage_costs(plan, costs, microbatch_costs, M)
    scale = _bandwidth_scale(costs, link_bandwidth)
    S = plan.num_stages

    def scaled(x: float) -> float:  # as the simulator scales: a zero stays zero (an infinite table bandwidth too)
        return x * scale if x > 0 else 0.0

    forward = np.array([[c.forward_s for c in row] for row in per_mb])[None]
    backward = np.array([[c.recompute_s + c.backward_s for c in row] for row in per_mb])[None]
    send = np.array([[scaled(c.send_s) if s + 1 < S else 0.0 for s, c in enumerate(row)] for row in per_mb])[None]
    first = per_mb[0]
    return {"forward": forward, "backward": backward, "send": send,
            "gather": np.array([scaled(c.op_gather_s) for c in first]),
            "step_gather": np.array([scaled(c.step_gather_s) for c in first]),
            "reduce": np.array([scaled(c.reduce_s) for c in first])}


def replay(
    plan: Plan,
    costs: CostTable,
    *,
    microbatch_costs: Sequence[float] | Sequence[CostTable] | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    link_bandwidth: float | None = None,
    op_overhead_s: float = 0.0,
    step_overhead_s: float = 0.0,
) -> float:
    """``simulate(plan, costs, ...).iteration_time_s`` by the batch form (one processor per device)."""
    arrays = plan_arrays(plan, costs, microbatch_costs=microbatch_costs, num_microbatches=num_microbatches,
                         link_bandwidth=link_bandwidth)
    return float(pipeline_times(**arrays, schedule=schedule or plan.schedule, virtual_stages=plan.virtual_stages,
                                op_overhead_s=op_overhead_s, step_overhead_s=step_overhead_s)[0])
