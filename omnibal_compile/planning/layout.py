"""Layout search: how to lay a model out on N devices (pipeline depth, schedule, chunks, data parallelism,
micro-batching).

Torch-free, like the solver. Given block costs, N devices, a global batch and a memory budget,
:func:`search_layout` lists every layout the rules allow, plans each promising one with the
project's planner (the exact DP for 1F1B; the DP's incumbent for interleaved schedules; the exact
zero-bubble search of :mod:`omnibal_compile.planning.zero_bubble` for the split-backward schedules)
and scores its plan with the simulator (:func:`omnibal_compile.sim.simulate`); it returns the
layout with the least predicted time per sample that fits, the table of every candidate considered,
and which schedule won by how much over the best 1F1B layout (:meth:`LayoutSearch.verdict`).

Glossary:
    layout      PP x DP x TP = N devices: a pipeline of PP devices running a schedule (1F1B, interleaved 1F1B,
                or one of the zero-bubble schedules interleaved-zb, zbv, dualpipev), each device holding
                v chunks (1 for 1F1B, 2 for the V schedules, any v for the interleaved ones), each device a
                group of TP tensor-parallel ranks (TP = 1: none), replicated
                DP times, the replicas holding their training state as FSDP (weights freed after each
                forward, or kept gathered) or DDP; each replica runs M micro-batches of b samples per
                optimizer step, G = DP x M x b.
    family      1F1B (1f1b, interleaved: a whole backward per micro-batch) or zero-bubble (the backward
                split into its input-gradient and weight-gradient parts, W filling the bubble). Each family
                is pruned against its own best, so the best of each is found and the two are compared.
    not planned a zero-bubble layout the planner does not take (it plans them at DP 1 only; the cost table
                must split each backward into B and W; its exact search takes at most
                :data:`~omnibal_compile.planning.zero_bubble.MAX_CUT_VECTORS` cut vectors), or a layout
                with more stages than blocks: listed with the reason, not left out.
    tp          tensor-parallel degrees are tried where the caller gives the pass's facts for them
                (``tensor_parallel``): a TP group stays inside a node (TP <= devices_per_node and divides
                it; other degrees are left out, said in the notes); its costs are
                :func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` over NVLink (or the
                table's link without a device spec). Layouts the runtime does not run yet (TP with
                DP > 1) are planned and marked in the table's note column, not hidden.
    unit        what ``b`` and ``G`` count: samples (a cost function of the micro-batch size) or,
                for a cost table of one fixed micro-batch, micro-batches of that table's shape.
    topology    with a device spec, stages and replicas talk over NVLink inside a node of
                ``devices_per_node`` devices and over InfiniBand (one port per device) across
                nodes; ranks are laid out tensor-parallel-inner, then pipeline (a TP x PP of <= node
                size sits in one node, a data-parallel group spans nodes once N exceeds a node).
    estimate    an optimistic time per sample of a layout without planning it: every device gets
                1/PP of the work and memory, recomputation is bought at its cheapest rate (a
                fractional knapsack over the blocks' recompute options), sends are free, stages are
                as even as block sizes allow; for a zero-bubble schedule, the busiest device's M
                micro-batches with no bubble at all (and at least one micro-batch's forward and
                backward). It orders the candidates; one whose estimate exceeds the best predicted
                time of its family found so far by more than ``PRUNE_MARGIN`` is listed as not
                planned. It is a heuristic, not a proven bound (``prune=None`` plans every layout): it is
                the solver's closed form on ideal stages, which 1F1B beats when an early stage is the
                bottleneck (by up to a few per cent; the simulated time is at least M x the ideal stage,
                within one micro-batch's work of the estimate; tests/test_iteration_model.py).
    predicted   the simulator's iteration time of the layout's plan over the samples it processes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from omnibal_compile._utils.tables import counted, format_table
from omnibal_compile._utils.units import format_size
from omnibal_compile.costs.devices import DeviceSpec
from omnibal_compile.costs.mix import scale_costs
from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import (
    DATA_PARALLEL_LAYOUTS,
    NO_DATA_PARALLEL,
    CostTable,
    DataParallel,
    TensorParallelBlock,
)
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import SCHEDULES, Schedule, ScheduleRule, schedule_rule
from omnibal_compile.planning import PartitionProblem, least_memory_split, min_max_partition, problem_from_costs
from omnibal_compile.planning.build import plan_from_solution
from omnibal_compile.planning.dp import interleaved_incumbent, solve_dp
from omnibal_compile.planning.problem import in_flight
from omnibal_compile.planning.zero_bubble import search_refusal, solve_zero_bubble
from omnibal_compile.sim.simulate import simulate

__all__ = ["Layout", "Candidate", "LayoutSearch", "search_layout", "pipeline_depths"]



SEARCHED_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
"""Schedules the layout search chooses among: every one but gpipe (1F1B's time, holding all M micro-batches)."""

ZERO_BUBBLE_TIME_LIMIT = 20.0
"""Default seconds the exact zero-bubble search may take per layout; past it the layout is scored with the search's
best plan so far (said in the candidate's reason)."""

PRUNE_MARGIN = 0.10
"""A layout whose estimate exceeds the best predicted time of its family by more than this fraction is not planned: the
estimate is optimistic for most layouts, but its device split for interleaved schedules is a heuristic."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How N devices run the model: pipeline depth, chunks, data parallelism and micro-batching."""

    pp: int
    """Pipeline devices (stages per replica = pp x virtual_stages)."""
    data_parallel: DataParallel = NO_DATA_PARALLEL
    """Data-parallel replicas of the pipeline and how they hold the training state."""
    virtual_stages: int = 1
    """Chunks per device: 1 for 1F1B, 2 for the V schedules (zbv, dualpipev), any for the interleaved ones."""
    schedule: str = ""
    """The pipeline schedule (a name in :data:`SEARCHED_SCHEDULES`); empty: 1f1b for one chunk, else interleaved."""
    microbatch_size: int = 1
    """Units (samples, or micro-batches of the cost table's shape) per micro-batch."""
    num_microbatches: int = 1
    """Micro-batches per replica per optimizer step."""
    tp: int = 1
    """Tensor-parallel ranks per pipeline device (1 = none)."""

    def __post_init__(self) -> None:
        if not self.schedule:
            object.__setattr__(self, "schedule", "1f1b" if self.virtual_stages == 1 else "interleaved")
        schedule_rule(self.schedule)  # an unknown name is refused, naming the known ones

    @property
    def rule(self) -> ScheduleRule:
        """The schedule's rules."""
        return SCHEDULES[self.schedule]

    @property
    def zero_bubble(self) -> bool:
        """Whether the schedule splits each backward (the zero-bubble family)."""
        return self.rule.split_backward

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return self.data_parallel.size

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def runtime_note(self) -> str:
        """What the pipeline runtime does not run yet of this layout, whatever its plan
        (:meth:`~omnibal_compile.ir.schedule.ScheduleRule.runtime_gaps`); empty when it runs."""
        return self.note(recomputes=False)

    def note(self, *, recomputes: bool) -> str:
        """:attr:`runtime_note` for a plan of this layout that recomputes or not."""
        gaps = self.rule.runtime_gaps(tp=self.tp, recomputes=recomputes)
        return f"not run yet: {'; '.join(gaps)}" if gaps else ""

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def units_per_step(self) -> int:
        """Units all replicas process per optimizer step (the global batch)."""
        return self.dp * self.num_microbatches * self.microbatch_size

    @property
    def schedule_label(self) -> str:
        """The schedule in a table: ``1F1B``, ``interleaved x2``, ``interleaved-zb`` (ZB-H1) or ``... x2``, ``zbv``."""
        if self.schedule == "1f1b":
            return "1F1B"
        if self.rule.stages_per_device is None and (self.virtual_stages > 1 or not self.zero_bubble):
            return f"{self.schedule} x{self.virtual_stages}"
        return self.schedule

    def describe(self, *, schedule: bool = True) -> str:
        """One line, e.g. ``PP 8 x DP 16, 1F1B, FSDP, M 16 x b 4`` (``schedule=False`` leaves the schedule out)."""
        dp, m, b = self.data_parallel, self.num_microbatches, self.microbatch_size
        sched = f"{self.schedule_label}, " if schedule else ""
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        return f"PP {self.pp} x DP {dp.size}{tp}, {sched}{dp.label}, M {m} x b {b}"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout considered, and what became of it."""

    layout: Layout
    """The layout."""
    status: str
    """``best``, ``planned`` (planned and simulated), ``not planned`` (its estimate was no better than the
    best of its family found, or the planner does not take it: see ``reason``), or ``rejected`` (see ``reason``)."""
    estimate_s: float = math.nan
    """Optimistic seconds per unit before planning (see the module glossary); nan when not estimated."""
    time_per_unit_s: float = math.nan
    """Predicted (simulated) seconds per unit of the plan; nan when not planned."""
    iteration_s: float = math.nan
    """Predicted seconds of one optimizer step."""
    peak_memory_bytes: float = math.nan
    """Simulated peak memory of the fullest device; for a layout that does not fit, the least any plan needs."""
    bubble_fraction: float = math.nan
    """Idle share of device time in the simulated iteration."""
    reason: str = ""
    """Why it was rejected or not planned (or, planned, how its plan was cut short)."""
    plan: Plan | None = field(default=None, repr=False)
    """The plan it was scored with (None unless planned)."""

    @property
    def runtime_note(self) -> str:
        """What the pipeline runtime does not run yet of this layout with its plan (a split-backward plan that
        recomputes, tp with a split backward: :meth:`~omnibal_compile.ir.schedule.ScheduleRule.runtime_gaps`); empty
        when it runs."""
        recomputes = self.plan is not None and any(o != "none" for o in self.plan.block_recompute)
        return self.layout.note(recomputes=recomputes)

    @property
    def planned(self) -> bool:
        return self.status in ("best", "planned")


@dataclass(frozen=True, kw_only=True)
class LayoutSearch:
    """The result of :func:`search_layout`: the best layout, its plan, and every candidate considered."""

    best: Candidate
    """The layout with the least predicted time per unit that fits."""
    candidates: tuple[Candidate, ...]
    """Every layout considered, best first, then planned by time, not planned, rejected."""
    devices: int
    """Devices laid out."""
    global_batch: int | None
    """Units per optimizer step (None when the micro-batch count was fixed instead)."""
    memory_budget: float | None
    """Bytes per device (None: unconstrained)."""
    unit: str
    """What a unit is (``sample``, ``micro-batch``...)."""
    seconds: float
    """Wall time of the search."""
    costs: CostTable = field(repr=False)
    """The cost table the best plan was made with (micro-batch size and links of the best layout)."""
    notes: tuple[str, ...] = ()
    """Assumptions worth printing (topology, left-out layouts)."""

    @property
    def plan(self) -> Plan:
        assert self.best.plan is not None
        return self.best.plan

    def table(self, limit: int | None = None) -> str:
        """The candidates as an aligned table; ``limit`` rows at most (a count of the rest follows)."""
        return format_candidates(self.candidates, unit=self.unit, limit=limit)

    def summary(self, limit: int | None = 20) -> str:
        budget = format_size(self.memory_budget) if self.memory_budget is not None else "unconstrained"
        b = self.best
        batch = (f"global batch {counted(self.global_batch, self.unit)} per step" if self.global_batch is not None
                 else f"{counted(self.best.layout.num_microbatches, 'micro-batch')} per replica per step")
        head = (f"layout search: {counted(self.devices, 'device')}, {batch}, memory budget {budget} per device; "
                f"{len(self.candidates)} layouts "
                f"considered, {sum(c.planned for c in self.candidates)} planned and simulated, in {self.seconds:.1f} s")
        chosen = (
            f"chosen: {b.layout.describe()}: predicted {_ms(b.time_per_unit_s)} ms per {self.unit}, "
            f"{b.iteration_s:.4g} s per step, bubble {b.bubble_fraction:.1%}, peak {format_size(b.peak_memory_bytes)}"
        )
        return "\n".join([head, *self.notes, self.table(limit), chosen, self.verdict(), *self.best_per_tp()])

    def best_of(self, zero_bubble: bool) -> Candidate | None:
        """The fastest planned candidate of a family (module glossary), None when none was planned."""
        planned = [c for c in self.candidates if c.planned and c.layout.zero_bubble == zero_bubble]
        return min(planned, key=lambda c: c.time_per_unit_s, default=None)

    def verdict(self) -> str:
        """Which schedule won, and by how much over the best 1F1B layout (1F1B or interleaved), in a sentence."""
        b, unit = self.best, self.unit
        one = self.best_of(zero_bubble=False)
        zb = self.best_of(zero_bubble=True)
        won = f"schedule: {b.layout.schedule_label} won"

        def figure(c: Candidate) -> str:
            return f"{c.layout.describe()}: {_ms(c.time_per_unit_s)} ms per {unit}"

        if b.layout.zero_bubble:
            if one is None:
                return f"{won}; no 1F1B layout was planned (see the table's reasons)"
            less = 1 - b.time_per_unit_s / one.time_per_unit_s
            return (f"{won}: {less:.1%} less time per {unit} ({one.time_per_unit_s / b.time_per_unit_s:.3f}x the "
                    f"throughput) than the best 1F1B layout ({figure(one)}); predicted by the simulator")
        if zb is None:
            why = sorted({c.reason for c in self.candidates if c.layout.zero_bubble and c.reason})
            return f"{won}; no zero-bubble layout was planned" + (f" ({why[0]}{', ...' if len(why) > 1 else ''})"
                                                                  if why else "")
        more = zb.time_per_unit_s / b.time_per_unit_s - 1
        if math.isclose(zb.time_per_unit_s, b.time_per_unit_s, rel_tol=1e-9):  # the tie-break (_better) kept 1F1B
            return (f"{won}: the best zero-bubble layout ({figure(zb)}) ties it; the tie goes to 1F1B (its runtime "
                    "runs recomputation and data parallelism)")
        return (f"{won}: the best zero-bubble layout ({figure(zb)}) takes {more:.1%} more time per {unit}; "
                "predicted by the simulator")

    def best_per_tp(self) -> list[str]:
        """One line per tensor-parallel degree planned, its best layout side by side (nothing with one degree)."""
        best: dict[int, Candidate] = {}
        for c in self.candidates:  # best first, then by predicted time
            if c.planned and c.layout.tp not in best:
                best[c.layout.tp] = c
        if len(best) < 2:
            return []
        rows = [("tp", "best layout", f"predicted ms/{self.unit}", "vs chosen", "peak memory", "note")]
        for tp, c in sorted(best.items()):
            rows.append((str(tp), c.layout.describe(), _ms(c.time_per_unit_s),
                         f"{c.time_per_unit_s / self.best.time_per_unit_s:.3f}x", format_size(c.peak_memory_bytes),
                         c.runtime_note or "-"))
        return ["best per tensor-parallel degree:", format_table(rows, "llrrrl")]

    def __str__(self) -> str:
        return self.summary()


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.4g}"


def format_candidates(candidates: Sequence[Candidate], *, unit: str = "sample", limit: int | None = None) -> str:
    """Layout (its TP in it), schedule, estimate, predicted time per unit, step time, bubble, memory, status and
    reason per candidate, and a note where the runtime does not run a layout yet."""
    shown = list(candidates if limit is None else candidates[:limit])
    notes = any(c.runtime_note for c in shown)  # the column only when a layout does not run yet
    rows = [("layout", "schedule", f"estimate ms/{unit}", f"predicted ms/{unit}", "step s", "bubble", "peak memory",
             "status", *(("note",) if notes else ()))]
    for c in shown:
        mem = "-" if math.isnan(c.peak_memory_bytes) else format_size(c.peak_memory_bytes)
        rows.append((
            c.layout.describe(schedule=False), c.layout.schedule_label, _ms(c.estimate_s), _ms(c.time_per_unit_s),
            "-" if math.isnan(c.iteration_s) else f"{c.iteration_s:.4g}",
            "-" if math.isnan(c.bubble_fraction) else f"{c.bubble_fraction:.1%}", mem,
            c.status + (f": {c.reason}" if c.reason else ""), *((c.runtime_note or "-",) if notes else ()),
        ))
    text = format_table(rows, "llrrrrrl" + ("l" if notes else ""))
    if len(shown) < len(candidates):
        rest = candidates[len(shown):]
        kinds = {s: sum(c.status == s for c in rest) for s in ("planned", "not planned", "rejected")}
        text += "\n... " + ", ".join(f"{n} more {s}" for s, n in kinds.items() if n)
    return text


# -- costs -----------------------------------------------------------------------------------------
def _links(device: DeviceSpec | None, per_node: int, layout: Layout) -> tuple[str, str]:
    """(stage link, data-parallel link) names of ``layout`` (pipeline-inner ranks), or ('', '') without a device."""
    if device is None:
        return "", ""
    stage = "nvlink" if layout.pp * layout.tp <= per_node else "infiniband"
    dp = "nvlink" if layout.devices <= per_node else "infiniband"
    return stage, dp


def pipeline_depths(devices: int, num_blocks: int) -> list[int]:
    """Pipeline depths a model of ``num_blocks`` blocks can take on ``devices`` devices: divisors, <= blocks."""
    return [p for p in range(1, devices + 1) if devices % p == 0 and p <= num_blocks]


# -- the estimate ----------------------------------------------------------------------------------
def _extra_time_to_fit(problem: PartitionProblem, capacity: float) -> float:
    """Least recompute seconds per micro-batch that bring the model's kept activations to ``capacity``
    bytes, buying recomputation at its cheapest rate first (fractional: a relaxation); inf if impossible."""
    opts = problem.option_indices()
    t = np.asarray(problem.time, dtype=np.float64)[:, opts]
    a = np.asarray(problem.act, dtype=np.float64)[:, opts]
    first = np.argmin(t + 1e-30 * a, axis=1)
    rows = np.arange(len(t))
    need = float(a[rows, first].sum()) - capacity
    if need <= 0:
        return 0.0
    segments = []  # (seconds per byte saved, bytes saved) along each block's lower hull
    for i in range(len(t)):
        ti, ai = t[i, first[i]], a[i, first[i]]
        while True:
            better = [(float((t[i, o] - ti) / (ai - a[i, o])), o) for o in range(len(opts)) if a[i, o] < ai]
            if not better:
                break
            rate, o = min(better)
            segments.append((max(rate, 0.0), float(ai - a[i, o])))
            ti, ai = t[i, o], a[i, o]
    extra = 0.0
    for rate, saved in sorted(segments):
        take = min(saved, need)
        extra += rate * take
        need -= take
        if need <= 0:
            return extra
    return math.inf


def _estimate(problem: PartitionProblem, layout: Layout, budget: float | None, cache: dict) -> float:
    """Optimistic seconds per optimizer step of ``layout`` (module glossary); inf when it cannot fit.

    The planner's objective with ideal stages: 1F1B ``W + (M - 1) T``, interleaved ``M L + (p - 1) / (p v) W``,
    where W is the replica's work per micro-batch (fastest options plus the least recomputation that fits,
    spread over the devices' total memory), T the largest stage's time and L the largest device's: at least
    W / S (W / p), and at least the least largest part of a contiguous split of the blocks' fastest times
    into S stages (p devices), what block sizes allow. For interleaved schedules a device's two chunks are
    not contiguous, so its bound is a heuristic: pairing chunks can balance better, or worse.

    The zero-bubble schedules: ``M L`` (the busiest device's work with no bubble), at least the work of one
    micro-batch's forwards and input gradients (its weight gradients may wait); L is at least W / p, the largest
    stage of a contiguous split into p for one chunk per device and the largest block otherwise.
    """
    P = problem
    p, v, S, M = layout.pp, layout.virtual_stages, layout.num_stages, layout.num_microbatches
    fastest = tuple(min(P.time[i][o] for o in P.option_indices()) for i in range(P.n))
    extra = 0.0
    if budget is not None:
        transient = max(P.gathered, default=0.0) + max(P.workspace, default=0.0)
        per_device = budget - sum(P.static) / p - transient
        if per_device <= 0:
            return math.inf
        inflight = sum(in_flight(P, s) for s in range(S))
        extra = _extra_time_to_fit(P, p * per_device * S / inflight)
    work = sum(fastest) + extra
    for k in (S, p):
        if (fastest, k) not in cache:
            cache[(fastest, k)] = min_max_partition(fastest, k)[1]
    if layout.zero_bubble:
        largest = cache[(fastest, p)] if v == 1 else max(fastest)
        step = max(M * max(work / p, largest), work - sum(P.weight))
    elif v == 1:
        step = work + (M - 1) * max(work / S, cache[(fastest, S)])
    else:
        step = M * max(work / p, cache[(fastest, p)]) + (p - 1) / (p * v) * work
    return step + sum(P.sync) / p


# -- the search ------------------------------------------------------------------------------------
def search_layout(
    costs: CostTable | Callable[[int], CostTable],
    *,
    devices: int,
    global_batch: int | None = None,
    num_microbatches: int | None = None,
    memory_budget: float | None = None,
    microbatch_sizes: Sequence[int] = (1,),
    device: DeviceSpec | None = None,
    devices_per_node: int = 8,
    pipeline: Sequence[int] | None = None,
    virtual_stages: Sequence[int] = (1, 2),
    schedules: Sequence[str] = SEARCHED_SCHEDULES,
    data_parallel: Sequence[DataParallel] = DATA_PARALLEL_LAYOUTS,
    recompute: str = "auto",
    unit: str = "sample",
    prune: float | None = PRUNE_MARGIN,
    zero_bubble_time_limit: float = ZERO_BUBBLE_TIME_LIMIT,
    tensor_parallel: Mapping[int, Mapping[str, TensorParallelBlock]] | None = None,
    tp_latency_s: float = 0.0,
) -> LayoutSearch:
    """Choose the layout of ``devices`` devices with the least predicted time per unit that fits ``memory_budget``.

    Args:
        costs: one micro-batch's block costs: a function ``b -> CostTable`` of the micro-batch size in
            units, or a CostTable of a one-unit micro-batch (larger ones scaled by :func:`scale_costs`).
        devices: N; every layout has PP x DP = N.
        global_batch: units per optimizer step, all replicas together (G = DP x M x b).
        num_microbatches: instead of ``global_batch``: M fixed, each layout's step holds DP x M x b units.
        memory_budget: bytes per device; None = unconstrained.
        microbatch_sizes: micro-batch sizes b to try (units).
        device: the accelerator, for the topology's links (module glossary); None keeps the table's
            link bandwidth for sends and data-parallel collectives alike.
        devices_per_node: devices that share NVLink.
        pipeline: pipeline depths to try (default: every divisor of N the block count allows).
        virtual_stages: chunks per device to try (v > 1 only where PP > 1): v = 1 runs 1f1b or interleaved-zb
            (ZB-H1), v > 1 interleaved or interleaved-zb, v = 2 also zbv and dualpipev.
        schedules: the schedules to choose among (names in :data:`SEARCHED_SCHEDULES`); the zero-bubble ones are
            tried at PP > 1.
        data_parallel: data-parallel layouts to try (each taken at the layout's DP; their own size is ignored).
        recompute: ``auto`` (the planner picks per block) or one option forced everywhere.
        unit: name of a unit in the printed table.
        prune: leave a layout unplanned when its estimate exceeds the best predicted time found by more
            than this fraction; None plans every layout that fits (slow: seconds per layout at paper scale).
        zero_bubble_time_limit: seconds the exact zero-bubble search may take per layout (then its best plan so
            far scores the layout, said in the table); problems of more than
            :data:`~omnibal_compile.planning.zero_bubble.MAX_CUT_VECTORS` cut vectors are not planned.
        tensor_parallel: tensor-parallel degrees to try besides 1, each with the pass's facts at that degree
            (``TensorParallelReport.blocks()`` of ``find_pairs(stage, graph, tp)``), per unit: they are scaled
            with the micro-batch size. None: TP 1 only.
        tp_latency_s: seconds of one tensor-parallel all-reduce call beyond its bytes.

    Raises:
        PlanError: no layout fits the budget; the message names the layout that needs least and its budget,
            also kept as the error's ``least_budget`` attribute (bytes per device).
    """
    start = time.perf_counter()
    if not isinstance(devices, int) or devices < 1:
        raise InputError(f"devices must be a positive integer, got {devices!r}")
    if (global_batch is None) == (num_microbatches is None):
        raise InputError(
            "give the layout search global_batch (units per step) or num_microbatches (per replica), one of them"
        )
    for name, value in (("global_batch", global_batch), ("num_microbatches", num_microbatches)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if memory_budget is not None and memory_budget <= 0:
        raise InputError(f"memory_budget must be positive, got {memory_budget}")
    sizes = sorted({int(b) for b in microbatch_sizes})
    if not sizes or sizes[0] < 1:
        raise InputError(f"microbatch_sizes must be positive integers, got {list(microbatch_sizes)}")
    for name in schedules:
        schedule_rule(name).require(SEARCHED_SCHEDULES, "the layout search")
    kinds = list(dict.fromkeys(d.resized(1) for d in data_parallel))
    if not kinds or not all(isinstance(d, DataParallel) for d in kinds):
        raise InputError(f"data_parallel must be DataParallel layouts to try, got {list(data_parallel)!r}")
    tables: dict[tuple[int, int, str, str], CostTable] = {}
    facts: dict[int, Mapping[str, TensorParallelBlock]] = {1: {}, **(tensor_parallel or {})}

    def table_for(b: int, tp: int, stage_link: str, dp_link: str) -> CostTable:
        key = (b, tp, stage_link, dp_link)
        if key not in tables:
            base = costs(b) if callable(costs) else scale_costs(costs, b)
            if base.precision.optimizer_shards != 1:
                raise InputError(
                    f"the cost table shards the optimizer over {base.precision.optimizer_shards} ranks; the search "
                    "chooses the data-parallel degree itself: give costs with optimizer_shards=1")
            # the TP group sits in a node: NVLink (the table's own link without a device spec)
            tp_bandwidth = device.link_bandwidth("nvlink") if device is not None else base.link_bandwidth
            if tp > 1:  # at tp 1 the table is searched as given (it may be a TP rank's the caller made)
                base = tensor_parallel_table(base, tp, sharded={k: f.scaled(b) for k, f in facts[tp].items()},
                                             bandwidth=tp_bandwidth, latency_s=tp_latency_s)
            if device is not None:
                base = dataclasses.replace(base, link_bandwidth=device.link_bandwidth(stage_link),
                                           dp_link_bandwidth=device.link_bandwidth(dp_link))
            tables[key] = base
        return tables[key]

    flat = Layout(pp=1, data_parallel=NO_DATA_PARALLEL.resized(devices))
    n = len(table_for(sizes[0], 1, *_links(device, devices_per_node, flat)).blocks)
    depths = sorted(set(pipeline)) if pipeline is not None else pipeline_depths(devices, n)
    bad = [p for p in depths if p < 1 or devices % p or p > n]
    if bad:
        raise InputError(f"pipeline depths {bad} do not divide {devices} devices or exceed the model's {n} blocks")
    notes = []
    if device is not None:
        notes.append(f"links: {device.name}, NVLink inside nodes of {devices_per_node} devices, InfiniBand across "
                     "(tensor-parallel-inner, then pipeline ranks)")
    degrees = [1]
    for tp in sorted(facts):
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise InputError(f"tensor_parallel degrees must be integers >= 1, got {tp!r}")
        why = ("does not divide the devices" if devices % tp else
               f"exceeds the node of {devices_per_node} devices" if tp > devices_per_node else
               f"does not divide the node of {devices_per_node} devices" if devices_per_node % tp else "")
        if why:
            notes.append(f"left out: tp={tp} {why} (a tensor-parallel group stays inside a node)")
        elif tp > 1:
            degrees.append(tp)
    if len(degrees) > 1:
        notes.append("tensor parallel: sharded blocks' compute and parameters / tp plus their all-reduces; "
                     "activations not divided (no sequence parallelism)")

    # Every layout the rules allow; the schedule's own rules reject some with a reason. One device is no pipeline:
    # it runs one chunk, 1F1B. A zero-bubble layout at DP > 1 is listed once for every data-parallel layout (the
    # planner plans those schedules at DP 1 only).
    layouts: list[Layout] = []
    skipped = 0
    chunk_counts = sorted({v for v in virtual_stages if v >= 1})
    for tp in degrees:
        for p in depths:
            if (devices // tp) % p:
                continue
            dp = devices // (p * tp)
            for sched in dict.fromkeys(schedules):
                rule = SCHEDULES[sched]
                for v in _chunks(rule, chunk_counts):
                    if p == 1 and (v > 1 or rule.split_backward):
                        continue
                    for b in sizes:
                        if global_batch is not None and global_batch % (dp * b):
                            skipped += 1
                            continue
                        # exactly one of global_batch and num_microbatches is given (checked above)
                        m = cast(int, num_microbatches) if global_batch is None else global_batch // (dp * b)
                        for held in (kinds if dp > 1 and not rule.split_backward else kinds[:1]):
                            layouts.append(Layout(pp=p, data_parallel=held.resized(dp), virtual_stages=v,
                                                  schedule=sched, microbatch_size=b, num_microbatches=m, tp=tp))
    if skipped:
        notes.append(f"left out: {counted(skipped, 'pipeline depth and micro-batch size pair')} whose DP x b does not "
                     f"divide the global batch of {global_batch}")
    if not layouts and all(p == 1 for p in depths) and all(SCHEDULES[k].split_backward for k in schedules):
        raise InputError(f"schedules {list(schedules)} split the backward to fill a pipeline's bubble, and "
                         f"on {counted(devices, 'device')} there is no pipeline: give more devices, or schedule 1f1b")
    if not layouts:
        raise PlanError(f"no layout of {counted(devices, 'device')} splits a global batch of {global_batch} {unit}s "
                        f"into micro-batches of {sizes}: change the global batch or the micro-batch sizes")

    results: list[Candidate] = []
    pending: list[tuple[float, Layout, PartitionProblem, CostTable]] = []
    sched_cache: dict = {}
    for lay in layouts:
        if lay.num_stages > n:
            results.append(Candidate(layout=lay, status="not planned", reason=(
                f"{lay.virtual_stages} stages per device x PP {lay.pp} = {lay.num_stages} stages exceed the model's "
                f"{n} blocks")))
            continue
        try:
            Schedule(kind=lay.schedule, num_microbatches=lay.num_microbatches,
                     virtual_stages=lay.virtual_stages).check(lay.num_stages)
        except PlanError as e:
            results.append(Candidate(layout=lay, status="rejected", reason=str(e).split(";")[0]))  # Schedule's rule
            continue
        table = table_for(lay.microbatch_size, lay.tp, *_links(device, devices_per_node, lay))
        try:  # the planner's own rules for the split-backward schedules: a B/W split in the costs, DP 1
            problem = problem_from_costs(table, num_stages=lay.num_stages, num_microbatches=lay.num_microbatches,
                                         schedule=lay.schedule, virtual_stages=lay.virtual_stages,
                                         budget=memory_budget, recompute=recompute, data_parallel=lay.data_parallel)
        except (InputError, PlanError) as e:
            if not lay.zero_bubble:
                raise
            every = " (one row for every data-parallel layout)" if lay.dp > 1 else ""
            results.append(Candidate(layout=lay, status="not planned", reason=_first_clause(str(e)) + every))
            continue
        est = _estimate(problem, lay, memory_budget, sched_cache) / lay.units_per_step
        refusal = search_refusal(problem) if lay.zero_bubble else ""
        if refusal:  # the exact search is bounded; larger problems are left out, saying so
            results.append(Candidate(layout=lay, status="not planned", estimate_s=est, reason=_first_clause(refusal)))
            continue
        pending.append((est, lay, problem, table))

    pending.sort(key=lambda x: x[0])
    best: Candidate | None = None
    family_best: dict[bool, float] = {}  # the best predicted time per unit of each family (zero-bubble or not)
    least_need: tuple[float, Layout] | None = None
    for est, lay, problem, table in pending:
        bar = family_best.get(lay.zero_bubble)
        if prune is not None and bar is not None and est > bar * (1 + prune) and not math.isinf(est):
            results.append(Candidate(layout=lay, status="not planned", estimate_s=est,
                                     reason=f"estimate over the best of its family by more than {prune:.0%}"))
            continue
        if memory_budget is not None and not lay.zero_bubble:  # exact: the least memory any plan of the layout needs
            _, _, need = least_memory_split(problem)
            if not need <= problem.memory_limit(0) * lay.virtual_stages:
                results.append(Candidate(layout=lay, status="rejected", estimate_s=est, peak_memory_bytes=need,
                                         reason=f"needs at least {format_size(need)} per device"))
                if least_need is None or need < least_need[0]:
                    least_need = (need, lay)
                continue
        cand = _plan_and_simulate(problem, table, lay, est, memory_budget, zero_bubble_time_limit)
        results.append(cand)
        if cand.planned:
            family_best[lay.zero_bubble] = min(family_best.get(lay.zero_bubble, math.inf), cand.time_per_unit_s)
            if best is None or _better(cand, best):
                best = cand
    if best is None:
        error = PlanError(_nothing_fits(devices, memory_budget, least_need, results))
        error.least_budget = least_need[0] if least_need else None  # type: ignore[attr-defined]
        raise error
    best_table = table_for(best.layout.microbatch_size, best.layout.tp, *_links(device, devices_per_node, best.layout))
    best = dataclasses.replace(best, status="best")
    rest = sorted((c for c in results if c.layout != best.layout), key=_table_order)
    return LayoutSearch(best=best, candidates=(best, *rest), devices=devices, global_batch=global_batch,
                        memory_budget=memory_budget, unit=unit, seconds=time.perf_counter() - start, costs=best_table,
                        notes=tuple(notes))


def _better(a: Candidate, b: Candidate) -> bool:
    """Whether planned ``a`` beats ``b``: less predicted time per unit; on a tie (1e-9), the 1F1B family (its runtime
    runs recomputation and data parallelism), then less peak memory."""
    if not math.isclose(a.time_per_unit_s, b.time_per_unit_s, rel_tol=1e-9):
        return a.time_per_unit_s < b.time_per_unit_s
    return (a.layout.zero_bubble, a.peak_memory_bytes) < (b.layout.zero_bubble, b.peak_memory_bytes)


def _chunks(rule: ScheduleRule, counts: Sequence[int]) -> list[int]:
    """The chunk counts of ``counts`` schedule ``rule`` runs: its own (1 or 2), or any; a whole-backward schedule
    with any count runs from 2 (interleaved at one chunk is 1F1B)."""
    if rule.stages_per_device is not None:
        return [v for v in counts if v == rule.stages_per_device]
    return [v for v in counts if v > 1 or rule.split_backward]


def _first_clause(message: str) -> str:
    """A refusal's first clause, for the candidates' table (the fix it names follows ``;`` or ``: ``)."""
    return message.split(";")[0].split(": ")[0]


def _table_order(c: Candidate) -> tuple[int, float]:
    """Planned by predicted time, then not planned by estimate, then rejected by estimate."""
    rank = {"planned": 0, "not planned": 1, "rejected": 2}[c.status]
    key = c.time_per_unit_s if c.planned else c.estimate_s
    return rank, math.inf if math.isnan(key) else key


def _plan_and_simulate(
    problem: PartitionProblem, table: CostTable, lay: Layout, est: float, budget: float | None,
    zero_bubble_time_limit: float = ZERO_BUBBLE_TIME_LIMIT,
) -> Candidate:
    """Plan ``lay`` (exact DP for 1F1B, the DP's incumbent for interleaved, the exact zero-bubble search for the
    split-backward schedules) and simulate its plan.

    When the simulated peak exceeds the budget (the planner's in-flight count for interleaved schedules is
    an approximation), the layout is planned again against the budget shrunk by the overshoot (twice at most).
    """
    limit = budget
    for _ in range(3):
        try:
            if lay.zero_bubble:
                sol = solve_zero_bubble(problem, time_limit=zero_bubble_time_limit)
            else:
                sol = solve_dp(problem) if lay.virtual_stages == 1 else interleaved_incumbent(problem)
        except PlanError as e:
            return Candidate(layout=lay, status="rejected", estimate_s=est, reason=f"planner: {e}")
        cut_short = f"the exact search stopped at its {zero_bubble_time_limit:g} s limit: its best plan so far" if (
            lay.zero_bubble and sol.status != "optimal") else ""
        plan = dataclasses.replace(plan_from_solution(sol, table, problem), tensor_parallel=lay.tp)
        sim = simulate(plan, table)
        peak = float(max(sim.peak_memory_bytes))
        if budget is None or peak <= budget * (1 + 1e-9) + 1e-6:
            return Candidate(
                layout=lay,
                status="planned",
                estimate_s=est,
                plan=plan,
                time_per_unit_s=sim.iteration_time_s / lay.units_per_step,
                iteration_s=sim.iteration_time_s,
                peak_memory_bytes=peak,
                bubble_fraction=sim.bubble_fraction,
                reason=cut_short,
            )
        # aim under the budget by the overshoot, cumulatively (limit starts as budget, not None here)
        limit = cast(float, limit) * budget / peak
        problem = dataclasses.replace(problem, budget=(limit,) * len(problem.budget))
    return Candidate(layout=lay, status="rejected", estimate_s=est, peak_memory_bytes=peak,
                     reason=f"simulated peak {format_size(peak)} over the budget")


def _nothing_fits(
    devices: int, budget: float | None, least: tuple[float, Layout] | None, results: list[Candidate]
) -> str:
    if least is None:
        reasons = sorted({c.reason for c in results if c.reason})
        return f"no layout of {counted(devices, 'device')} could be planned: {'; '.join(reasons[:3])}"
    need, lay = least
    return (
        f"no layout of {counted(devices, 'device')} fits the memory budget of {format_size(budget or 0)} per device: "
        f"the one that needs least, {lay.describe()}, needs {format_size(need)} per device even with the most "
        f"recomputation allowed. Give a budget of at least {format_size(need)}, more devices, or a smaller "
        "micro-batch (microbatch_sizes)."
    )


# -- optimize(devices=...) -------------------------------------------------------------------------
def job_devices() -> tuple[int, str]:
    """(devices of this job, where the count comes from): torchrun's ``WORLD_SIZE``, else the visible GPUs,
    else 1 (said so)."""
    import os

    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 0:
        return int(world), f"{world} devices from torchrun's WORLD_SIZE"
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus:
        return gpus, f"{counted(gpus, 'visible GPU')}"
    return 1, "no GPU and no WORLD_SIZE here: 1 device assumed (pass devices=N to plan for N)"


def choose_layout(
    costs: CostTable,
    *,
    devices: int,
    device: DeviceSpec | None = None,
    global_batch: int | None = None,
    num_stages: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    num_microbatches: int | None = None,
    data_parallel: DataParallel = NO_DATA_PARALLEL,
    memory_budget: float | None = None,
    recompute: str = "auto",
) -> LayoutSearch:
    """:func:`search_layout` for ``optimize(devices=...)``: one micro-batch of ``costs`` is the unit, and what the
    caller fixed is pinned (stages, schedule and chunks, data-parallel degree and layout, micro-batch count).

    ``data_parallel`` with size > 1 pins the data-parallel degree and layout; size 1 leaves both to the search.
    Without ``global_batch`` or ``num_microbatches``, a step holds two micro-batches per device (said in the notes).
    Without ``schedule`` every schedule of :data:`SEARCHED_SCHEDULES` is a choice (those that run the pinned chunks).
    """
    dp = data_parallel.size
    rule = None
    if schedule is not None:
        rule = schedule_rule(schedule)
        rule.require(SEARCHED_SCHEDULES, "the layout search (for gpipe give num_stages=)")
    if dp > 1 and devices % dp:
        raise InputError(f"dp={dp} does not divide devices={devices}")
    pipeline = None
    if virtual_stages is not None:
        chunks = virtual_stages
    elif rule is not None and rule.stages_per_device is not None:
        chunks = rule.stages_per_device
    else:
        chunks = 2 if schedule == "interleaved" else 1
    if num_stages is not None:
        if num_stages % chunks:
            raise InputError(f"num_stages={num_stages} is not a multiple of virtual_stages={chunks}")
        pipeline = [num_stages // chunks]
        if devices % pipeline[0]:
            raise InputError(f"{pipeline[0]} pipeline devices do not divide devices={devices}")
    elif dp > 1:
        pipeline = [devices // dp]
    if pipeline is not None and dp > 1 and pipeline[0] * dp != devices:
        raise InputError(f"{pipeline[0]} pipeline devices x dp={dp} is not devices={devices}")
    # None leaves schedule and chunks to the search (each schedule with one chunk or two)
    pinned_v = num_stages is not None or schedule is not None or virtual_stages is not None
    notes = []
    if global_batch is None and num_microbatches is None:
        global_batch = 2 * devices
        notes.append(f"global batch not given: {global_batch} micro-batches per step assumed (2 per device)")
    result = search_layout(
        costs, devices=devices, global_batch=global_batch, num_microbatches=num_microbatches,
        memory_budget=memory_budget, device=device, pipeline=pipeline,
        virtual_stages=[chunks] if pinned_v else (1, 2),
        schedules=[schedule] if schedule is not None else SEARCHED_SCHEDULES,
        data_parallel=[data_parallel] if dp > 1 else DATA_PARALLEL_LAYOUTS, recompute=recompute,
        unit="micro-batch",
    )
    return dataclasses.replace(result, notes=(*notes, *result.notes))
