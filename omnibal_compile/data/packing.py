"""Packings: samples grouped into micro-batches, and micro-batches grouped into global steps.

Every balancer (random batching, length grouping, ISF, ours) returns a :class:`Packing`, so the
metrics, the sampler and the command treat them alike.

Glossary:
    pack        the samples one data-parallel rank processes as one micro-batch. ``packed``
                layout: concatenated into one row of a fixed shape (Q_v tiles, Q_t tokens);
                ``padded`` layout (random and length-grouped baselines): one row per sample,
                padded to the longest sample of the micro-batch.
    capacity    the fixed pack shape (Q_v, Q_t) a packed layout fills.
    step        one global training step: ``dp`` packs, one per data-parallel rank.
    oversized   a sample with more tiles than Q_v or more tokens than Q_t: it fits no pack.
                Policy ``error`` raises, ``truncate`` clips it to the capacity (the collator cuts
                the sample), ``own-pack`` puts it alone in a pack larger than the capacity.
                The reference ISF code drops such samples silently; we never do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from omnibal_compile._utils.validate import check_int, check_seed
from omnibal_compile.config import OVERSIZED_POLICIES
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.errors import InputError

__all__ = [
    "PackShape", "Packing", "OversizedPolicy", "OVERSIZED_POLICIES", "MAX_PACK_TILES", "MAX_PACK_TOKENS",
    "refuse_unpackable", "split_oversized", "packing_from_groups",
    "even_groups", "assign_steps", "random_batches", "length_grouped_batches",
]

MAX_PACK_TILES = 4096
"""Most image tiles one pack may hold (a pack's tiles are one batch of the vision encoder)."""
MAX_PACK_TOKENS = 2**21
"""Most LLM tokens one pack may hold (2,097,152: beyond any VLM's context, far below a corrupt length's)."""

OversizedPolicy = Literal["error", "truncate", "own-pack"]
Layout = Literal["packed", "padded"]


@dataclass(frozen=True, kw_only=True)
class PackShape:
    """The fixed micro-batch shape a pack is filled up to."""

    tiles: int
    """Q_v: image tiles per pack (the vision encoder's batch)."""
    tokens: int
    """Q_t: LLM tokens per pack (the language model's sequence length)."""

    def __post_init__(self) -> None:
        # A shape becomes tensors of that size in every step: a corrupt length must not allocate terabytes.
        hint = ("larger packs would not fit in memory; check the length statistics for a corrupt sample, or fix the "
                "shape with DataOptions(shape=PackShape(...)) and oversized='truncate'")
        object.__setattr__(self, "tiles", check_int(self.tiles, "pack shape tiles (Q_v)", min=0, max=MAX_PACK_TILES,
                                                    hint=hint))
        object.__setattr__(self, "tokens", check_int(self.tokens, "pack shape tokens (Q_t)", min=1,
                                                     max=MAX_PACK_TOKENS, hint=hint))


def refuse_unpackable(stats: LengthStats, ids: np.ndarray | None = None) -> None:
    """Raise naming the first sample (of ``ids``, default all) that no pack may hold (over the pack limits)."""
    ids = np.arange(len(stats)) if ids is None else np.asarray(ids)
    over = ids[(stats.tiles[ids] > MAX_PACK_TILES) | (stats.tokens[ids] > MAX_PACK_TOKENS)]
    if over.size:
        i = int(over[0])
        raise InputError(
            f"{stats.source}: sample {i} has {stats.tiles[i]:,} tiles and {stats.tokens[i]:,} tokens, more than any "
            f"pack may hold ({MAX_PACK_TILES:,} tiles, {MAX_PACK_TOKENS:,} tokens; {over.size} such sample(s)); "
            "check the statistics for a corrupt length and drop that sample, or (Python API) fix the shape with "
            "DataOptions(shape=PackShape(...)) and oversized='truncate'"
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class Packing:
    """Samples grouped into packs (CSR arrays) and packs into steps of ``dp`` ranks."""

    order: np.ndarray
    """Sample ids, pack after pack; pack ``p`` is ``order[offsets[p]:offsets[p + 1]]``."""
    offsets: np.ndarray
    """Pack boundaries into ``order`` (length ``num_packs + 1``)."""
    steps: np.ndarray
    """``[num_steps, dp]`` pack ids: ``steps[s, r]`` is rank r's pack at step s."""
    capacity: PackShape | None
    """Fixed pack shape for the packed layout; None for the padded layout."""
    layout: Layout
    """``packed`` (one row per pack) or ``padded`` (one row per sample)."""
    oversized: np.ndarray
    """Ids of samples that fit no pack (handled by ``oversized_policy``)."""
    oversized_policy: str
    """What was done with them: ``error``, ``truncate`` or ``own-pack``."""
    method: str
    """Which balancer produced the packing."""

    @property
    def num_packs(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def dp(self) -> int:
        return int(self.steps.shape[1])

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    def pack(self, p: int) -> np.ndarray:
        """Sample ids of pack ``p``."""
        return self.order[self.offsets[p]:self.offsets[p + 1]]

    def pack_sums(self, values: np.ndarray) -> np.ndarray:
        """Per-pack sum of a per-sample array (0 for an empty pack)."""
        csum = np.concatenate([[0], np.cumsum(values[self.order], dtype=np.int64)])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    def pack_max(self, values: np.ndarray) -> np.ndarray:
        """Per-pack maximum of a per-sample array (0 for an empty pack)."""
        out = np.zeros(self.num_packs, dtype=np.int64)
        counts = np.diff(self.offsets)
        nonempty = counts > 0
        if self.order.size:
            out[nonempty] = np.maximum.reduceat(values[self.order], self.offsets[:-1][nonempty])
        return out

    def digest(self) -> str:
        """A fingerprint of the packs and their step order (equal digests: the same sequence of batches)."""
        h = hashlib.sha256()
        for a in (self.order, self.offsets, self.steps):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
            h.update(b"|")
        return h.hexdigest()[:16]

    def samples_per_pack(self) -> float:
        return float(self.order.size) / max(self.num_packs, 1)

    def check_exactly_once(self, n: int) -> None:
        """Raise unless every sample id in ``range(n)`` is in exactly one pack scheduled exactly once."""
        scheduled = np.sort(self.steps.ravel())
        if not np.array_equal(scheduled, np.arange(self.num_packs)):
            raise AssertionError(f"{self.method}: steps do not schedule each of the {self.num_packs} packs once")
        if not np.array_equal(np.sort(self.order), np.arange(n)):
            raise AssertionError(f"{self.method}: packs do not hold each of the {n} samples exactly once")


def split_oversized(stats: LengthStats, capacity: PackShape, policy: str) -> tuple[LengthStats, np.ndarray]:
    """Apply the oversized-sample policy: returns the statistics to pack and the oversized ids.

    ``truncate`` returns statistics clipped to the capacity (the ids are still reported);
    ``own-pack`` returns them unchanged (the caller gives each oversized id its own pack).
    """
    if policy not in OVERSIZED_POLICIES:
        raise InputError(f"unknown oversized policy {policy!r}; choose one of {list(OVERSIZED_POLICIES)}")
    big = np.flatnonzero((stats.tiles > capacity.tiles) | (stats.tokens > capacity.tokens))
    if big.size and policy == "error":
        first = ", ".join(f"{i} ({stats.tiles[i]} tiles, {stats.tokens[i]} tokens)" for i in big[:5])
        raise InputError(
            f"{stats.source}: {big.size} sample(s) exceed the pack shape ({capacity.tiles} tiles, {capacity.tokens} "
            f"tokens), e.g. {first}; raise the shape, or set oversized (--oversized) to 'truncate' or 'own-pack'"
        )
    if big.size and policy == "own-pack":
        refuse_unpackable(stats, big)  # each becomes a pack of its own shape
    if big.size and policy == "truncate":
        stats = LengthStats(
            tiles=np.minimum(stats.tiles, capacity.tiles),
            tokens=np.minimum(stats.tokens, capacity.tokens),
            image_flags=np.minimum(stats.image_flags, capacity.tiles),
            source=stats.source,
        )
    return stats, big


def even_groups(n: int, num_groups: int) -> np.ndarray:
    """Offsets splitting ``n`` items into ``num_groups`` consecutive groups whose sizes differ by <= 1."""
    base, extra = divmod(n, num_groups)
    sizes = np.full(num_groups, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_divisible(sizes: np.ndarray, dp: int) -> np.ndarray:
    """Split the largest groups in two until their number is a multiple of ``dp``; new sizes.

    Keeps every sample exactly once per epoch without padding steps with repeated samples.
    """
    sizes = np.asarray(sizes, np.int64)
    need = _round_up(sizes.size, dp) - sizes.size
    if need == 0:
        return sizes
    if int(np.maximum(sizes - 1, 0).sum()) < need:
        raise InputError(
            f"{int(sizes.sum())} samples cannot fill whole steps of {dp} data-parallel ranks; use fewer ranks"
        )
    # Fewer than dp splits, each of the currently largest group (its first half stays in place).
    out = sizes.tolist()
    for _ in range(need):
        i = int(np.argmax(out))
        half = out[i] // 2
        out[i:i + 1] = [half, out[i] - half]
    return np.asarray(out, np.int64)


def packing_from_groups(
    order: np.ndarray, sizes: np.ndarray, *, dp: int, capacity: PackShape | None, layout: Layout,
    oversized: np.ndarray, policy: str, method: str, seed: int, in_order: bool = False,
) -> Packing:
    """Build a :class:`Packing` from groups given as sample ids (``order``) and group ``sizes``.

    Steps are random (a plain sampler over packs) unless ``in_order``: consecutive runs of ``dp``
    groups form a step.
    """
    sizes = np.asarray(sizes, np.int64)
    sizes = make_divisible(sizes[sizes > 0], dp)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    steps = np.arange(sizes.size).reshape(-1, dp) if in_order else assign_steps(sizes.size, dp, seed=seed)
    return Packing(order=np.asarray(order, np.int64), offsets=offsets, steps=steps, capacity=capacity, layout=layout,
                   oversized=np.asarray(oversized, np.int64), oversized_policy=policy, method=method)


def assign_steps(num_packs: int, dp: int, *, seed: int, key: np.ndarray | None = None) -> np.ndarray:
    """Schedule packs onto ``[num_packs // dp, dp]`` steps.

    Without ``key`` the schedule is random (what a plain sampler over packs does). With ``key``
    (one cost per pack) packs are sorted by it and consecutive runs of ``dp`` share a step, so the
    ranks of a step get packs of near-equal cost; the order of steps is then shuffled.
    """
    if num_packs % dp:
        raise InputError(f"{num_packs} packs do not divide among {dp} data-parallel ranks")
    rng = np.random.default_rng(seed)
    if key is None:
        return rng.permutation(num_packs).reshape(-1, dp)
    # Random tie-break first, so equal-cost packs land in different steps across seeds.
    tie = rng.permutation(num_packs)
    ranked = tie[np.argsort(np.asarray(key)[tie], kind="stable")].reshape(-1, dp)
    ranked = ranked[rng.permutation(ranked.shape[0])]
    # Which rank gets which pack of a step is irrelevant to balance; shuffle it too.
    return np.take_along_axis(ranked, rng.random(ranked.shape).argsort(axis=1), axis=1)


def random_batches(stats: LengthStats, *, dp: int, batch_size: int, seed: int = 0) -> Packing:
    """Random batching: shuffle, cut into micro-batches of ``batch_size`` samples padded to their longest."""
    dp, batch_size = check_int(dp, "dp", min=1), check_int(batch_size, "batch_size", min=1)
    seed = check_seed(seed)
    n = len(stats)
    perm = np.random.default_rng(seed).permutation(n)
    num = _round_up(-(-n // batch_size), dp)
    offsets = even_groups(n, num)
    steps = np.arange(num).reshape(-1, dp)
    return Packing(order=perm, offsets=offsets, steps=steps, capacity=None, layout="padded",
                   oversized=np.zeros(0, np.int64), oversized_policy="error", method="random")


def length_grouped_batches(stats: LengthStats, *, dp: int, batch_size: int, seed: int = 0) -> Packing:
    """LLaVA-style modality and length grouping (``get_modality_length_grouped_indices``).

    Samples with images and text-only samples are grouped separately; each is shuffled and cut
    into mega-batches of ``dp * batch_size``, sorted by length within a mega-batch, and dealt to
    ranks so each rank's summed length is as even as a greedy split allows.
    """
    dp, batch_size = check_int(dp, "dp", min=1), check_int(batch_size, "batch_size", min=1)
    rng = np.random.default_rng(check_seed(seed))
    if len(stats) < dp:
        raise InputError(f"{len(stats)} samples cannot fill {dp} data-parallel ranks; use fewer ranks")
    mb = dp * batch_size
    megas: list[np.ndarray] = []
    leftover = np.zeros(0, np.int64)
    for ids in (np.flatnonzero(stats.image_flags > 0), np.flatnonzero(stats.image_flags == 0)):
        ids = ids[rng.permutation(ids.size)]
        pieces = [ids[i:i + mb] for i in range(0, ids.size, mb)]
        # Every mega-batch must give each rank a micro-batch, so a tail shorter than dp joins its
        # neighbour (a modality with fewer than dp samples joins the other modality).
        if pieces and pieces[-1].size < dp:
            tail = pieces.pop()
            if pieces:
                pieces[-1] = np.concatenate([pieces[-1], tail])
            else:
                leftover = np.concatenate([leftover, tail])
        megas += pieces
    if leftover.size:  # with no mega-batch of either modality (each has fewer than dp samples), they form one
        megas = [*megas[:-1], np.concatenate([megas[-1], leftover])] if megas else [leftover]
    groups: list[np.ndarray] = []
    for i in rng.permutation(len(megas)):
        mega = megas[i][np.argsort(-stats.tokens[megas[i]], kind="stable")]
        groups += _split_even_chunks(mega, stats.tokens, dp, batch_size)
    return packing_from_groups(np.concatenate(groups), np.array([g.size for g in groups]), dp=dp, capacity=None,
                               layout="padded", oversized=np.zeros(0, np.int64), policy="error",
                               method="length-grouped", seed=seed, in_order=True)


def _split_even_chunks(mega: np.ndarray, tokens: np.ndarray, dp: int, batch_size: int) -> list[np.ndarray]:
    """Greedy: each sample (longest first) goes to the rank with the least total length that has room."""
    if mega.size % dp:
        # LLaVA deals an uneven mega-batch round-robin.
        return [mega[r::dp] for r in range(dp)]
    per = mega.size // dp
    chunks: list[list[int]] = [[] for _ in range(dp)]
    load = np.zeros(dp)
    for i in mega.tolist():
        r = int(np.argmin(load))
        chunks[r].append(i)
        load[r] += tokens[i]
        if len(chunks[r]) == per:
            load[r] = np.inf
    return [np.array(c, np.int64) for c in chunks]
