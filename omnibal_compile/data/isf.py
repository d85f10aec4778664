"""OmniBal's Iterative Sampling and Filtering (ISF), vectorised, and its parameter search.

Faithful to the reference ``BalancedDataset.iter_random_groups`` / ``search_arguments``
(github.com/ModelTC/OmniBal), re-implemented with numpy: the greedy fill of a shuffled sequence
is computed for every start position at once (cumulative sums + ``searchsorted``), then the chain
of group starts is followed from the first sample.

Glossary:
    greedy fill   walk the shuffled samples; add each to the current group unless that would
                  exceed Q_v tiles or Q_t tokens, in which case close the group and open a new one.
    filter        keep a group if its tiles reach ``tile_thresh`` (reference: exactly Q_v) or its
                  tokens reach ``token_thresh`` (reference: Q_t - 128); the rest go back to the pool.
    iterations    T: rounds of (resample the pool, greedy fill, filter); after T - 1 filters the
                  remaining pool is grouped once more and kept as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from omnibal_compile._utils.validate import check_int, check_number, check_seed
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.data.packing import Packing, PackShape, packing_from_groups, split_oversized
from omnibal_compile.errors import InputError

__all__ = ["greedy_groups", "isf_groups", "isf_pack", "IsfSearch", "isf_search"]


def _chain_from_zero(nxt: np.ndarray) -> np.ndarray:
    """The path 0 -> nxt[0] -> ... -> n as an array, where ``nxt[i] > i`` and ``nxt[n] = n``.

    A plain loop over a Python list (~50 ns a step, one step per group) measured faster here than
    pointer doubling, whose ~log2(groups) full-array gathers cost more than the loop they replace.
    """
    n = nxt.size - 1
    jump = nxt.tolist()
    path = [0]
    i = 0
    while i < n:
        i = jump[i]
        path.append(i)
    return np.asarray(path, dtype=np.int64)


def _greedy(tiles: np.ndarray, tokens: np.ndarray, capacity: PackShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy-fill offsets plus the prefix sums of tiles and tokens (group sums are their differences)."""
    n = tokens.size
    dtype = tokens.dtype  # int32 when the caller knows the totals fit: half the memory traffic
    cv = np.zeros(n + 1, dtype)
    ct = np.zeros(n + 1, dtype)
    np.cumsum(tiles, out=cv[1:])
    np.cumsum(tokens, out=ct[1:])
    if n == 0:
        return np.zeros(1, np.int64), cv, ct
    # A group starting at i ends before the first j whose prefix overflows either budget.
    end_v = np.searchsorted(cv, cv[:-1] + capacity.tiles, side="right") - 1
    end_t = np.searchsorted(ct, ct[:-1] + capacity.tokens, side="right") - 1
    return _chain_from_zero(np.append(np.minimum(end_v, end_t), n)), cv, ct


def greedy_groups(tiles: np.ndarray, tokens: np.ndarray, capacity: PackShape) -> np.ndarray:
    """Offsets of the greedy fill of samples in the given order (every sample must fit alone)."""
    return _greedy(np.asarray(tiles, np.int64), np.asarray(tokens, np.int64), capacity)[0]


def isf_groups(
    stats: LengthStats, ids: np.ndarray, *, capacity: PackShape, token_thresh: int, tile_thresh: int | None = None,
    iterations: int = 50, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """ISF over the samples ``ids`` (all must fit ``capacity``): groups as (order, sizes)."""
    iterations = check_int(iterations, "iterations", min=1)
    seed = check_seed(seed)
    tile_thresh = capacity.tiles if tile_thresh is None else tile_thresh
    ids = np.asarray(ids, np.int64)
    small = max(int(stats.tokens[ids].sum()), int(stats.tiles[ids].sum()), ids.size) + capacity.tokens < 2**31
    dtype = np.int32 if small else np.int64
    # Carry each pooled sample's lengths with it, so each round shuffles three small arrays
    # instead of gathering from the full statistics.
    pool, pv, pt = ids.astype(dtype), stats.tiles[ids].astype(dtype), stats.tokens[ids].astype(dtype)
    kept_order: list[np.ndarray] = []
    kept_sizes: list[np.ndarray] = []
    for it in range(iterations):
        if pool.size == 0:
            break
        # Reference seeds: seed for the first fill, then seed + i for refill i.
        perm = np.random.default_rng(seed if it == 0 else seed + it - 1).permutation(pool.size)
        pool, pv, pt = pool[perm], pv[perm], pt[perm]
        off, cv, ct = _greedy(pv, pt, capacity)
        sizes = np.diff(off)
        if it == iterations - 1:
            kept_order.append(pool)
            kept_sizes.append(sizes)
            break
        good = (cv[off[1:]] - cv[off[:-1]] >= tile_thresh) | (ct[off[1:]] - ct[off[:-1]] >= token_thresh)
        owner_good = np.repeat(good, sizes)
        kept_order.append(pool[owner_good])
        kept_sizes.append(sizes[good])
        rest = ~owner_good
        pool, pv, pt = pool[rest], pv[rest], pt[rest]
    order = np.concatenate(kept_order).astype(np.int64) if kept_order else np.zeros(0, np.int64)
    return order, np.concatenate(kept_sizes) if kept_sizes else np.zeros(0, np.int64)


def isf_pack(
    stats: LengthStats,
    *,
    dp: int,
    capacity: PackShape,
    token_thresh: int | None = None,
    tile_thresh: int | None = None,
    iterations: int = 50,
    seed: int = 0,
    oversized: str = "error",
) -> Packing:
    """ISF packs scheduled randomly onto steps of ``dp`` ranks (as the reference sampler does).

    ``token_thresh`` defaults to ``capacity.tokens - 128`` as in the reference search.
    """
    dp = check_int(dp, "dp", min=1)
    stats, big = split_oversized(stats, capacity, oversized)
    fits = np.ones(len(stats), bool)
    if oversized == "own-pack":
        fits[big] = False
    thresh = capacity.tokens - 128 if token_thresh is None else token_thresh
    order, sizes = isf_groups(stats, np.flatnonzero(fits), capacity=capacity, token_thresh=thresh,
                              tile_thresh=tile_thresh, iterations=iterations, seed=seed)
    if oversized == "own-pack":
        order = np.concatenate([order, big])
        sizes = np.concatenate([sizes, np.ones(big.size, np.int64)])
    return packing_from_groups(order, sizes, dp=dp, capacity=capacity, layout="packed", oversized=big, policy=oversized,
                               method="isf", seed=seed)


@dataclass(frozen=True, kw_only=True)
class IsfSearch:
    """What :func:`isf_search` chose and the candidates it tried."""

    capacity: PackShape
    """Chosen (Q_v, Q_t)."""
    token_thresh: int
    """Chosen lower token threshold (Q_t - 128)."""
    packing: Packing
    """The ISF packing of the chosen parameters."""
    tried: tuple[tuple[int, int, float, float, float], ...]
    """Every candidate: (Q_v, Q_t, samples per pack, vision Dist, language Dist)."""


OUTLIER_FACTOR = 64
"""A sample longer than this many times the median sample does not count in the ISF search's tokens per tile."""


def isf_search(
    stats: LengthStats, *, dp: int, samples_per_pack: float, iterations: int = 50, seed: int = 0,
    start_tokens: int = 4096, token_margin: int = 128, length_bin: int = 256, oversized: str = "error",
    max_tries: int = 200,
    progress: Callable[[str], None] | None = None,
) -> IsfSearch:
    """The reference parameter search: pick (Q_v, Q_t) whose ISF packs average ``samples_per_pack``.

    Starts from Q_t = ``start_tokens`` and Q_v = Q_t / (tokens per tile of an average sample,
    rounded to 16), then steps Q_v by 1 and Q_t by that per-tile amount, up while packs hold too
    few samples, down once they hold too many, and keeps the candidate with samples per pack in
    ``[k, k + 1]`` and the lowest vision + language Dist Ratio (one pack per rank, random steps).
    The reference also adds a Pad Ratio term, which is 0 for one pack per rank, so it is omitted.
    """
    from omnibal_compile.data.metrics import dist_ratio

    k = check_number(samples_per_pack, "samples_per_pack", min=1)
    dp, iterations, seed = check_int(dp, "dp", min=1), check_int(iterations, "iterations", min=1), check_seed(seed)
    binned_tokens = -(-stats.tokens // length_bin) * length_bin  # the reference bins lengths to 256 first
    round_to = max(length_bin // 16, 1)  # the reference rounds to 16 with 256-token bins
    # The reference's tokens per tile of the average sample, over the typical samples: one corrupt or huge sample
    # (16M tokens among 1K-token ones) would otherwise set every candidate shape, and then be named among dozens of
    # normal samples as too large for it. On real data nothing is left out (the longest is < 2x the median).
    typical = stats.tokens <= OUTLIER_FACTOR * max(float(np.median(stats.tokens)), 1.0)
    per_tile = int(((float(binned_tokens[typical].mean()) // max(float(stats.tiles[typical].mean()), 1.0) + 1)
                    // round_to) * round_to)
    per_tile = max(per_tile, round_to)
    q_t, q_v = start_tokens, max(start_tokens // per_tile, 1)
    best: tuple[float, IsfSearch] | None = None
    tried: list[tuple[int, int, float, float, float]] = []
    max_seen = 0.0
    for _ in range(max_tries):
        if q_v < 1 or q_t <= token_margin:
            break
        cap = PackShape(tiles=q_v, tokens=q_t)
        packing = isf_pack(stats, dp=dp, capacity=cap, token_thresh=q_t - token_margin, iterations=iterations,
                           seed=seed, oversized=oversized)
        spp = packing.samples_per_pack()
        dv = dist_ratio(packing.pack_sums(stats.tiles)[packing.steps])
        dt = dist_ratio(packing.pack_sums(stats.tokens)[packing.steps])
        tried.append((q_v, q_t, spp, dv, dt))
        if progress:
            progress(f"ISF search: Q_v={q_v} Q_t={q_t}: {spp:.2f} samples/pack, Dist vision {dv:.4f} language {dt:.4f}")
        max_seen = max(max_seen, spp)
        if k <= spp <= k + 1 and (best is None or dv + dt < best[0]):
            best = (dv + dt, IsfSearch(capacity=cap, token_thresh=q_t - token_margin, packing=packing, tried=()))
        if max_seen > k + 1:
            if best is not None:
                break
            q_v, q_t = q_v - 1, q_t - per_tile
        else:
            q_v, q_t = q_v + 1, q_t + per_tile
    if best is None:
        raise InputError(
            f"{stats.source}: the ISF search found no (Q_v, Q_t) giving {k:g}-{k + 1:g} samples per pack "
            f"(tried {[(v, t, round(s, 2)) for v, t, s, _, _ in tried][:8]}...); change samples_per_pack or "
            "start_tokens"
        )
    r = best[1]
    return IsfSearch(capacity=r.capacity, token_thresh=r.token_thresh, packing=r.packing, tried=tuple(tried))
