"""Cost types shared by the cost pass (producer) and the planners and simulator (consumers).

Torch-free on purpose: the solver modules import only this. All figures are per micro-batch of
the planned shape unless a field says otherwise.

Glossary:
    recompute option  ``none`` keeps every activation for backward; ``selective`` keeps matmul
                      outputs and recomputes cheap ops (norms, activations, softmax); ``full``
                      keeps only the block's input and reruns the whole block before backward.
    static bytes      weights + gradients + optimizer states held by the device for the block,
                      independent of the number of micro-batches in flight.
    precision         bytes per parameter for weights, gradients, fp32 master copy and optimizer
                      states, with optional sharding of the last two over data-parallel ranks.
    data parallel     dp replicas of the whole pipeline (DDP or FSDP): divides static bytes as the
                      layout shards them and adds gradient reduction (and FSDP's all-gathers) to
                      the iteration, over the table's data-parallel bandwidth (``CostTable.dp_bandwidth``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from omnibal_compile._utils.tables import format_table
from omnibal_compile.errors import InputError

__all__ = [
    "RECOMPUTE_OPTIONS", "BlockCost", "CostTable", "Precision", "BF16_ADAM", "FP32_ADAM",
    "DP_SHARDS", "DataParallel", "DataParallelCost", "NO_DATA_PARALLEL", "DATA_PARALLEL_LAYOUTS", "COMPUTE_DTYPES",
    "running_peak", "PRECISION_NAMES", "precision_named", "with_frozen", "SharedParameter", "held_once",
    "ring_collective_s", "TensorParallelBlock",
]

RECOMPUTE_OPTIONS: tuple[str, ...] = ("none", "selective", "full")

COMPUTE_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
"""Activation dtypes a :class:`Precision` may name (torch dtype names)."""


@dataclass(frozen=True, kw_only=True)
class SharedParameter:
    """A parameter that several blocks read (a head tied to the embedding): the static bytes of each of those
    blocks count it whole, as a stage holding any one of them keeps it, but a device holding several keeps one
    copy (:func:`held_once`)."""

    name: str
    """Its name in the captured graph."""
    blocks: tuple[int, ...]
    """Indices of the blocks reading it (two or more, ascending)."""
    numel: int
    """Its elements."""
    frozen: bool = False
    """Whether it is frozen (``requires_grad=False``: its weights only are static)."""


def ring_collective_s(nbytes: Any, group: int, bandwidth: float) -> Any:
    """Seconds of one ring all-gather or reduce-scatter of ``nbytes`` (the whole, gathered size; a number, or a
    numpy array of them) among ``group``
    ranks: each rank sends ``(group - 1) / group`` of it over ``bandwidth`` bytes/s. An all-reduce is a
    reduce-scatter then an all-gather: twice this. The one rule of collective time for tensor parallelism
    (:func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` and the analytic Megatron rule,
    :func:`omnibal_compile.costs.analytic.tensor_parallel_costs`); 0 for a group of one."""
    if not isinstance(group, int) or group < 1:
        raise InputError(f"collective group must be a positive integer of ranks, got {group!r}")
    if not bandwidth > 0:
        raise InputError(f"collective bandwidth must be positive bytes/s, got {bandwidth}")
    return (group - 1) / group * nbytes / bandwidth


@dataclass(frozen=True, kw_only=True)
class TensorParallelBlock:
    """What the tensor-parallel pass shards in one block, as the costs need it: the sums over the block's sharded
    Megatron pairs (:class:`omnibal_compile.compile.tensor_parallel.TensorParallelReport` ``.blocks()``), per
    micro-batch of the shape the pass saw."""

    pairs: int
    """Forward all-reduces: one per sharded column/row pair of the block (not a pair whose row output a
    sequence-parallel region reduce-scatters), one for a vocabulary-parallel embedding, three for a vocabulary-
    parallel head's loss."""
    backward_reduces: int
    """All-reduces of the backward: one per column-wise layer (DTensor's ``ColwiseParallel`` reduces each layer's
    input gradient on its own: 3 for attention's q, k and v, where Megatron fuses them into one), none for a layer
    reading a sequence-parallel region all-gathered, one per norm weight such a region reads."""
    params: int
    """Parameter elements of the pairs' linear layers (weights and biases), whole: each rank holds 1 / tp."""
    flops: float
    """Forward FLOPs of the ops each rank runs on its shard only: the pairs' linear layers and the attention
    between them (2 x multiply-adds, the formulas of ``torch.utils.flop_counter``)."""
    forward_bytes: int
    """Bytes the forward all-reduces: each such pair's row-wise layer's output."""
    backward_bytes: int
    """Bytes the backward all-reduces: each column-wise layer's input gradient (and with sequence parallelism the
    gradients of the norm weights read by sequence shards)."""
    sequence_forward_calls: int = 0
    """Sequence parallelism: reduce-scatters and all-gathers of the forward (the row-wise outputs reduce-scattered
    on the sequence, the column-wise inputs all-gathered; each one ring pass, half an all-reduce)."""
    sequence_forward_bytes: int = 0
    """Whole bytes of the values those forward calls move."""
    sequence_backward_calls: int = 0
    """Sequence parallelism: reduce-scatters and all-gathers of the backward (the mirror of the forward's, and the
    gradients of whole values entering a region all-gathered)."""
    sequence_backward_bytes: int = 0
    """Whole bytes of the values those backward calls move."""
    sequence_share: float = 0.0
    """Sequence parallelism: the share of the block's activation bytes that are sequence shards (each rank keeps
    1 / tp of them)."""

    def __post_init__(self) -> None:
        if min(self.pairs, self.backward_reduces, self.params, self.flops, self.forward_bytes, self.backward_bytes,
               self.sequence_forward_calls, self.sequence_forward_bytes, self.sequence_backward_calls,
               self.sequence_backward_bytes) < 0 or not 0 <= self.sequence_share <= 1:
            raise InputError(f"tensor-parallel block facts must be non-negative (sequence_share at most 1), "
                             f"got {self}")

    def scaled(self, k: float) -> TensorParallelBlock:
        """The same block on a micro-batch ``k`` times as large: FLOPs and bytes scale, parameters do not (the
        rule of :func:`omnibal_compile.costs.mix.scale_costs`)."""
        return dataclasses.replace(self, flops=self.flops * k, forward_bytes=round(self.forward_bytes * k),
                                   backward_bytes=round(self.backward_bytes * k),
                                   sequence_forward_bytes=round(self.sequence_forward_bytes * k),
                                   sequence_backward_bytes=round(self.sequence_backward_bytes * k))


def held_once(shared: Sequence[tuple[tuple[int, ...], float]], blocks: Sequence[int] | range) -> float:
    """Bytes that summing the static bytes of ``blocks`` counts too often: per shared parameter, given as (its
    blocks, the static bytes of one copy), one copy for every block of ``blocks`` reading it beyond the first."""
    held = set(blocks)
    return sum(size * max(0, sum(1 for b in on if b in held) - 1) for on, size in shared)


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """What one block costs in time and memory."""

    name: str
    """Block name, as in the block graph and the plan."""
    kind: str
    """``layer``, ``module`` or ``glue``."""
    flops: float
    """Forward FLOPs per micro-batch."""
    num_params: int
    """Parameter elements."""
    static_bytes: int
    """Weights + gradients + optimizer states on the device (after any optimizer sharding)."""
    forward_s: float
    """Forward time per micro-batch, seconds."""
    backward_s: float
    """Backward time per micro-batch without recomputation, seconds."""
    weight_grad_s: float | None = None
    """W: the part of ``backward_s`` that computes the weight gradients (the rest, :attr:`backward_input_s`, is the
    input-gradient part B that the previous stage waits for); zero-bubble schedules run it apart. The same under
    every recompute option (recomputation adds its ``recompute_s`` before B). 0 for a frozen block; None when not
    known (tables costed before it was measured)."""
    activation_bytes: Mapping[str, int]
    """Bytes kept alive from forward to backward, per recompute option (keys: RECOMPUTE_OPTIONS)."""
    recompute_s: Mapping[str, float]
    """Extra time each recompute option adds per micro-batch (``none`` -> 0)."""
    workspace_bytes: int = 0
    """Bytes the block holds only while it computes, on top of what it keeps for backward: forward
    temporaries, the backward's incoming gradient and scratch, and the activations a recomputing
    block rebuilds (the largest over the recompute options; measured by the cost pass, 0 if not).
    The planners' memory bound charges it whatever option the block runs under."""
    peak_bytes: Mapping[str, int] = field(default_factory=dict)
    """Peak live bytes of one forward and backward of the block alone, per recompute option (what it
    keeps plus its workspace under that option); empty when not measured. The predicted peak of a
    stage (:func:`running_peak`) reads it."""
    signature: str = ""
    """Hash of the block's computation and input shapes (:func:`omnibal_compile.costs._signature.block_signature`);
    blocks with the same signature cost the same. Empty when not known."""
    profiled_as: str = ""
    """Name of the block whose measured times and FLOPs this entry reuses (the first block with the same
    signature); empty when measured itself. Activation bytes are always the block's own."""
    time_spread: float = 0.0
    """Relative spread of the profiled times: the larger of forward's and backward's interquartile range
    over their median, across the timed repeats (0 for modelled times)."""
    tensor_parallel_s: float = 0.0
    """Seconds of tensor-parallel all-reduces per micro-batch already inside ``forward_s`` + ``backward_s`` (and the
    forward's again in ``recompute_s['full']``); 0 at tp = 1 (:func:`omnibal_compile.costs.tensor_parallel.
    tensor_parallel_table`)."""
    frozen_params: int = 0
    """Of ``num_params``, the elements that are frozen (``requires_grad=False``): ``static_bytes`` holds only their
    weights (:attr:`Precision.frozen_bytes_per_param`), and data parallelism reduces no gradient for them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_bytes", dict(self.activation_bytes))
        object.__setattr__(self, "recompute_s", dict(self.recompute_s))
        object.__setattr__(self, "peak_bytes", dict(self.peak_bytes))
        measured = [("activation_bytes", self.activation_bytes), ("recompute_s", self.recompute_s)]
        for what, d in (*measured, *([("peak_bytes", self.peak_bytes)] if self.peak_bytes else [])):
            missing = [o for o in RECOMPUTE_OPTIONS if o not in d]
            if missing:
                raise InputError(f"block '{self.name}': {what} lacks recompute options {missing}")
            if any(v < 0 for v in d.values()):
                raise InputError(f"block '{self.name}': {what} has a negative entry {d}")
        if self.forward_s < 0 or self.backward_s < 0 or self.static_bytes < 0 or self.workspace_bytes < 0:
            raise InputError(f"block '{self.name}': times and bytes must be non-negative")
        if self.weight_grad_s is not None and not 0 <= self.weight_grad_s <= self.backward_s * (1 + 1e-9):
            raise InputError(f"block '{self.name}': weight_grad_s {self.weight_grad_s} must lie within 0..backward_s "
                             f"({self.backward_s}): it is a part of the backward")
        if not 0 <= self.frozen_params <= max(self.num_params, 0):
            raise InputError(f"block '{self.name}': frozen_params {self.frozen_params} must be within 0..num_params "
                             f"({self.num_params})")

    @property
    def backward_input_s(self) -> float:
        """B: the input-gradient part of the backward, ``backward_s - weight_grad_s`` (all of it when W is unknown)."""
        return max(0.0, self.backward_s - (self.weight_grad_s or 0.0))

    def trained_params(self, precision: Precision) -> float:
        """Parameter elements that train (get gradients and optimizer states), read from ``static_bytes`` as costed
        with ``precision``: ``(static_bytes - frozen_params x frozen bytes) / bytes_per_param``."""
        per_param = precision.bytes_per_param
        rest = self.static_bytes - self.frozen_params * precision.frozen_bytes_per_param
        return max(0.0, rest) / per_param if per_param > 0 else 0.0


def running_peak(kept: Sequence[float], peak: Sequence[float]) -> float:
    """Most bytes one micro-batch holds on a stage while it runs through the stage's blocks:
    ``max_b (sum(kept[:b]) + peak[b])``, with ``kept[b]`` what block b keeps for backward and
    ``peak[b]`` its own peak (kept plus workspace, under its recompute option).

    In the forward, the blocks before b have kept theirs when b runs; in the backward, the blocks
    after b have already freed theirs (the last block's backward runs first). Either way block b
    adds its own peak to what the blocks before it keep. 0 for an empty stage.
    """
    total, best = 0.0, 0.0
    for k, p in zip(kept, peak, strict=True):
        best = max(best, total + p)
        total += k
    return best


DP_SHARDS: tuple[str, ...] = ("fsdp", "ddp")
"""How a pipeline stage is data-parallel: FSDP2 ``fully_shard`` (ZeRO-3) or DDP-style replication."""
DEFAULT_DP_SHARD = "fsdp"
"""The data-parallel engine planned for and run when none is named (FSDP2, as the runtime does)."""


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Data parallelism around the pipeline: how many replicas, and how their training state is laid out.

    ``ddp``: every rank holds whole weights, gradients and optimizer states; gradients are summed by
    a ring all-reduce after the last micro-batch's backward. ``fsdp`` (FSDP2 / ZeRO-3): weights,
    gradients, master copy and optimizer states are sharded over the ranks; each block's weights
    are all-gathered while it computes and its gradients reduce-scattered after the last backward.
    """

    size: int = 1
    """Data-parallel replicas of the pipeline (dp); 1 = none, where both layouts are the same."""
    shard: str = DEFAULT_DP_SHARD
    """``ddp`` (replicated state) or ``fsdp`` (everything sharded over the ``size`` ranks)."""
    reshard_after_forward: bool = True
    """FSDP only: free gathered weights after each forward and gather them again for the backward
    (FSDP2's default); False keeps every block's weights gathered for the whole iteration."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise InputError(f"data-parallel size (dp) must be a positive integer, got {self.size!r}")
        if self.shard not in DP_SHARDS:
            raise InputError(f"data-parallel shard (dp_shard) must be one of {list(DP_SHARDS)}, got {self.shard!r}")

    @property
    def gathers(self) -> bool:
        """Weights are sharded and all-gathered before use (FSDP over more than one rank)."""
        return self.shard == "fsdp" and self.size > 1

    @property
    def label(self) -> str:
        """A short name for tables: ``FSDP``, ``FSDP kept`` (weights kept gathered), ``DDP``, or ``no DP``."""
        if self.size == 1:
            return "no DP"
        return "DDP" if self.shard == "ddp" else "FSDP" if self.reshard_after_forward else "FSDP kept"

    def resized(self, size: int) -> DataParallel:
        """The same layout over ``size`` replicas."""
        return dataclasses.replace(self, size=size)

    def describe(self) -> str:
        """One plain phrase, e.g. ``4 data-parallel replicas, FSDP (reshard after forward)``."""
        if self.size == 1:
            return "no data parallelism"
        how = (
            "DDP"
            if self.shard == "ddp"
            else "FSDP (" + ("reshard after forward" if self.reshard_after_forward else "weights kept gathered") + ")"
        )
        return f"{self.size} data-parallel replicas, {how}"

    def block_cost(
        self, block: BlockCost, precision: Precision, link_bandwidth: float, latency_s: float = 0.0
    ) -> DataParallelCost:
        """What this layout costs ``block`` on one device; the one place the rules below are written.

        A block's parameters are read from its static bytes, ``P = static_bytes / bytes_per_param``,
        so a table costed with ``precision`` gives back exactly its ``static_bytes`` at dp = 1.
        With ``r = (dp - 1) / dp``, ``bw = link_bandwidth`` and ``a = latency_s`` (the fixed cost of
        one collective call: the block with parameters is one FSDP/DDP unit, each of its
        collectives costs ``a`` plus its bytes over ``bw``):
            static      ``P * precision.bytes_per_param_on(self)``, plus, for FSDP without
                        resharding, the gathered whole weights ``P * weight_bytes`` kept all iteration
            gathered    FSDP resharding after forward: ``P * weight_bytes`` alive while the block
                        computes (a stage holds its largest block's; FSDP's prefetch of the next
                        block can briefly double this, which is not modelled)
            gather      FSDP: one all-gather of the weights, ``a + r * P * weight_bytes / bw``
            reduce      DDP ring all-reduce ``a + 2 r * P * grad_bytes / bw``; FSDP reduce-scatter
                        ``a + r * P * grad_bytes / bw`` (``a`` only where ``P > 0``)
        The model is ZeRO-3's. Under ``torch.distributed.pipelining`` FSDP2 also keeps unsharded
        gradients (and the weights after a backward) until the last micro-batch's backward, so real
        peaks can be higher than this predicts.
        """
        per_param = precision.bytes_per_param
        params = block.trained_params(precision)
        frozen = block.frozen_params
        weights = (params + frozen) * precision.weight_bytes
        ratio = (self.size - 1) / self.size
        kept = weights if self.gathers and not self.reshard_after_forward else 0.0
        if latency_s < 0:
            raise InputError(f"collective latency must be >= 0 seconds, got {latency_s}")
        call = latency_s if params + frozen > 0 and self.size > 1 else 0.0
        reduce_call = latency_s if params > 0 and self.size > 1 else 0.0  # frozen parameters: nothing to reduce
        frozen_static = frozen * precision.frozen_bytes_per_param / (self.size if self.shard == "fsdp" else 1)
        trained_static = (block.static_bytes - frozen * precision.frozen_bytes_per_param) * (
            precision.bytes_per_param_on(self) / per_param if per_param > 0 else 1.0)
        return DataParallelCost(
            static_bytes=max(0.0, trained_static) + frozen_static + kept,
            gathered_bytes=weights if self.gathers and self.reshard_after_forward else 0.0,
            gather_s=call + ratio * weights / link_bandwidth if self.gathers else 0.0,
            reduce_s=reduce_call
            + (1 if self.shard == "fsdp" else 2) * ratio * params * precision.grad_bytes / link_bandwidth,
        )


NO_DATA_PARALLEL = DataParallel()
"""One pipeline replica: the layout every cost table's static bytes describe."""

DATA_PARALLEL_LAYOUTS: tuple[DataParallel, ...] = (
    DataParallel(shard="fsdp"),
    DataParallel(shard="fsdp", reshard_after_forward=False),
    DataParallel(shard="ddp"),
)
"""The data-parallel layouts the runtime runs, each at size 1 (:meth:`DataParallel.resized` gives the replicas):
FSDP freeing gathered weights after each forward, FSDP keeping them gathered for the whole iteration, and DDP."""


@dataclass(frozen=True, kw_only=True)
class DataParallelCost:
    """What data parallelism adds to one block on one device (see :meth:`DataParallel.block_cost`)."""

    static_bytes: float
    """Weights, gradients and optimizer states held under the layout (gathered weights kept included)."""
    gathered_bytes: float
    """Whole weights gathered only while the block computes (FSDP resharding after forward), else 0."""
    gather_s: float
    """Seconds of one all-gather of its weights (FSDP), else 0."""
    reduce_s: float
    """Seconds of its gradient reduction once per iteration (all-reduce or reduce-scatter)."""

    def op_gather_s(self, dp: DataParallel) -> float:
        """Gather before every forward and every backward (FSDP resharding after forward), else 0."""
        return self.gather_s if dp.reshard_after_forward else 0.0

    def step_gather_s(self, dp: DataParallel) -> float:
        """Gather once before the iteration's first forward (FSDP keeping weights gathered), else 0."""
        return 0.0 if dp.reshard_after_forward else self.gather_s


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per parameter of what training holds for it; the optimizer part may be sharded."""

    weight_bytes: int = 2
    """Bytes of the working weight (bf16: 2)."""
    grad_bytes: int = 2
    """Bytes of its gradient."""
    master_bytes: int = 4
    """Bytes of an fp32 master copy (0 when weights are already fp32)."""
    optimizer_bytes: int = 8
    """Bytes of optimizer states (Adam: two fp32 moments = 8)."""
    optimizer_shards: int = 1
    """Data-parallel ranks the master copy and optimizer states are sharded over (ZeRO-1); 1 = none.
    Under a data-parallel layout of more than one rank it must be 1 or the layout's size."""
    compute_dtype: str = "bfloat16"
    """Dtype activations are computed and kept in (``bfloat16``, ``float16`` or ``float32``). Costs
    for a target GPU are measured in it whatever dtype the model was built in; upcasts the model's
    code does itself (fp32 norms and softmax) are kept, as in mixed-precision training."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InputError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if min(self.weight_bytes, self.grad_bytes, self.master_bytes, self.optimizer_bytes) < 0:
            raise InputError(f"precision byte counts must be >= 0, got {self}")
        if self.optimizer_shards < 1:
            raise InputError(f"optimizer_shards must be >= 1 (data-parallel ranks), got {self.optimizer_shards}")

    def bytes_per_param_on(self, dp: DataParallel) -> float:
        """Bytes one device holds per parameter under ``dp``: the one rule for static memory.

        ``(weight + grad) / a + (master + optimizer) / b`` with ``a = dp.size`` under FSDP (else 1)
        and ``b = max(optimizer_shards, a)``: DDP shards only what ZeRO-1 shards, FSDP everything.
        """
        if dp.size > 1 and self.optimizer_shards not in (1, dp.size):
            raise InputError(
                f"precision.optimizer_shards={self.optimizer_shards} disagrees with dp={dp.size}: ZeRO-1 shards the "
                f"optimizer over the data-parallel ranks; set optimizer_shards to 1 or {dp.size}"
            )
        a = dp.size if dp.shard == "fsdp" else 1
        b = max(self.optimizer_shards, a)
        return (self.weight_bytes + self.grad_bytes) / a + (self.master_bytes + self.optimizer_bytes) / b

    @property
    def bytes_per_param(self) -> float:
        """Bytes per parameter of one pipeline replica (no data-parallel layout beyond ``optimizer_shards``)."""
        return self.bytes_per_param_on(NO_DATA_PARALLEL)

    @property
    def frozen_bytes_per_param(self) -> int:
        """Bytes a frozen parameter holds: one copy of its weight, the fp32 master when there is one (the runtime
        keeps parameters in fp32 and casts them per use), else the working weight; no gradient or optimizer state."""
        return self.master_bytes or self.weight_bytes


PRECISION_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""The ``precision`` setting's names -> torch dtype names (:data:`COMPUTE_DTYPES`)."""


def precision_named(name: str) -> Precision:
    """The :class:`Precision` a ``precision`` setting costs: ``bf16`` / ``fp16`` mixed precision (16-bit weights,
    gradients and activations, fp32 master copy and Adam moments), or ``fp32`` (:data:`FP32_ADAM`)."""
    if name not in PRECISION_NAMES:
        raise InputError(f"precision (--precision) must be one of {list(PRECISION_NAMES)}, got {name!r}")
    return FP32_ADAM if name == "fp32" else Precision(compute_dtype=PRECISION_NAMES[name])


def with_frozen(table: CostTable, frozen_params: Sequence[int]) -> CostTable:
    """A modelled table (roofline, analytic) with ``frozen_params[k]`` of block k's parameters frozen: their
    gradient and optimizer bytes dropped from ``static_bytes``; a block reading frozen parameters computes no
    weight gradients for them, so its backward loses ``fraction x forward_s`` (the weight-gradient matmuls cost
    about the forward's); and the blocks before the first one with trained parameters run no backward at all
    (nothing before them needs a gradient: the model's inputs do not), so they keep nothing for it either.
    Profiled tables measure all this on the frozen model (``annotate_costs``) and need no such model."""
    if len(frozen_params) != len(table.blocks):
        raise InputError(f"frozen_params needs one entry per block ({len(table.blocks)}), got {len(frozen_params)}")
    p = table.precision
    blocks: list[BlockCost] = []
    trained_yet = False
    for b, f in zip(table.blocks, frozen_params):
        f = min(int(f), b.num_params)
        new = max(0, f - b.frozen_params)
        trained_yet = trained_yet or f < b.num_params
        fraction = new / b.num_params if b.num_params else 0.0
        static = round(b.static_bytes - new * (p.bytes_per_param - p.frozen_bytes_per_param))
        if not trained_yet:  # no gradient flows here
            none = dict.fromkeys(RECOMPUTE_OPTIONS, 0)
            blocks.append(dataclasses.replace(
                b, frozen_params=f, static_bytes=static, backward_s=0.0, activation_bytes=none,
                weight_grad_s=None if b.weight_grad_s is None else 0.0,
                recompute_s=dict.fromkeys(RECOMPUTE_OPTIONS, 0.0)))  # peak_bytes kept: the forward's, at most
        else:
            backward = max(0.0, b.backward_s - fraction * b.forward_s)
            # the weight-gradient matmuls dropped are W's; a wholly frozen block has no W left
            weight = None if b.weight_grad_s is None else 0.0 if f >= b.num_params else min(
                backward, max(0.0, b.weight_grad_s - fraction * b.forward_s))
            blocks.append(dataclasses.replace(b, frozen_params=f, static_bytes=static, backward_s=backward,
                                              weight_grad_s=weight))
    return dataclasses.replace(table, blocks=tuple(blocks))


BF16_ADAM = Precision()
"""bf16 weights and gradients, fp32 master weights and Adam moments: 16 bytes/parameter."""
FP32_ADAM = Precision(weight_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8, compute_dtype="float32")
"""fp32 weights, gradients, Adam moments and activations: 16 bytes/parameter."""

@dataclass(frozen=True, kw_only=True)
class CostTable:
    """Costs of every block of a model, plus what crosses each cut, for one micro-batch shape."""

    blocks: tuple[BlockCost, ...]
    """One entry per block, in chain order."""
    cut_bytes: tuple[int, ...]
    """``cut_bytes[k]``: bytes sent across cut k (between block k-1 and k); entries 0 and n are 0."""
    link_bandwidth: float
    """Bytes per second between adjacent pipeline stages."""
    device: str
    """Device the times are for (``cpu``, ``a100-80gb``, ...)."""
    source: str
    """``profiled`` (measured here) or ``roofline`` (modelled for a target device)."""
    batch_shape: Mapping[str, int] = field(default_factory=dict)
    """Micro-batch shape the costs were taken at (e.g. tiles, tokens)."""
    precision: Precision = BF16_ADAM
    """Bytes per parameter the static bytes were computed with (one replica; data parallelism applied later)."""
    activation_dtype: str = ""
    """Dtype the activations and memory traffic were measured in (``bfloat16``...); "" when not recorded."""
    attention: str = ""
    """The attention kernel the costs assume, in words; "" when not recorded."""
    dp_link_bandwidth: float | None = None
    """Bytes per second of one device in data-parallel collectives (all-gather, reduction), when they run
    over another link than the stages' sends (e.g. InfiniBand between nodes); None = ``link_bandwidth``."""
    dp_link_latency_s: float = 0.0
    """Seconds of one data-parallel collective call beyond its bytes (launch, FSDP's hooks): every block
    with parameters pays it per all-gather and per reduction (``runtime.links.measure_links`` measures it
    on local gloo ranks; 0 = bytes only)."""
    shared: tuple[SharedParameter, ...] = ()
    """Parameters several blocks read (tied weights), each counted in every one of those blocks' static bytes."""
    processors: float | None = None
    """Processors all the run's ranks share, e.g. the CPU cores under local CPU ranks; None = one per rank (one GPU
    each). A device fact the planner and the simulator both read through
    :func:`omnibal_compile.sim.simulate.pipeline_processors`: ranks that compute at once beyond it slow each other."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks per stage the costs are for: each block's figures are one rank's
    (:func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table`); 1 = none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "cut_bytes", tuple(int(b) for b in self.cut_bytes))
        object.__setattr__(self, "batch_shape", dict(self.batch_shape))
        if len(self.cut_bytes) != len(self.blocks) + 1:
            raise InputError(
                f"cut_bytes needs {len(self.blocks) + 1} entries (one per cut incl. both ends), got "
                f"{len(self.cut_bytes)}"
            )
        if self.link_bandwidth <= 0:
            raise InputError(f"link_bandwidth must be positive, got {self.link_bandwidth}")
        if self.dp_link_bandwidth is not None and self.dp_link_bandwidth <= 0:
            raise InputError(f"dp_link_bandwidth must be positive (or None), got {self.dp_link_bandwidth}")
        if not self.dp_link_latency_s >= 0:
            raise InputError(f"dp_link_latency_s must be >= 0 seconds, got {self.dp_link_latency_s}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise InputError(f"tensor_parallel must be a positive integer, got {self.tensor_parallel!r}")
        if self.processors is not None and not self.processors > 0:
            raise InputError(f"processors must be positive (or None for one per rank), got {self.processors}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    @property
    def dp_bandwidth(self) -> float:
        """Bytes/s of data-parallel collectives: ``dp_link_bandwidth``, else ``link_bandwidth``."""
        return self.link_bandwidth if self.dp_link_bandwidth is None else self.dp_link_bandwidth

    def shared_static(self, dp: DataParallel) -> tuple[tuple[tuple[int, ...], float], ...]:
        """(blocks, static bytes of one copy on a device under ``dp``) of every :attr:`shared` parameter, by the
        rules of :meth:`DataParallel.block_cost`."""
        p = self.precision
        out = []
        for sp in self.shared:
            one = dataclasses.replace(
                self.blocks[sp.blocks[0]], num_params=sp.numel, frozen_params=sp.numel if sp.frozen else 0,
                static_bytes=round(sp.numel * (p.frozen_bytes_per_param if sp.frozen else p.bytes_per_param)))
            out.append((sp.blocks, dp.block_cost(one, p, self.dp_bandwidth, self.dp_link_latency_s).static_bytes))
        return tuple(out)

    def data_parallel_costs(self, dp: DataParallel) -> list[DataParallelCost]:
        """Each block's :meth:`DataParallel.block_cost` under ``dp`` over this table's data-parallel link."""
        return [dp.block_cost(b, self.precision, self.dp_bandwidth, self.dp_link_latency_s) for b in self.blocks]

    def require_backward_split(self, schedule: str) -> None:
        """Raise an :class:`InputError` unless every block's backward is split into B and W (``weight_grad_s``), as
        ``schedule``, one that runs the weight-gradient part apart, needs."""
        unknown = [b.name for b in self.blocks if b.weight_grad_s is None]
        if unknown:
            raise InputError(
                f"schedule {schedule!r} runs each backward's weight-gradient part apart, but the cost table does not "
                f"split the backward of {len(unknown)} blocks (e.g. {unknown[:3]}): cost the model again (cost "
                "cache format 3 measures it), or set their weight_grad_s"
            )

    def send_s(self, cut: int) -> float:
        """Seconds to send what crosses ``cut`` to the next stage."""
        return self.cut_bytes[cut] / self.link_bandwidth

    def summary(self) -> str:
        """Per-block table: forward/backward ms, GFLOPs, static and activation MiB per option."""
        mib = 1 / 2**20
        profiled = self.source == "profiled"
        rows: list[tuple[str, ...]] = [
            ("#", "block", "fwd ms", "bwd ms", "GFLOP", "static MiB", "act none/sel/full MiB", "recomp ms sel/full")
        ]
        if profiled:
            rows[0] += ("spread", "times of")
        for i, b in enumerate(self.blocks):
            a, r = b.activation_bytes, b.recompute_s
            row: tuple[str, ...] = (
                str(i), b.name, f"{b.forward_s * 1e3:.3f}", f"{b.backward_s * 1e3:.3f}", f"{b.flops / 1e9:.4f}",
                f"{b.static_bytes * mib:.2f}",
                f"{a['none'] * mib:.2f}/{a['selective'] * mib:.2f}/{a['full'] * mib:.2f}",
                f"{r['selective'] * 1e3:.3f}/{r['full'] * 1e3:.3f}",
            )
            if profiled:
                row += (f"{b.time_spread:.1%}", b.profiled_as or "measured")
            rows.append(row)
        shape = ", ".join(f"{k} {v}" for k, v in dict(self.batch_shape).items())
        title = f"Costs on {self.device} ({self.source})" + (f", micro-batch of {shape}" if shape else "") + ":"
        notes = "".join(f"\n{line}" for line in (
            f"Activations in {self.activation_dtype}." if self.activation_dtype else "",
            f"Attention: {self.attention}." if self.attention else "",
        ) if line)
        text = title + notes + "\n" + format_table(rows, "rl" + "r" * (len(rows[0]) - 2 - profiled) + "l" * profiled)
        text += ("\nact: activation bytes kept per micro-batch with no / selective / full recomputation; recomp: the "
                 "forward time each recomputes in the backward.")
        shared = sum(1 for b in self.blocks if b.profiled_as)
        if profiled:
            measured = len(self.blocks) - shared
            text += ("\nspread: interquartile range of the timed repeats over their median; times of: the block "
                     "whose timing it shares" + (f" ({measured} blocks timed, {shared} share the times of an "
                                                  "identical block: same computation and input shapes)." if shared
                                                  else "."))
        return text

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostTable:
        data = dict(data)
        data["blocks"] = tuple(BlockCost(**b) for b in data["blocks"])
        data["shared"] = tuple(
            SharedParameter(**{**sp, "blocks": tuple(sp["blocks"])}) for sp in data.get("shared", ())
        )
        if isinstance(data.get("precision"), Mapping):
            data["precision"] = Precision(**data["precision"])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        return cls.from_dict(json.loads(text))
