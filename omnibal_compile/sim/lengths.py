"""Micro-batches that differ: per-micro-batch cost tables from (tiles, tokens) shapes (torch-free).

A cost table is measured at one micro-batch shape. Real micro-batches carry different numbers of
image tiles and text tokens; this module rescales the table per micro-batch with a linear model,
so the simulator can replay random batches or the data balancer's packs.

Glossary:
    shape          (tiles, tokens) of one micro-batch: image tiles through the vision encoder, and
                   LLM tokens (text plus image tokens).
    vision blocks  the first ``vision_blocks`` blocks of the chain (the ViT and projector) scale
                   with tiles; every later block scales with tokens.
    linear model   a block's times, FLOPs and activation bytes scale with its load relative to the
                   reference shape (attention's quadratic term is ignored: exact for MLPs and
                   projections, an under-estimate for long sequences); static bytes do not change;
                   bytes sent across a cut scale with the block before it.
    reference      the shape the table's costs describe; by default the mean of the given shapes,
                   so the table counts as the average micro-batch.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

from omnibal_compile.costs import BlockCost, CostTable
from omnibal_compile.errors import InputError

__all__ = ["load_lengths", "scale_costs", "shape_costs", "random_microbatch_costs"]


def load_lengths(paths: Sequence[str | Path]) -> list[tuple[int, int]]:
    """(tiles, tokens) of every sample in JSON files of ``{"vit_num": .., "token_num": ..}`` entries."""
    samples: list[tuple[int, int]] = []
    for path in paths:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise InputError(f"length file {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise InputError(f"length file {p} is not JSON: {e}") from None
        if not isinstance(data, list):
            raise InputError(f"length file {p} must hold a JSON list of samples")
        for i, item in enumerate(data):
            try:
                samples.append((int(item["vit_num"]), int(item["token_num"])))
            except (KeyError, TypeError, ValueError):
                raise InputError(f"length file {p}, entry {i}: expected {{'vit_num': int, 'token_num': int}}, got {item!r}") from None
    if not samples:
        raise InputError("the length files hold no samples")
    return samples


def _scale_block(b: BlockCost, k: float) -> BlockCost:
    return dataclasses.replace(
        b,
        flops=b.flops * k,
        forward_s=b.forward_s * k,
        backward_s=b.backward_s * k,
        activation_bytes={o: int(round(v * k)) for o, v in b.activation_bytes.items()},
        recompute_s={o: v * k for o, v in b.recompute_s.items()},
    )


def scale_costs(costs: CostTable, block_scales: Sequence[float]) -> CostTable:
    """``costs`` with block i's load multiplied by ``block_scales[i]`` (see the linear model above)."""
    if len(block_scales) != len(costs.blocks):
        raise InputError(f"block_scales has {len(block_scales)} entries for {len(costs.blocks)} blocks")
    if any(k < 0 for k in block_scales):
        raise InputError("block scales must be non-negative")
    cuts = [costs.cut_bytes[0]] + [int(round(c * block_scales[i - 1])) for i, c in enumerate(costs.cut_bytes) if i > 0]
    return dataclasses.replace(
        costs, blocks=tuple(_scale_block(b, k) for b, k in zip(costs.blocks, block_scales)), cut_bytes=tuple(cuts)
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


def random_microbatch_costs(
    costs: CostTable,
    length_files: Sequence[str | Path],
    *,
    num_microbatches: int,
    samples_per_microbatch: int,
    vision_blocks: int,
    seed: int = 0,
) -> list[CostTable]:
    """Cost tables for ``num_microbatches`` micro-batches of random samples (the unbalanced baseline)."""
    if samples_per_microbatch < 1:
        raise InputError("samples_per_microbatch must be >= 1")
    samples = load_lengths(length_files)
    rng = random.Random(seed)
    shapes = []
    for _ in range(num_microbatches):
        picked = [samples[rng.randrange(len(samples))] for _ in range(samples_per_microbatch)]
        shapes.append((sum(p[0] for p in picked), sum(p[1] for p in picked)))
    return shape_costs(costs, shapes, vision_blocks=vision_blocks)
