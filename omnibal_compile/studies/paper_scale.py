"""Paper-scale ablation: simulated epoch time of a VLM on many GPUs, one balance added at a time.

Reproduces the structure of OmniBal's ablation (arXiv 2407.20761, Table 5) with this library's
pieces: analytic block costs on a roofline GPU (:mod:`omnibal_compile.models.analytic`), the data
balancer (:func:`omnibal_compile.data.balance_pack`) on real length statistics, the planners of
:mod:`omnibal_compile.solver`, and the pipeline schedule of :mod:`omnibal_compile.sim`.

How an epoch is simulated (all of it vectorised with numpy):
    1. the dataset is cut into micro-batches by a batching (random padded batches, or our balanced
       packs); each global step holds ``dp x M`` consecutive micro-batches of the packing's step
       order, ``M`` per data-parallel rank;
    2. each micro-batch is costed at its own shape (tiles, LLM tokens computed, attention pairs):
       per block type, forward/backward/recompute seconds and the bytes sent to the next stage;
    3. a plan (cut points + recompute option per block) turns those into per-stage forward and
       backward(+recompute) times per micro-batch; each rank's pipeline iteration is replayed
       exactly as :func:`omnibal_compile.sim.simulate` does (same operation order, same
       dependencies, sends overlapped), for all ranks and steps at once (:func:`pipeline_times`;
       tests/test_paper_scale.py checks it against ``simulate`` with one CostTable per micro-batch;
       calling ``simulate`` for each of the ~19k rank-steps of every row would take tens of minutes);
    4. a step lasts as long as its slowest data-parallel rank (the gradient all-reduce waits for
       it); the epoch is the sum over steps; GPU-days = epoch seconds x GPUs / 86400.
    Not modelled: the gradient all-reduce / distributed-optimizer collectives and the optimizer
    step themselves (about the same time in every row, so leaving them out makes the ratios
    somewhat larger gains than a real run would show), data loading, kernel-launch overheads.

Glossary:
    PP, DP, M      pipeline stages, data-parallel ranks, micro-batches per rank per step.
    planning shape plans balance stage times of the mean micro-batch of the balanced packing and
                   size memory for its largest tiles, tokens and pairs, so every micro-batch fits
                   the memory the plan predicts.
    steps          baseline (random batches, uniform layer split, full recompute) -> + balanced
                   data -> + ILP partition (full recompute) -> + per-block recompute (ILP with
                   ``recompute="auto"``); side rows: OmniBal's heuristic partition in place of the
                   ILP, and Megatron's VLM layout (ViT on stage 0).
    acceptance     a planner's new plan replaces the step before's only if
                   :func:`omnibal_compile.sim.simulate` predicts it faster at the planning shape
                   (the planners optimise a closed form that can rank near-equal plans the other way).
    budget         memory a device may use: ``memory_fraction`` of its HBM (the rest is kept for
                   the allocator's fragmentation, NCCL buffers and workspace).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from omnibal_compile.cost_table import RECOMPUTE_OPTIONS, Precision
from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.data.metrics import pack_loads
from omnibal_compile.data.packing import Packing, random_batches
from omnibal_compile.devices import A100_80G, DeviceSpec
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.models.analytic import BLOCK_TYPES, MicroBatch, TypeCosts, VLMSpec, cost_table, type_costs
from omnibal_compile.plan import Plan
from omnibal_compile.sim.simulate import operation_order, simulate
from omnibal_compile.solver import PartitionProblem, evaluate, problem_from_costs, solve, uniform_boundaries
from omnibal_compile.tables import format_table

__all__ = [
    "Setup",
    "MicroBatches",
    "PlanChoice",
    "Row",
    "PAPER_GPU_DAYS",
    "pipeline_times",
    "make_batches",
    "stage_times",
    "epoch_seconds",
    "plan_steps",
    "vit_first_boundaries",
    "run_ablation",
    "format_ablation",
]

PAPER_GPU_DAYS: dict[str, tuple[float, ...]] = {
    "internvl-6b-20b": (61.8, 51.9, 29.0, 21.3),
    "internvl-6b-34b": (75.4, 30.5),
}
"""OmniBal Table 5 (Megatron backend): baseline, + data, + model, + memory; 6+34B: baseline and full only."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One paper-scale configuration."""

    model: VLMSpec
    """The model (an analytic block list)."""
    pp: int
    """Pipeline stages (one GPU each)."""
    dp: int
    """Data-parallel ranks; GPUs = pp x dp."""
    global_batch: int = 1024
    """Samples per optimizer step (InternVL-1.5 fine-tuning uses 1024)."""
    samples_per_microbatch: int = 4
    """Samples per micro-batch (random batches) or per pack (balanced data) on average."""
    device: DeviceSpec = A100_80G
    """GPU whose roofline times the blocks."""
    memory_fraction: float = 0.9
    """Share of the GPU's memory a plan may use."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam moments over the DP ranks (Megatron's distributed optimizer, ZeRO-1)."""
    link: str = "nvlink"
    """Link between pipeline stages: a pipeline of <= 8 stages sits in one 8-GPU node (``nvlink``)."""
    ilp_time_limit: float = 10.0
    """Seconds each ILP solve may take (it starts from the exact DP optimum, so a limit costs no quality)."""

    def __post_init__(self) -> None:
        per_step = self.dp * self.samples_per_microbatch
        if self.global_batch % per_step or self.global_batch // per_step < 1:
            raise InputError(f"global_batch {self.global_batch} must be a multiple of dp x samples_per_microbatch = {per_step}")
        if self.microbatches < self.pp:
            raise InputError(f"{self.microbatches} micro-batches per rank are fewer than {self.pp} stages; 1F1B needs M >= PP")

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.samples_per_microbatch)

    @property
    def gpus(self) -> int:
        return self.pp * self.dp

    @property
    def precision(self) -> Precision:
        return Precision(optimizer_shards=self.dp if self.distributed_optimizer else 1)

    @property
    def budget(self) -> float:
        return self.memory_fraction * self.device.memory_bytes


@dataclass(frozen=True, kw_only=True, eq=False)
class MicroBatches:
    """An epoch of micro-batches from one batching: their shapes and how steps group them."""

    name: str
    """Batching (``random`` or ``balanced``)."""
    tiles: np.ndarray
    """Tiles per micro-batch."""
    tokens: np.ndarray
    """LLM tokens computed per micro-batch (padding included for padded batches)."""
    pairs: np.ndarray
    """Causal attention pairs per micro-batch."""
    steps: np.ndarray
    """``[num_steps, dp * M]`` micro-batch ids of each global step."""
    seconds: float
    """Time the batching took here."""

    def mean_shape(self) -> MicroBatch:
        return MicroBatch(tiles=round(self.tiles.mean()), tokens=round(self.tokens.mean()),
                          attention_pairs=float(self.pairs.mean()))

    def planning_shape(self) -> MicroBatch:
        return MicroBatch(tiles=int(self.tiles.max()), tokens=int(self.tokens.max()), attention_pairs=float(self.pairs.max()))


@dataclass(frozen=True, kw_only=True)
class PlanChoice:
    """A pipeline plan at block level."""

    boundaries: tuple[int, ...]
    """Stage cut points over the model's blocks."""
    recompute: tuple[str, ...]
    """Recompute option per block."""
    planner: str
    """Who made it."""
    status: str = ""
    """Solver status."""
    solve_seconds: float = 0.0
    """Planning time."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the ablation table."""

    name: str
    """Step of the ablation."""
    batching: str
    """Which micro-batches it runs."""
    plan: PlanChoice | None
    """The plan it runs (None: the planner found none that fits; see ``notes``)."""
    epoch_s: float
    """Simulated seconds per epoch."""
    gpu_days: float
    """Epoch GPU-days: epoch_s x GPUs / 86400."""
    peak_memory_gib: float
    """Largest per-device memory of the plan at the batching's largest micro-batch (static + in flight)."""
    fits: bool
    """Whether that fits the budget."""
    chain: bool = True
    """Part of the monotone chain (False for side rows such as the OmniBal heuristic)."""
    notes: dict = field(default_factory=dict)
    """Anything else worth printing."""


def pipeline_times(forward: np.ndarray, backward: np.ndarray, send: np.ndarray, *, schedule: str = "1f1b") -> np.ndarray:
    """Iteration time of many pipelines at once: ``[N, M, S]`` arrays -> ``[N]`` seconds.

    ``forward[n, m, s]``: forward seconds of stage s on micro-batch m in pipeline n;
    ``backward``: its backward plus recomputation; ``send[n, m, s]``: seconds to send stage s's
    output on (the gradient comes back in the same time). One stage per device, the operation
    order and dependencies of :func:`omnibal_compile.sim.simulate`.
    """
    forward, backward, send = (np.asarray(a, dtype=np.float64) for a in (forward, backward, send))
    if forward.ndim != 3 or forward.shape != backward.shape or forward.shape != send.shape:
        raise InputError(f"forward, backward and send must be [N, M, S] arrays of one shape, got {forward.shape}, "
                         f"{backward.shape}, {send.shape}")
    N, M, S = forward.shape
    orders = operation_order(schedule, S, 1, M)
    f_end: dict[tuple[int, int], np.ndarray] = {}
    b_end: dict[tuple[int, int], np.ndarray] = {}
    free = [np.zeros(N) for _ in range(S)]
    pos = [0] * S
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(S):
            while pos[d] < len(orders[d]):
                kind, s, m = orders[d][pos[d]]
                if kind == "F":
                    if s > 0 and (s - 1, m) not in f_end:
                        break
                    ready = f_end[(s - 1, m)] + send[:, m, s - 1] if s > 0 else 0.0
                    end = np.maximum(free[d], ready) + forward[:, m, s]
                    f_end[(s, m)] = end
                else:
                    if (s, m) not in f_end or (s < S - 1 and (s + 1, m) not in b_end):
                        break
                    ready = f_end[(s, m)] if s == S - 1 else b_end[(s + 1, m)] + send[:, m, s]
                    end = np.maximum(free[d], ready) + backward[:, m, s]
                    b_end[(s, m)] = end
                free[d] = end
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise InputError(f"schedule {schedule!r} deadlocks for M={M}, S={S}")
    return np.max(np.stack(list(b_end.values())), axis=0)


def make_batches(
    stats: LengthStats, *, per_step: int, samples_per_microbatch: int, cost: Callable[..., np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, MicroBatches]:
    """Random padded batches and our balanced packs of ``stats``, ``per_step`` micro-batches per step.

    ``cost`` (``(tiles, tokens, pairs) -> seconds``) lets the balancer put packs of equal
    predicted time into the same step.
    """
    out = {}
    for name in ("random", "balanced"):
        start = time.perf_counter()
        if name == "random":
            packing: Packing = random_batches(stats, dp=per_step, batch_size=samples_per_microbatch, seed=seed)
        else:
            packing = balance_pack(stats, dp=per_step, samples_per_pack=samples_per_microbatch, cost=cost, seed=seed)
        loads = pack_loads(stats, packing)
        out[name] = MicroBatches(
            name=name, tiles=loads["tiles"].astype(np.float64), tokens=loads["computed"].astype(np.float64),
            pairs=np.asarray(loads["pairs"], dtype=np.float64), steps=packing.steps,
            seconds=time.perf_counter() - start,
        )
    return out


def _type_counts(model: VLMSpec, plan: PlanChoice) -> np.ndarray:
    """``[S, types, options]``: how many blocks of each type run under each option on each stage."""
    types = model.block_types()
    S = len(plan.boundaries) - 1
    counts = np.zeros((S, len(BLOCK_TYPES), len(RECOMPUTE_OPTIONS)))
    for s in range(S):
        for i in range(plan.boundaries[s], plan.boundaries[s + 1]):
            counts[s, BLOCK_TYPES.index(types[i]), RECOMPUTE_OPTIONS.index(plan.recompute[i])] += 1
    return counts


def stage_times(model: VLMSpec, costs: TypeCosts, plan: PlanChoice, link_bandwidth: float) -> tuple[np.ndarray, ...]:
    """Per micro-batch and stage: forward, backward + recompute, and send seconds, each ``[micro-batches, S]``."""
    counts = _type_counts(model, plan)
    fwd = np.stack([costs.forward_s[t] for t in BLOCK_TYPES], axis=1)  # [mb, types]
    extra = np.stack([np.stack([np.zeros_like(costs.forward_s[t]), costs.selective_s[t], costs.forward_s[t]], axis=1)
                      for t in BLOCK_TYPES], axis=1)  # [mb, types, options]
    forward = fwd @ counts.sum(axis=2).T
    backward = 2 * forward + np.einsum("mto,sto->ms", extra, counts)
    types = model.block_types()
    send = np.stack([
        costs.out_bytes[types[plan.boundaries[s + 1] - 1]] / link_bandwidth if s + 1 < len(plan.boundaries) - 1
        else np.zeros_like(fwd[:, 0])
        for s in range(len(plan.boundaries) - 1)
    ], axis=1)
    return forward, backward, send


def epoch_seconds(setup: Setup, batches: MicroBatches, costs: TypeCosts, plan: PlanChoice) -> float:
    """Simulated epoch: per step the slowest DP rank's pipeline iteration, summed over steps."""
    forward, backward, send = stage_times(setup.model, costs, plan, setup.device.link_bandwidth(setup.link))
    steps = batches.steps.reshape(-1, setup.dp, setup.microbatches)  # [step, rank, micro-batch]
    flat = steps.reshape(-1, setup.microbatches)
    it = pipeline_times(forward[flat], backward[flat], send[flat])
    return float(it.reshape(steps.shape[0], setup.dp).max(axis=1).sum())


def _problem(setup: Setup, time_shape: MicroBatch, memory_shape: MicroBatch, recompute: str) -> PartitionProblem:
    """The planner's problem: times of the ``time_shape`` micro-batch, memory of the ``memory_shape`` one."""

    def problem(shape: MicroBatch) -> PartitionProblem:
        table = cost_table(setup.model, shape, device=setup.device, precision=setup.precision, link=setup.link)
        return problem_from_costs(table, num_stages=setup.pp, num_microbatches=setup.microbatches,
                                  budget=setup.budget, recompute=recompute)

    timed, sized = problem(time_shape), problem(memory_shape)
    return dataclasses.replace(timed, act=sized.act, cut_bytes=sized.cut_bytes)


def vit_first_boundaries(model: VLMSpec, pp: int) -> tuple[int, ...]:
    """Megatron's VLM layout: the whole vision encoder and projector on stage 0, LLM layers split evenly."""
    first_llm = model.vision.layers + 3  # vision.embed, the ViT layers, projector, llm.embed
    per, extra = divmod(model.llm.layers, pp)
    bounds, layer = [0], 0
    for s in range(pp - 1):
        layer += per + (1 if s < extra else 0)
        bounds.append(first_llm + layer)
    return (*bounds, model.num_blocks)


def plan_steps(
    setup: Setup, time_shape: MicroBatch, memory_shape: MicroBatch
) -> tuple[dict[str, PlanChoice], dict[str, str]]:
    """The plans of the ablation (balanced for ``time_shape`` micro-batches, fitting ``memory_shape`` ones),
    and, for planners that found no plan that fits, why."""
    model = setup.model
    n = model.num_blocks
    uniform = tuple(uniform_boundaries(["layer" if t.endswith(".layer") else "module" for t in model.block_types()],
                                       setup.pp))
    plans = {"uniform": PlanChoice(boundaries=uniform, recompute=("full",) * n, planner="uniform"),
             "vit-first": PlanChoice(boundaries=vit_first_boundaries(model, setup.pp), recompute=("full",) * n,
                                     planner="vit-first")}
    failed: dict[str, str] = {}
    for key, planner, recompute in (("ilp-full", "ilp", "full"), ("ilp-auto", "ilp", "auto"),
                                    ("omnibal-full", "omnibal", "full"), ("omnibal-auto", "omnibal", "auto")):
        start = time.perf_counter()
        try:
            sol = solve(_problem(setup, time_shape, memory_shape, recompute), planner, time_limit=setup.ilp_time_limit)
        except PlanError as e:  # a heuristic split may not fit where the ILP's does
            failed[key] = str(e)
            continue
        plans[key] = PlanChoice(boundaries=sol.boundaries, recompute=sol.recompute, planner=planner, status=sol.status,
                                solve_seconds=time.perf_counter() - start)
    # The planners optimise the closed form sum_s T_s + (M - 1) max_s T_s; the schedule itself can
    # rank two near-equal plans the other way. So, as a compiler checks a rewrite before keeping it,
    # each step keeps the step before's plan unless the simulator prefers the new one.
    for key, before in (("ilp-full", "uniform"), ("ilp-auto", "ilp-full"), ("omnibal-full", "uniform"),
                        ("omnibal-auto", "omnibal-full")):
        if key not in plans or before not in plans:
            continue
        new, old = (_simulated(setup, plans[k], time_shape) for k in (key, before))
        if new > old:
            plans[key] = dataclasses.replace(
                plans[before], planner=plans[key].planner, solve_seconds=plans[key].solve_seconds,
                status=f"kept the {before} plan (simulated {old:.4f} s vs {new:.4f} s per iteration)",
            )
    return plans, failed


def _simulated(setup: Setup, plan: PlanChoice, shape: MicroBatch) -> float:
    """Iteration seconds of ``plan`` by :func:`omnibal_compile.sim.simulate`, every micro-batch of ``shape``."""
    table = cost_table(setup.model, shape, device=setup.device, precision=setup.precision, link=setup.link)
    full = Plan(block_names=table.names, boundaries=plan.boundaries, recompute=plan.recompute, schedule="1f1b",
                num_microbatches=setup.microbatches)
    return simulate(full, table).iteration_time_s


def _memory(setup: Setup, plan: PlanChoice, shape: MicroBatch) -> tuple[float, bool]:
    sol = evaluate(_problem(setup, shape, shape, "auto"), plan.boundaries, plan.recompute)
    return max(sol.stage_memory) / 2**30, sol.feasible


def run_ablation(setup: Setup, batches: dict[str, MicroBatches]) -> list[Row]:
    """The ablation rows for ``setup`` on ``batches`` (from :func:`make_batches` with ``per_step = dp x M``)."""
    for b in batches.values():
        if b.steps.shape[1] != setup.dp * setup.microbatches:
            raise InputError(f"batching '{b.name}' has {b.steps.shape[1]} micro-batches per step; this setup needs "
                             f"dp x M = {setup.dp * setup.microbatches}")
    costs = {k: type_costs(setup.model, b.tiles, b.tokens, b.pairs, device=setup.device) for k, b in batches.items()}
    balanced = batches["balanced"]
    plans, failed = plan_steps(setup, balanced.mean_shape(), balanced.planning_shape())
    spec = [  # (name, batching, plan, in the monotone chain)
        ("baseline: random batches, uniform split, full recompute", "random", "uniform", True),
        ("+ balanced data", "balanced", "uniform", True),
        ("+ ILP partition (full recompute)", "balanced", "ilp-full", True),
        ("+ per-block recompute (ILP, auto) = omnibal_compile", "balanced", "ilp-auto", True),
        ("  OmniBal heuristic partition (full recompute)", "balanced", "omnibal-full", False),
        ("  OmniBal heuristic partition + per-stage recompute", "balanced", "omnibal-auto", False),
        ("  Megatron VLM layout (ViT on stage 0), full recompute", "balanced", "vit-first", False),
    ]
    rows = []
    for name, batching, key, chain in spec:
        if key in failed:
            if chain:
                raise PlanError(f"{name}: {failed[key]}")
            rows.append(Row(name=name, batching=batching, plan=None, epoch_s=math.nan, gpu_days=math.nan,
                            peak_memory_gib=math.nan, fits=False, chain=False, notes={"error": failed[key]}))
            continue
        b, plan = batches[batching], plans[key]
        epoch = epoch_seconds(setup, b, costs[batching], plan)
        peak, fits = _memory(setup, plan, b.planning_shape())
        rows.append(Row(name=name, batching=batching, plan=plan, epoch_s=epoch, gpu_days=epoch * setup.gpus / 86400,
                        peak_memory_gib=peak, fits=fits, chain=chain))
    return rows


def _stage_layout(model: VLMSpec, plan: PlanChoice) -> str:
    """Blocks per stage as ``v<ViT layers>+l<LLM layers>``, and recompute counts."""
    types = model.block_types()
    parts = []
    for s in range(len(plan.boundaries) - 1):
        ts = types[plan.boundaries[s]:plan.boundaries[s + 1]]
        v, l = ts.count("vision.layer"), ts.count("llm.layer")
        parts.append(f"v{v}" if not l else (f"l{l}" if not v else f"v{v}+l{l}"))
    rec = {o: plan.recompute.count(o) for o in RECOMPUTE_OPTIONS if plan.recompute.count(o)}
    return "|".join(parts) + "  " + ",".join(f"{o[:3]}:{c}" for o, c in rec.items())


def format_ablation(setup: Setup, rows: Sequence[Row], paper: Sequence[float] = ()) -> str:
    """The ablation as printed by ``bench/paper_scale.py``; ``paper`` aligns the paper's GPU-days with the chain."""
    base = rows[0].gpu_days
    chain = [r for r in rows if r.chain]
    paper_ratio: dict[str, str] = {}
    if len(paper) == len(chain):
        paper_ratio = {r.name: f"{p / paper[0]:.3f} ({p:g})" for r, p in zip(chain, paper)}
    elif len(paper) == 2:  # baseline and full only
        paper_ratio = {chain[0].name: f"1.000 ({paper[0]:g})", chain[-1].name: f"{paper[1] / paper[0]:.3f} ({paper[1]:g})"}
    head = (f"{setup.model.name}: PP {setup.pp} x DP {setup.dp} = {setup.gpus} {setup.device.name} GPUs, "
            f"M = {setup.microbatches} micro-batches of ~{setup.samples_per_microbatch} samples per rank per step "
            f"(global batch {setup.global_batch}), 1F1B, budget {setup.budget / 1e9:.0f} GB/GPU, "
            f"{'distributed optimizer' if setup.distributed_optimizer else 'no optimizer sharding'}")
    cols = ("step", "GPU-days", "ratio", "paper ratio (GPU-days)", "peak GiB", "stages (ViT|LLM layers) recompute")
    body = []
    for r in rows:
        if r.plan is None:
            body.append((r.name, "-", "-", "-", "-", "no plan fits: " + r.notes.get("error", "")[:60]))
            continue
        body.append((r.name, f"{r.gpu_days:.2f}", f"{r.gpu_days / base:.3f}", paper_ratio.get(r.name, "-"),
                     f"{r.peak_memory_gib:.1f}{'' if r.fits else ' OVER'}", _stage_layout(setup.model, r.plan)))
    return head + "\n" + format_table([cols, *body], "lrrlrl")
