"""Balance metrics of a packing, as defined in the OmniBal paper, plus a compute-weighted one.

Glossary:
    Dist Ratio   for one step with loads T_1..T_N on the N data-parallel ranks:
                 sum_i (T_max - T_i) / (T_max * N), the fraction of rank-time spent waiting for
                 the slowest rank; averaged over steps. Vision: T_i = tiles of rank i's pack.
                 Language: T_i = LLM tokens rank i computes (real tokens of a packed row, or
                 ``rows * longest`` of a padded micro-batch).
    Pad Ratio    padding tokens / all tokens of the micro-batch shapes: padded layout pads every
                 row to the micro-batch's longest sample; packed layout pads each row to Q_t.
    compute Dist the Dist Ratio of a :class:`ShapeCost` (tiles, tokens and attention pairs -> FLOPs),
                 i.e. of what the ranks actually wait on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.data.packing import Packing

__all__ = ["ShapeCost", "BalanceMetrics", "dist_ratio", "balance_metrics", "pack_loads", "shape_model_cost"]


@dataclass(frozen=True, kw_only=True)
class ShapeCost:
    """Forward cost of a micro-batch as a function of its shape (a roofline-free FLOP model).

    Defaults: rough forward FLOPs of InternVL-Chat-1.2 (InternViT-6B at 448 px, 1025 patches per
    tile; a 34B LLM, hidden 7168, 60 layers), the model the shared statistics were measured on.
    """

    flops_per_tile: float = 2 * 5.9e9 * 1025
    """Vision encoder FLOPs per tile (2 x parameters x patches)."""
    flops_per_token: float = 2 * 34e9
    """LLM FLOPs per token excluding attention scores (2 x parameters)."""
    flops_per_attention_pair: float = 4 * 7168 * 60
    """FLOPs per (query, key) pair: QK^T and AV, over all layers; causal pairs are counted."""

    def __call__(self, tiles: np.ndarray, tokens: np.ndarray, attention_pairs: np.ndarray) -> np.ndarray:
        return (self.flops_per_tile * tiles + self.flops_per_token * tokens
                + self.flops_per_attention_pair * attention_pairs)


CostFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def shape_model_cost(model: Any) -> CostFn:
    """A pack cost from the cost pass's fitted ``ShapeCostModel``: predicted forward + backward seconds.

    The model is linear per block over (1, tiles, text tokens, attention = tokens^2 / rows); the
    blocks' coefficients are summed (without the per-block clipping at 0 that ``table()`` applies),
    so whole arrays of packs are costed at once. For a packed row the attention feature is the
    sum of squared sample lengths, since attention stays inside each sample.
    """
    coef = np.zeros(4)
    for quantity in ("forward_s", "backward_s"):
        for block in model.coefficients[quantity]:
            coef += np.asarray(block, dtype=np.float64)
    tpt = int(model.tokens_per_tile)

    def cost(tiles: np.ndarray, tokens: np.ndarray, attention_pairs: np.ndarray) -> np.ndarray:
        text = np.maximum(tokens - tiles * tpt, 0)
        squares = 2 * np.asarray(attention_pairs, dtype=np.float64) - tokens  # undo (sq + tokens) / 2
        return coef[0] + coef[1] * tiles + coef[2] * text + coef[3] * squares

    return cost


@dataclass(frozen=True, kw_only=True)
class BalanceMetrics:
    """How balanced a packing is; lower ratios are better."""

    method: str
    """Balancer name."""
    pad_ratio: float
    """Padding tokens / all tokens of the micro-batch shapes."""
    dist_vision: float
    """Dist Ratio of tiles across data-parallel ranks, averaged over steps."""
    dist_language: float
    """Dist Ratio of LLM tokens across data-parallel ranks, averaged over steps."""
    dist_compute: float
    """Dist Ratio of the shape cost model's FLOPs."""
    samples_per_pack: float
    """Mean samples per micro-batch (pack)."""
    num_steps: int
    """Global steps in one epoch."""
    oversized: int
    """Samples that fit no pack (handled by the oversized policy)."""
    seconds: float = 0.0
    """Time the balancer took, when measured."""


def dist_ratio(loads: np.ndarray) -> float:
    """Mean over steps (rows) of sum_i (T_max - T_i) / (T_max * N); steps with T_max = 0 count 0."""
    loads = np.asarray(loads, dtype=np.float64)
    t_max = loads.max(axis=1)
    waste = (t_max[:, None] - loads).sum(axis=1)
    ratio = np.divide(waste, t_max * loads.shape[1], out=np.zeros_like(t_max), where=t_max > 0)
    return float(ratio.mean()) if ratio.size else 0.0


def pack_loads(stats: LengthStats, packing: Packing) -> dict[str, np.ndarray]:
    """Per-pack tiles, real tokens, computed tokens (with padding rows) and attention pairs."""
    tiles = packing.pack_sums(stats.tiles)
    tokens = packing.pack_sums(stats.tokens)
    sq = packing.pack_sums(stats.tokens * stats.tokens)
    if packing.layout == "padded":
        rows = np.diff(packing.offsets)
        longest = packing.pack_max(stats.tokens)
        computed = rows * longest
        pairs = rows * longest * (longest + 1) / 2
    else:
        computed = tokens
        pairs = (sq + tokens) / 2  # causal attention inside each sample only
    return {"tiles": tiles, "tokens": tokens, "computed": computed, "pairs": pairs}


def balance_metrics(stats: LengthStats, packing: Packing, *, cost: CostFn | None = None,
                    seconds: float = 0.0) -> BalanceMetrics:
    """Pad Ratio, Dist Ratios and samples per pack of ``packing`` over ``stats``."""
    loads = pack_loads(stats, packing)
    if packing.layout == "padded":
        shape_tokens = loads["computed"]
    else:
        assert packing.capacity is not None
        # An own-pack oversized sample is its own shape; count it at its size.
        shape_tokens = np.maximum(loads["tokens"], packing.capacity.tokens)
    pad = float((shape_tokens - loads["tokens"]).sum()) / float(shape_tokens.sum())
    flops = (cost or ShapeCost())(loads["tiles"], loads["computed"], loads["pairs"])
    s = packing.steps
    return BalanceMetrics(
        method=packing.method,
        pad_ratio=pad,
        dist_vision=dist_ratio(loads["tiles"][s]),
        dist_language=dist_ratio(loads["computed"][s]),
        dist_compute=dist_ratio(np.asarray(flops)[s]),
        samples_per_pack=packing.samples_per_pack(),
        num_steps=packing.num_steps,
        oversized=int(packing.oversized.size),
        seconds=seconds,
    )
