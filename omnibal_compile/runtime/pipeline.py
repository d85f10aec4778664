"""Build one rank's share of a pipeline on ``torch.distributed.pipelining`` and train with it.

Glossary:
    rank stages    the stages a rank runs: ``r, r + W, r + 2W, ...`` for ``W`` ranks (one stage per
                   rank unless the plan is interleaved with ``virtual_stages > 1``).
    micro-batch    one of ``num_microbatches`` equal slices (along dim 0 of every input) of a
                   batch. Stages are captured at the micro-batch shape; every batch must split
                   into micro-batches of exactly that shape (pipelining's buffers are fixed).
    loss weights   the generated last stage returns the model's own loss, a mean over its
                   micro-batch. The pipelining ``loss_fn`` multiplies it by the micro-batch's
                   share of the batch's loss terms (its labelled tokens, or its rows when the
                   batch has no ``labels``), passed as ``target``; with ``scale_grads=False`` the
                   summed gradients then equal those of the unsplit model's loss on the whole batch.
    tied parameter one parameter object under several names (tied embedding and head). Every rank
                   whose stages use it holds a copy; their gradients are summed after backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule
from torch.utils import _pytree as pytree

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.labels import IGNORE_INDEX
from omnibal_compile.passes.capture import normalize_example_inputs
from omnibal_compile.passes.recompute import apply_recompute
from omnibal_compile.plan import Plan

if TYPE_CHECKING:  # the runtime consumes what optimize() built; it never calls back into it
    from omnibal_compile.api import OptimizeResult

__all__ = [
    "RankPipeline",
    "TiedParameter",
    "build_pipeline",
    "check_pipeline",
    "get_schedule_class",
    "loss_weights",
    "rank_stages",
]

_SCHEDULE_CLASSES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}
"""Schedule kind (:data:`omnibal_compile.schedule.SCHEDULE_KINDS`) -> the torch class that runs it."""


def check_pipeline(plan: Plan, *, world_size: int, batch_size: int | None = None) -> None:
    """Raise a clear :class:`PlanError` unless ``plan`` can run on ``world_size`` ranks with this batch."""
    plan.pipeline_schedule.check(plan.num_stages)
    s, v, m = plan.num_stages, plan.virtual_stages, plan.num_microbatches
    if world_size != plan.num_devices:
        extra = f" ({s} stages / {v} virtual stages per rank)" if v > 1 else ""
        raise PlanError(
            f"the plan needs {plan.num_devices} ranks{extra} but world size is {world_size}: "
            f"launch {plan.num_devices} processes, or re-plan for {world_size} ranks"
        )
    if batch_size is not None and batch_size % m:
        raise PlanError(
            f"batch size {batch_size} is not divisible by {m} micro-batches; use a batch size that is a multiple of {m}"
        )


def get_schedule_class(kind: str) -> type[_PipelineSchedule]:
    """The ``torch.distributed.pipelining`` schedule class that runs schedule ``kind``."""
    if kind not in _SCHEDULE_CLASSES:
        raise PlanError(f"schedule {kind!r} is unknown; use one of {list(_SCHEDULE_CLASSES)}")
    return _SCHEDULE_CLASSES[kind]


def rank_stages(plan: Plan, rank: int) -> tuple[int, ...]:
    """Stage indices that ``rank`` runs (``rank, rank + W, ...``)."""
    if not 0 <= rank < plan.num_devices:
        raise InputError(f"rank {rank} is out of range for a plan on {plan.num_devices} ranks")
    return tuple(range(rank, plan.num_stages, plan.num_devices))


def loss_weights(flat_inputs: Sequence[Any], input_names: Sequence[str], weighting: str = "tokens") -> torch.Tensor:
    """Per-row share of the batch's loss terms, summing to 1 (see the module glossary).

    ``tokens``: rows weigh by their labelled tokens (``labels[:, 1:] != -100``), right for a loss
    that is the mean over labelled next-token positions (Hugging Face causal LMs, the reference
    VLM); rows weigh equally when there is no ``labels`` input. ``rows``: always equally, right for
    a loss that is a mean over rows.
    """
    if weighting not in ("tokens", "rows"):
        raise InputError(f"loss weighting must be 'tokens' or 'rows', got {weighting!r}")
    rows = int(flat_inputs[0].shape[0])
    if weighting == "tokens" and "labels" in input_names:
        labels = flat_inputs[list(input_names).index("labels")]
        if isinstance(labels, torch.Tensor) and labels.dim() == 2:
            counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).double()
            total = counts.sum()
            if total == 0:
                raise InputError("the batch has no labelled token (every label is -100): nothing to train on")
            return counts / total
    return torch.full((rows,), 1.0 / rows, dtype=torch.float64)


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


@dataclass(frozen=True)
class _WeightedLoss:
    """pipelining ``loss_fn``: the last stage's scalar loss output times the micro-batch's weight."""

    index: int

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        loss = outs[self.index]
        return loss * target.sum().to(loss.dtype)


class _TensorOutputs(nn.Module):
    """The last stage with only its tensor outputs (pipelining handles stage outputs as tensors)."""

    def __init__(self, stage: nn.Module, keep: tuple[int, ...]) -> None:
        super().__init__()
        self.stage = stage
        self.keep = keep

    def forward(self, *args: Any) -> tuple[Any, ...]:
        out = self.stage(*args)
        return tuple(out[j] for j in self.keep)


@dataclass(frozen=True, kw_only=True)
class TiedParameter:
    """A parameter used by stages on several ranks."""

    names: tuple[str, ...]
    """Its names in the original model."""
    ranks: tuple[int, ...]
    """Ranks whose stages use it."""
    group: Any = field(repr=False)
    """Process group of those ranks (None on ranks outside it)."""
    param: nn.Parameter | None = field(repr=False)
    """The local copy (None on ranks that do not hold it)."""


@dataclass(frozen=True, kw_only=True)
class RankPipeline:
    """One rank's stages, schedule and parameters; :meth:`step` runs one training iteration."""

    rank: int
    """This rank."""
    world_size: int
    """Pipeline ranks."""
    plan: Plan
    """The plan the stages were made from (micro-batches, schedule)."""
    stage_indices: tuple[int, ...]
    """Stages this rank runs."""
    modules: tuple[nn.Module, ...] = field(repr=False)
    """The stage modules (recompute applied), in ``stage_indices`` order."""
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
    """How micro-batch losses are weighted: ``tokens`` or ``rows`` (see :func:`loss_weights`)."""
    state: dict[str, torch.Tensor] = field(repr=False)
    """Original model name -> tensor, for every parameter and persistent buffer this rank holds."""
    tied: tuple[TiedParameter, ...] = field(repr=False)
    """Parameters shared with stages on other ranks."""
    device: torch.device
    """Device the stages run on."""

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Original parameter name -> its gradient, for the parameters this rank holds."""
        return {n: t.grad for n, t in self.state.items() if isinstance(t, nn.Parameter)}

    def flatten(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """A batch (dict, tuple or ``(args, kwargs)``) -> the model's flat inputs, shape-checked."""
        args, kwargs = normalize_example_inputs(batch)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(f"the batch does not have the structure the pipeline was built for: expected {self.in_spec}, got {spec}")
        m = self.plan.num_microbatches
        for name, x, shape in zip(self.input_names, leaves, self.microbatch_shapes):
            want = (shape[0] * m, *shape[1:])
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputError(
                    f"batch input '{name}' has shape {got} but the pipeline was built for {want} "
                    f"({m} micro-batches of {shape}); pipelining's buffers are fixed, so pack batches to the "
                    "planned shape (a packing collator) or re-compile the stages for this shape"
                )
        return tuple(x.to(self.device) for x in leaves)

    def step(self, batch: Any) -> float | None:
        """Forward and backward on one batch; returns the batch loss on the rank with the last stage.

        Gradients accumulate into ``.grad`` (zero them before); tied parameters' gradients are summed
        across the ranks holding them. The caller runs the optimizer.
        """
        flat = self.flatten(batch)
        target = loss_weights(flat, self.input_names, self.weighting).to(self.device) if self.has_last else None
        losses: list[torch.Tensor] = []
        args = flat if self.has_first else ()
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        for t in self.tied:
            if t.group is not None and t.param is not None:
                if t.param.grad is None:
                    t.param.grad = torch.zeros_like(t.param)
                dist.all_reduce(t.param.grad, group=t.group)
        if not self.has_last:
            return None
        return float(sum(loss.detach().double() for loss in losses))


def _original_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return names


def build_pipeline(
    result: OptimizeResult,
    *,
    rank: int,
    world_size: int,
    device: torch.device | str = "cpu",
    group: Any = None,
    recompute: bool = True,
    weighting: str = "tokens",
) -> RankPipeline:
    """This rank's :class:`RankPipeline` for ``result`` (from :func:`omnibal_compile.api.compile_for_microbatches`).

    Every rank must call it with the same ``result`` (same model, seed, plan), in the same order
    with respect to other collective calls: it creates process groups for tied parameters.
    ``result.plan`` sets the schedule, micro-batches and virtual stages; its recompute options are
    applied by :func:`omnibal_compile.passes.recompute.apply_recompute` unless ``recompute=False``.
    ``weighting`` says how the model's loss averages (see :func:`loss_weights`).
    """
    if weighting not in ("tokens", "rows"):
        raise InputError(f"weighting must be 'tokens' or 'rows', got {weighting!r}")
    plan = result.plan
    check_pipeline(plan, world_size=world_size)
    device = torch.device(device)
    mine = rank_stages(plan, rank)
    examples = _stage_examples(result, mine, device)
    loss_index = _loss_index(result)
    modules: list[nn.Module] = []
    for i, s in enumerate(mine):
        mod: nn.Module = apply_recompute(result.stages[s], result.graph, plan) if recompute else result.stages[s]
        ins, outs = examples[i]
        keep = tuple(j for j, v in enumerate(outs) if isinstance(v, torch.Tensor))
        if len(keep) < len(outs):  # only the last stage may return non-tensors (HF outputs hold Nones)
            mod = _TensorOutputs(mod, keep)
            examples[i] = (ins, tuple(outs[j] for j in keep))
            loss_index = keep.index(loss_index)
        modules.append(mod.to(device))
    names = _original_names(result.model)
    state: dict[str, torch.Tensor] = {}
    for mod in modules:
        for t in list(mod.parameters()) + list(mod.buffers()):
            for name in names.get(id(t), []):
                state[name] = t
    tied = _tied_parameters(result, rank, names, group)
    stages = tuple(
        PipelineStage(mod, s, plan.num_stages, device, input_args=ins, output_args=outs, group=group)
        for s, mod, (ins, outs) in zip(mine, modules, examples)
    )
    loss_fn = _WeightedLoss(loss_index)
    cls = get_schedule_class(plan.schedule)
    runs = list(stages) if issubclass(cls, PipelineScheduleMulti) else stages[0]  # one stage per rank otherwise
    schedule = cls(runs, plan.num_microbatches, loss_fn=loss_fn, scale_grads=False)
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
    )


def _stage_examples(
    result: OptimizeResult, wanted: Sequence[int], device: torch.device
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Example inputs and outputs of the ``wanted`` stages, from running every stage once on the
    captured micro-batch: pipelining's static mode takes their shapes, dtypes and ``requires_grad``
    (true exactly for the values that carry gradients at run time)."""

    def fresh(x: Any) -> Any:
        return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x

    values: tuple[Any, ...] = tuple(fresh(x) for x in result.captured.example_flat_inputs)
    found: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
    with torch.enable_grad():
        for s, stage in enumerate(result.stages[: max(wanted) + 1]):
            out = stage(*values)
            outs = tuple(fresh(x) for x in (out if isinstance(out, (tuple, list)) else (out,)))
            found[s] = (values, outs)
            values = outs
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
        return tuple(fresh(v.to(device)) if isinstance(v, torch.Tensor) else v for v in vals)

    return [(to_device(found[s][0]), to_device(found[s][1])) for s in wanted]


def _tied_parameters(
    result: OptimizeResult, rank: int, names: dict[int, list[str]], group: Any
) -> tuple[TiedParameter, ...]:
    plan = result.plan
    w = plan.num_devices
    holders: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, stage in enumerate(result.stages):
        for p in stage.parameters():
            holders.setdefault(id(p), set()).add(s % w)
            params[id(p)] = p
    tied = []
    for key in sorted(holders, key=lambda k: names.get(k, [""])[0]):
        ranks = tuple(sorted(holders[key]))
        if len(ranks) < 2:
            continue
        if group is not None:
            raise InputError("tied parameters across ranks are only supported on the default process group")
        pg = dist.new_group(list(ranks))  # every rank calls new_group, in the same order
        tied.append(
            TiedParameter(
                names=tuple(names.get(key, [])),
                ranks=ranks,
                group=pg if rank in ranks else None,
                param=params[key] if rank in ranks else None,
            )
        )
    return tuple(tied)
