"""The joint partition + recomputation problem, and the one accounting every solver shares.

Torch-free. Notation (as in the ILP):
    n blocks i = 0..n-1, S stages s = 0..S-1 (contiguous, non-empty), M micro-batches;
    option o in {none, selective, full} per block;
    t_io = f_i + b_i + r_io     time of block i under option o (forward, backward, recompute);
    a_io                        activation bytes block i keeps for backward under option o;
    w_i                         static bytes (weights, gradients, optimizer states);
    h_s                         shared parameters (tied weights) that several blocks of stage s read: each
                                such block's w_i counts it, the stage holds one copy (:func:`held_once`);
    c_k = bytes_k / bandwidth   time to send what crosses cut k (c_0 = c_n = 0);
    u_i                         bytes of block i's weights gathered while it computes (FSDP), else 0;
    q_i                         workspace: bytes block i holds only while it computes, beyond a_io;
    d_i                         seconds of data-parallel communication block i adds once per iteration;
    p_io                        peak bytes of one forward and backward of block i alone under option o
                                (a_io plus what it holds while it computes; p_io <= a_io + q_i).
Stage s running blocks [i, j):
    T_s = sum t_io + c_j + c_i            (sends forward activations at its end, gradients at its start)
    Mem_s = sum w_i - h_s + max u_i + max q_i + k_s * sum a_io + bytes_i + k_s * bytes_j
            (k_s micro-batches in flight; a receive buffer; the outputs each micro-batch in flight holds
            until its backward, which torch's pipelining keeps to run that backward)
Mem_s is what every planner fits under the budget: a bound, linear in the options, with one
interval constant (max q_i). The predicted peak a plan reports is tighter:
    Peak_s = sum w_i - h_s + max u_i + (k_s - 1) A + max_b (A_<b + p_bo) + bytes_i + k_s * bytes_j,   A = sum a_io,
the micro-batch that runs holding only what the blocks before b keep plus b's own peak
(:func:`omnibal_compile.ir.costs.running_peak`); Peak_s <= Mem_s. Without p (not measured) Peak_s = Mem_s.
In flight k_s: GPipe M; 1F1B min(S - s, M); interleaved 1F1B with p = S / v devices and v chunks
per device: device d = s mod p keeps min(2 (p - d - 1) + (v - 1) p + 1, v M) micro-batch chunks at
its peak (Megatron's warm-up count + 1), shared evenly by its v chunks, each chunk given 1/v of the
device budget (an approximation that keeps stages independent).
Iteration time: GPipe and 1F1B  sum_s T_s + (M - 1) max_s T_s;
    interleaved  M max_d T_d + (p - 1) / (p v) sum_s T_s, with T_d the sum over device d's chunks
    For equal stages of time T these give (M + S - 1) T, and (v M + p - 1) T for interleaved.
    Devices sharing P < S processors (``processors``, e.g. local CPU ranks on fewer cores; GPipe and
    1F1B only): max(that, M sum_s T_s / P), since P processors do at most P seconds of work a second;
    balancing the stages then buys nothing once the shared work binds (:func:`pipeline_time`).
    This is a surrogate of the simulator (:mod:`omnibal_compile.sim`, the reference iteration-time
    model), checked against it in tests/test_iteration_model.py. With every micro-batch alike and
    free sends it is exact for equal stages (data parallelism included), for GPipe whenever one stage
    has both the largest forward and the largest backward (GPipe takes sum F + (M - 1) max F +
    sum B + (M - 1) max B, so the closed form is a lower bound of it), and for 1F1B whenever the last
    stage is a bottleneck; otherwise 1F1B may run a few per cent either side of it, never below the
    closed form less the stages after the bottleneck, never above GPipe's time. With sends, charged
    here as busy time at both ends of a cut where the simulator overlaps them, it bounds 1F1B from above.
Data parallelism (``problem_from_costs(data_parallel=...)``, rules in
:meth:`omnibal_compile.ir.costs.DataParallel.block_cost`): w_i is the per-device static bytes of
the layout; FSDP's gathers before every forward and backward are part of t_io (2 gathers per
micro-batch); the once-per-iteration terms (gradient reduction after the last backward, FSDP's one
gather when weights stay gathered) add D = max over devices of sum d_i to the iteration time. The
planner charges D in full, an upper bound on what the simulator finds exposed (the first stage
finishes last, so its reduction is exposed; later stages' overlap the backwards still running
before them): exact for equal stages and whenever the first device has the largest D. The ILP
and the DP optimise this same objective (D enters as one more max term, not per stage).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omnibal_compile._utils.units import format_size
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import (
    NO_DATA_PARALLEL,
    RECOMPUTE_OPTIONS,
    CostTable,
    DataParallel,
    held_once,
    running_peak,
)
from omnibal_compile.ir.schedule import SCHEDULES, Schedule
from omnibal_compile.sim.simulate import live_counts, pipeline_processors, shared_work_time, stage_schedule_time

__all__ = [
    "PartitionProblem", "Solution", "evaluate", "in_flight", "problem_from_costs", "lower_bound", "stage_time_bound",
    "stage_static", "stage_shared", "sync_time", "stage_peak", "stage_io", "PlanFigures", "plan_figures",
    "device_limit", "evaluate_zero_bubble", "zero_bubble_block_parts", "zero_bubble_devices", "zero_bubble_peak",
    "zero_bubble_stage_act", "zero_bubble_stage_fixed", "pipeline_time",
]

OPTIONS = RECOMPUTE_OPTIONS

PLANNED_SCHEDULES: frozenset[str] = frozenset(SCHEDULES)
"""Schedules the planners cover: the classic ones by their closed forms, the split-backward ones (interleaved-zb,
zbv, dualpipev) by the simulator's model (:mod:`omnibal_compile.planning.zero_bubble`)."""


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """Everything a solver needs, as plain numbers."""

    names: tuple[str, ...]
    """Block names."""
    kinds: tuple[str, ...]
    """Block kinds (``layer`` / ``module`` / ``glue``)."""
    time: tuple[tuple[float, float, float], ...]
    """t_io: seconds per micro-batch of block i under none / selective / full."""
    act: tuple[tuple[int, int, int], ...]
    """a_io: activation bytes kept per micro-batch under none / selective / full."""
    static: tuple[int, ...]
    """w_i: static bytes of block i."""
    cut_time: tuple[float, ...]
    """c_k: send time across cut k, k = 0..n (c_0 = c_n = 0)."""
    cut_bytes: tuple[int, ...]
    """Bytes across cut k (receive buffer of a stage starting at k)."""
    num_params: tuple[int, ...]
    """Parameters per block (for the parameter baseline)."""
    flops: tuple[float, ...]
    """Forward FLOPs per block (for the FLOPs baseline)."""
    num_stages: int
    """S, stages (all chunks of all devices)."""
    num_microbatches: int
    """M."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved`` (see :attr:`pipeline_schedule`)."""
    virtual_stages: int = 1
    """v, chunks per device (interleaved only)."""
    budget: tuple[float, ...] = ()
    """Memory budget per device (length p = S / v); empty = unconstrained."""
    allowed: tuple[str, ...] = OPTIONS
    """Recompute options the solver may use."""
    gathered: tuple[float, ...] = ()
    """u_i: bytes block i gathers while it computes (FSDP resharding after forward); a stage adds its largest.
    Empty = none."""
    workspace: tuple[float, ...] = ()
    """q_i: bytes block i holds only while it computes, beyond its activations; a stage adds its largest.
    Empty = none."""
    sync: tuple[float, ...] = ()
    """d_i: data-parallel seconds block i adds once per iteration; a device adds its blocks' sum. Empty = none."""
    peak: tuple[tuple[float, float, float], ...] = ()
    """p_io: peak bytes of one forward and backward of block i alone under none / selective / full; the
    predicted peak (not the planners' bound) reads it. Empty = not measured."""
    data_parallel: DataParallel = NO_DATA_PARALLEL
    """The data-parallel layout ``static``, ``gathered``, ``sync`` and ``time`` were derived with (recorded in
    plans)."""
    shared: tuple[tuple[tuple[int, ...], float], ...] = ()
    """(blocks, static bytes of one copy) of each parameter several blocks read (tied weights): w_i of each of
    those blocks counts it, a stage holding several of them one copy (h_s). Empty = none."""
    forward: tuple[float, ...] = ()
    """f_i: the forward part of t_io (seconds per micro-batch); needed by the zero-bubble schedules. Empty = none."""
    weight: tuple[float, ...] = ()
    """w_i: the weight-gradient part of block i's backward (0 for a frozen block), which a zero-bubble schedule
    runs apart; needed by them. Empty = not given."""
    processors: float | None = None
    """Processors the pipeline's devices share (:func:`omnibal_compile.sim.simulate.pipeline_processors` of the
    cost table's, as the simulator takes them); None = one per device. Fewer than the devices bound the
    iteration time by the work they share (:func:`pipeline_time`); GPipe and 1F1B only."""
    tie_tolerance: float = 0.0
    """Plans predicted within this fraction of the least iteration time count as equal, and
    :func:`omnibal_compile.planning.ties.break_ties` picks among them by figures that do not depend on
    timings (0: the fastest plan, exactly; :func:`problem_from_costs` sets it for measured costs)."""

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("kinds", "time", "act", "static", "num_params", "flops"):
            if len(getattr(self, name)) != n:
                raise InputError(f"{name} has {len(getattr(self, name))} entries for {n} blocks")
        if len(self.cut_time) != n + 1 or len(self.cut_bytes) != n + 1:
            raise InputError(f"cut_time and cut_bytes need n + 1 = {n + 1} entries")
        if not 1 <= self.num_stages <= n:
            raise PlanError(f"num_stages={self.num_stages} must lie in [1, {n}] (the number of blocks)")
        self.pipeline_schedule.check(self.num_stages)
        self.pipeline_schedule.rule.require(PLANNED_SCHEDULES, "the planner")
        if self.budget and len(self.budget) != self.num_devices:
            raise InputError(f"budget needs one entry per device ({self.num_devices}), got {len(self.budget)}")
        if not self.allowed or any(o not in OPTIONS for o in self.allowed):
            raise InputError(f"allowed recompute options must be a non-empty subset of {list(OPTIONS)}")
        if not (isinstance(self.tie_tolerance, (int, float)) and 0 <= self.tie_tolerance < 1):
            raise InputError(f"tie_tolerance must be a fraction in [0, 1), got {self.tie_tolerance!r}")
        for name in ("gathered", "workspace", "sync", "peak", "forward", "weight"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise InputError(f"{name} has {len(getattr(self, name))} entries for {n} blocks (or give none)")
        if self.processors is not None and not self.processors > 0:
            raise InputError(f"processors must be positive (or None for one per device), got {self.processors}")
        if self.shares_processors and self.schedule not in ("gpipe", "1f1b"):
            raise PlanError(f"the planner models devices that share processors ({self.processors:g} for "
                            f"{self.num_devices} devices) under gpipe and 1f1b only, not {self.schedule!r}: plan "
                            "it with processors=None in the cost table (one per device), or with gpipe or 1f1b")
        if self.pipeline_schedule.rule.split_backward:
            if not (self.forward and self.weight):
                raise InputError(f"schedule {self.schedule!r} splits each backward: the problem needs forward and "
                                 "weight (each block's forward and weight-gradient seconds)")
            if self.sync:
                raise PlanError(f"the planner plans schedule {self.schedule!r} without data parallelism only; "
                                "plan it at data_parallel size 1")

    @property
    def pipeline_schedule(self) -> Schedule:
        """The schedule, micro-batches and chunks per device, as one value."""
        return Schedule(kind=self.schedule, num_microbatches=self.num_microbatches, virtual_stages=self.virtual_stages)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def shares_processors(self) -> bool:
        """The devices share fewer processors than there are devices."""
        return shared_work_time(1.0, self.processors, self.num_devices) > 0

    @property
    def num_devices(self) -> int:
        return self.num_stages // self.virtual_stages

    def device_of(self, s: int) -> int:
        return SCHEDULES[self.schedule].device_of(s, self.num_devices)

    def stage_budget(self, s: int) -> float:
        """Memory a stage may use (its device's budget, split evenly among the device's chunks)."""
        if not self.budget:
            return math.inf
        return self.budget[self.device_of(s)] / self.virtual_stages

    def memory_limit(self, s: int) -> float:
        """The most memory stage ``s`` may be predicted to use and still fit: its budget plus a
        rounding allowance of one part in 1e9. The one fitting rule of every planner and check."""
        return self.stage_budget(s) * (1 + 1e-9) + 1e-6

    def option_indices(self) -> tuple[int, ...]:
        return tuple(OPTIONS.index(o) for o in self.allowed)

    def useful_options(self, i: int) -> tuple[int, ...]:
        """The allowed options of block ``i`` that no other allowed option dominates.

        An option that keeps no less activation memory and takes no less time than another is never
        needed (``lm_head``'s selective policy saves the logits, which none never keeps, and runs
        longer); of options equal in both, the one recomputing least (the lowest index) stays.
        Every solver and the tie-break choose among these only.
        """
        opts = self.option_indices()
        cost = [(self.time[i][o], self.act[i][o]) for o in opts]
        return tuple(
            o for k, o in enumerate(opts)
            if not any(
                (q_cost[0] <= cost[k][0] and q_cost[1] <= cost[k][1]) and (q_cost != cost[k] or q < k)
                for q, q_cost in enumerate(cost) if q != k
            )
        )


def in_flight(problem: PartitionProblem, s: int) -> float:
    """k_s: micro-batches whose activations stage ``s`` holds at its peak (see module docstring)."""
    S, M = problem.num_stages, problem.num_microbatches
    if problem.schedule == "gpipe":
        return float(M)
    if problem.schedule == "1f1b":
        return float(min(S - s, M))
    if problem.pipeline_schedule.rule.split_backward:  # the most alive on the stage (zero_bubble counts its device)
        d = problem.device_of(s)
        k = problem.pipeline_schedule.stages_of(d, S).index(s)
        counts = live_counts(problem.schedule, problem.num_devices, problem.virtual_stages, M)[d]
        return float(max(c[k] for c in counts))
    p, v = problem.num_devices, problem.virtual_stages
    d = problem.device_of(s)
    chunks = min(2 * (p - d - 1) + (v - 1) * p + 1, v * M)
    return chunks / v


@dataclass(frozen=True, kw_only=True)
class Solution:
    """A plan at solver level: cut points, recompute options, and its predicted figures."""

    boundaries: tuple[int, ...]
    """0 = b_0 < ... < b_S = n."""
    recompute: tuple[str, ...]
    """Option per block."""
    stage_time: tuple[float, ...]
    """T_s per micro-batch."""
    stage_memory: tuple[float, ...]
    """Mem_s: the memory bound every planner fits under the budget."""
    iteration_time: float
    """The schedule's iteration time."""
    feasible: bool
    """Every stage fits its budget."""
    planner: str = ""
    """Who produced it."""
    status: str = ""
    """Solver status (e.g. ``optimal``, ``time limit, gap 0.3%``)."""
    solve_seconds: float = 0.0
    """Wall time of the solve."""
    gap: float | None = None
    """Relative optimality gap reported by the solver, when known."""
    binding: str = ""
    """What limits the plan: ``time of stage k`` or ``memory of stage k: ... free, too little to recompute less``."""
    sync_time: float = 0.0
    """D: data-parallel seconds the iteration time includes (see the module docstring); 0 without dp."""
    extra: dict = field(default_factory=dict)
    """Solver-specific notes."""
    stage_peak: tuple[float, ...] = ()
    """Peak_s: the predicted peak memory of each stage (<= Mem_s; see the module docstring)."""


def pipeline_time(problem: PartitionProblem, total: float, largest: float) -> float:
    """GPipe's and 1F1B's iteration time before D from the stages' summed and largest time per micro-batch:
    the closed form sum_s T_s + (M - 1) max_s T_s, or, when the devices share fewer processors than there are
    devices, the shared work's bound M sum_s T_s / processors if larger (the simulator's processor sharing:
    :func:`omnibal_compile.sim.simulate.shared_work_time`). The one objective every GPipe/1F1B planner uses."""
    M = problem.num_microbatches
    closed = total + (M - 1) * largest
    return max(closed, shared_work_time(M * total, problem.processors, problem.num_devices))


def _iteration_time(problem: PartitionProblem, stage_time: Sequence[float]) -> float:
    M = problem.num_microbatches
    if problem.schedule in ("gpipe", "1f1b"):
        return pipeline_time(problem, sum(stage_time), max(stage_time))
    p, v = problem.num_devices, problem.virtual_stages
    per_device = [sum(stage_time[s] for s in range(problem.num_stages) if problem.device_of(s) == d) for d in range(p)]
    return M * max(per_device) + (p - 1) / (p * v) * sum(stage_time)


def stage_static(problem: PartitionProblem, i: int, j: int) -> float:
    """sum w_i - h_s + max u_i + max q_i over blocks [i, j): memory a stage holds whatever is in flight."""
    return sum(problem.static[i:j]) - stage_shared(problem, i, j) + stage_transient(problem, i, j)


def stage_shared(problem: PartitionProblem, i: int, j: int) -> float:
    """h_s over blocks [i, j): the static bytes that sum w_i counts more than once (tied weights)."""
    return held_once(problem.shared, range(i, j)) if problem.shared else 0.0


def stage_transient(problem: PartitionProblem, i: int, j: int) -> float:
    """max u_i + max q_i over blocks [i, j): what a stage holds only while one of its blocks computes."""
    return max(problem.gathered[i:j], default=0.0) + max(problem.workspace[i:j], default=0.0)


def sync_time(problem: PartitionProblem, boundaries: Sequence[int]) -> float:
    """D: the largest device's sum of d_i (0 without data parallelism)."""
    if not problem.sync:
        return 0.0
    per_stage = [sum(problem.sync[i:j]) for i, j in zip(boundaries, boundaries[1:])]
    return max(
        sum(per_stage[s] for s in range(problem.num_stages) if problem.device_of(s) == d)
        for d in range(problem.num_devices)
    )


def stage_figures(problem: PartitionProblem, s: int, i: int, j: int, options: Sequence[int]) -> tuple[float, float]:
    """(T_s, Mem_s) of stage ``s`` running blocks [i, j) with option index ``options[b - i]`` each."""
    t = sum(problem.time[b][o] for b, o in zip(range(i, j), options)) + problem.cut_time[i] + problem.cut_time[j]
    a = sum(problem.act[b][o] for b, o in zip(range(i, j), options))
    mem = stage_static(problem, i, j) + in_flight(problem, s) * a + stage_io(problem, s, i, j)
    return t, mem


def stage_io(problem: PartitionProblem, s: int, i: int, j: int) -> float:
    """bytes_i + k_s bytes_j: stage ``s`` on [i, j) receives its input into one buffer, and every micro-batch
    in flight holds the stage's outputs until its backward (the pipeline runs that backward from them)."""
    recv = problem.cut_bytes[i] if i > 0 else 0
    return recv + (in_flight(problem, s) * problem.cut_bytes[j] if j < problem.n else 0.0)


def stage_peak(problem: PartitionProblem, s: int, i: int, j: int, options: Sequence[int]) -> float:
    """Peak_s of stage ``s`` running blocks [i, j) with option index ``options[b - i]`` each; Mem_s
    when the blocks' peaks are not known."""
    if not problem.peak:
        return stage_figures(problem, s, i, j, options)[1]
    kept = [problem.act[b][o] for b, o in zip(range(i, j), options)]
    own = [problem.peak[b][o] for b, o in zip(range(i, j), options)]
    # the other micro-batches in flight keep all (k_s - 1 of them; fewer than one with interleaved's share)
    others = (in_flight(problem, s) - 1) * sum(kept)
    return (sum(problem.static[i:j]) - stage_shared(problem, i, j) + max(problem.gathered[i:j], default=0.0) + others
            + running_peak(kept, own)
            + stage_io(problem, s, i, j))


def evaluate(
    problem: PartitionProblem,
    boundaries: Sequence[int],
    recompute: Sequence[str],
    *,
    planner: str = "",
    status: str = "",
    solve_seconds: float = 0.0,
    gap: float | None = None,
    extra: dict | None = None,
) -> Solution:
    """Predicted stage times, memory and iteration time (pipeline + D) of a plan, by the shared accounting."""
    b = tuple(int(x) for x in boundaries)
    if len(b) != problem.num_stages + 1 or b[0] != 0 or b[-1] != problem.n or any(x >= y for x, y in zip(b, b[1:])):
        raise PlanError(
            f"boundaries {list(b)} are not {problem.num_stages} contiguous non-empty stages of {problem.n} blocks"
        )
    if len(recompute) != problem.n:
        raise PlanError(f"recompute has {len(recompute)} entries for {problem.n} blocks")
    if problem.pipeline_schedule.rule.split_backward:  # their own accounting, and the simulator's time
        return evaluate_zero_bubble(problem, b, recompute, planner=planner, status=status, solve_seconds=solve_seconds,
                            gap=gap, extra=dict(extra or {}))
    opts = [OPTIONS.index(r) for r in recompute]
    times, mems, peaks = [], [], []
    for s in range(problem.num_stages):
        t, m = stage_figures(problem, s, b[s], b[s + 1], opts[b[s] : b[s + 1]])
        times.append(t)
        mems.append(m)
        peaks.append(stage_peak(problem, s, b[s], b[s + 1], opts[b[s] : b[s + 1]]))
    feasible = all(m <= problem.memory_limit(s) for s, m in enumerate(mems))
    binding = _binding(problem, b, opts, times, mems)
    return Solution(
        boundaries=b,
        recompute=tuple(recompute),
        stage_time=tuple(times),
        stage_memory=tuple(mems),
        iteration_time=_iteration_time(problem, times) + sync_time(problem, b),
        feasible=feasible,
        planner=planner,
        status=status,
        solve_seconds=solve_seconds,
        gap=gap,
        binding=binding,
        sync_time=sync_time(problem, b),
        extra=dict(extra or {}),
        stage_peak=tuple(peaks),
    )


def _binding(problem: PartitionProblem, b: tuple[int, ...], opts: Sequence[int], times: Sequence[float],
             mems: Sequence[float]) -> str:
    """What limits the plan: the time of its slowest stage, or that stage's memory when the stage
    recomputes and no block of it could recompute less (a faster option) and still fit; with its free bytes."""
    slow = max(range(len(times)), key=times.__getitem__)
    i, j = b[slow], b[slow + 1]
    recomputing = [k for k in range(i, j) if opts[k] != 0]
    if not problem.budget or not recomputing:
        return f"time of stage {slow}"
    budget = problem.stage_budget(slow)
    free = f"{format_size(max(budget - mems[slow], 0.0))} of {format_size(budget)} free"
    for k in recomputing:
        for o in problem.useful_options(k):
            if problem.time[k][o] < problem.time[k][opts[k]]:
                trial = [*opts[i:k], o, *opts[k + 1 : j]]
                if stage_figures(problem, slow, i, j, trial)[1] <= problem.memory_limit(slow):
                    return f"time of stage {slow}, which recomputes with {free}"
    return f"memory of stage {slow}: {free}, too little to recompute less"


def stage_time_bound(problem: PartitionProblem, iteration_bound: float) -> float:
    """Largest stage time any plan with iteration time <= ``iteration_bound`` can have.

    1F1B/GPipe: sum_s T_s + (M - 1) max_s T_s <= bound and sum_s T_s >= the fastest total work W,
    so max_s T_s <= (bound - W) / (M - 1). Interleaved: a stage is part of its device's time and
    M T_d <= bound - (p - 1) / (p v) W.
    """
    P, M = problem, problem.num_microbatches
    work = sum(min(P.time[i][o] for o in P.option_indices()) for i in range(P.n))
    if P.schedule in ("gpipe", "1f1b"):
        return (iteration_bound - work) / (M - 1) if M > 1 else iteration_bound
    p, v = P.num_devices, P.virtual_stages
    return (iteration_bound - (p - 1) / (p * v) * work) / M


def lower_bound(problem: PartitionProblem) -> float:
    """max(total work / S, largest block) with the fastest option everywhere: no plan's bottleneck is lower."""
    fastest = [min(problem.time[i][o] for o in problem.option_indices()) for i in range(problem.n)]
    return max(sum(fastest) / problem.num_stages, max(fastest))


PROFILED_TIE_TOLERANCE = 0.02
"""Tie tolerance for measured costs. A fixed value, not each run's own spread: a tolerance taken
from a noisy spread would move the edge of the tie set from run to run. 2% is above the gaps
between the demo's competing plans under CPU noise (``python bench/cost_stability.py`` prints them
and the run-to-run spread); set ``tie_tolerance=`` to override it."""

def tie_tolerance_for(costs: CostTable) -> float:
    """:data:`PROFILED_TIE_TOLERANCE` for costs timed with a measured spread, 0 for modelled (exact) ones."""
    return PROFILED_TIE_TOLERANCE if any(b.time_spread > 0 for b in costs.blocks) else 0.0


def _split_backward(costs: CostTable, schedule: str) -> dict[str, tuple[float, ...]]:
    """The problem's ``forward`` and ``weight`` for a schedule that splits the backward (none for the others)."""
    if schedule not in SCHEDULES or not SCHEDULES[schedule].split_backward:
        return {}
    costs.require_backward_split(schedule)
    return {"forward": tuple(b.forward_s for b in costs.blocks),
            "weight": tuple(float(b.weight_grad_s or 0.0) for b in costs.blocks)}


def problem_from_costs(
    costs: CostTable,
    *,
    num_stages: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    budget: float | Sequence[float] | None = None,
    recompute: str = "auto",
    data_parallel: DataParallel = NO_DATA_PARALLEL,
    tie_tolerance: float | None = None,
) -> PartitionProblem:
    """Build the solver's problem from a cost table.

    ``recompute``: ``auto`` lets the solver pick per block; ``none``/``selective``/``full`` forces one option.
    ``data_parallel``: replicas of the pipeline and their layout; its per-block costs come from
    :meth:`~omnibal_compile.ir.costs.CostTable.data_parallel_costs`.
    ``tie_tolerance``: see :attr:`PartitionProblem.tie_tolerance`; None takes
    :func:`tie_tolerance_for` of the costs (a fixed default when the
    times were measured with a spread, 0 for modelled ones).
    """
    if recompute == "auto":
        allowed = OPTIONS
    elif recompute in OPTIONS:
        allowed = (recompute,)
    else:
        raise InputError(f"recompute must be 'auto' or one of {list(OPTIONS)}, got {recompute!r}")
    p = num_stages // virtual_stages if virtual_stages else num_stages
    if budget is None:
        budgets: tuple[float, ...] = ()
    elif isinstance(budget, (int, float)):
        budgets = (float(budget),) * p
    else:
        budgets = tuple(float(x) for x in budget)
    if any(x <= 0 for x in budgets):
        raise InputError(f"memory budgets must be positive, got {list(budgets)}")
    blocks = costs.blocks
    dp = data_parallel
    dpc = costs.data_parallel_costs(dp)
    return PartitionProblem(
        names=tuple(b.name for b in blocks),
        kinds=tuple(b.kind for b in blocks),
        time=tuple(
            tuple(b.forward_s + b.backward_s + b.recompute_s[o] + 2 * c.op_gather_s(dp) for o in OPTIONS)  # type: ignore[misc]
            for b, c in zip(blocks, dpc)
        ),
        act=tuple(tuple(int(b.activation_bytes[o]) for o in OPTIONS) for b in blocks),  # type: ignore[misc]
        static=tuple(int(round(c.static_bytes)) for c in dpc),
        shared=costs.shared_static(dp),
        gathered=tuple(c.gathered_bytes for c in dpc) if dp.gathers else (),
        workspace=tuple(float(b.workspace_bytes) for b in blocks) if any(b.workspace_bytes for b in blocks) else (),
        peak=tuple(tuple(float(b.peak_bytes[o]) for o in OPTIONS) for b in blocks)  # type: ignore[misc]
        if all(b.peak_bytes for b in blocks) else (),
        sync=tuple(c.step_gather_s(dp) + c.reduce_s for c in dpc) if dp.size > 1 else (),
        data_parallel=dp,
        cut_time=tuple(costs.send_s(k) if 0 < k < len(blocks) else 0.0 for k in range(len(blocks) + 1)),
        cut_bytes=tuple(c if 0 < k < len(blocks) else 0 for k, c in enumerate(costs.cut_bytes)),
        num_params=tuple(b.num_params for b in blocks),
        flops=tuple(b.flops for b in blocks),
        **_split_backward(costs, schedule),
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        budget=budgets,
        allowed=allowed,
        processors=pipeline_processors(costs.processors, dp.size),
        tie_tolerance=tie_tolerance_for(costs) if tie_tolerance is None else tie_tolerance,
    )


# The split-backward schedules' accounting (module docstring of omnibal_compile.planning.zero_bubble).


def zero_bubble_block_parts(P: PartitionProblem, b: int, o: int) -> tuple[float, float, float]:
    """(forward, backward with recomputation, weight-gradient part) seconds of block ``b`` under option ``o``."""
    f, w = P.forward[b], P.weight[b]
    return f, P.time[b][o] - f, w


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    """A zbv plan's figures by this module's accounting."""

    stage_time: tuple[float, ...]
    """F + I + W per stage and micro-batch."""
    stage_memory: tuple[float, ...]
    """Each stage's share of its device's memory at the device's peak (the two of a device sum to it)."""
    device_memory: tuple[float, ...]
    """Per device: the memory bound fitted under its budget."""
    iteration_time: float
    """The simulator's iteration time."""


def zero_bubble_stage_fixed(P: PartitionProblem, i: int, j: int) -> float:
    """Bytes stage [i, j) holds whatever is alive: static - shared + transient + its receive buffer."""
    return (sum(P.static[i:j]) - stage_shared(P, i, j) + stage_transient(P, i, j)
            + (P.cut_bytes[i] if i > 0 else 0))


def zero_bubble_stage_act(P: PartitionProblem, i: int, j: int, acts: float) -> float:
    """Bytes one micro-batch keeps alive on stage [i, j): its activations and its outputs."""
    return acts + (P.cut_bytes[j] if j < P.n else 0)


def zero_bubble_peak(counts: Sequence[tuple[int, ...]], acts: Sequence[float]) -> tuple[float, tuple[int, ...]]:
    """The largest sum_k n_k A_k over the count tuples, and the tuple."""
    return max(((sum(n * a for n, a in zip(c, acts)), c) for c in counts), key=lambda x: x[0])


def zero_bubble_devices(P: PartitionProblem, d: int) -> tuple[int, ...]:
    return P.pipeline_schedule.stages_of(d, P.num_stages)


def plan_figures(P: PartitionProblem, boundaries: Sequence[int], options: Sequence[int]) -> PlanFigures:
    """Stage times, memory and iteration time of the plan with these cut points and option indices."""
    b = boundaries
    D, S = P.num_devices, P.num_stages
    F, B, W, A = [], [], [], []
    for s in range(S):
        parts = [zero_bubble_block_parts(P, k, options[k]) for k in range(b[s], b[s + 1])]
        F.append(sum(x[0] for x in parts))
        B.append(sum(x[1] for x in parts))
        W.append(sum(x[2] for x in parts))
        A.append(zero_bubble_stage_act(P, b[s], b[s + 1], sum(P.act[k][options[k]] for k in range(b[s], b[s + 1]))))
    send = [P.cut_time[b[s + 1]] for s in range(S)]
    it = stage_schedule_time(P.schedule, D, P.num_microbatches, forward_s=F, backward_s=B, weight_s=W, send_s=send,
                             virtual_stages=P.virtual_stages)
    counts = live_counts(P.schedule, D, P.virtual_stages, P.num_microbatches)
    mem = [0.0] * S
    device = []
    for d in range(D):
        stages = zero_bubble_devices(P, d)
        _, peak = zero_bubble_peak(counts[d], [A[s] for s in stages])
        for s, k in zip(stages, peak):
            mem[s] = zero_bubble_stage_fixed(P, b[s], b[s + 1]) + k * A[s]
        device.append(sum(mem[s] for s in stages))
    return PlanFigures(
        stage_time=tuple(f + x for f, x in zip(F, B)),
        stage_memory=tuple(mem),
        device_memory=tuple(device),
        iteration_time=it,
    )


def device_limit(P: PartitionProblem, d: int) -> float:
    """The most memory device ``d`` may be predicted to use (its budget and the rounding allowance)."""
    return P.budget[d] * (1 + 1e-9) + 1e-6 if P.budget else math.inf


def evaluate_zero_bubble(
    P: PartitionProblem, boundaries: Sequence[int], recompute: Sequence[str], **fields: Any
) -> Solution:
    """:func:`evaluate` for the split-backward schedules (interleaved-zb, zbv, dualpipev)."""
    opts = [OPTIONS.index(r) for r in recompute]
    fig = plan_figures(P, boundaries, opts)
    over = [d for d in range(P.num_devices) if fig.device_memory[d] > device_limit(P, d)]
    busiest = max(range(P.num_devices), key=lambda d: sum(fig.stage_time[s] for s in zero_bubble_devices(P, d)))
    binding = (f"memory of device {over[0]}" if over else
               f"time of device {busiest} (stages {', '.join(map(str, zero_bubble_devices(P, busiest)))})")
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
