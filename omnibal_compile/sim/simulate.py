"""Discrete-event simulation of one pipeline-parallel training iteration (torch-free).

Each device runs a fixed, schedule-given order of compute operations; an operation starts when its
device is free and its input has arrived. That fixes every start time, so the simulation is exact
for the model it assumes:

- forward of stage s on micro-batch m needs the forward of stage s-1 on m, plus the time to send
  what crosses the cut between them (``cut_bytes / link_bandwidth``) when they sit on different
  devices; sends overlap with compute (asynchronous point-to-point, as in torch.distributed.pipelining);
- backward of stage s on m needs the backward of stage s+1 on m plus the gradient send back (the
  same bytes as the activations sent forward), and for the last stage its own forward;
- a backward of a stage with recomputed blocks first reruns their forward (a ``recompute`` event);
- data parallelism (``plan.dp``, rules in :meth:`omnibal_compile.ir.costs.DataParallel.block_cost`,
  over the link bandwidth): each stage reduces its gradients (``dp_reduce``) after its last backward,
  one reduction at a time per device, and the iteration ends when the last one does; FSDP gathers a
  stage's weights (``dp_gather``) before every forward and backward when it reshards after forward
  (the device waits; FSDP's prefetch would hide part of it, so this is an upper bound), else once
  per stage at the start of the iteration, before the stage's first forward.
- tensor parallelism (a table from :func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table`):
  a device is one rank of its stage's TP group; the group's all-reduces are inside the blocks' forward,
  backward and full-recompute times (``BlockCost.tensor_parallel_s`` says how much), on the intra-node
  link, not overlapped with compute. Their link is taken as free of the pipeline sends and data-parallel
  collectives (no contention modelled: sends are asynchronous and small next to a layer's all-reduces).

Glossary:
    S, D, v, M     stages (virtual stages for interleaved), devices, chunks per device (S = D v),
                   micro-batches per iteration. Stage s runs on device ``s % D`` (plan convention).
    F, B, R        forward, backward, recompute time of one stage on one micro-batch.
    busy time      time a device spends computing (F + R + B over its operations).
    bubble fraction  idle share of device time: ``1 - sum(busy) / (D * iteration time)``.
    in flight      micro-batches whose forward on a stage has started and whose backward there has
                   not finished; their activations are alive. Peak activation memory of a device is
                   the peak over time of the in-flight activation bytes of its stages.
    workspace      what a block holds only while it computes, beyond its kept activations
                   (temporaries, the backward's scratch, what recomputation rebuilds). With the
                   blocks' measured peaks (``BlockCost.peak_bytes``) the micro-batch that runs on a
                   stage holds ``running_peak`` of it instead of all it keeps, as the plan's
                   predicted peak counts it (``solver.problem.stage_peak``); without them the
                   device's largest ``BlockCost.workspace_bytes`` is added on top of the in-flight
                   bytes, as the planner's bound adds it (``solver.problem.stage_transient``).

Schedules (the operation order per device; the same orders as torch.distributed.pipelining):
    gpipe        all forwards (micro-batch 0..M-1), then all backwards (0..M-1) (``ScheduleGPipe``).
                 In flight per stage: M.
    1f1b         ``min(M, S - s)`` warm-up forwards, then alternate one backward and one forward,
                 then the remaining backwards (``Schedule1F1B``). In flight per stage: ``min(S - s, M)``.
    interleaved-zb, zbv, dualpipev  the orders of torch's ``ScheduleInterleavedZeroBubble``,
                 ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (:mod:`omnibal_compile.sim.zero_bubble`),
                 with each backward split into its input-gradient part ``I`` (the previous stage waits for
                 it; ``backward`` events) and its weight-gradient part ``W`` (``backward_weight`` events, timed
                 by ``BlockCost.weight_grad_s``). A micro-batch's activations on a stage stay alive until its
                 W has run. Under the V placement stages D - 1 and D share a device, so that hop sends nothing.
    Which (schedule, M, v, S) torch can run is checked by :class:`omnibal_compile.ir.schedule.Schedule`,
    and which device runs a stage by its placement (:meth:`omnibal_compile.ir.schedule.Schedule.device_of`).
    interleaved  Megatron's interleaved 1F1B as in ``ScheduleInterleaved1F1B``: rounds of
                 ``R = M // max(1, M // D)`` micro-batches; the k-th forward of device d runs chunk
                 ``(k // R) % v``, the j-th backward chunk ``v - 1 - (j // R) % v``; warm-up forwards
                 ``W_d = min((v - 1) R + 2 (D - 1 - d), v M)``, then one forward / one backward, then
                 the rest of the backwards. Chunk-micro-batches in flight on device d: ``min(W_d + 1, v M)``.

Closed forms with equal stages, no sends and F, B per stage (tested in tests/test_sim.py):
    gpipe, 1f1b       T = (M + S - 1)(F + B),  bubble = (S - 1) / (M + S - 1).
                      With data parallelism (gather G and reduction R per stage): T + R (DDP),
                      T + G + R (FSDP keeping weights gathered), (M + S - 1)(F + B + 2G) + R
                      (FSDP resharding after forward): the first stage finishes last, so its
                      reduction is exposed in full.
    interleaved       with f, b per chunk (a device holds v chunks, so f = F_device / v) and M a
                      multiple of D: T = (v M + D - 1)(f + b), bubble = (D - 1) / (v M + D - 1).
                      Derivation: every device computes v M (f + b). The last device cannot start
                      before micro-batch 0 has crossed the D - 1 devices before it, (D - 1) f; its
                      last operation is the backward of chunk 0 (stage D - 1) of the last micro-batch,
                      whose gradient must still cross D - 1 devices, (D - 1) b. So
                      T >= (D - 1) f + v M (f + b) + (D - 1) b, and the warm-up length W_d keeps the
                      last device busy without a gap in between, so equality holds (the simulator
                      reproduces it exactly for b = f, 2f, 3f and v = 1..3). With v = 1 this is 1F1B's
                      formula with S = D; v chunks cut the bubble v-fold because each op is v times
                      shorter.
    interleaved-zb    at v = 1 (ZB-H1, Qi et al. 2024) with F, B (input gradient) and W per stage:
                      T = M (F + B + W) + (S - 1)(F + B - W); with W = 0 it is 1F1B's
                      (tests/test_sim_zero_bubble.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, cast

from omnibal_compile._utils.tables import counted
from omnibal_compile.errors import InputError, PlanError, SimulationError
from omnibal_compile.ir.costs import CostTable, held_once, running_peak
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.sim.zero_bubble import Op, dualpipev_order, interleaved_zero_bubble_order, zbv_order

__all__ = [
    "live_counts",
    "Event",
    "StageCost",
    "SimResult",
    "simulate",
    "schedule_time",
    "stage_schedule_time",
    "stage_costs",
    "operation_order",
    "SimulationError",
    "pipeline_processors",
    "processor_rate",
    "shared_work_time",
]

EventKind = Literal[
    "forward", "recompute", "backward", "backward_weight", "send_forward", "send_backward", "dp_gather", "dp_reduce"
]
COMPUTE_EVENTS: tuple[EventKind, ...] = ("forward", "recompute", "backward", "backward_weight")
"""Event kinds that are compute (busy time)."""


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """What one stage costs for one micro-batch, summed over its blocks under the plan's recompute options."""

    forward_s: float
    """Forward time."""
    backward_s: float
    """Backward time, without recomputation."""
    recompute_s: float
    """Time rerunning the forward of recomputed blocks before the backward."""
    send_s: float
    """Time to send what crosses the cut after the stage (0 for the last stage); gradients come back in the same
    time."""
    activation_bytes: int
    """Bytes kept from forward to backward under the chosen recompute options, the stage's outputs included
    (the pipeline holds them until the micro-batch's backward)."""
    workspace_bytes: int
    """Bytes held only while one of its blocks computes, beyond kept activations (largest
    ``BlockCost.workspace_bytes``)."""
    running_bytes: int | None = None
    """Most bytes one micro-batch holds while it runs through the stage (``cost_table.running_peak`` of the
    blocks' kept and peak bytes under their options); None when the blocks' peaks were not measured."""
    static_bytes: int
    """Weights, gradients and optimizer states of the stage (as the plan's data-parallel layout holds them)."""
    gathered_bytes: int = 0
    """Whole weights of its largest block while FSDP has them gathered (resharding after forward), else 0."""
    op_gather_s: float = 0.0
    """FSDP all-gather before each forward and each backward (resharding after forward), else 0."""
    step_gather_s: float = 0.0
    """FSDP all-gather once before the stage's first forward (weights kept gathered), else 0."""
    reduce_s: float = 0.0
    """Gradient reduction after the stage's last backward (data parallelism), else 0."""
    weight_s: float = 0.0
    """W, the weight-gradient part of ``backward_s`` (a zero-bubble schedule runs it apart; 0 when unknown)."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One interval of the simulated timeline."""

    kind: EventKind
    """``forward``, ``recompute``, ``backward`` (under a split backward: its input-gradient part),
    ``backward_weight`` (the weight-gradient part), ``send_forward``, ``send_backward``, ``dp_gather`` or
    ``dp_reduce``."""
    stage: int
    """Stage computing (for sends: the stage sending)."""
    device: int
    """Device the stage runs on."""
    microbatch: int
    """Micro-batch index."""
    start_s: float
    """Start time, seconds from the start of the iteration."""
    end_s: float
    """End time, seconds."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """How one iteration of a plan runs under its schedule, as simulated."""

    schedule: str
    """Schedule simulated."""
    num_stages: int
    """Stages (virtual stages for interleaved)."""
    num_devices: int
    """Pipeline devices."""
    num_microbatches: int
    """Micro-batches in the iteration."""
    iteration_time_s: float
    """Time from the start to the end of the last backward or gradient reduction (plus step overhead)."""
    bubble_fraction: float
    """Idle share of device time: ``1 - sum(busy_s) / (num_devices * iteration_time_s)``."""
    busy_s: tuple[float, ...]
    """Compute time (forward + recompute + backward) of each device."""
    stage_busy_s: tuple[float, ...]
    """Compute time of each stage."""
    peak_inflight: tuple[int, ...]
    """Largest number of micro-batches in flight on each stage."""
    peak_activation_bytes: tuple[int, ...]
    """Peak activation bytes of each device: in-flight activations plus recompute workspace."""
    static_bytes: tuple[int, ...]
    """Weights, gradients and optimizer states of each device, plus the largest block's gathered weights (FSDP)."""
    peak_memory_bytes: tuple[int, ...]
    """``static_bytes + peak_activation_bytes`` per device."""
    events: tuple[Event, ...] = field(repr=False)
    """Every compute and send interval, sorted by start time (left out of the repr: there are many)."""
    device_stages: tuple[tuple[int, ...], ...] = ()
    """The stages of each device, as the schedule places them (empty: looped, ``d, d + D, ...``)."""

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """A short table: per device busy ms, utilisation, peak in flight and memory."""
        mib = 1 / 2**20
        lines = [
            f"simulated {self.schedule}: {self.num_stages} stages on {self.num_devices} devices, "
            f"{counted(self.num_microbatches, 'micro-batch')}: iteration {self.iteration_time_s * 1e3:.3f} ms, "
            f"bubble {self.bubble_fraction:.1%}",
            f"{'device':>6}  {'busy ms':>10}  {'util':>6}  {'in flight':>9}  {'peak MiB':>10}",
        ]
        for d in range(self.num_devices):
            stages = self.device_stages[d] if self.device_stages else range(d, self.num_stages, self.num_devices)
            inflight = "+".join(str(self.peak_inflight[s]) for s in stages)
            util = self.busy_s[d] / self.iteration_time_s if self.iteration_time_s else 0.0
            lines.append(
                f"{d:>6}  {self.busy_s[d] * 1e3:>10.3f}  {util:>6.1%}  {inflight:>9}  "
                f"{self.peak_memory_bytes[d] * mib:>10.2f}"
            )
        return "\n".join(lines)


def stage_costs(plan: Plan, costs: CostTable, *, scale: float = 1.0) -> tuple[StageCost, ...]:
    """Per-stage costs of ``plan`` from ``costs`` (block names must match), times and activations scaled by
    ``scale``."""
    if tuple(costs.names) != tuple(plan.block_names):
        diff = [
            f"#{i}: plan '{a}' vs costs '{b}'" for i, (a, b) in enumerate(zip(plan.block_names, costs.names)) if a != b
        ]
        raise PlanError(
            f"the cost table ({len(costs.names)} blocks) does not match the plan ({plan.num_blocks} blocks)"
            + (f"; first differences: {diff[:3]}" if diff else "")
        )
    if scale < 0:
        raise InputError(f"micro-batch cost scale must be non-negative, got {scale}")
    options = plan.block_recompute
    dp = plan.dp
    out = []
    every = costs.data_parallel_costs(dp)
    shared = costs.shared_static(dp)
    for st in plan.stages:
        blocks = costs.blocks[st.start : st.stop]
        opts = options[st.start : st.stop]
        send = costs.send_s(st.stop) if st.stop < plan.num_blocks else 0.0
        # its outputs, which the pipeline holds per micro-batch until that micro-batch's backward
        held = costs.cut_bytes[st.stop] if st.stop < plan.num_blocks else 0
        dpc = every[st.start : st.stop]
        out.append(
            StageCost(
                forward_s=scale * sum(b.forward_s for b in blocks),
                backward_s=scale * sum(b.backward_s for b in blocks),
                weight_s=scale * sum(b.weight_grad_s or 0.0 for b in blocks),
                recompute_s=scale * sum(b.recompute_s[o] for b, o in zip(blocks, opts)),
                send_s=scale * send,
                activation_bytes=int(round(scale * (sum(b.activation_bytes[o] for b, o in zip(blocks, opts)) + held))),
                workspace_bytes=int(round(scale * max(b.workspace_bytes for b in blocks))),
                running_bytes=int(round(scale * (held + running_peak(
                    [b.activation_bytes[o] for b, o in zip(blocks, opts)],
                    [b.peak_bytes[o] for b, o in zip(blocks, opts)],
                )))) if all(b.peak_bytes for b in blocks) else None,
                # a tied weight read by several of its blocks: one copy (ir.costs.held_once)
                static_bytes=int(round(sum(c.static_bytes for c in dpc) - held_once(shared, range(st.start, st.stop)))),
                gathered_bytes=int(round(max(c.gathered_bytes for c in dpc))),
                op_gather_s=sum(c.op_gather_s(dp) for c in dpc),
                step_gather_s=sum(c.step_gather_s(dp) for c in dpc),
                reduce_s=sum(c.reduce_s for c in dpc),
            )
        )
    return tuple(out)


def _running_excess(c: StageCost) -> int:
    """Bytes a stage's running micro-batch holds beyond its kept activations (the workspace bound without peaks)."""
    return c.workspace_bytes if c.running_bytes is None else c.running_bytes - c.activation_bytes


def operation_order(schedule: str, num_devices: int, virtual_stages: int, num_microbatches: int) -> list[list[Op]]:
    """The order in which each device runs its forwards (``F``) and backwards: whole (``B``), or split into the
    input-gradient part (``I``) and the weight-gradient part (``W``) under the zero-bubble schedules."""
    D, v, M = num_devices, virtual_stages, num_microbatches
    sched = Schedule(kind=schedule, num_microbatches=M, virtual_stages=v)
    sched.check(D * v)
    if schedule == "interleaved-zb":
        return interleaved_zero_bubble_order(D, v, M)
    if schedule == "zbv":
        return zbv_order(D, M)
    if schedule == "dualpipev":
        return dualpipev_order(D, M)
    S = D * v
    orders: list[list[Op]] = []
    for d in range(D):
        ops: list[Op] = []
        if schedule == "gpipe":
            ops += [("F", d, m) for m in range(M)] + [("B", d, m) for m in range(M)]
        elif schedule == "1f1b":
            warm = min(M, S - d)
            ops += [("F", d, m) for m in range(warm)]
            for m in range(M):
                ops.append(("B", d, m))
                if warm + m < M:
                    ops.append(("F", d, warm + m))
        else:  # interleaved
            R = sched.microbatches_per_round(D)
            total = v * M
            warm = min((v - 1) * R + 2 * (D - 1 - d), total)
            next_mb = [0] * v
            next_bmb = [0] * v

            # fwd and bwd run only within this iteration, so the loop variables they read are this device's
            def fwd(k: int) -> Op:
                c = (k // R) % v  # noqa: B023
                next_mb[c] += 1  # noqa: B023
                return ("F", c * D + d, next_mb[c] - 1)  # noqa: B023

            def bwd(j: int) -> Op:
                c = v - 1 - (j // R) % v  # noqa: B023
                next_bmb[c] += 1  # noqa: B023
                return ("B", c * D + d, next_bmb[c] - 1)  # noqa: B023

            ops += [fwd(k) for k in range(warm)]
            for j in range(total):
                if warm + j < total:
                    ops.append(fwd(warm + j))
                ops.append(bwd(j))
        orders.append(ops)
    return orders


def _held_across_stages(plan: Plan, costs: CostTable, stages: Sequence[int]) -> int:
    """Bytes of tied weights that a device running ``stages`` holds once but its stages' static bytes count once
    each (stages of one device that share a parameter)."""
    if not costs.shared:
        return 0
    shared = costs.shared_static(plan.dp)
    b = plan.boundaries
    each = sum(held_once(shared, range(b[s], b[s + 1])) for s in stages)
    return int(round(held_once(shared, [i for s in stages for i in range(b[s], b[s + 1])]) - each))


def _microbatch_stage_costs(
    plan: Plan, costs: CostTable, microbatch_costs: Sequence[float] | Sequence[CostTable] | None, M: int
) -> list[tuple[StageCost, ...]]:
    if microbatch_costs is None:
        base = stage_costs(plan, costs)
        return [base] * M
    items = list(microbatch_costs)
    if len(items) != M:
        raise InputError(
            f"microbatch_costs has {len(items)} entries for {M} micro-batches; give one scale factor or one "
            "CostTable per micro-batch (or set num_microbatches to match)"
        )
    out = []
    for i, item in enumerate(items):
        if isinstance(item, CostTable):
            out.append(stage_costs(plan, item))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            out.append(stage_costs(plan, costs, scale=float(item)))
        else:
            raise InputError(f"microbatch_costs[{i}] is a {type(item).__name__}; expected a float scale or a CostTable")
    return out


def _bandwidth_scale(costs: CostTable, link_bandwidth: float | None) -> float:
    """Factor on the table's send and data-parallel times under ``simulate(link_bandwidth=...)``."""
    if link_bandwidth is None or link_bandwidth == costs.link_bandwidth:
        return 1.0
    if not link_bandwidth > 0:
        raise InputError(f"link_bandwidth must be positive, got {link_bandwidth}")
    if costs.link_bandwidth == float("inf"):  # its times are 0: no finite bandwidth can be recovered from them
        raise InputError(f"the cost table's link is free (infinite bandwidth), so its sends cannot be timed at "
                         f"link_bandwidth={link_bandwidth}; give a table with a finite link_bandwidth")
    return costs.link_bandwidth / link_bandwidth


def pipeline_processors(processors: float | None, data_parallel: int) -> float | None:
    """Processors one pipeline replica's devices share: the run's ``processors`` (:attr:`CostTable.processors`)
    split evenly among its ``data_parallel`` replicas, which run alike; None = one per device. The planner
    (``planning.problem.problem_from_costs``) and :func:`simulate` both take the share from here."""
    if processors is None:
        return None
    if not processors > 0 or data_parallel < 1:
        raise InputError(f"processors must be positive and data_parallel >= 1, got {processors} and {data_parallel}")
    return processors / data_parallel


def processor_rate(processors: float | None, computing: int) -> float:
    """Seconds of work per second of each of ``computing`` devices that share ``processors`` equally (None: one
    each): ``min(1, processors / computing)``. The simulator's rule of shared processors."""
    return 1.0 if processors is None else min(1.0, processors / max(1, computing))


def shared_work_time(work_s: float, processors: float | None, num_devices: int) -> float:
    """The least time ``num_devices`` sharing ``processors`` take for ``work_s`` seconds of compute (seconds of
    one processor each), whatever the schedule: by :func:`processor_rate` no more than ``processors`` seconds
    of work get done per second. 0 when every device has a processor of its own (no bound beyond the
    schedule's)."""
    if processors is None or processors >= num_devices:
        return 0.0
    return work_s / processors


def _ready_at(
    kind: str, s: int, m: int, S: int, f_end: dict[tuple[int, int], float], b_end: dict[tuple[int, int], float], send
) -> float | None:
    """When operation (kind, s, m)'s input has arrived (``send(s, m)``: time from stage s to s + 1 and
    back), or None while its producer has not finished. ``b_end`` holds when each input gradient is done (its
    ``B`` or ``I``); a ``W`` waits for its own stage's ``I``."""
    if kind == "W":
        return b_end.get((s, m))
    if kind == "F":
        if s == 0:
            return 0.0
        return f_end[(s - 1, m)] + send(s - 1, m) if (s - 1, m) in f_end else None
    if (s, m) not in f_end:
        return None
    if s == S - 1:
        return f_end[(s, m)]
    return b_end[(s + 1, m)] + send(s, m) if (s + 1, m) in b_end else None


def _timeline(
    orders: list[list[Op]],
    segments,
    ready_at,
    processors: float | None,
    *,
    f_start: dict[tuple[int, int], float],
    f_end: dict[tuple[int, int], float],
    b_end: dict[tuple[int, int], float],
    w_end: dict[tuple[int, int], float],
) -> list[Event]:
    """Run every device's operations in order; fill the start/end maps (``b_end``: a ``B`` or ``I``, ``w_end``: a
    ``W``) and return the compute events.

    An operation starts when its device is free and ``ready_at`` gives its input's arrival. Devices
    that compute at the same moment share ``processors`` (None: one each) equally: each progresses
    at ``min(1, processors / computing)`` seconds of work per second. A virtual clock counts work done
    per computing device, so a segment ends when it has advanced by the segment's work; with one
    processor per device it is the wall clock and every end is start + work exactly.
    """
    D = len(orders)
    pos = [0] * D
    # per computing device: [segments left, index, virtual finish, wall start of the segment, op]
    running: dict[int, list] = {}
    events: list[Event] = []
    now = virtual = 0.0
    remaining = sum(len(o) for o in orders)
    while remaining:
        # Start every idle device whose next operation's input is here by now.
        upcoming = []
        for d in range(D):
            if d in running or pos[d] >= len(orders[d]):
                continue
            kind, s, m = orders[d][pos[d]]
            ready = ready_at(kind, s, m)
            if ready is None:
                continue
            if ready <= now:
                segs = segments(kind, s, m)
                running[d] = [segs, 0, virtual + segs[0][1], now, (kind, s, m)]
                if kind == "F":
                    f_start[(s, m)] = now
            else:
                upcoming.append(ready)
        if not running and not upcoming:
            stuck = {d: orders[d][pos[d]] for d in range(D) if pos[d] < len(orders[d])}
            raise SimulationError(f"the operation orders deadlock; devices wait on {stuck}")
        rate = processor_rate(processors, len(running))
        finish = min((r[2] for r in running.values()), default=float("inf"))
        t_finish = now + (finish - virtual) / rate if running else float("inf")
        t_next = min(t_finish, min(upcoming, default=float("inf")))
        if t_next < t_finish:  # an input arrives first: advance, then start it
            virtual += (t_next - now) * rate
            now = t_next
            continue
        virtual, now = finish, t_finish
        for d in [d for d, r in running.items() if r[2] <= finish]:
            segs, i, _, seg_start, (kind, s, m) = running[d]
            events.append(Event(kind=segs[i][0], stage=s, device=d, microbatch=m, start_s=seg_start, end_s=now))
            if i + 1 < len(segs):
                running[d] = [segs, i + 1, virtual + segs[i + 1][1], now, (kind, s, m)]
                continue
            del running[d]
            (f_end if kind == "F" else w_end if kind == "W" else b_end)[(s, m)] = now
            pos[d] += 1
            remaining -= 1
    return events


def schedule_time(
    schedule: str,
    num_devices: int,
    num_microbatches: int,
    *,
    forward_s: float = 1.0,
    backward_s: float = 1.0,
    weight_s: float = 0.0,
    virtual_stages: int = 1,
    processors: float | None = None,
    op_overhead_s: float = 0.0,
) -> float:
    """Iteration time of equal stages with free sends: ``forward_s``/``backward_s`` per stage and
    micro-batch (per chunk when interleaved), ``weight_s`` of the backward its weight-gradient part (run apart by
    the zero-bubble schedules). Without shared processors this is the closed form, e.g. (M + S - 1)(F + B) for
    1F1B; ``processors`` and ``op_overhead_s`` (added to every action: F, B, I and W) as in :func:`simulate`. With
    no compute and ``op_overhead_s=1`` it is the schedule's depth in actions, which the runtime-overhead fit
    divides by (:func:`omnibal_compile.calibrate.overhead.fit_overhead`)."""
    if not 0 <= weight_s <= backward_s:
        raise InputError(f"weight_s must lie within 0..backward_s ({backward_s}), got {weight_s}")
    if op_overhead_s < 0:
        raise InputError(f"op_overhead_s must be >= 0, got {op_overhead_s}")
    orders = operation_order(schedule, num_devices, virtual_stages, num_microbatches)
    S = num_devices * virtual_stages
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    w_end: dict[tuple[int, int], float] = {}
    work: dict[str, tuple[EventKind, float]] = {
        "F": ("forward", forward_s + op_overhead_s), "B": ("backward", backward_s + op_overhead_s),
        "I": ("backward", backward_s - weight_s + op_overhead_s), "W": ("backward_weight", weight_s + op_overhead_s)}
    _timeline(
        orders,
        lambda kind, s, m: [work[kind]],
        lambda kind, s, m: _ready_at(kind, s, m, S, f_end, b_end, lambda s, m: 0.0),
        processors,
        f_start={},
        f_end=f_end,
        b_end=b_end,
        w_end=w_end,
    )
    return max([*b_end.values(), *w_end.values()])


def stage_schedule_time(
    schedule: str,
    num_devices: int,
    num_microbatches: int,
    *,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    weight_s: Sequence[float],
    send_s: Sequence[float],
    virtual_stages: int = 1,
) -> float:
    """Iteration time of stages with their own costs per micro-batch, one processor per device, no data
    parallelism: what :func:`simulate` finds for such a plan (the planner's objective for the zero-bubble
    schedules). Per stage s: ``forward_s[s]``, ``backward_s[s]`` (the whole backward, recomputation included),
    ``weight_s[s]`` (its weight-gradient part, run apart when the schedule splits the backward) and
    ``send_s[s]`` (to stage s + 1 and the gradient back; free when both stages share a device)."""
    D, v, M = num_devices, virtual_stages, num_microbatches
    S = D * v
    if not len(forward_s) == len(backward_s) == len(weight_s) == len(send_s) == S:
        raise InputError(f"stage costs need {S} entries each (num_devices x virtual_stages)")
    orders = operation_order(schedule, D, v, M)
    placed = Schedule(kind=schedule, num_microbatches=M, virtual_stages=v)
    device_of = [placed.device_of(s, S) for s in range(S)]
    work = {"F": forward_s, "B": backward_s, "W": weight_s,
            "I": [b - w for b, w in zip(backward_s, weight_s)]}
    kinds: dict[str, EventKind] = {"F": "forward", "B": "backward", "I": "backward", "W": "backward_weight"}

    def send(s: int, m: int) -> float:
        return 0.0 if s + 1 >= S or device_of[s] == device_of[s + 1] else send_s[s]

    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    w_end: dict[tuple[int, int], float] = {}
    _timeline(
        orders,
        lambda kind, s, m: [(kinds[kind], work[kind][s])],
        lambda kind, s, m: _ready_at(kind, s, m, S, f_end, b_end, send),
        None,
        f_start={},
        f_end=f_end,
        b_end=b_end,
        w_end=w_end,
    )
    return max({**b_end, **w_end}.values())


def simulate(
    plan: Plan,
    costs: CostTable,
    *,
    microbatch_costs: Sequence[float] | Sequence[CostTable] | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    link_bandwidth: float | None = None,
    op_overhead_s: float = 0.0,
    step_overhead_s: float = 0.0,
    processors: float | None = None,
) -> SimResult:
    """Simulate one training iteration of ``plan`` with per-block ``costs``.

    Args:
        plan: cut points, recompute options, schedule, micro-batch count and chunks per device.
        costs: block costs for one micro-batch of the planned shape (block names as in the plan).
        microbatch_costs: micro-batches that differ: one scale factor per micro-batch (times,
            activations and sends multiplied by it) or one CostTable per micro-batch (e.g. the cost
            pass evaluated at each balanced pack's shape). Its length sets the micro-batch count.
        schedule: override ``plan.schedule``.
        num_microbatches: override ``plan.num_microbatches``.
        link_bandwidth: override ``costs.link_bandwidth`` (bytes/s) for sends, scaling data-parallel
            communication (``costs.dp_bandwidth``) by the same factor; ``float('inf')`` makes both free.
        op_overhead_s: runtime cost of every forward and backward action beyond its compute (the
            schedule's Python, send/receive posting, autograd bookkeeping); measure it on the target
            with :func:`omnibal_compile.runtime.measure_overhead`. Counted as busy time.
        step_overhead_s: fixed cost per iteration (optimizer step, barrier), added at the end.
        processors: processors the devices of this pipeline share (None: the cost table's
            :attr:`~omnibal_compile.ir.costs.CostTable.processors`, split among the plan's data-parallel
            replicas by :func:`pipeline_processors`; None there too: one per device, as with one GPU per
            rank). When more devices compute at once than there are processors, each computes at
            ``processors / computing`` speed (processor sharing, :func:`processor_rate`).
    """
    if op_overhead_s < 0 or step_overhead_s < 0:
        raise InputError("op_overhead_s and step_overhead_s must be >= 0")
    if processors is not None and not processors > 0:
        raise InputError(f"processors must be positive (or None for the cost table's), got {processors}")
    if processors is None:
        processors = pipeline_processors(costs.processors, plan.dp.size)
    sched = schedule or plan.schedule
    if microbatch_costs is not None and num_microbatches is None:
        M = len(microbatch_costs)
    else:
        M = num_microbatches if num_microbatches is not None else cast(int, plan.num_microbatches)  # filled by Plan
    S, v = plan.num_stages, plan.virtual_stages
    D = plan.num_devices
    orders = operation_order(sched, D, v, M)
    placed = Schedule(kind=sched, num_microbatches=M, virtual_stages=v)
    if placed.rule.split_backward:
        costs.require_backward_split(sched)
    device_of = [placed.device_of(s, S) for s in range(S)]
    stages_of = [placed.stages_of(d, S) for d in range(D)]
    per_mb = _microbatch_stage_costs(plan, costs, microbatch_costs, M)
    bw_scale = _bandwidth_scale(costs, link_bandwidth)

    def send(s: int, m: int) -> float:
        """Send time from stage s to s+1 (or the gradient back), 0 when both are on one device."""
        if s + 1 >= S or device_of[s] == device_of[s + 1]:
            return 0.0
        return per_mb[m][s].send_s * bw_scale

    def segments(kind: str, s: int, m: int) -> list[tuple[EventKind, float]]:
        """Work of one operation, in order: (event kind, seconds on a processor of its own)."""
        c = per_mb[m][s]
        gather: list[tuple[EventKind, float]] = [("dp_gather", c.op_gather_s * bw_scale)] if c.op_gather_s > 0 else []
        if kind == "F":
            return gather + [("forward", c.forward_s + op_overhead_s)]
        if kind == "W":  # the weights gathered for its I are still there
            return [("backward_weight", c.weight_s + op_overhead_s)]
        return (
            gather
            + ([("recompute", c.recompute_s)] if c.recompute_s > 0 else [])
            + [("backward", (c.backward_s if kind == "B" else c.backward_s - c.weight_s) + op_overhead_s)]
        )

    # FSDP keeping weights gathered: each device gathers its stages' weights in turn from the start.
    events: list[Event] = []
    gathered_at = [0.0] * S
    for d in range(D):
        clock = 0.0
        for s in stages_of[d]:
            if per_mb[0][s].step_gather_s > 0:
                events.append(Event(kind="dp_gather", stage=s, device=d, microbatch=0, start_s=clock,
                                    end_s=clock + per_mb[0][s].step_gather_s * bw_scale))
                clock = gathered_at[s] = events[-1].end_s

    def ready(kind: str, s: int, m: int) -> float | None:
        at = _ready_at(kind, s, m, S, f_end, b_end, send)
        return max(at, gathered_at[s]) if at is not None and kind == "F" and m == 0 else at

    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    w_end: dict[tuple[int, int], float] = {}
    f_start: dict[tuple[int, int], float] = {}
    events += _timeline(orders, segments, ready, processors, f_start=f_start, f_end=f_end, b_end=b_end, w_end=w_end)
    # when micro-batch m's backward on stage s is wholly done (its W, when split): its activations free then
    done = {key: w_end.get(key, end) for key, end in b_end.items()}
    # Gradient reduction after each stage's last backward, one at a time per device.
    finish = max(done.values())
    for d in range(D):
        clock = 0.0
        for last, s in sorted((max(done[(s, m)] for m in range(M)), s) for s in stages_of[d]):
            if per_mb[0][s].reduce_s > 0:
                start = max(clock, last)
                events.append(Event(kind="dp_reduce", stage=s, device=d, microbatch=M - 1, start_s=start,
                                    end_s=start + per_mb[0][s].reduce_s * bw_scale))
                clock = events[-1].end_s
                finish = max(finish, clock)
    for (s, m), end in f_end.items():
        if s + 1 < S and send(s, m) > 0:
            d = device_of[s]
            events.append(
                Event(kind="send_forward", stage=s, device=d, microbatch=m, start_s=end, end_s=end + send(s, m))
            )
    for (s, m), end in b_end.items():
        if s > 0 and send(s - 1, m) > 0:
            d = device_of[s]
            events.append(
                Event(kind="send_backward", stage=s, device=d, microbatch=m, start_s=end, end_s=end + send(s - 1, m))
            )

    T = finish + step_overhead_s
    compute = [e for e in events if e.kind in COMPUTE_EVENTS]
    stage_busy = [0.0] * S
    for e in compute:
        stage_busy[e.stage] += e.duration_s
    busy = [sum(stage_busy[s] for s in stages_of[d]) for d in range(D)]
    bubble = 1.0 - sum(busy) / (D * T) if T > 0 else 0.0

    # Memory: sweep activation lifetimes [forward start, backward done); frees before allocations at equal times.
    # A deferred W keeps all the micro-batch's activations of the stage alive until it runs (an upper bound: its
    # I has freed what only the input gradient needed).
    peak_inflight = [0] * S
    peak_act = [0] * D
    for d in range(D):
        changes: list[tuple[float, int, int, int]] = []  # (time, +1/-1 order key, stage, bytes signed)
        for s in stages_of[d]:
            for m in range(M):
                a = per_mb[m][s].activation_bytes
                changes.append((f_start[(s, m)], 1, s, a))
                changes.append((done[(s, m)], 0, s, -a))
        changes.sort(key=lambda c: (c[0], c[1]))
        count = {s: 0 for s in stages_of[d]}
        live = 0
        for _, is_alloc, s, nbytes in changes:
            count[s] += 1 if is_alloc else -1
            live += nbytes
            peak_inflight[s] = max(peak_inflight[s], count[s])
            peak_act[d] = max(peak_act[d], live)
        # what one running micro-batch holds beyond all it keeps (negative when the blocks after the
        # running one free more than it needs), or the largest workspace on top
        excess = max((_running_excess(per_mb[m][s]) for s in stages_of[d] for m in range(M)), default=0)
        peak_act[d] += excess
    static = [
        sum(per_mb[0][s].static_bytes for s in stages_of[d])
        + max(per_mb[0][s].gathered_bytes for s in stages_of[d])
        - _held_across_stages(plan, costs, stages_of[d])
        for d in range(D)
    ]
    events.sort(key=lambda e: (e.start_s, e.device, e.kind))
    return SimResult(
        schedule=sched,
        num_stages=S,
        num_devices=D,
        num_microbatches=M,
        iteration_time_s=T,
        bubble_fraction=bubble,
        busy_s=tuple(busy),
        stage_busy_s=tuple(stage_busy),
        peak_inflight=tuple(peak_inflight),
        peak_activation_bytes=tuple(peak_act),
        static_bytes=tuple(static),
        peak_memory_bytes=tuple(st + a for st, a in zip(static, peak_act)),
        events=tuple(events),
        device_stages=tuple(stages_of),
    )


@lru_cache(maxsize=64)
def live_counts(schedule: str, num_devices: int, virtual_stages: int,
                num_microbatches: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per device, the micro-batches alive on each of its stages (in :meth:`Schedule.stages_of` order; alive from
    the F until the W, or the whole backward B) after each forward of its operation order, keeping only the count
    tuples no other dominates: the peak of sum_k n_k A_k is attained at one of them for any A_k >= 0."""
    D, v = num_devices, virtual_stages
    placed = Schedule(kind=schedule, num_microbatches=num_microbatches, virtual_stages=v)
    out = []
    for d, ops in enumerate(operation_order(schedule, D, v, num_microbatches)):
        index = {s: k for k, s in enumerate(placed.stages_of(d, D * v))}
        n = [0] * v
        seen: set[tuple[int, ...]] = set()
        for kind, s, _ in ops:
            if kind == "F":
                n[index[s]] += 1
                seen.add(tuple(n))
            elif kind in ("W", "B"):
                n[index[s]] -= 1
        kept = [p for p in seen if not any(q != p and all(a >= b for a, b in zip(q, p)) for q in seen)]
        out.append(tuple(sorted(kept)))
    return tuple(out)
