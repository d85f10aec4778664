"""Our balancer: two-dimensional balanced packing, then cost-matched steps across ranks.

ISF fills packs greedily in random order and keeps the full ones, so pack loads still vary and
a random assignment of packs to ranks leaves ranks waiting. We instead:

1. fix the number of packs P = ceil(n / k) (rounded so every step has ``dp`` packs) and give
   every pack k or k + 1 samples;
2. deal samples largest-first, round by round, each round giving one sample to each pack with
   the biggest going to the least-loaded pack (longest-processing-time in rounds), in units
   normalised so a perfect pack is (1, 1) in (tiles, tokens);
3. refine with pairwise swaps: pair the heaviest packs with the lightest (under several
   orderings) and make, in every pair at once, the sample swap that most reduces the squared
   distance of both packs from (1, 1);
4. set the pack shape (Q_v, Q_t) to the largest pack, unless given (then packs must fit it;
   P grows until they do);
5. sort packs by cost (tiles then tokens, or a :class:`~omnibal_compile.data.metrics.ShapeCost`
   / callable) and let each run of ``dp`` consecutive packs form a step, so the ranks of a step
   get near-equal work; the order of steps is shuffled.

Glossary:
    normalised load  a pack's (tiles, tokens) divided by the dataset's totals over P.
    round            one pass dealing one sample to each pack.
"""

from __future__ import annotations

import numpy as np

from omnibal_compile._utils.validate import check_int, check_number, check_seed
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.data.metrics import CostFn, pack_loads
from omnibal_compile.data.packing import (
    OVERSIZED_POLICIES,
    Packing,
    PackShape,
    assign_steps,
    refuse_unpackable,
    split_oversized,
)
from omnibal_compile.errors import InputError

__all__ = ["balanced_partition", "balance_pack"]


def balanced_partition(x: np.ndarray, y: np.ndarray, num_packs: int, *, seed: int = 0,
                       refine_rounds: int = 48) -> np.ndarray:
    """Split items with 2-D sizes (x, y) into ``num_packs`` packs of near-equal count and sums.

    Returns a ``[num_packs, ceil(n / num_packs)]`` matrix of item indices, -1 in unused slots.
    """
    n = x.size
    rng = np.random.default_rng(seed)
    kmax = -(-n // num_packs)
    sx, sy = x.sum(), y.sum()
    nx = x * (num_packs / sx) if sx > 0 else np.zeros(n)
    ny = y * (num_packs / sy) if sy > 0 else np.zeros(n)
    tie = rng.permutation(n)
    order = tie[np.argsort(-(nx + ny)[tie], kind="stable")]
    slots = np.full((num_packs, kmax), -1, dtype=np.int64)
    lx = np.zeros(num_packs)
    ly = np.zeros(num_packs)
    for r in range(kmax):
        chunk = order[r * num_packs:(r + 1) * num_packs]
        dest = np.argsort(lx + ly + rng.random(num_packs) * 1e-9, kind="stable")[:chunk.size]
        slots[dest, r] = chunk
        lx[dest] += nx[chunk]
        ly[dest] += ny[chunk]
    if num_packs < 2:
        return slots
    # Padded per-item sizes so empty slots read 0; they are masked out of swaps below.
    px = np.append(nx, 0.0)
    py = np.append(ny, 0.0)
    orderings = (lambda: lx + ly, lambda: lx - ly, lambda: lx, lambda: ly, lambda: rng.random(num_packs))
    half = num_packs // 2
    for it in range(refine_rounds):
        score = orderings[it % len(orderings)]()
        ranked = np.argsort(score, kind="stable")
        a, b = ranked[-half:][::-1], ranked[:half]  # heaviest with lightest
        sa, sb = slots[a], slots[b]
        xa, ya, xb, yb = px[sa], py[sa], px[sb], py[sb]
        dx = xb[:, None, :] - xa[:, :, None]  # [pair, slot in a, slot in b]: moving b's item into a
        dy = yb[:, None, :] - ya[:, :, None]
        gap_x = (lx[a] - lx[b])[:, None, None]
        gap_y = (ly[a] - ly[b])[:, None, None]
        delta = 2 * (dx * gap_x + dy * gap_y) + 2 * (dx * dx + dy * dy)
        delta[(sa < 0)[:, :, None] | (sb < 0)[:, None, :]] = np.inf
        flat = delta.reshape(delta.shape[0], -1).argmin(axis=1)
        best = delta.reshape(delta.shape[0], -1)[np.arange(flat.size), flat]
        do = best < -1e-12
        if not do.any():
            if it >= len(orderings):
                break
            continue
        rows = np.flatnonzero(do)
        i, j = np.divmod(flat[rows], kmax)
        pa, pb = a[rows], b[rows]
        item_a, item_b = slots[pa, i], slots[pb, j]
        slots[pa, i], slots[pb, j] = item_b, item_a
        mx, my = nx[item_b] - nx[item_a], ny[item_b] - ny[item_a]
        lx[pa] += mx
        ly[pa] += my
        lx[pb] -= mx
        ly[pb] -= my
    return slots


def _pack_count(n: int, own: int, dp: int, k: float, source: str) -> int:
    """Balanced packs to make: about n / k, such that they plus ``own`` one-sample packs fill whole steps."""
    num = -(-(int(np.ceil(n / k)) + own) // dp) * dp - own
    if num > n:  # too few samples for that many packs: fewer, fuller packs instead
        num = (n + own) // dp * dp - own
    if num < (1 if n else 0):
        raise InputError(
            f"{source}: {n} samples (+ {own} oversized in packs of their own) cannot fill whole steps of {dp} "
            "data-parallel ranks; use fewer ranks"
        )
    return num


def balance_pack(
    stats: LengthStats, *, dp: int, samples_per_pack: float, capacity: PackShape | None = None,
    cost: CostFn | None = None, seed: int = 0, oversized: str = "error", refine_rounds: int = 48,
    row_tokens: int | None = None, dummy_tile_tokens: int = 0,
) -> Packing:
    """Our balanced packing of ``stats`` for ``dp`` ranks at about ``samples_per_pack`` samples per pack.

    With ``capacity`` the packs must fit it (oversized samples follow ``oversized``); without,
    the capacity is the largest pack. ``row_tokens``/``dummy_tile_tokens`` also require
    ``tokens + (Q_v - tiles) * dummy_tile_tokens <= row_tokens``, for a collator that gives each
    padding tile placeholder tokens in the row. ``cost`` (a callable ``(tiles, tokens,
    attention_pairs) -> cost`` per pack, e.g. :class:`~omnibal_compile.data.metrics.ShapeCost`)
    decides which packs share a step; default: tiles, then tokens.
    """
    dp = check_int(dp, "dp", min=1)
    samples_per_pack = check_number(samples_per_pack, "samples_per_pack", min=1)
    seed = check_seed(seed)
    refine_rounds = check_int(refine_rounds, "refine_rounds", min=0)
    if oversized not in OVERSIZED_POLICIES:
        raise InputError(f"unknown oversized policy {oversized!r}; choose one of {list(OVERSIZED_POLICIES)}")
    big = np.zeros(0, np.int64)
    packed_stats = stats
    if capacity is not None:
        packed_stats, big = split_oversized(stats, capacity, oversized)
    else:
        refuse_unpackable(stats)  # the shape is derived from the packs: no sample may exceed the limits
    fits = np.ones(len(stats), bool)
    if oversized == "own-pack":
        fits[big] = False
    ids = np.flatnonzero(fits)
    own = int((~fits).sum())
    n = ids.size
    num = _pack_count(n, own, dp, samples_per_pack, stats.source)
    tiles_f = packed_stats.tiles[ids].astype(float)
    tokens_f = packed_stats.tokens[ids].astype(float)
    fitted = capacity is None
    for _ in range(64):
        slots = balanced_partition(tiles_f, tokens_f, num, seed=seed, refine_rounds=refine_rounds) if n else \
            np.zeros((0, 1), np.int64)
        used = slots >= 0
        if capacity is None:
            break
        tv = np.where(used, packed_stats.tiles[ids][slots], 0).sum(axis=1)
        tt = np.where(used, packed_stats.tokens[ids][slots], 0).sum(axis=1)
        fit = (tv <= capacity.tiles) & (tt <= capacity.tokens)
        if row_tokens is not None:
            fit &= tt + (capacity.tiles - tv) * dummy_tile_tokens <= row_tokens
        if fit.all():
            fitted = True
            break
        if num + dp > n:
            break  # cannot add packs; the error below names the fix
        num += dp
    if not fitted:
        raise InputError(
            f"{stats.source}: packs of {samples_per_pack:g} samples do not fit ({capacity.tiles} tiles, "  # type: ignore[union-attr]
            f"{capacity.tokens} tokens); lower samples_per_pack or raise the shape"  # type: ignore[union-attr]
        )
    own_ids = np.flatnonzero(~fits)
    order = np.concatenate([ids[slots[used]], own_ids])
    sizes = np.concatenate([used.sum(axis=1), np.ones(own_ids.size, np.int64)])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if (sizes.size) % dp:
        raise InputError(f"internal: {sizes.size} packs for {dp} ranks")
    draft = Packing(order=order, offsets=offsets, steps=np.arange(sizes.size).reshape(-1, dp), capacity=capacity,
                    layout="packed", oversized=big, oversized_policy=oversized, method="ours")
    loads = pack_loads(packed_stats, draft)
    if capacity is None:
        capacity = PackShape(tiles=int(loads["tiles"].max()), tokens=int(loads["tokens"].max()))
    if cost is None:
        key = np.lexsort((loads["tokens"], loads["tiles"])).argsort()  # rank by tiles, then tokens
    else:
        key = np.asarray(cost(loads["tiles"], loads["computed"], loads["pairs"]), dtype=np.float64)
    steps = assign_steps(sizes.size, dp, seed=seed, key=key)
    return Packing(order=order, offsets=offsets, steps=steps, capacity=capacity, layout="packed", oversized=big,
                   oversized_policy=oversized, method="ours")
