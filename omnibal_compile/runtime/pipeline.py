"""Build one rank's share of a pipeline on ``torch.distributed.pipelining`` and train with it.

Glossary:
    rank stages    the stages a rank runs, as its schedule places them
                   (:meth:`omnibal_compile.ir.schedule.ScheduleRule.stages_of`): ``r, r + W, r + 2W, ...``
                   for ``W`` ranks (one stage per rank unless ``virtual_stages > 1``).
    micro-batch    one of ``num_microbatches`` equal slices (along dim 0 of every input) of a
                   batch. Stages are captured at the micro-batch shape; every batch must split
                   into micro-batches of exactly that shape (pipelining's buffers are fixed).
    loss weights   the generated last stage returns the model's own loss, a mean over its
                   micro-batch. The pipelining ``loss_fn`` multiplies it by the micro-batch's
                   share of the batch's loss terms (its labelled tokens, or its rows when the
                   batch has no ``labels``), passed as ``target``; with ``scale_grads=False`` the
                   summed gradients then equal those of the unsplit model's loss on the whole batch.
    tied parameter one parameter object under several names (tied embedding and head). Every rank
                   whose stages use it holds a copy; their gradients are summed after backward over
                   the pipeline ranks of one data-parallel replica (those sharing a dp index).
    mesh           a ``DeviceMesh`` with dims ``("dp", "pp")``: each row along ``pp`` is one pipeline
                   (a replica), each column along ``dp`` holds the copies of one set of stages.
    data parallel  each stage module is data-parallel over ``dp``: FSDP2 ``fully_shard`` (``fsdp``,
                   ZeRO-3: one unit per recompute region whose parameters nothing else in the stage
                   reads, plus the stage for the rest) or FSDP's composable ``replicate`` (``ddp``:
                   DDP-style, whole parameters on every dp rank). Blocks that are not a called
                   submodule (codegen inlines them) cannot be units: FSDP gathers on forward hooks.
                   ``PipelineStage`` turns gradient sync off for all but the last micro-batch's
                   backward (under a split backward, torch's ``REDUCE_GRAD`` action after each stage's last
                   W; FSDP then keeps the gathered weights: ``ScheduleRule.fsdp_may_reshard``). Every dp
                   rank weighs its micro-batch losses by its share of the *global* step's loss terms (an
                   all-reduce of the counts over ``dp``), so the gradients are summed over ``dp`` (divide
                   factor 1), never averaged again.
    16 bits        ``precision`` bf16 / fp16: the stages of a model captured in that dtype get fp32
                   masters back and are wrapped at every dp (FSDP2 on the 1-rank dp mesh at dp = 1)
                   with a policy gathering 16-bit weights and reducing fp32 gradients
                   (:mod:`omnibal_compile.runtime.precision`); batches' float inputs are cast to the
                   captured dtypes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.fx as fx
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.compile.capture import normalize_example_inputs, structure_mismatch
from omnibal_compile.compile.recompute import CheckpointedRegion, apply_recompute
from omnibal_compile.compile.tensor_parallel import TensorParallelReport, tensor_parallel_stage
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import NO_DATA_PARALLEL, DataParallel
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import CLASSIC_SCHEDULES, SCHEDULE_KINDS, schedule_rule
from omnibal_compile.runtime.compiled import compile_stage
from omnibal_compile.runtime.precision import compute_dtype, mixed_precision_policy, restore_masters
from omnibal_compile.runtime.tensor_parallel import check_tensor_parallel, mesh_layout
from omnibal_compile.runtime.weights import RankWeights, materialise, retarget_meta

if TYPE_CHECKING:  # the runtime consumes what optimize() built; it never calls back into it
    from omnibal_compile.api import OptimizeResult

__all__ = [
    "RankPipeline",
    "TiedParameter",
    "build_pipeline",
    "check_pipeline",
    "get_schedule_class",
    "loss_terms",
    "loss_weights",
    "rank_stages",
]

RUNTIME_SCHEDULES: frozenset[str] = frozenset(SCHEDULE_KINDS)
"""Schedules this runtime builds stages for (each rank's stages as the schedule places them)."""


def check_pipeline(plan: Plan, *, world_size: int, batch_size: int | None = None, dp: int = 1, tp: int = 1,
                   data_parallel: DataParallel | None = None, precision: str | None = None) -> None:
    """Raise a clear :class:`PlanError` unless ``plan`` can run on ``world_size`` ranks (``dp`` pipelines of ``tp``
    tensor-parallel ranks per stage) with this batch.

    ``batch_size`` is the whole step's rows over all ``dp`` pipelines. ``data_parallel`` (of size ``dp``) and
    ``precision``: the layout the stages are wrapped in, checked against the schedule when given.
    """
    plan.pipeline_schedule.check(plan.num_stages)
    plan.pipeline_schedule.rule.require(RUNTIME_SCHEDULES, "the pipeline runtime (run)")
    s, v, m = plan.num_stages, plan.virtual_stages, cast(int, plan.num_microbatches)  # Plan.__post_init__ fills it in
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise PlanError(f"dp (data-parallel pipelines, --dp) must be an integer >= 1, got {dp!r}")
    recomputed = [b for b, o in zip(plan.block_names, plan.block_recompute) if o != "none"]
    if recomputed and not plan.pipeline_schedule.rule.runs_recomputation:
        # measured on the reference VLM (zbv, full recompute): an LLM layer reruns 10 times per micro-batch (1 in B, 9
        # in W's autograd calls); a torch.utils.checkpoint.GraphExecGroup over B and W raises CheckpointError (both
        # read the same saved activations: W restarts at the nodes B ran); one over W alone reruns it twice (B, W)
        # while the costs count once; selective checkpointing refuses a second backward of its saved outputs
        raise PlanError(
            f"schedule {plan.schedule!r} splits each backward, and torch's weight-gradient pass reruns a recomputed "
            f"block once per parameter group (one autograd call each, and checkpointing recomputes per call: 10 "
            f"reruns per micro-batch of a reference LLM layer where the plan's costs count 1); the plan recomputes "
            f"{len(recomputed)} blocks (e.g. {recomputed[:2]}): plan with recompute 'none' for this schedule, or use "
            f"one among {sorted(CLASSIC_SCHEDULES)}"
        )
    rule = plan.pipeline_schedule.rule
    if data_parallel is not None and not rule.fsdp_may_reshard and data_parallel.reshard_after_forward and _in_fsdp(
            data_parallel, precision):
        raise PlanError(
            f"schedule {plan.schedule!r} splits each backward, and FSDP resharding after forward would lose every "
            "weight gradient of the stages (torch's input-gradient pass finds the weights through the stage's "
            "parameters, which are their shards again after the forward): keep the gathered weights "
            "(--no-reshard-after-forward, reshard_after_forward=False; plan with it), or use --dp-shard ddp"
        )
    check_tensor_parallel(plan, tp=tp)
    if tp > 1 and world_size != dp * tp * plan.num_devices:
        raise PlanError(f"dp={dp} x pp={plan.num_devices} x tp={tp} need {dp * tp * plan.num_devices} processes but "
                        f"world size is {world_size}: launch that many (--nproc), or change --dp / --tp")
    if world_size != dp * tp * plan.num_devices:
        extra = f" ({s} stages / {v} virtual stages per rank)" if v > 1 else ""
        if dp == 1:
            raise PlanError(
                f"the plan needs {plan.num_devices} ranks{extra} but world size is {world_size}: "
                f"launch {plan.num_devices} processes, or re-plan for {world_size} ranks"
            )
        raise PlanError(
            f"dp={dp} pipelines of {plan.num_devices} ranks{extra} need {dp * plan.num_devices} processes but world "
            f"size is {world_size}: launch {dp * plan.num_devices} processes (--nproc), or change --dp"
        )
    if batch_size is not None and batch_size % (dp * m):
        if dp == 1:
            raise PlanError(
                f"batch size {batch_size} is not divisible by {m} micro-batches; use a batch size that is a "
                f"multiple of {m}"
            )
        raise PlanError(
            f"batch size {batch_size} is not divisible by dp={dp} x {m} micro-batches = {dp * m}: each "
            f"data-parallel rank runs batch_size / dp rows in {m} micro-batches; use --batch-size a multiple of "
            f"{dp * m}"
        )


def get_schedule_class(kind: str) -> type[_PipelineSchedule]:
    """The ``torch.distributed.pipelining`` schedule class that runs schedule ``kind`` (its rule's ``torch_class``)."""
    return cast(type[_PipelineSchedule], getattr(pipelining, schedule_rule(kind).torch_class))


def rank_stages(plan: Plan, rank: int) -> tuple[int, ...]:
    """Stage indices that ``rank`` runs, as the plan's schedule places them."""
    if not 0 <= rank < plan.num_devices:
        raise InputError(f"rank {rank} is out of range for a plan on {plan.num_devices} ranks")
    return plan.pipeline_schedule.stages_of(rank, plan.num_stages)


def loss_terms(flat_inputs: Sequence[Any], input_names: Sequence[str], weighting: str = "tokens") -> torch.Tensor:
    """Per-row count of the loss terms the model's loss averages over (float64).

    ``tokens``: a row's labelled tokens (``labels[:, 1:] != -100``), right for a loss that is the
    mean over labelled next-token positions (Hugging Face causal LMs, the reference VLM); 1 per row
    when there is no ``labels`` input. ``rows``: 1 per row, right for a loss that is a mean over rows.
    """
    if weighting not in ("tokens", "rows"):
        raise InputError(f"loss weighting must be 'tokens' or 'rows', got {weighting!r}")
    rows = int(flat_inputs[0].shape[0])
    if weighting == "tokens" and "labels" in input_names:
        labels = flat_inputs[list(input_names).index("labels")]
        if isinstance(labels, torch.Tensor) and labels.dim() == 2:
            return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).double()
    return torch.ones(rows, dtype=torch.float64)


def loss_weights(
    flat_inputs: Sequence[Any],
    input_names: Sequence[str],
    weighting: str = "tokens",
    *,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row share of the step's loss terms (:func:`loss_terms`); sums to 1 over the batch.

    ``total``: the loss terms of the whole step when the batch is one data-parallel rank's part of
    it (default: this batch's own).
    """
    counts = loss_terms(flat_inputs, input_names, weighting)
    total = counts.sum() if total is None else total.to(counts)
    if total == 0:
        raise InputError("the batch has no labelled token (every label is -100): nothing to train on")
    return counts / total


def _loss_index(result: OptimizeResult) -> int:
    out = next(n for n in result.captured.graph_module.graph.nodes if n.op == "output")
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in pytree.tree_leaves(out.args[0])]
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
            return i
    raise InputError(
        f"{result.captured.model_name} returns no scalar loss for this batch; pipelined training needs the model "
        "to compute its loss (pass labels in the batch)"
    )


_UNIT_TYPES: tuple[type[nn.Module], ...] = (CheckpointedRegion,)
"""Submodules a stage calls (so FSDP's forward hooks fire) that become FSDP units of their own."""


@dataclass(frozen=True)
class _WeightedLoss:
    """pipelining ``loss_fn``: the last stage's scalar loss output times the micro-batch's weight."""

    index: int

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        loss = outs[self.index].float()  # a 16-bit model's loss: its weighting and sum in fp32
        weight = target.sum().to(loss.dtype)
        # a micro-batch of empty rows (labels all -100, weight 0) has a 0/0 mean loss: it adds nothing
        return torch.where(weight > 0, loss, torch.zeros_like(loss)) * weight


class _TensorOutputs(nn.Module):
    """A stage with only its outputs at ``keep`` (pipelining handles stage outputs as tensors: the last stage drops
    its others); ``copy_views``: an output that is a view is returned as a copy, because torch's split backward
    (``stage_backward_input``) detaches the stage outputs in place, which a view refuses."""

    def __init__(self, stage: nn.Module, keep: tuple[int, ...], *, copy_views: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.keep = keep
        self.copy_views = copy_views

    def forward(self, *args: Any) -> tuple[Any, ...]:
        out = self.stage(*args)
        picked = tuple(out[j] for j in self.keep)
        if self.copy_views:
            picked = tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in picked)
        return picked


def _check_split_backward(stage: nn.Module, inputs: Sequence[Any], index: int, schedule: str) -> None:
    """Raise a :class:`PlanError` when stage ``index`` returns a tensor needing a gradient whose autograd graph
    reaches none of its inputs needing one (an embedding of token ids at the start of the LLM): torch 2.13's split
    backward finds a stage's weight gradients from its input-gradient pass, which never walks such a branch, so
    their gradients would be lost (its own TODO in ``PipelineStage.backward_weight_one_chunk``; the first stage is
    run whole instead)."""
    # zeros of the examples' shapes: valid token ids and labels, and the graph does not depend on the values
    ins = [torch.zeros_like(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
    wanted = {id(x) for x in ins if isinstance(x, torch.Tensor) and x.requires_grad}
    with torch.enable_grad():
        outs = stage(*ins)

    def reaches(t: torch.Tensor) -> bool:
        if id(t) in wanted:
            return True
        seen: set[Any] = set()
        stack = [t.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if id(getattr(fn, "variable", None)) in wanted:  # an input's AccumulateGrad
                return True
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return False

    lost = [i for i, t in enumerate(outs) if isinstance(t, torch.Tensor) and t.requires_grad and not reaches(t)]
    if lost:
        raise PlanError(
            f"stage {index} returns output(s) {lost} that need a gradient but do not depend on any stage input that "
            f"needs one (e.g. the LLM's token embedding after a vision stage): schedule {schedule!r} splits the "
            "backward, and torch's input-gradient pass never reaches that branch, so its weight gradients would be "
            "lost; cut the model so that such a branch starts its stage's computation from a differentiable input "
            "or sits in the first stage, or use a schedule with a whole backward"
        )


@dataclass(frozen=True, kw_only=True)
class TiedParameter:
    """A parameter used by stages on several pipeline ranks of one replica."""

    names: tuple[str, ...]
    """Its names in the original model."""
    ranks: tuple[int, ...]
    """Pipeline ranks whose stages use it."""
    group: Any = field(repr=False)
    """Process group of those ranks in this rank's replica (None on ranks outside it)."""
    param: nn.Parameter | None = field(repr=False)
    """The local copy (None on ranks that do not hold it); a ``DTensor`` under data parallelism."""


@dataclass(frozen=True, kw_only=True)
class RankPipeline:
    """One rank's stages, schedule and parameters; :meth:`step` runs one training iteration."""

    rank: int
    """This rank's pipeline rank (its index along ``pp``)."""
    world_size: int
    """Pipeline ranks of one replica."""
    plan: Plan
    """The plan the stages were made from (micro-batches, schedule)."""
    stage_indices: tuple[int, ...]
    """Stages this rank runs."""
    modules: tuple[nn.Module, ...] = field(repr=False)
    """The stage modules (recompute and data parallelism applied), in ``stage_indices`` order."""
    stages: tuple[PipelineStage, ...] = field(repr=False)
    """pipelining stages wrapping ``modules``."""
    schedule: Any = field(repr=False)
    """The pipelining schedule."""
    in_spec: pytree.TreeSpec = field(repr=False)
    """Structure of the model's ``(args, kwargs)``."""
    input_names: tuple[str, ...]
    """Names of the model's flat inputs."""
    microbatch_shapes: tuple[tuple[int, ...], ...]
    """Shape of every flat input of one micro-batch, as captured."""
    weighting: str
    """How micro-batch losses are weighted: ``tokens`` or ``rows`` (see :func:`loss_terms`)."""
    state: dict[str, torch.Tensor] = field(repr=False)
    """Original model name -> tensor, for every parameter and persistent buffer this rank holds."""
    tied: tuple[TiedParameter, ...] = field(repr=False)
    """Parameters shared with stages on other pipeline ranks of this replica."""
    device: torch.device
    """Device the stages run on."""
    dp_rank: int = 0
    """This rank's data-parallel index (which replica it belongs to)."""
    dp_size: int = 1
    """Data-parallel replicas."""
    dp_group: Any = field(default=None, repr=False)
    """Process group along ``dp`` (the ranks holding copies of these stages); None when ``dp_size`` is 1."""
    dp_shard: str | None = None
    """``fsdp`` or ``ddp`` (:data:`DP_SHARDS`); None when ``dp_size`` is 1."""
    pp_group: Any = field(default=None, repr=False)
    """Process group along ``pp`` (this replica's pipeline ranks); None: the default group (one pipeline)."""
    forward_flops: float = 0.0
    """Forward FLOPs of one micro-batch through this rank's stages (counted once, when they were built)."""
    input_dtypes: tuple[torch.dtype, ...] = ()
    """Dtype of every flat input as captured; :meth:`flatten` casts a batch's inputs to them (bf16 pixel values
    for a model captured in bf16). Empty: kept as given."""
    param_dtype: torch.dtype = torch.float32
    """Dtype the stages' parameters compute in (``--precision``); the optimizer's parameters stay fp32."""
    tp_size: int = 1
    """Tensor-parallel ranks per stage (the mesh's ``tp`` dimension)."""
    tensor_parallel: tuple[TensorParallelReport, ...] = field(default=(), repr=False)
    """With ``tp_size > 1``: what the tensor-parallel pass sharded in each of this rank's stages, and what not."""

    def _loss_context(self) -> Any:
        """``loss_parallel()`` when this rank's last stage computes its loss on vocabulary shards (the
        tensor-parallel pass's LM head), around forward and backward as torch asks; else nothing."""
        if any(r.loss_parallel for r in self.tensor_parallel):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once (``DTensor`` shards or replicas under data parallelism)."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def clip_grad_norm(self, max_norm: float | None = None) -> float:
        """The global gradient norm over every stage, pipeline rank and dp shard, before clipping; with
        ``max_norm`` (> 0) every gradient is then scaled by ``min(1, max_norm / (norm + 1e-6))``, as
        ``torch.nn.utils.clip_grad_norm_`` does on the unsplit model. A collective: every rank calls it.

        Squares of local gradients are summed over the mesh dims a gradient is sharded on (``dp`` for FSDP
        shards, ``tp`` for tensor-parallel ones; replicated gradients are equal on those ranks already, so each
        counts once), then over ``pp``; a tied parameter counts on the first pipeline rank holding it only (its
        copies hold the same summed gradient).
        """
        others = {id(t.param) for t in self.tied if t.param is not None and self.rank != t.ranks[0]}
        by_groups: dict[tuple[Any, ...], torch.Tensor] = {}  # the groups a square sums over -> their sum
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        for p in self.parameters():
            g = p.grad
            if g is None or id(p) in others:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            squares = torch.linalg.vector_norm(local, dtype=torch.float64) ** 2
            groups: tuple[Any, ...] = ()
            if isinstance(g, DTensor):
                # FSDP2 over tensor-parallel shards places the dp dim as a _StridedShard, which is_shard() denies
                groups = tuple(g.device_mesh.get_group(d) for d, place in enumerate(g.placements)
                               if not place.is_replicate())
            by_groups[groups] = by_groups.get(groups, torch.zeros((), dtype=torch.float64, device=self.device)
                                              ) + squares
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for groups in sorted(by_groups, key=len):  # same keys, same order, on every rank of a group
            for group in groups:
                dist.all_reduce(by_groups[groups], group=group)
            total += by_groups[groups]
        dist.all_reduce(total, group=self.pp_group)
        norm = float(total.sqrt())
        if max_norm and norm + 1e-6 > max_norm:
            with torch.no_grad():
                for g in grads:
                    g.mul_(max_norm / (norm + 1e-6))
        return norm

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Original parameter name -> its gradient, for the parameters this rank holds (local, as held)."""
        return {n: t.grad for n, t in self.state.items() if isinstance(t, nn.Parameter)}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Original name -> whole tensor, detached, for every tensor this rank holds.

        A collective over ``dp`` under data parallelism (FSDP shards are gathered): every rank calls it.
        """
        return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for n, t in self.state.items()}

    def flatten(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """A batch (dict, tuple or ``(args, kwargs)``) -> the model's flat inputs, shape-checked."""
        args, kwargs = normalize_example_inputs(batch)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(structure_mismatch("the pipeline", self.in_spec, spec))
        m = cast(int, self.plan.num_microbatches)  # Plan.__post_init__ fills it in
        for name, x, shape in zip(self.input_names, leaves, self.microbatch_shapes):
            want = (shape[0] * m, *shape[1:])
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputError(
                    f"batch input '{name}' has shape {got} but the pipeline was built for {want} "
                    f"({m} micro-batches of {shape}); pipelining's buffers are fixed, so pack batches to the "
                    "planned shape (a packing collator) or re-compile the stages for this shape"
                )
        if self.input_dtypes:
            return tuple(x.to(self.device, d if x.is_floating_point() else x.dtype)
                         for x, d in zip(leaves, self.input_dtypes))
        return tuple(x.to(self.device) for x in leaves)

    def evaluate(self, batch: Any) -> tuple[float, float] | None:
        """Forward only (no gradient, stages in eval mode) on this rank's batch; on ranks with the last stage, the
        loss summed over the step's labelled tokens (each micro-batch's mean loss x its loss terms,
        :func:`loss_terms`) and their count, both summed over ``dp``: their ratio is the step's mean loss."""
        flat = self.flatten(batch)
        counts = loss_terms(flat, self.input_names, self.weighting)
        losses: list[torch.Tensor] = []
        modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        try:
            with torch.no_grad(), self._loss_context():
                self.schedule.eval(*(flat if self.has_first else ()), target=counts.to(self.device) if self.has_last
                                   else None, losses=losses if self.has_last else None, return_outputs=False)
        finally:
            for m, mode in zip(self.modules, modes):
                m.train(mode)
        if not self.has_last:
            return None
        summed = torch.stack([sum(loss.detach().double() for loss in losses) + torch.zeros((), dtype=torch.float64,
                                                                                           device=self.device),
                              counts.sum().to(self.device)])
        if self.dp_group is not None:
            dist.all_reduce(summed, group=self.dp_group)
        return float(summed[0]), float(summed[1])

    def step(self, batch: Any, *, loss_scale: float = 1.0) -> float | None:
        """Forward and backward on this rank's batch; returns the whole step's loss on ranks with the last stage.

        ``batch`` is this data-parallel rank's part of the step. Gradients accumulate into ``.grad``
        (zero them before); they are summed over ``dp`` and, for tied parameters, over the pipeline
        ranks holding them. The caller runs the optimizer. ``loss_scale`` (fp16's :class:`LossScaler`) multiplies
        the loss the gradients come from (the returned loss is unscaled).
        """
        flat = self.flatten(batch)
        target = None
        if self.has_last:
            total = loss_terms(flat, self.input_names, self.weighting).sum()
            if self.dp_group is not None:  # weights are shares of the global step, across dp ranks too
                total = total.to(self.device)
                dist.all_reduce(total, group=self.dp_group)
            target = loss_weights(flat, self.input_names, self.weighting, total=total).to(self.device) * loss_scale
        losses: list[torch.Tensor] = []
        args = flat if self.has_first else ()
        with self._loss_context():
            self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        for t in self.tied:
            if t.group is not None and t.param is not None and t.param.requires_grad:  # a frozen one: no gradient
                if t.param.grad is None:
                    t.param.grad = torch.zeros_like(t.param)
                grad = t.param.grad
                # Copies on every pipeline rank hold the same dp shard, so their local parts add up;
                # without grad mode, to_local() is the shard itself (not a copy), so this sums in place.
                with torch.no_grad():
                    dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=t.group)
        if not self.has_last:
            return None
        loss = sum(loss.detach().double() for loss in losses)
        assert isinstance(loss, torch.Tensor)
        loss = loss / loss_scale
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
        return float(loss)


def _local_names(module: nn.Module, original: dict[int, list[str]]) -> dict[str, list[str]]:
    """Module-local name -> original model names, for every parameter and buffer of ``module``."""
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return {n: original.get(id(t), []) for n, t in named}


def _original_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return names


def _check_stage_params_disjoint(modules: Sequence[nn.Module], stages: Sequence[int], precision: str | None = None
                                 ) -> None:
    """No parameter in two of one rank's stages (FSDP2 and replicate wrap each stage on its own); ``precision``:
    the 16-bit setting that wraps them at dp = 1."""
    owner: dict[int, int] = {}
    for s, mod in zip(stages, modules):
        for p in mod.parameters():
            if owner.setdefault(id(p), s) != s:
                if precision is not None:
                    raise InputError(
                        f"stages {owner[id(p)]} and {s} on one rank share a parameter (tied weights); --precision "
                        f"{precision} keeps fp32 masters under FSDP2, which wraps each stage on its own: use "
                        "--precision fp32, or a plan that puts them on different ranks")
                raise InputError(
                    f"stages {owner[id(p)]} and {s} on one rank share a parameter (tied weights); data parallelism "
                    "shards each stage on its own: use dp=1, or a plan that puts them on different ranks"
                )


def _check_captured_in(result: OptimizeResult, low: torch.dtype, precision: str | None, mesh: DeviceMesh | None
                       ) -> None:
    """A 16-bit run needs its model captured with 16-bit parameters, and a mesh for FSDP2's masters."""
    found = {p.dtype for p in result.model.parameters() if p.is_floating_point()}
    if found - {low}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found))
        raise InputError(
            f"precision {precision}: the model was captured with {names} parameters; capture it in "
            f"{str(low).removeprefix('torch.')} (runtime.precision.cast_for_capture(model, {low}) and cast_inputs on "
            "the batch, before compile_for_microbatches) so that its graph's casts are those of a 16-bit model")
    if mesh is None:
        raise InputError(f"precision {precision} keeps fp32 master weights under FSDP2 on the dp mesh: give "
                         "build_pipeline a mesh (init_device_mesh(..., (dp, pp), mesh_dim_names=('dp', 'pp')))")


def _in_fsdp(layout: DataParallel, precision: str | None) -> bool:
    """Whether the stages are wrapped in FSDP2 ``fully_shard``: ``fsdp`` at dp > 1, and at dp = 1 in 16 bits (its
    masters on the 1-rank dp mesh)."""
    return (layout.size > 1 and layout.shard == "fsdp") or (layout.size == 1 and compute_dtype(precision) is not None)


def _make_data_parallel(module: nn.Module, mesh: DeviceMesh, layout: DataParallel,
                        mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    """``module`` made data-parallel over the 1-D ``mesh`` by ``layout`` in place (module glossary); returns it.

    FSDP2 units: every called submodule (a recompute region) whose parameters no other part of the
    stage reads, then the stage for the rest. Gradients are summed over ``dp``, not averaged: the
    loss weights already divide by the global step's loss terms. ``mp``: the mixed precision policy
    (:func:`~omnibal_compile.runtime.precision.mixed_precision_policy`) of every unit.
    """
    mp = mp if mp is not None else MixedPrecisionPolicy()
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    units: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if name and isinstance(sub, _UNIT_TYPES) and not any(name.startswith(n + ".") for n, _ in units):
            inside: dict[int, int] = {}
            for _, p in sub.named_parameters(remove_duplicate=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
            if inside and all(counts[k] == c for k, c in inside.items()):  # read nowhere else in the stage
                units.append((name, sub))
    if layout.shard == "fsdp":
        for _, sub in units:
            fully_shard(sub, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp)
        fully_shard(module, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp)
    else:  # "ddp": DataParallel admits only DP_SHARDS
        for _, sub in units:
            replicate(sub, mesh=mesh, mp_policy=mp)
        replicate(module, mesh=mesh, mp_policy=mp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM, and 1.0 needs no scaling
    return module


def build_pipeline(
    result: OptimizeResult,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    mesh: DeviceMesh | None = None,
    device: torch.device | str = "cpu",
    data_parallel: DataParallel | None = None,
    recompute: bool = True,
    weighting: str = "tokens",
    precision: str | None = None,
    masters: Mapping[str, torch.Tensor] | None = None,
    weights: RankWeights | None = None,
    compile: bool = False,
    sequence_parallel: bool = False,
) -> RankPipeline:
    """This rank's :class:`RankPipeline` for ``result`` (from :func:`omnibal_compile.api.compile_for_microbatches`).

    Give ``rank`` and ``world_size`` for one pipeline on the default process group, or a ``mesh``
    with dims ``("dp", "pp")`` (``init_device_mesh``) for ``dp`` pipelines whose stages are
    data-parallel as ``data_parallel`` says (a :class:`~omnibal_compile.ir.costs.DataParallel` of the
    mesh's dp size; None: FSDP2 resharding after forward). Every rank must call it with the same ``result`` (same
    model, seed, plan), in the same order with respect to other collective calls: it creates
    process groups for tied parameters. ``result.plan`` sets the schedule, micro-batches and
    virtual stages; its recompute options are applied by
    :func:`omnibal_compile.compile.recompute.apply_recompute` unless ``recompute=False``.
    ``weighting`` says how the model's loss averages (see :func:`loss_terms`). ``precision``: ``bf16`` / ``fp16``
    compute with 16-bit parameters over fp32 masters (:mod:`omnibal_compile.runtime.precision`): ``result`` must be
    captured with its parameters in that dtype (``cast_for_capture``), ``masters`` (its return) gives the fp32
    values back (without it the 16-bit values are upcast), and a ``mesh`` is needed (dp = 1 too: its 1-rank dp
    mesh holds the masters). None or ``fp32``: float32. With ``dp > 1`` (or 16 bits) this rank's stage modules of
    ``result`` become FSDP/replicate modules in place: build from a ``result`` of its own. ``weights``: ``result``
    was cut from a model on meta (:func:`~omnibal_compile.runtime.weights.meta_start`); only this rank's stages'
    tensors are made real, from these, on ``device`` (in 16 bits their parameters as the fp32 masters, read
    exactly: ``masters`` is then not needed). ``compile``: each stage module's forward runs under ``torch.compile``
    (:mod:`omnibal_compile.runtime.compiled`), recompute regions inside it. ``sequence_parallel``: with a ``tp``
    mesh dim, the token-wise ops between the tensor-parallel pairs (residual adds, norms) run on sequence shards
    (:mod:`omnibal_compile.compile.tensor_parallel`, glossary: sequence).
    """
    if weighting not in ("tokens", "rows"):
        raise InputError(f"weighting must be 'tokens' or 'rows', got {weighting!r}")
    if data_parallel is not None and not isinstance(data_parallel, DataParallel):
        raise InputError(f"data_parallel must be a DataParallel (ir.costs), got {data_parallel!r}")
    one_pipeline = rank is not None and world_size is not None
    if (mesh is None and not one_pipeline) or (mesh is not None and (rank, world_size) != (None, None)):
        raise InputError("give build_pipeline either rank and world_size (one pipeline) or mesh (dp x pp), not both")
    replicas: list[list[int]]  # global ranks of every replica's pipeline ranks (a replica: one dp and tp index)
    tp_size, replica = 1, 0
    if mesh is not None:
        rank, world_size = mesh["pp"].get_local_rank(), mesh["pp"].size()
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        group = mesh["pp"].get_group()
        replicas, replica, tp_size = mesh_layout(mesh)
    else:
        assert rank is not None and world_size is not None
        dp_rank, dp_size, group, replicas = 0, 1, None, [list(range(world_size))]
    plan = result.plan
    layout = data_parallel if data_parallel is not None else dataclasses.replace(
        NO_DATA_PARALLEL.resized(dp_size), reshard_after_forward=plan.pipeline_schedule.rule.fsdp_may_reshard)
    if layout.size != dp_size:
        raise InputError(f"data_parallel has {layout.size} replicas, the mesh's dp dimension {dp_size}: give one size")
    check_pipeline(plan, world_size=world_size * dp_size * tp_size, dp=dp_size, tp=tp_size, data_parallel=layout,
                   precision=precision)
    check_tensor_parallel(plan, tp=tp_size, compile=compile, sequence_parallel=sequence_parallel)
    device = torch.device(device)
    low = compute_dtype(precision)
    if low is not None:
        _check_captured_in(result, low, precision, mesh)
    mine = rank_stages(plan, rank)
    flops: dict[int, float] = {}
    examples = _stage_examples(result, mine, device, flops)
    holders = _tied_holders(result, _original_names(result.model))  # before materialise gives this rank new tensors
    if weights is not None:
        materialise(result.model, [result.stages[s] for s in mine], weights, device,
                    param_dtype=torch.float32 if low is not None else None)  # 16 bits: the masters, exact
        for s in mine:
            retarget_meta(result.stages[s], device)
    elif device.type != "cpu":  # captured on cpu (the model was built there): the devices its ops name, moved
        for s in mine:
            retarget_meta(result.stages[s], device, source="cpu")
    loss_index = _loss_index(result)
    modules: list[nn.Module] = []
    sharded: dict[int, nn.Parameter] = {}  # id(replicated parameter) -> its tensor-parallel DTensor
    reports: list[TensorParallelReport] = []
    for i, s in enumerate(mine):
        gm = result.stages[s]
        if tp_size > 1:  # before recompute: the pass reads the stage's blocks as codegen made them
            assert mesh is not None
            gm, report, new = tensor_parallel_stage(gm, result.graph, mesh["tp"], sequence_parallel=sequence_parallel)
            sharded.update(new)
            reports.append(report)
        mod: nn.Module = apply_recompute(gm, result.graph, plan) if recompute else gm
        if compile:  # before the output filter below, which stays outside the compiled region
            mod = compile_stage(mod)
        ins, outs = examples[i]
        keep = tuple(j for j, v in enumerate(outs) if isinstance(v, torch.Tensor))
        split = plan.pipeline_schedule.rule.split_backward
        if len(keep) < len(outs):  # only the last stage may return non-tensors (HF outputs hold Nones)
            mod = _TensorOutputs(mod, keep, copy_views=split)
            examples[i] = (ins, tuple(outs[j] for j in keep))
            loss_index = keep.index(loss_index)
        elif split:
            mod = _TensorOutputs(mod, keep, copy_views=True)
        if split and s > 0:
            _check_split_backward(mod, ins, s, plan.schedule)
        modules.append(mod)
    original = _original_names(result.model)
    original.update({id(p): original.get(k, []) for k, p in sharded.items()})
    local = [_local_names(mod, original) for mod in modules]  # names survive fully_shard; objects do not
    if low is not None:  # after the examples (run in 16 bits): the stages hold fp32 masters from here
        for mod, names in zip(modules, local):
            restore_masters(mod, masters or {}, names)
    modules = [mod.to(device) for mod in modules]
    if _in_fsdp(layout, precision) or dp_size > 1:
        assert mesh is not None
        _check_stage_params_disjoint(modules, mine, precision if dp_size == 1 else None)
        # dp = 1 in 16 bits: FSDP2 over the 1-rank dp mesh, for its gather-in-bf16 / reduce-in-fp32 policy
        wrap = layout if dp_size > 1 else dataclasses.replace(layout, shard="fsdp")
        modules = [_make_data_parallel(mod, mesh["dp"], wrap, mixed_precision_policy(low)) for mod in modules]
    state: dict[str, torch.Tensor] = {}
    for mod, names in zip(modules, local):
        tensors = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
        for n, t in tensors:
            for name in names[n]:
                state[name] = t
    tied = _tied_parameters(holders, rank, replicas, replica, state)
    stages = tuple(
        PipelineStage(mod, s, plan.num_stages, device, input_args=ins, output_args=outs, group=group)
        for s, mod, (ins, outs) in zip(mine, modules, examples)
    )
    loss_fn = _WeightedLoss(loss_index)
    cls = get_schedule_class(plan.schedule)
    m = cast(int, plan.num_microbatches)  # Plan.__post_init__ fills it in
    schedule: _PipelineSchedule
    if issubclass(cls, PipelineScheduleMulti):
        schedule = cls(list(stages), m, loss_fn=loss_fn, scale_grads=False)
    else:  # one stage per rank: every schedule's torch class is a PipelineScheduleMulti or a Single
        schedule = cast(type[PipelineScheduleSingle], cls)(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    return RankPipeline(
        rank=rank,
        world_size=world_size,
        plan=plan,
        stage_indices=mine,
        modules=tuple(modules),
        stages=stages,
        schedule=schedule,
        in_spec=result.captured.in_spec,
        input_names=result.stage_info(0).input_names,
        microbatch_shapes=tuple(tuple(x.shape) for x in result.captured.example_flat_inputs),
        weighting=weighting,
        state=state,
        tied=tied,
        device=device,
        dp_rank=dp_rank,
        dp_size=dp_size,
        dp_group=mesh["dp"].get_group() if mesh is not None and dp_size > 1 else None,
        dp_shard=layout.shard if dp_size > 1 else None,
        pp_group=group,
        tp_size=tp_size,
        tensor_parallel=tuple(reports),
        forward_flops=sum(flops.values()),
        input_dtypes=tuple(x.dtype for x in result.captured.example_flat_inputs),
        param_dtype=low or torch.float32,
    )


def _stage_examples(
    result: OptimizeResult, wanted: Sequence[int], device: torch.device, flops: dict[int, float] | None = None
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Example inputs and outputs of the ``wanted`` stages, from running every stage up to the last wanted one on
    the captured micro-batch: pipelining's static mode takes their shapes, dtypes and ``requires_grad`` (true
    exactly for the values that carry gradients at run time). They run on ``meta`` (nothing allocated or
    computed, weights real or not; runtime checks left out, :mod:`omnibal_compile.costs.meta`) unless a stage
    reads values into shapes (``nonzero``, data-dependent sizes): then for real, which needs real weights in every
    stage before. ``flops`` gets each wanted stage's forward FLOPs on that micro-batch."""
    from omnibal_compile.costs.meta import value_reads

    flops = {} if flops is None else flops
    stages = result.stages[: max(wanted) + 1]
    on_meta = not any(value_reads(stage.graph) for stage in stages)
    if not on_meta and any(t.is_meta for stage in stages for t in stage.parameters()):
        raise InputError(
            f"{result.captured.model_name} reads tensor values into shapes ({value_reads(stages[0].graph)[:1]}...): "
            "its stage examples need real weights in every stage; this rank was built on meta"
        )
    found = _run_examples(result, stages, wanted, flops, on_meta=on_meta)
    last = result.plan.num_stages - 1
    for s in wanted:
        for kind, vals in zip(("input", "output"), found[s]):
            for i, v in enumerate(vals):
                if not isinstance(v, torch.Tensor) and not (kind == "output" and s == last):
                    raise InputError(
                        f"stage {s} {kind} #{i} is a {type(v).__name__}, not a tensor: pipelining sends tensors only; "
                        "cut the model elsewhere"
                    )

    def to_device(vals: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            torch.empty_like(v, device=device).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
            for v in vals
        )

    return [(to_device(found[s][0]), to_device(found[s][1])) for s in wanted]


def _run_examples(
    result: OptimizeResult, stages: Sequence[fx.GraphModule], wanted: Sequence[int], flops: dict[int, float], *,
    on_meta: bool,
) -> dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """Stage index -> (inputs, outputs) of running ``stages`` in turn on the captured micro-batch (see
    :func:`_stage_examples`); ``on_meta``: on meta copies of the inputs and of each stage's tensors."""
    from omnibal_compile.costs._measure import count_flops
    from omnibal_compile.costs.meta import check_only_nodes, drop_checks

    def fresh(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        twin = torch.empty_like(x, device="meta") if on_meta else x.detach()
        return twin.requires_grad_(x.requires_grad)

    values: tuple[Any, ...] = tuple(fresh(x) for x in result.captured.example_flat_inputs)
    found: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
    with torch.enable_grad():
        for s, stage in enumerate(stages):
            counter = count_flops()
            with counter if s in wanted else contextlib.nullcontext():
                if on_meta:  # a copy without the checks (they read values), every op on meta
                    runnable = fx.GraphModule(stage, copy.deepcopy(stage.graph))
                    drop_checks(runnable, check_only_nodes(runnable.graph))
                    with _OnMeta():
                        out = runnable(*values)
                else:
                    out = stage(*values)
            if s in wanted:
                flops[s] = float(counter.get_total_flops())
            outs = tuple(fresh(x) for x in (out if isinstance(out, (tuple, list)) else (out,)))
            found[s] = (values, outs)
            values = outs
    return found


class _OnMeta(TorchDispatchMode):
    """Runs every op on meta twins of its tensors (real weights and constants included: a twin is free) and devices
    (a captured ``.to(device)``), so a stage runs on meta inputs whatever its weights are; autograd, above this
    mode, still sets ``requires_grad``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def twin(x: Any) -> Any:
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x

        return func(*pytree.tree_map(twin, args), **pytree.tree_map(twin, kwargs or {}))


def _tied_holders(result: OptimizeResult, names: dict[int, list[str]]) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(original names, pipeline ranks holding it) of every parameter used on several ranks.

    Read before data parallelism replaces this rank's parameter objects."""
    plan = result.plan
    holders: dict[int, set[int]] = {}
    for s, stage in enumerate(result.stages):
        for p in stage.parameters():
            holders.setdefault(id(p), set()).add(plan.pipeline_schedule.device_of(s, plan.num_stages))
    found = [(tuple(names.get(k, [])), tuple(sorted(ranks))) for k, ranks in holders.items() if len(ranks) > 1]
    return sorted(found)


def _tied_parameters(
    holders: Sequence[tuple[tuple[str, ...], tuple[int, ...]]],
    rank: int,
    replicas: Sequence[Sequence[int]],
    replica: int,
    state: dict[str, torch.Tensor],
) -> tuple[TiedParameter, ...]:
    """Tied parameters with, per replica, a process group of the pipeline ranks holding them.

    ``replicas[d][r]`` is the global rank of pipeline rank ``r`` in replica ``d``; this rank is
    pipeline rank ``rank`` of replica ``replica``. Every rank creates every group, in one order.
    """
    tied = []
    for names, ranks in holders:
        groups = [dist.new_group([replicas[d][r] for r in ranks]) for d in range(len(replicas))]
        held = rank in ranks
        param = state[names[0]] if held else None
        tied.append(
            TiedParameter(
                names=names,
                ranks=ranks,
                group=groups[replica] if held else None,
                param=param if isinstance(param, nn.Parameter) else None,
            )
        )
    return tuple(tied)
