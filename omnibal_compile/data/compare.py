"""Compare the four ways of batching on the same statistics: random, length-grouped, ISF, ours.

Glossary:
    progress   a :class:`omnibal_compile.progress.Progress`: one step per method, the ISF search's
               status lines as notes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.isf import isf_search
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.data.metrics import BalanceMetrics, CostFn, balance_metrics
from omnibal_compile.data.packing import PackShape, length_grouped_batches, random_batches
from omnibal_compile.errors import InputError
from omnibal_compile.progress import Progress

__all__ = ["Comparison", "compare_balancers", "format_comparison", "METHODS"]

METHODS: tuple[str, ...] = ("random", "length-grouped", "isf", "ours")


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Metrics of each method plus the pack shapes ISF and ours chose."""

    rows: tuple[BalanceMetrics, ...]
    """One row per method, in the order run."""
    shapes: dict[str, PackShape]
    """Pack shape (Q_v, Q_t) of the packing methods."""
    num_samples: int
    """Samples balanced."""
    dp: int
    """Data-parallel ranks."""


def compare_balancers(
    stats: LengthStats, *, dp: int, samples_per_pack: int, seed: int = 0, iterations: int = 50,
    methods: tuple[str, ...] = METHODS, cost: CostFn | None = None, progress: Progress | None = None,
    oversized: str = "error",
) -> Comparison:
    """Run each method; ours targets the samples per pack ISF reached (when ISF runs). ``oversized``: the policy of
    ISF and ours for a sample larger than their pack shape (``error``, ``truncate`` or ``own-pack``)."""
    rows: list[BalanceMetrics] = []
    shapes: dict[str, PackShape] = {}
    isf_spp: float | None = None
    for method in methods:
        if progress is not None:
            progress.step(f"{method}: balancing {len(stats):,} samples")
        t0 = time.perf_counter()
        if method == "random":
            packing = random_batches(stats, dp=dp, batch_size=samples_per_pack, seed=seed)
        elif method == "length-grouped":
            packing = length_grouped_batches(stats, dp=dp, batch_size=samples_per_pack, seed=seed)
        elif method == "isf":
            found = isf_search(stats, dp=dp, samples_per_pack=samples_per_pack, iterations=iterations, seed=seed,
                               oversized=oversized, progress=progress.note if progress is not None else None)
            packing = found.packing
            isf_spp = packing.samples_per_pack()
        elif method == "ours":
            packing = balance_pack(stats, dp=dp, samples_per_pack=isf_spp or samples_per_pack, seed=seed, cost=cost,
                                   oversized=oversized)
        else:
            raise InputError(f"unknown method {method!r}; choose from {list(METHODS)}")
        seconds = time.perf_counter() - t0
        if packing.capacity is not None:
            shapes[method] = packing.capacity
        rows.append(balance_metrics(stats, packing, cost=cost, seconds=seconds))
    return Comparison(rows=tuple(rows), shapes=shapes, num_samples=len(stats), dp=dp)


def format_comparison(c: Comparison) -> str:
    """A fixed-width table of the comparison."""
    head = (f"{'method':<16} {'samples/pack':>12} {'Pad':>7} {'Dist vis':>9} {'Dist lang':>9} {'Dist FLOPs':>10} "
            f"{'steps':>7} {'shape (Q_v, Q_t)':>17} {'time s':>7}")
    lines = [f"{c.num_samples} samples, {c.dp} data-parallel ranks, one micro-batch per rank per step", head,
             "-" * len(head)]
    for r in c.rows:
        shape = c.shapes.get(r.method)
        shape_s = f"({shape.tiles}, {shape.tokens})" if shape else "padded"
        lines.append(
            f"{r.method:<16} {r.samples_per_pack:>12.2f} {r.pad_ratio:>7.4f} {r.dist_vision:>9.5f} "
            f"{r.dist_language:>9.5f} {r.dist_compute:>10.5f} {r.num_steps:>7} {shape_s:>17} {r.seconds:>7.2f}"
        )
    lines += [
        "Pad: padding tokens / all tokens of the micro-batch shapes. Dist: the share of rank-time spent waiting for",
        "the slowest rank of a step, by images (vis), LLM tokens (lang) and estimated FLOPs; lower is better.",
        "shape (Q_v, Q_t): the fixed pack shape, image tiles x text tokens; time s: seconds the method took.",
    ]
    return "\n".join(lines)
