"""Paper-scale ablation: simulated epoch time of a VLM on many GPUs, one balance added at a time.

Reproduces the structure of OmniBal's ablation (arXiv 2407.20761, Table 5) with this library's
pieces: analytic block costs on a roofline GPU (:mod:`omnibal_compile.costs.analytic`), the
batchings of :mod:`omnibal_compile.data` on real length statistics, the planners of
:mod:`omnibal_compile.planning`, and the pipeline schedule of :mod:`omnibal_compile.sim`.
Everything here is SIMULATED; nothing runs a model.

How an epoch is simulated (all of it vectorised with numpy):
    1. the dataset is cut into micro-batches by a batching; each global step holds ``dp x M``
       micro-batches, ``M`` per data-parallel rank;
    2. each micro-batch is costed at its own shape (tiles, LLM tokens computed, attention pairs):
       per block type, forward/backward/recompute seconds and the bytes sent to the next stage;
    3. a plan (cut points + recompute option per block) turns those into per-stage forward and
       backward(+recompute) times per micro-batch; each rank's pipeline iteration is replayed
       by the simulator's batch form, :func:`omnibal_compile.sim.replay.pipeline_times` (the
       operation order, dependencies and timing rules of :func:`omnibal_compile.sim.simulate`:
       sends overlapped, data-parallel gathers before each operation and gradient reductions after
       each stage's last backward), for all ranks and steps at once (tests/test_iteration_model.py
       checks it equals ``simulate``, tests/test_paper_scale.py on this study's costs);
    4. a step lasts as long as its slowest data-parallel rank (each stage's gradient reduction
       waits for that stage on every rank); the epoch is the sum over steps;
       GPU-days = epoch seconds x GPUs / 86400.
    Not modelled: the optimizer step, data loading, kernel-launch overheads.

Glossary:
    PP, TP, DP, M  pipeline stages, tensor-parallel width, data-parallel ranks, micro-batches per rank
                   per step (global batch / (DP x samples per micro-batch)). GPUs = PP x TP x DP.
    batching       ``length-grouped`` (InternVL's trainer: HF ``group_by_length`` with LLaVA's
                   sampler, one mega-batch per global step sorted by length and dealt into DP x M
                   micro-batches of even total length, padded), ``random`` (padded), ``isf``
                   (OmniBal's ISF packs) and ``ours`` (our balancer's packs).
    baseline split ``uniform`` (equal layer counts), ``parameters`` (DeepSpeed ``PipelineModule``'s
                   default: the contiguous split with the smallest largest-stage parameter count) or
                   ``vit-first`` (Megatron's VLM layout: vision encoder and projector on stage 0,
                   LLM layers split evenly), each with full recomputation. ``vit-first`` runs at the
                   smallest PP x TP that fits the budget (:func:`vit_first_setup`).
    chains         ``paper``: baseline -> + ISF data -> + OmniBal's search partition -> + one
                   recompute option per stage (the least that fits); ``ours``: baseline -> + our
                   balancer -> + ILP partition (full recompute) -> + per-block recompute (ILP).
                   Every chain runs at its baseline's parallel layout.
    planning shape plans balance stage times of the mean micro-batch of their chain's batching and
                   size memory for its largest tiles, tokens and pairs, so every micro-batch fits.
    acceptance     in the ``ours`` chain a planner's plan replaces the step before's only if the
                   pipeline replay predicts it faster at the planning shape (the planners optimise a
                   closed form that can rank near-equal plans the other way).
    budget         memory a device may use: ``memory_fraction`` of its memory in GiB (the rest is
                   kept for the allocator's fragmentation, NCCL buffers and workspace).
    DP traffic     Megatron's distributed optimizer (ZeRO-1, ``dp_shard="ddp"``): per iteration a
                   gradient reduce-scatter and a parameter all-gather, the volume of one ring
                   all-reduce, charged after each stage's last backward over ``dp_link``; or ZeRO-3
                   (``dp_shard="fsdp"``): weights gathered before every forward and backward too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from omnibal_compile._utils.tables import format_table
from omnibal_compile.costs.analytic import BLOCK_TYPES, MicroBatch, TypeCosts, VLMSpec, cost_table, type_costs
from omnibal_compile.costs.devices import A100_80G, DeviceSpec
from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.isf import isf_pack, isf_search
from omnibal_compile.data.lengths import INTERNVL_TOKENS_PER_TILE, LengthStats
from omnibal_compile.data.metrics import pack_loads
from omnibal_compile.data.packing import Packing, length_grouped_batches, random_batches
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import NO_DATA_PARALLEL, RECOMPUTE_OPTIONS, DataParallel, Precision
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.planning import PartitionProblem, evaluate, problem_from_costs, solve, uniform_boundaries
from omnibal_compile.planning.baselines import min_max_partition
from omnibal_compile.sim.replay import pipeline_times

if TYPE_CHECKING:
    from bench.studies.compiled_costs import CompiledCosts

__all__ = [
    "Setup",
    "MicroBatches",
    "PlanChoice",
    "Row",
    "PAPER_GPU_DAYS",
    "BATCHINGS",
    "SPLITS",
    "CLOSEST",
    "retile_internvl15",
    "pipeline_times",
    "make_batches",
    "pack_cost",
    "stage_times",
    "epoch_seconds",
    "data_parallel_times",
    "baseline_boundaries",
    "vit_first_boundaries",
    "vit_first_setup",
    "run_ablation",
    "chain_ratios",
    "format_ablation",
    "format_distance",
    "format_cost_sources",
]

PAPER_GPU_DAYS: dict[str, tuple[float, ...]] = {
    "internvl-6b-20b": (61.8, 51.9, 29.0, 21.3),
    "internvl-6b-34b": (75.4, 30.5),
}
"""OmniBal Table 5 (Megatron backend): baseline, + data, + model, + memory; 6+34B: baseline and full only."""

BATCHINGS: tuple[str, ...] = ("length-grouped", "random", "isf", "ours")
"""Batchings :func:`make_batches` builds (module glossary)."""
SPLITS: tuple[str, ...] = ("uniform", "parameters", "vit-first")
"""Baseline splits (module glossary)."""
CLOSEST = ("vit-first", "paper")
"""(baseline split, chain) read as the paper's own setup: Table 5 is on the Megatron backend, whose
VLM layout puts the vision encoder on the first stage, under "3D parallelism" (TP as needed to fit),
and the paper's steps are ISF, its search partition and per-stage recomputation."""


def _source_costs(
    model: VLMSpec,
    costs: CompiledCosts | None,
    tiles: np.ndarray,
    tokens: np.ndarray,
    pairs: np.ndarray,
    *,
    device: DeviceSpec,
    tensor_parallel: int,
) -> TypeCosts:
    """Per-type costs from compiled tables when given, else from the analytic formulas of ``model``."""
    if costs is not None:
        return costs.type_costs(tiles, tokens, pairs, device=device, tensor_parallel=tensor_parallel)
    return type_costs(model, tiles, tokens, pairs, device=device, tensor_parallel=tensor_parallel)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One paper-scale configuration."""

    model: VLMSpec
    """The model (an analytic block list)."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel ranks."""
    tp: int = 1
    """Tensor-parallel width (Megatron TP with sequence parallelism inside a node)."""
    global_batch: int = 1024
    """Micro-batches x samples per optimizer step (InternVL-1.5 fine-tuning uses 1024 samples)."""
    samples_per_microbatch: int = 4
    """Samples per micro-batch (padded batchings) or per pack (packed ones) on average."""
    device: DeviceSpec = A100_80G
    """GPU whose roofline times the blocks."""
    memory_fraction: float = 0.9
    """Share of the GPU's memory a plan may use."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam moments over the DP ranks (ZeRO-1)."""
    dp_shard: str = "ddp"
    """``ddp``: replicated weights and gradients, ZeRO-1 optimizer (Megatron's distributed optimizer);
    ``fsdp``: ZeRO-3, weights gathered before each forward and backward."""
    dp_comm: bool = True
    """Charge the data-parallel collectives (False: leave them out, as the first version of this study did)."""
    link: str = ""
    """Link between pipeline stages; empty: ``nvlink`` when a replica (PP x TP GPUs) fits one 8-GPU node,
    else ``infiniband`` for every send (conservative)."""
    dp_link: str = "infiniband"
    """Link of the data-parallel collectives (replicas sit on different nodes)."""
    ilp_time_limit: float = 10.0
    """Seconds each ILP solve may take (it starts from the exact DP optimum, so a limit costs no quality)."""
    planner: str = "ilp"
    """Our planner: ``ilp``, or ``dp``, the exact dynamic programme the ILP is warm-started from (same
    optimum, no ILP solve: for quick tests)."""
    costs: CompiledCosts | None = None
    """Block costs: None for the analytic formulas of ``model``; else the cost tables the compiler produced
    from Hugging Face code of the same shapes (:mod:`bench.studies.compiled_costs`)."""

    def __post_init__(self) -> None:
        if self.costs is not None and self.costs.model != self.model:
            raise InputError(
                f"the compiled costs are of {self.costs.model.name}, the setup's model is {self.model.name}"
            )
        per_step = self.dp * self.samples_per_microbatch
        if self.global_batch % per_step or self.global_batch // per_step < 1:
            raise InputError(
                f"global_batch {self.global_batch} must be a multiple of dp x samples_per_microbatch = {per_step}"
            )
        try:  # the study runs 1F1B: the schedule's own rules
            Schedule(kind="1f1b", num_microbatches=self.microbatches).check(self.pp)
        except PlanError as e:
            raise InputError(f"setup: {e}") from None

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.samples_per_microbatch)

    @property
    def per_step(self) -> int:
        """Micro-batches per global step, over all ranks."""
        return self.dp * self.microbatches

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def pipeline_link(self) -> str:
        return self.link or ("nvlink" if self.pp * self.tp <= 8 else "infiniband")

    @property
    def precision(self) -> Precision:
        return Precision(optimizer_shards=self.dp if self.distributed_optimizer else 1)

    @property
    def data_parallel(self) -> DataParallel:
        return DataParallel(size=self.dp, shard=self.dp_shard) if self.dp_comm else NO_DATA_PARALLEL

    @property
    def budget(self) -> float:
        return self.memory_fraction * self.device.memory_bytes

    @property
    def cost_source(self) -> str:
        """Where the block costs come from, in words."""
        if self.costs is None:
            return "analytic formulas"
        return f"compiled from Hugging Face code ({self.costs.hf_class} on meta)"

    def layout(self) -> str:
        return f"PP {self.pp} x TP {self.tp} x DP {self.dp} = {self.gpus} GPUs, M = {self.microbatches}"

    def type_costs(self, tiles: np.ndarray, tokens: np.ndarray, pairs: np.ndarray) -> TypeCosts:
        """Per-type costs of micro-batches of these shapes on one device of this layout, from the setup's cost
        source."""
        return _source_costs(self.model, self.costs, tiles, tokens, pairs, device=self.device, tensor_parallel=self.tp)

    def type_params(self) -> dict[str, int]:
        """Parameters of one block of each type, from the setup's cost source."""
        return dict(self.costs.params) if self.costs is not None else self.model.type_params()


@dataclass(frozen=True, kw_only=True, eq=False)
class MicroBatches:
    """An epoch of micro-batches from one batching: their shapes and how steps group them."""

    name: str
    """Batching (one of :data:`BATCHINGS`)."""
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
    round_robin: bool = False
    """Micro-batch ``c`` of a step goes to rank ``c % dp`` (a sampler's order under gradient accumulation,
    as the HF/accelerate data loader deals it); else to rank ``c // M``."""
    notes: str = ""
    """How it was built (e.g. ISF's chosen pack shape)."""

    def rank_steps(self, dp: int, microbatches: int) -> np.ndarray:
        """``[num_steps, dp, M]`` micro-batch ids per step and rank."""
        if self.steps.shape[1] != dp * microbatches:
            raise InputError(f"batching '{self.name}' has {self.steps.shape[1]} micro-batches per step; "
                             f"dp x M = {dp * microbatches}")
        if self.round_robin:
            return self.steps.reshape(-1, microbatches, dp).transpose(0, 2, 1)
        return self.steps.reshape(-1, dp, microbatches)

    def mean_shape(self) -> MicroBatch:
        return MicroBatch(tiles=round(self.tiles.mean()), tokens=round(self.tokens.mean()),
                          attention_pairs=float(self.pairs.mean()))

    def planning_shape(self) -> MicroBatch:
        return MicroBatch(
            tiles=int(self.tiles.max()), tokens=int(self.tokens.max()), attention_pairs=float(self.pairs.max())
        )


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
    split: str
    """Baseline split of its chain (one of :data:`SPLITS`)."""
    chain: str
    """``baseline``, ``paper``, ``ours`` or ``side`` (not part of a chain)."""
    batching: str
    """Which micro-batches it runs."""
    setup: Setup
    """Its parallel layout."""
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
    notes: dict = field(default_factory=dict)
    """Anything else worth printing."""


def retile_internvl15(stats: LengthStats, *, max_tiles: int = 12, max_tokens: int = 4096) -> LengthStats:
    """Statistics measured at InternVL's 4-tile limit re-tiled as InternVL-1.5 trains (<= 12 tiles + thumbnail).

    The bundled statistics were tiled with at most 4 crops plus a thumbnail: 1 tile (an image that
    fit one crop), 3 (1x2 grid), 4 (1x3) or 5 (2x2, or 1x4). Image sizes were not stored, so the
    re-tiling is an explicit assumption, the upper end of what 12 crops allow: every multi-crop image
    is large enough for the largest grid of the same aspect ratio within ``max_tiles`` crops
    (InternVL's tiler takes the larger of two equal-ratio grids once the image covers half its
    pixels): 1x2 -> 2x4, 1x3 -> 2x6, 5-tile images read as 2x2 -> 3x3; single-crop images stay
    single. Each added tile adds 256 image tokens; samples are then cut at ``max_tokens``
    (InternVL-1.5's ``max_seq_length``; the text is truncated). The unchanged statistics are the
    lower end.
    """
    crops = np.where(stats.tiles > 1, stats.tiles - 1, stats.tiles)  # the thumbnail is not a crop
    new_crops = crops.copy()
    for k, (a, b) in {2: (1, 2), 3: (1, 3), 4: (1, 1)}.items():  # crops -> the aspect ratio of their grid
        f = math.isqrt(max_tiles // (a * b))  # largest f x (a, b) grid within max_tiles crops
        new_crops[crops == k] = max(f * f * a * b, k)
    real = stats.image_flags == stats.tiles  # dummy tiles of text-only samples stay as they are
    tiles = np.where(real & (crops > 1), new_crops + 1, stats.tiles)
    tokens = stats.tokens + INTERNVL_TOKENS_PER_TILE * (tiles - stats.tiles)
    return LengthStats(
        tiles=tiles,
        tokens=np.minimum(tokens, max_tokens),
        image_flags=np.where(real, tiles, stats.image_flags),
        source=f"{stats.source}, re-tiled to <= {max_tiles} crops + thumbnail, <= {max_tokens} tokens",
    )


def make_batches(
    stats: LengthStats, *, per_step: int, samples_per_microbatch: int, cost: Callable[..., np.ndarray] | None = None,
    seed: int = 0, methods: Sequence[str] = BATCHINGS, isf_search_samples: int = 100_000,
) -> dict[str, MicroBatches]:
    """The batchings ``methods`` of ``stats``, ``per_step`` micro-batches per global step.

    ``cost`` (``(tiles, tokens, pairs) -> seconds``) lets our balancer put packs of equal
    predicted time into the same step. ISF's pack shape is chosen by its own search
    (:func:`~omnibal_compile.data.isf.isf_search`) on ``isf_search_samples`` draws of ``stats``
    (the search packs the data once per candidate; it starts at ``samples_per_microbatch`` x the mean
    sample's tokens instead of 4096), then ``stats`` is packed with it.
    """
    unknown = [m for m in methods if m not in BATCHINGS]
    if unknown:
        raise InputError(f"unknown batchings {unknown}; choose from {list(BATCHINGS)}")
    out = {}
    for name in methods:
        start = time.perf_counter()
        notes = ""
        if name == "random":
            packing: Packing = random_batches(stats, dp=per_step, batch_size=samples_per_microbatch, seed=seed)
        elif name == "length-grouped":
            packing = length_grouped_batches(stats, dp=per_step, batch_size=samples_per_microbatch, seed=seed)
        elif name == "isf":
            sample = stats if len(stats) <= isf_search_samples else stats.resample(isf_search_samples, seed=seed)
            # The reference search walks up from 4096 tokens; shapes below k mean samples' tokens give
            # fewer than k samples per pack, which it never keeps, so start there.
            begin = max(4096, int(samples_per_microbatch * sample.tokens.mean()) // 256 * 256)
            found = isf_search(sample, dp=per_step, samples_per_pack=samples_per_microbatch, seed=seed,
                               oversized="own-pack", start_tokens=begin)
            packing = isf_pack(stats, dp=per_step, capacity=found.capacity, token_thresh=found.token_thresh, seed=seed,
                               oversized="own-pack")
            notes = f"ISF pack shape {found.capacity.tiles} tiles x {found.capacity.tokens} tokens"
        else:
            packing = balance_pack(stats, dp=per_step, samples_per_pack=samples_per_microbatch, cost=cost, seed=seed)
        loads = pack_loads(stats, packing)
        out[name] = MicroBatches(
            name=name, tiles=loads["tiles"].astype(np.float64), tokens=loads["computed"].astype(np.float64),
            pairs=np.asarray(loads["pairs"], dtype=np.float64), steps=packing.steps,
            seconds=time.perf_counter() - start, round_robin=name == "length-grouped", notes=notes,
        )
    return out


def pack_cost(
    model: VLMSpec, *, device: DeviceSpec = A100_80G, costs: CompiledCosts | None = None
) -> Callable[..., np.ndarray]:
    """Predicted forward + backward seconds of a pack, for our balancer's grouping of packs into steps
    (from ``costs`` when given, else the analytic formulas)."""
    types = model.block_types()
    counts = {t: types.count(t) for t in set(types)}

    def cost(tiles: np.ndarray, tokens: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        tc = _source_costs(model, costs, tiles, tokens, pairs, device=device, tensor_parallel=1)
        return sum((tc.forward_s[t] + tc.backward_s[t]) * c for t, c in counts.items())

    return cost


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
    bwd = np.stack([costs.backward_s[t] for t in BLOCK_TYPES], axis=1)
    extra = np.stack([np.stack([np.zeros_like(costs.forward_s[t]), costs.selective_s[t], costs.forward_s[t]], axis=1)
                      for t in BLOCK_TYPES], axis=1)  # [mb, types, options]
    per_type = counts.sum(axis=2).T
    forward = fwd @ per_type
    backward = bwd @ per_type + np.einsum("mto,sto->ms", extra, counts)
    types = model.block_types()
    send = np.stack([
        costs.out_bytes[types[plan.boundaries[s + 1] - 1]] / link_bandwidth if s + 1 < len(plan.boundaries) - 1
        else np.zeros_like(fwd[:, 0])
        for s in range(len(plan.boundaries) - 1)
    ], axis=1)
    return forward, backward, send


def _table(setup: Setup, shape: MicroBatch):
    if setup.costs is not None:
        return setup.costs.cost_table(shape, device=setup.device, precision=setup.precision, link=setup.dp_link,
                                      tensor_parallel=setup.tp)
    return cost_table(setup.model, shape, device=setup.device, precision=setup.precision, link=setup.dp_link,
                      tensor_parallel=setup.tp)


def data_parallel_times(setup: Setup, plan: PlanChoice) -> tuple[np.ndarray, np.ndarray]:
    """Per stage: the gather before each forward and backward, and the gradient reduction per iteration.

    By :meth:`~omnibal_compile.ir.costs.DataParallel.block_cost` (the simulator's and the planner's
    rule) over ``setup.dp_link``; they depend on parameters only, not on the micro-batch.
    """
    dp = setup.data_parallel
    S = len(plan.boundaries) - 1
    if dp.size == 1:
        return np.zeros(S), np.zeros(S)
    if dp.gathers and not dp.reshard_after_forward:
        raise InputError("the paper-scale replay models FSDP resharding after forward only")
    table = _table(setup, MicroBatch(tiles=1, tokens=1, attention_pairs=1.0))
    costs = [dp.block_cost(b, table.precision, table.link_bandwidth) for b in table.blocks]
    b = plan.boundaries
    gather = np.array([sum(c.op_gather_s(dp) for c in costs[b[s]:b[s + 1]]) for s in range(S)])
    reduce = np.array([sum(c.reduce_s for c in costs[b[s]:b[s + 1]]) for s in range(S)])
    return gather, reduce


def epoch_seconds(setup: Setup, batches: MicroBatches, costs: TypeCosts, plan: PlanChoice) -> float:
    """Simulated epoch: per step the slowest DP rank's pipeline iteration, summed over steps."""
    forward, backward, send = stage_times(setup.model, costs, plan, setup.device.link_bandwidth(setup.pipeline_link))
    steps = batches.rank_steps(setup.dp, setup.microbatches)  # [step, rank, micro-batch]
    flat = steps.reshape(-1, setup.microbatches)
    gather, reduce = data_parallel_times(setup, plan)
    it = pipeline_times(forward[flat], backward[flat], send[flat], gather=gather, reduce=reduce)
    return float(it.reshape(steps.shape[0], setup.dp).max(axis=1).sum())


def _replay(setup: Setup, plan: PlanChoice, shape: MicroBatch) -> float:
    """Iteration seconds of ``plan`` with every micro-batch of ``shape`` (the acceptance check)."""
    costs = setup.type_costs(np.array([shape.tiles]), np.array([shape.tokens]), np.array([shape.attention_pairs]))
    f, b, s = stage_times(setup.model, costs, plan, setup.device.link_bandwidth(setup.pipeline_link))
    idx = np.zeros((1, setup.microbatches), dtype=np.int64)
    gather, reduce = data_parallel_times(setup, plan)
    return float(pipeline_times(f[idx], b[idx], s[idx], gather=gather, reduce=reduce)[0])


def _problem(setup: Setup, time_shape: MicroBatch, memory_shape: MicroBatch, recompute: str) -> PartitionProblem:
    """The planner's problem: times of the ``time_shape`` micro-batch, memory of the ``memory_shape`` one."""
    pipe_bw = setup.device.link_bandwidth(setup.pipeline_link)

    def problem(shape: MicroBatch) -> PartitionProblem:
        p = problem_from_costs(_table(setup, shape), num_stages=setup.pp, num_microbatches=setup.microbatches,
                               budget=setup.budget, recompute=recompute, data_parallel=setup.data_parallel)
        # The table's link is the data-parallel one; stage-to-stage sends use the pipeline's.
        return dataclasses.replace(p, cut_time=tuple(b / pipe_bw for b in p.cut_bytes))

    timed, sized = problem(time_shape), problem(memory_shape)
    return dataclasses.replace(timed, act=sized.act, cut_bytes=sized.cut_bytes, workspace=sized.workspace)


def vit_first_boundaries(model: VLMSpec, pp: int) -> tuple[int, ...]:
    """Megatron's VLM layout: the whole vision encoder and projector on stage 0, LLM layers split evenly."""
    first_llm = model.vision.layers + 3  # vision.embed, the ViT layers, projector, llm.embed
    per, extra = divmod(model.llm.layers, pp)
    bounds, layer = [0], 0
    for s in range(pp - 1):
        layer += per + (1 if s < extra else 0)
        bounds.append(first_llm + layer)
    return (*bounds, model.num_blocks)


def baseline_boundaries(
    model: VLMSpec, split: str, pp: int, *, params: Mapping[str, int] | None = None
) -> tuple[int, ...]:
    """Cut points of a baseline split (:data:`SPLITS`); ``params``: per-type parameters (default: the analytic
    counts)."""
    if split == "uniform":
        return tuple(
            uniform_boundaries(["layer" if t.endswith(".layer") else "module" for t in model.block_types()], pp)
        )
    if split == "parameters":
        params = params or model.type_params()
        return tuple(min_max_partition([params[t] for t in model.block_types()], pp)[0])
    if split == "vit-first":
        return vit_first_boundaries(model, pp)
    raise InputError(f"unknown baseline split {split!r}; choose from {list(SPLITS)}")


def _memory(setup: Setup, plan: PlanChoice, shape: MicroBatch) -> tuple[float, bool]:
    sol = evaluate(_problem(setup, shape, shape, "auto"), plan.boundaries, plan.recompute)
    return max(sol.stage_memory) / 2**30, sol.feasible


def vit_first_setup(setup: Setup, batches: MicroBatches, *, layouts: Sequence[tuple[int, int]] = ()) -> Setup | None:
    """The smallest (PP x TP, then PP) of ``layouts`` (default: PP = ``setup.pp`` or twice that, TP = 1, 2,
    4 or 8) at ``setup.gpus`` GPUs whose ViT-first split fits the budget with full recomputation at
    ``batches``' largest micro-batch; None if none does."""
    layouts = layouts or [(pp, tp) for pp in (setup.pp, 2 * setup.pp) for tp in (1, 2, 4, 8)]
    for pp, tp in sorted(layouts, key=lambda x: (x[0] * x[1], x[0])):
        if setup.gpus % (pp * tp):
            continue
        try:
            cand = dataclasses.replace(setup, pp=pp, tp=tp, dp=setup.gpus // (pp * tp))
        except InputError:  # too few micro-batches per rank for this many stages
            continue
        plan = PlanChoice(
            boundaries=vit_first_boundaries(setup.model, pp),
            recompute=("full",) * setup.model.num_blocks,
            planner="vit-first",
        )
        if _memory(cand, plan, batches.planning_shape())[1]:
            return cand
    return None


def _solve(setup: Setup, batches: MicroBatches, planner: str, recompute: str) -> PlanChoice | str:
    start = time.perf_counter()
    try:
        sol = solve(_problem(setup, batches.mean_shape(), batches.planning_shape(), recompute), planner,
                    time_limit=setup.ilp_time_limit)
    except PlanError as e:  # a heuristic split may not fit where the ILP's does
        return str(e)
    return PlanChoice(boundaries=sol.boundaries, recompute=sol.recompute, planner=planner, status=sol.status,
                      solve_seconds=time.perf_counter() - start)


def _accept(setup: Setup, new: PlanChoice | str, old: PlanChoice, shape: MicroBatch, what: str) -> PlanChoice | str:
    """Keep ``old`` unless ``new`` replays faster at ``shape`` (module glossary: acceptance)."""
    if isinstance(new, str):
        return new
    t_new, t_old = _replay(setup, new, shape), _replay(setup, old, shape)
    if t_new <= t_old:
        return new
    return dataclasses.replace(old, planner=new.planner, solve_seconds=new.solve_seconds,
                               status=f"kept the {what} plan (replayed {t_old:.3f} s vs {t_new:.3f} s per iteration)")


def run_ablation(setups: Mapping[str, Setup], batches: Mapping[str, MicroBatches]) -> list[Row]:
    """The ablation rows: for each baseline split (key of ``setups``, at its layout) the baseline, the
    ``paper`` and ``ours`` chains and a random-batching side row. ``batches`` from :func:`make_batches`
    with ``per_step`` equal to every setup's ``dp x M``."""
    missing = [b for b in BATCHINGS if b not in batches]
    if missing:
        raise InputError(f"run_ablation needs the batchings {missing} too")
    costs: dict[tuple[str, int], TypeCosts] = {}
    solved: dict[tuple[int, int, int], dict[str, PlanChoice | str]] = {}
    rows: list[Row] = []
    for split, setup in setups.items():
        n = setup.model.num_blocks
        base = PlanChoice(boundaries=baseline_boundaries(setup.model, split, setup.pp, params=setup.type_params()),
                          recompute=("full",) * n,
                          planner=split)
        key = (setup.pp, setup.tp, setup.dp)
        if key not in solved:  # the planners' plans depend on the layout, not on the baseline
            solved[key] = {
                "omnibal-full": _solve(setup, batches["isf"], "omnibal", "full"),
                "omnibal-stage": _solve(setup, batches["isf"], "omnibal", "auto"),
                "ilp-full": _solve(setup, batches["ours"], setup.planner, "full"),
                "ilp-auto": _solve(setup, batches["ours"], setup.planner, "auto"),
            }
        plans = solved[key]
        ours_shape = batches["ours"].mean_shape()
        ilp_full = _accept(setup, plans["ilp-full"], base, ours_shape, f"{split} baseline")
        ilp_auto = (_accept(setup, plans["ilp-auto"], ilp_full, ours_shape, "ILP full-recompute")
                    if isinstance(ilp_full, PlanChoice) else plans["ilp-auto"])
        spec: list[tuple[str, str, str, PlanChoice | str]] = [
            ("baseline: length-grouped batches, full recompute", "baseline", "length-grouped", base),
            ("baseline with random batches", "side", "random", base),
            ("+ data: ISF", "paper", "isf", base),
            ("+ model: OmniBal search partition", "paper", "isf", plans["omnibal-full"]),
            ("+ memory: one recompute option per stage", "paper", "isf", plans["omnibal-stage"]),
            ("+ data: our balancer", "ours", "ours", base),
            ("+ model: ILP partition", "ours", "ours", ilp_full),
            ("+ memory: per-block recompute (ILP)", "ours", "ours", ilp_auto),
        ]
        for name, chain, batching, plan in spec:
            if isinstance(plan, str):
                rows.append(Row(name=name, split=split, chain=chain, batching=batching, setup=setup, plan=None,
                                epoch_s=math.nan, gpu_days=math.nan, peak_memory_gib=math.nan, fits=False,
                                notes={"error": plan}))
                continue
            b = batches[batching]
            ck = (batching, setup.tp, id(setup.costs))
            if ck not in costs:
                costs[ck] = setup.type_costs(b.tiles, b.tokens, b.pairs)
            epoch = epoch_seconds(setup, b, costs[ck], plan)
            peak, fits = _memory(setup, plan, b.planning_shape())
            rows.append(
                Row(
                    name=name,
                    split=split,
                    chain=chain,
                    batching=batching,
                    setup=setup,
                    plan=plan,
                    epoch_s=epoch,
                    gpu_days=epoch * setup.gpus / 86400,
                    peak_memory_gib=peak,
                    fits=fits,
                    notes={"status": plan.status} if plan.status else {},
                )
            )
    return rows


def chain_ratios(rows: Sequence[Row], split: str, chain: str) -> list[float]:
    """GPU-days of ``split``'s baseline and ``chain``'s three steps, relative to that baseline."""
    base = next(r for r in rows if r.split == split and r.chain == "baseline")
    return [1.0] + [r.gpu_days / base.gpu_days for r in rows if r.split == split and r.chain == chain]


def _stage_layout(model: VLMSpec, plan: PlanChoice) -> str:
    """Blocks per stage as ``v<ViT layers>+l<LLM layers>``, and recompute counts."""
    types = model.block_types()
    parts = []
    for s in range(len(plan.boundaries) - 1):
        ts = types[plan.boundaries[s]:plan.boundaries[s + 1]]
        v, n = ts.count("vision.layer"), ts.count("llm.layer")
        parts.append(f"v{v}" if not n else (f"l{n}" if not v else f"v{v}+l{n}"))
    rec = {o: plan.recompute.count(o) for o in RECOMPUTE_OPTIONS if plan.recompute.count(o)}
    return "|".join(parts) + "  " + ",".join(f"{o[:3]}:{c}" for o, c in rec.items())


SPLIT_NAMES = {"uniform": "uniform layer split", "parameters": "parameter-balanced split (DeepSpeed default)",
               "vit-first": "ViT on stage 0 (Megatron VLM layout)"}


def format_ablation(rows: Sequence[Row], paper: Sequence[float] = ()) -> str:
    """The ablation table of one model (all its baseline splits), as ``bench/paper_scale.py`` prints it.

    ``paper``: the paper's GPU-days (baseline, +data, +model, +memory, or baseline and full only),
    shown as ratios next to each chain's steps.
    """
    paper_ratio: list[str] = ["-"] * 4
    if len(paper) == 4:
        paper_ratio = [f"{p / paper[0]:.3f}" for p in paper]
    elif len(paper) == 2:
        paper_ratio = ["1.000", "-", "-", f"{paper[1] / paper[0]:.3f}"]
    cols = ("step (SIMULATED)", "GPU-days", "ratio", "paper", "peak GiB", "stages (ViT|LLM layers) recompute")
    out = []
    for split in dict.fromkeys(r.split for r in rows):
        group = [r for r in rows if r.split == split]
        base = next(r for r in group if r.chain == "baseline")
        s = base.setup
        closest = " <- closest reading of the paper" if (split, "paper") == CLOSEST else ""
        out.append(f"baseline split: {SPLIT_NAMES.get(split, split)}; {s.layout()}, link {s.pipeline_link}; "
                   f"costs: {s.cost_source}")
        body = []
        for r in group:
            # Position in its chain: 0 for the baseline, 1-3 for the data, model and memory steps.
            same = [x for x in group if x.chain == r.chain]
            k = next(i for i, x in enumerate(same) if x is r) + 1 if r.chain in ("paper", "ours") else 0
            label = {"side": "  ", "baseline": ""}.get(r.chain, f"[{r.chain}] ") + r.name
            if (split, r.chain) == CLOSEST and k == 3:
                label += closest
            paper_cell = paper_ratio[k] if r.chain != "side" else "-"
            if r.plan is None:
                body.append((label, "-", "-", paper_cell, "-", "no plan fits: " + r.notes.get("error", "")[:70]))
                continue
            body.append((label, f"{r.gpu_days:.2f}", f"{r.gpu_days / base.gpu_days:.3f}", paper_cell,
                         f"{r.peak_memory_gib:.1f}{'' if r.fits else ' OVER'}", _stage_layout(s.model, r.plan)))
        out.append(format_table([cols, *body], "lrrrrl"))
    return "\n".join(out)


def format_distance(rows: Sequence[Row], paper: Sequence[float]) -> str:
    """Each chain's cumulative ratios next to the paper's, and the largest gap (in ratio points)."""
    if len(paper) == 4:
        want = [p / paper[0] for p in paper]
    elif len(paper) == 2:
        want = [1.0, math.nan, math.nan, paper[1] / paper[0]]
    else:
        return ""
    lines = [("baseline split", "chain", "+data", "+model", "+memory", "largest gap", "final gap")]
    lines.append(("(paper)", "", *(f"{w:.3f}" if not math.isnan(w) else "-" for w in want[1:]), "", ""))
    for split in dict.fromkeys(r.split for r in rows):
        for chain in ("paper", "ours"):
            got = chain_ratios(rows, split, chain)
            gaps = [abs(g - w) for g, w in zip(got, want) if not (math.isnan(w) or math.isnan(g))]
            mark = " *" if (split, chain) == CLOSEST else ""
            lines.append((split + mark, chain, *(f"{g:.3f}" for g in got[1:]), f"{max(gaps):.3f}" if gaps else "-",
                          f"{got[-1] - want[-1]:+.3f}" if not math.isnan(got[-1]) else "-"))
    return format_table(lines, "llrrrrr")


def format_cost_sources(analytic: Sequence[Row], compiled: Sequence[Row]) -> str:
    """The same ablation on two cost sources, row by row: GPU-days and ratios of each, and their quotient."""
    lines = [("baseline split", "step (SIMULATED)", "analytic GPU-days", "ratio", "compiled GPU-days", "ratio",
              "compiled / analytic", "same plan")]
    for split in dict.fromkeys(r.split for r in analytic):
        a_rows = [r for r in analytic if r.split == split]
        c_rows = [r for r in compiled if r.split == split]
        if [r.name for r in a_rows] != [r.name for r in c_rows]:
            raise InputError(f"the two ablations differ in their {split} rows")
        a_base = next(r for r in a_rows if r.chain == "baseline")
        c_base = next(r for r in c_rows if r.chain == "baseline")
        for i, (a, c) in enumerate(zip(a_rows, c_rows)):
            label = {"side": "  ", "baseline": ""}.get(a.chain, f"[{a.chain}] ") + a.name
            same = "-" if a.plan is None or c.plan is None else (
                "yes" if (a.plan.boundaries, a.plan.recompute) == (c.plan.boundaries, c.plan.recompute) else "no")
            lines.append((split if i == 0 else "", label, f"{a.gpu_days:.2f}", f"{a.gpu_days / a_base.gpu_days:.3f}",
                          f"{c.gpu_days:.2f}", f"{c.gpu_days / c_base.gpu_days:.3f}", f"{c.gpu_days / a.gpu_days:.3f}",
                          same))
    return format_table(lines, "llrrrrrl")


# -- the zero-bubble schedules at the paper's layout (issue 30) -----------------------------------
@dataclass(frozen=True, kw_only=True)
class ScheduleRow:
    """One schedule at a setup's layout, simulated by the event simulator (:func:`omnibal_compile.sim.simulate`)."""

    name: str
    """What the row runs: the schedule and where its cuts and recomputation come from."""
    schedule: str
    """The schedule's name."""
    iteration_s: float
    """Simulated seconds of one iteration, every micro-batch of the batching's mean shape."""
    bubble: float
    """Idle share of device time in that iteration."""
    peak_gib: float
    """Simulated peak memory of the fullest device at the batching's largest micro-batch."""
    fits: bool
    """Whether that peak fits the setup's budget."""


def zero_bubble_rows(
    setup: Setup, batches: MicroBatches, plans: Mapping[str, PlanChoice]
) -> tuple[list[ScheduleRow], list[str]]:
    """(rows, notes): each of ``plans`` (1F1B plans at ``setup``'s layout, by name) under 1F1B and under ZB-H1
    (interleaved-zb, the same cuts and recomputation), then the DP's interleaved plan of two chunks per device
    under interleaved, interleaved-zb and zbv (the same 16 cuts; zbv places them in a V). The exact zero-bubble
    search is not run where it refuses the problem (its cut-vector bound; it plans at DP 1 only): the notes say
    so with its own words."""
    from omnibal_compile.ir.plan import Plan
    from omnibal_compile.planning.dp import interleaved_incumbent
    from omnibal_compile.planning.zero_bubble import search_refusal
    from omnibal_compile.sim import simulate

    pipe_bw = setup.device.link_bandwidth(setup.pipeline_link)
    dp = setup.data_parallel

    def table(shape: MicroBatch):
        t = _table(setup, shape)  # its link is the data-parallel one; stage sends use the pipeline's
        return dataclasses.replace(t, link_bandwidth=pipe_bw, dp_link_bandwidth=t.link_bandwidth)

    mean, largest = table(batches.mean_shape()), table(batches.planning_shape())
    M = setup.microbatches

    rows: list[ScheduleRow] = []

    def row(name: str, kind: str, boundaries: Sequence[int], recompute: Sequence[str], v: int) -> None:
        """The plan as given; when it does not fit, also with recomputation raised until it does."""
        options = list(recompute)
        raised = 0
        while True:
            plan = Plan(block_names=mean.names, boundaries=tuple(boundaries), recompute=tuple(options), schedule=kind,
                        num_microbatches=M, virtual_stages=v, data_parallel=dp.size, data_parallel_shard=dp.shard)
            sim = simulate(plan, mean)
            peaks = simulate(plan, largest).peak_memory_bytes
            fits = max(peaks) <= setup.budget
            if fits or not raised:
                changed = sum(a != b for a, b in zip(options, recompute))
                label = name if not raised else f"{name}, recomputation raised on {changed} blocks to fit"
                rows.append(ScheduleRow(name=label, schedule=kind, iteration_s=sim.iteration_time_s,
                                        bubble=sim.bubble_fraction, peak_gib=max(peaks) / 2**30, fits=fits))
            if fits:
                return
            # each over-budget device: every block of its stages one option more recomputation (none < selective
            # < full), a greedy of this study, not the planner
            more = 0
            for d, peak in enumerate(peaks):
                if peak <= setup.budget:
                    continue
                for st in plan.pipeline_schedule.stages_of(d, plan.num_stages):
                    for i in range(boundaries[st], boundaries[st + 1]):
                        k = RECOMPUTE_OPTIONS.index(options[i])
                        if k + 1 < len(RECOMPUTE_OPTIONS):
                            options[i] = RECOMPUTE_OPTIONS[k + 1]
                            more += 1
            if not more:  # full recomputation everywhere over budget still: the row above says so
                return
            raised += more

    for name, choice in plans.items():
        row(f"1F1B: {name}", "1f1b", choice.boundaries, choice.recompute, 1)
        row(f"ZB-H1: {name}'s cuts and recomputation", "interleaved-zb", choice.boundaries, choice.recompute, 1)
    S2 = 2 * setup.pp
    problem = dataclasses.replace(
        problem_from_costs(mean, num_stages=S2, num_microbatches=M, schedule="interleaved", virtual_stages=2,
                           budget=setup.budget, data_parallel=dp),
        act=problem_from_costs(largest, num_stages=S2, num_microbatches=M, schedule="interleaved", virtual_stages=2,
                               budget=setup.budget, data_parallel=dp).act)
    two = interleaved_incumbent(problem)
    label = f"the DP's interleaved plan ({S2} stages)"
    row(f"interleaved x2: {label}", "interleaved", two.boundaries, two.recompute, 2)
    row(f"interleaved-zb x2: {label}'s cuts and recomputation", "interleaved-zb", two.boundaries, two.recompute, 2)
    row(f"zbv: {label}'s cuts and recomputation in a V", "zbv", two.boundaries, two.recompute, 2)
    notes = []
    for kind, S, v in (("interleaved-zb", setup.pp, 1), ("zbv", S2, 2)):
        alone = problem_from_costs(mean, num_stages=S, num_microbatches=M, schedule=kind, virtual_stages=v)
        refusal = search_refusal(alone)
        notes.append(f"{kind} not planned by the exact zero-bubble search: {refusal or 'it plans at DP 1 only'}"
                     + ("; and it plans at DP 1 only" if refusal and dp.size > 1 else ""))
    return rows, notes


def format_schedule_rows(rows: Sequence[ScheduleRow], budget_gib: float) -> str:
    """The rows as a table, each iteration against the first row's."""
    base = rows[0].iteration_s
    lines = [("schedule and plan", "iteration s", "vs first", "bubble", f"peak GiB (budget {budget_gib:.0f})")]
    for r in rows:
        lines.append((r.name, f"{r.iteration_s:.3f}", f"{r.iteration_s / base:.3f}", f"{r.bubble:.1%}",
                      f"{r.peak_gib:.1f}" + ("" if r.fits else " (over)")))
    return format_table(lines, "lrrrr")
