"""Micro-batches that differ: per-micro-batch cost tables from (tiles, tokens) shapes (torch-free).

A cost table is measured at one micro-batch shape. Real micro-batches carry different numbers of
image tiles and text tokens; this module rescales the table per micro-batch with a linear model,
so the simulator can replay random batches or the data balancer's packs (:func:`packing_shapes`).
A fitted shape model of the cost pass (``ShapeCostModel.table(shape)``) is the more precise
alternative: its tables can be given to ``simulate(microbatch_costs=...)`` directly.

Glossary:
    shape          (tiles, tokens) of one micro-batch: image tiles through the vision encoder, and
                   LLM tokens (text plus image tokens).
    vision blocks  the first ``vision_blocks`` blocks of the chain (the ViT and projector) scale
                   with tiles; every later block scales with tokens.
    linear model   a block's times, FLOPs, activation, workspace and peak bytes scale with its load relative to the
                   reference shape (attention's quadratic term is ignored: exact for MLPs and
                   projections, an under-estimate for long sequences); static bytes do not change;
                   bytes sent across a cut scale with the block before it.
    reference      the shape the table's costs describe; by default the mean of the given shapes,
                   so the table counts as the average micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BlockCost, CostTable

__all__ = ["scale_costs", "shape_costs", "packing_shapes"]


def _scale_block(b: BlockCost, k: float) -> BlockCost:
    return dataclasses.replace(
        b,
        flops=b.flops * k,
        forward_s=b.forward_s * k,
        backward_s=b.backward_s * k,
        weight_grad_s=None if b.weight_grad_s is None else b.weight_grad_s * k,
        activation_bytes={o: int(round(v * k)) for o, v in b.activation_bytes.items()},
        recompute_s={o: v * k for o, v in b.recompute_s.items()},
        workspace_bytes=int(round(b.workspace_bytes * k)),
        peak_bytes={o: int(round(v * k)) for o, v in b.peak_bytes.items()},
    )


def scale_costs(costs: CostTable, scale: float | Sequence[float]) -> CostTable:
    """``costs`` with each block's load multiplied by ``scale`` (one factor, or one per block).

    The one rule of a larger or smaller micro-batch (see the linear model above): times, FLOPs,
    activations, workspace, peaks and sent bytes scale, weights and optimizer states do not. One
    factor also scales the table's ``batch_shape`` (the whole micro-batch grew); the layout search
    and ``simulate(microbatch_costs=[factor])`` use this form.
    """
    uniform = not hasattr(scale, "__len__")  # not isinstance(scale, Sequence): a numpy array of factors is one too
    # the casts follow the test above: without a length, scale is the one factor
    scales = ([float(cast(float, scale))] * len(costs.blocks) if uniform
              else [float(k) for k in cast(Sequence[float], scale)])
    if len(scales) != len(costs.blocks):
        raise InputError(f"block_scales has {len(scales)} entries for {len(costs.blocks)} blocks")
    if any(k < 0 for k in scales) or (uniform and scales and scales[0] <= 0):
        raise InputError(f"micro-batch scale must be positive, got {scale}" if uniform
                         else "block scales must be non-negative")
    if all(k == 1 for k in scales):
        return costs
    # the tensor crossing cut i leaves block i - 1 (cut 0 carries the inputs, scaled with block 0)
    cuts = tuple(int(round(c * scales[max(i - 1, 0)])) for i, c in enumerate(costs.cut_bytes))
    shape = {k: round(v * scales[0]) for k, v in costs.batch_shape.items()} if uniform else costs.batch_shape
    return dataclasses.replace(
        costs, blocks=tuple(_scale_block(b, k) for b, k in zip(costs.blocks, scales)), cut_bytes=cuts,
        batch_shape=shape,
    )


def shape_costs(
    costs: CostTable,
    shapes: Sequence[tuple[float, float]],
    *,
    vision_blocks: int,
    reference: tuple[float, float] | None = None,
) -> list[CostTable]:
    """One cost table per micro-batch shape (tiles, tokens), relative to ``reference`` (default: the mean shape)."""
    if not shapes:
        raise InputError("shape_costs needs at least one (tiles, tokens) shape")
    if not 0 <= vision_blocks <= len(costs.blocks):
        raise InputError(f"vision_blocks must lie in [0, {len(costs.blocks)}], got {vision_blocks}")
    ref_tiles, ref_tokens = reference or (
        sum(s[0] for s in shapes) / len(shapes), sum(s[1] for s in shapes) / len(shapes)
    )
    if ref_tokens <= 0 or (vision_blocks and ref_tiles <= 0):
        raise InputError(f"the reference shape (tiles {ref_tiles}, tokens {ref_tokens}) must be positive")
    out = []
    for tiles, tokens in shapes:
        kv = tiles / ref_tiles if vision_blocks else 1.0
        kt = tokens / ref_tokens
        out.append(scale_costs(costs, [kv] * vision_blocks + [kt] * (len(costs.blocks) - vision_blocks)))
    return out


def packing_shapes(stats: Any, packing: Any, *, step: int = 0) -> list[tuple[int, int]]:
    """(tiles, computed LLM tokens) of the packs of one step of a data packing, one per micro-batch.

    ``stats`` and ``packing`` come from :mod:`omnibal_compile.data` (``load_lengths`` and any balancer:
    ``random_batches``, ``length_grouped_batches``, ``isf_pack``, ``balance_pack``). Pack with
    ``dp`` = micro-batches per iteration so that one step's packs are one pipeline iteration's
    micro-batches (balanced against each other). Padded layouts count their padding tokens, since
    the model computes them.
    """
    from omnibal_compile.data.metrics import pack_loads

    if not 0 <= step < packing.num_steps:
        raise InputError(f"step must lie in [0, {packing.num_steps}), got {step}")
    loads = pack_loads(stats, packing)
    return [(int(loads["tiles"][p]), int(loads["computed"][p])) for p in packing.steps[step]]
