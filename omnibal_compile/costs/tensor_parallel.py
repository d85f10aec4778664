"""Per-block costs at a tensor-parallel degree: what one rank of a ``tp`` group computes, holds and communicates.

Torch-free (the layout search uses it). The facts come from the tensor-parallel pass
(:meth:`omnibal_compile.compile.tensor_parallel.TensorParallelReport.blocks`); the rule follows what the
runtime runs (DTensor ``ColwiseParallel`` / ``RowwiseParallel``, and with ``sequence_parallel`` the token-wise
regions between them on sequence shards).

Glossary:
    sharded share   ``s = facts.flops / block.flops``: the part of a block's work that each rank runs on
                    its 1 / tp shard (the pairs' linear layers and the attention between them). Forward,
                    backward, weight-gradient and recompute times become ``t (1 - s + s / tp)``: times are
                    taken to scale with FLOPs, which holds for matmul-bound blocks and overstates the gain
                    of memory-bound ones.
    static share    ``facts.params / block.num_params``: weights, gradients and optimizer states of the
                    sharded layers (and the vocabulary-parallel head and embedding) are divided by tp, every
                    other parameter (norms, tied embeddings and heads, refused pairs) stays whole on each
                    rank. ``num_params`` and ``frozen_params`` stay the block's whole counts, as the model
                    and the plan count them (the runtime checks a plan's against the model); the
                    data-parallel rules read a block's trained parameters from ``static_bytes``, so they see
                    one rank's shard of a trained block, while a frozen sharded block's FSDP weights are
                    counted whole (overstated).
    all-reduce      ``2 ring_collective_s(bytes, tp, bandwidth)`` (a reduce-scatter then an all-gather):
                    one per pair in the forward (the row-wise output), one per column-wise layer in the
                    backward (its input gradient), plus ``latency_s`` per call. Not overlapped with
                    compute: added to the block's times, and recorded in ``BlockCost.tensor_parallel_s``.
                    Full recomputation reruns the forward's all-reduces.
    sequence        with sequence parallelism a region's row outputs are reduce-scattered on the sequence and
                    the column inputs it reaches all-gathered, mirrored in the backward: each call one
                    ``ring_collective_s`` pass (half an all-reduce) plus ``latency_s``, so a pair's forward
                    moves the bytes of its all-reduce; the backward reduce-scatters one input gradient per
                    gathered value where DTensor's column layers all-reduce one each (q, k and v: 1, not 3).
                    The norm weights read by shards all-reduce their gradients (``backward_bytes``).
    activations     without sequence parallelism NOT divided: every rank computes and keeps the same
                    replicated activations outside the pairs, and the sharded values inside them (q, k, v,
                    the MLP's hidden) are a share this table does not know, so kept activations,
                    workspace and peaks stay those of one whole block: an upper bound. With it, kept
                    activations become ``a (1 - q + q / tp)`` for ``q = facts.sequence_share`` (the bytes of the
                    block's values that are sequence shards over all its values' bytes: what is kept is taken
                    to split alike); workspace and peaks stay whole (an upper bound).
    analytic rule   :func:`omnibal_compile.costs.analytic.tensor_parallel_costs` models Megatron with
                    sequence parallelism at paper scale: 4 all-gathers / reduce-scatters per layer and
                    direction and activations / tp. Its collective time is the same function
                    (:func:`omnibal_compile.ir.costs.ring_collective_s`): 2 all-reduces = 4 ring passes of
                    the same bytes, so a layer's communication agrees when the backward reduces one input
                    gradient per pair; the runtime's three q, k, v reduces add one more pass each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BlockCost, CostTable, TensorParallelBlock, ring_collective_s

__all__ = ["tensor_parallel_table", "tensor_parallel_block"]


def tensor_parallel_block(block: BlockCost, facts: TensorParallelBlock, tp: int, *, bandwidth: float,
                          latency_s: float = 0.0) -> BlockCost:
    """``block`` as one rank of a ``tp`` group with the pairs ``facts`` describes sharded (module glossary)."""
    if facts.flops > 0 and not block.flops > 0:
        raise InputError(f"block '{block.name}' records no FLOPs, so the share of it tensor parallelism divides is "
                         "unknown: cost the model with FLOPs (profiled or roofline tables have them)")
    if facts.params > block.num_params:
        raise InputError(f"block '{block.name}': the tensor-parallel pass shards {facts.params} parameters, more than "
                         f"its {block.num_params}: the facts are not this table's")
    s = min(1.0, facts.flops / block.flops) if facts.flops > 0 else 0.0
    keep = 1 - s + s / tp
    forward = facts.pairs * latency_s + 2 * ring_collective_s(facts.forward_bytes, tp, bandwidth) \
        + facts.sequence_forward_calls * latency_s + ring_collective_s(facts.sequence_forward_bytes, tp, bandwidth)
    backward = facts.backward_reduces * latency_s + 2 * ring_collective_s(facts.backward_bytes, tp, bandwidth) \
        + facts.sequence_backward_calls * latency_s + ring_collective_s(facts.sequence_backward_bytes, tp, bandwidth)
    q = facts.sequence_share
    f = facts.params / block.num_params if block.num_params else 0.0
    return dataclasses.replace(
        block,
        flops=block.flops * keep,
        forward_s=block.forward_s * keep + forward,
        backward_s=block.backward_s * keep + backward,
        weight_grad_s=None if block.weight_grad_s is None else block.weight_grad_s * keep,
        recompute_s={o: t * keep + (forward if o == "full" else 0.0) for o, t in block.recompute_s.items()},
        static_bytes=round(block.static_bytes * (1 - f + f / tp)),
        activation_bytes={o: round(a * (1 - q + q / tp)) for o, a in block.activation_bytes.items()},
        tensor_parallel_s=block.tensor_parallel_s + forward + backward,
    )


def tensor_parallel_table(table: CostTable, tp: int, *, sharded: Mapping[str, TensorParallelBlock],
                          bandwidth: float, latency_s: float = 0.0) -> CostTable:
    """``table`` as one rank of a ``tp``-way tensor-parallel group: the blocks named in ``sharded`` (the pass's
    facts at this ``tp``, per micro-batch of the table's shape) divided and given their all-reduces over
    ``bandwidth`` bytes/s (the intra-node link, e.g. ``DeviceSpec.link_bandwidth("nvlink")``) plus ``latency_s``
    per call; every other block is left as it is (replicated). Cut bytes are unchanged: each rank of a stage
    sends the whole activation to its peer of the next stage."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InputError(f"tp (tensor-parallel degree) must be an integer >= 1, got {tp!r}")
    if table.tensor_parallel != 1:
        raise InputError(f"the cost table is already for tp={table.tensor_parallel}: give the tp=1 table")
    if latency_s < 0:
        raise InputError(f"collective latency must be >= 0 seconds, got {latency_s}")
    unknown = sorted(set(sharded) - set(table.names))
    if unknown:
        raise InputError(f"tensor-parallel facts name blocks the cost table lacks: {unknown[:5]}")
    if tp == 1:
        return table
    blocks = tuple(tensor_parallel_block(b, sharded[b.name], tp, bandwidth=bandwidth, latency_s=latency_s)
                   if b.name in sharded else b for b in table.blocks)
    return dataclasses.replace(table, blocks=blocks, tensor_parallel=tp)
