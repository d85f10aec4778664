"""ISF (against a plain-Python transcription), our balancer, baselines and the metrics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal_compile.data import (
    LengthStats,
    PackShape,
    ShapeCost,
    balance_metrics,
    balance_pack,
    dist_ratio,
    isf_pack,
    isf_search,
    length_grouped_batches,
    load_lengths,
    random_batches,
)
from omnibal_compile.data.isf import greedy_groups
from omnibal_compile.data.lengths import bundled_length_files
from omnibal_compile.data.packing import make_divisible
from omnibal_compile.errors import InputError


def _greedy_reference(tiles: list[int], tokens: list[int], q_v: int, q_t: int) -> list[int]:
    """The reference ``_random_groups`` loop (after shuffling), returning group sizes."""
    sizes, v_sum, t_sum, cur = [], 0, 0, 0
    for v, t in zip(tiles, tokens):
        v_sum, t_sum = v_sum + v, t_sum + t
        if v_sum > q_v or t_sum > q_t:
            sizes.append(cur)
            v_sum, t_sum, cur = v, t, 1
        else:
            cur += 1
    if cur:
        sizes.append(cur)
    return [s for s in sizes if s]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 50)), min_size=1, max_size=80),
       st.integers(4, 12), st.integers(50, 200))
def test_vectorised_greedy_fill_matches_the_reference_loop(samples: list[tuple[int, int]], q_v: int, q_t: int) -> None:
    tiles = np.array([s[0] for s in samples])
    tokens = np.array([s[1] for s in samples])
    offsets = greedy_groups(tiles, tokens, PackShape(tiles=q_v, tokens=q_t))
    assert np.diff(offsets).tolist() == _greedy_reference(tiles.tolist(), tokens.tolist(), q_v, q_t)


def _stats(n: int, seed: int = 0) -> LengthStats:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 6, n)
    return LengthStats.from_arrays(tiles, tiles * 16 + rng.integers(2, 40, n))


@pytest.mark.parametrize("method", ["isf", "ours", "random", "length-grouped"])
@pytest.mark.parametrize(("n", "dp"), [(1000, 8), (37, 4), (9, 8)])
def test_every_method_packs_every_sample_exactly_once(method: str, n: int, dp: int) -> None:
    s = _stats(n)
    if method == "isf":
        p = isf_pack(s, dp=dp, capacity=PackShape(tiles=12, tokens=250), iterations=5)
    elif method == "ours":
        p = balance_pack(s, dp=dp, samples_per_pack=4)
    elif method == "random":
        p = random_batches(s, dp=dp, batch_size=4)
    else:
        p = length_grouped_batches(s, dp=dp, batch_size=4)
    p.check_exactly_once(n)
    assert p.dp == dp and (np.diff(p.offsets) > 0).all()


def test_isf_keeps_full_groups_and_fits_capacity() -> None:
    s = _stats(2000)
    cap = PackShape(tiles=12, tokens=250)
    p = isf_pack(s, dp=8, capacity=cap, token_thresh=240, iterations=20)
    tiles, tokens = p.pack_sums(s.tiles), p.pack_sums(s.tokens)
    assert (tiles <= cap.tiles).all() and (tokens <= cap.tokens).all()
    one = isf_pack(s, dp=8, capacity=cap, token_thresh=240, iterations=1)
    # Filtering and refilling must leave fewer under-full packs than a single greedy fill.
    def underfull(q: object) -> float:
        return float(((q.pack_sums(s.tiles) < cap.tiles) & (q.pack_sums(s.tokens) < 240)).mean())
    assert underfull(p) < underfull(one)


def test_ours_packs_even_counts_and_respects_a_given_capacity() -> None:
    s = _stats(3001)
    p = balance_pack(s, dp=8, samples_per_pack=4.5)
    counts = np.diff(p.offsets)
    assert counts.max() - counts.min() <= 1
    assert abs(p.samples_per_pack() - 4.5) < 0.1
    cap = PackShape(tiles=int(p.pack_sums(s.tiles).max()) - 1, tokens=int(p.pack_sums(s.tokens).max()))
    q = balance_pack(s, dp=8, samples_per_pack=4.5, capacity=cap)  # tighter: needs more packs
    assert (q.pack_sums(s.tiles) <= cap.tiles).all() and q.num_packs > p.num_packs
    q.check_exactly_once(len(s))


def test_ours_beats_isf_and_random_on_synthetic_data() -> None:
    s = _stats(4000, seed=3)
    found = isf_search(s, dp=8, samples_per_pack=4, iterations=10, start_tokens=16 * 16, token_margin=8, length_bin=16)
    isf = balance_metrics(s, found.packing)
    ours = balance_metrics(s, balance_pack(s, dp=8, samples_per_pack=found.packing.samples_per_pack()))
    rnd = balance_metrics(s, random_batches(s, dp=8, batch_size=4))
    assert 4 <= isf.samples_per_pack <= 5
    assert abs(ours.samples_per_pack - isf.samples_per_pack) < 0.05
    for name in ("pad_ratio", "dist_vision", "dist_language", "dist_compute"):
        assert getattr(ours, name) < getattr(isf, name), name
        assert getattr(ours, name) < getattr(rnd, name), name


@pytest.mark.parametrize("policy", ["error", "truncate", "own-pack"])
def test_oversized_samples_are_never_dropped(policy: str) -> None:
    s = LengthStats.from_arrays([1, 9, 1, 2, 1, 1, 3, 1], [10, 10, 500, 10, 10, 10, 10, 10])
    cap = PackShape(tiles=4, tokens=100)
    for pack in (lambda: isf_pack(s, dp=2, capacity=cap, oversized=policy),
                 lambda: balance_pack(s, dp=2, samples_per_pack=2, capacity=cap, oversized=policy)):
        if policy == "error":
            with pytest.raises(InputError, match=r"2 sample\(s\) exceed.*oversized \(--oversized\) to 'truncate'"):
                pack()
            continue
        p = pack()
        p.check_exactly_once(len(s))
        assert sorted(p.oversized.tolist()) == [1, 2]
        assert balance_metrics(s, p).oversized == 2 and balance_metrics(s, p).seconds == 0.0  # not timed unless told
        for pid in range(p.num_packs):
            ids = p.pack(pid)
            if policy == "own-pack" and (1 in ids or 2 in ids):
                assert ids.size == 1


def test_dist_ratio_matches_the_paper_formula() -> None:
    loads = np.array([[10, 5, 10, 5], [4, 4, 4, 4]])
    # step 0: (0 + 5 + 0 + 5) / (10 * 4) = 0.25; step 1: 0
    assert dist_ratio(loads) == pytest.approx(0.125)
    assert dist_ratio(np.zeros((2, 3))) == 0.0


def test_make_divisible_splits_largest_groups() -> None:
    assert make_divisible(np.array([4, 1, 3]), 4).tolist() == [2, 2, 1, 3]
    out = make_divisible(np.array([5, 1, 1]), 4)
    assert out.sum() == 7 and out.size == 4
    with pytest.raises(InputError, match="data-parallel"):
        make_divisible(np.array([1, 1, 1]), 4)


def test_targets_on_the_shared_statistics() -> None:
    s = load_lengths(bundled_length_files())
    found = isf_search(s, dp=8, samples_per_pack=4)
    ours = balance_metrics(s, balance_pack(s, dp=8, samples_per_pack=found.packing.samples_per_pack()))
    isf = balance_metrics(s, found.packing)
    assert abs(ours.samples_per_pack - isf.samples_per_pack) < 0.01
    assert ours.dist_vision <= 0.01 and ours.dist_language <= 0.02
    assert ours.pad_ratio < isf.pad_ratio


def test_shape_model_cost_sums_block_coefficients_and_steers_steps() -> None:
    from types import SimpleNamespace

    from omnibal_compile.data import shape_model_cost

    # Two blocks, features (1, tiles, text tokens, attention): forward + backward summed over blocks.
    model = SimpleNamespace(tokens_per_tile=16, coefficients={
        "forward_s": ((1.0, 2.0, 0.0, 0.0), (0.0, 0.0, 3.0, 0.5)),
        "backward_s": ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.5)),
    })
    cost = shape_model_cost(model)
    tiles, tokens = np.array([2, 0]), np.array([2 * 16 + 10, 20])
    squares = np.array([42**2, 20**2])
    got = cost(tiles, tokens, (squares + tokens) / 2)
    assert got.tolist() == pytest.approx([2 + 4 + 30 + 42**2, 2 + 0 + 60 + 20**2])
    s = _stats(800)
    p = balance_pack(s, dp=8, samples_per_pack=4, cost=cost)
    p.check_exactly_once(len(s))
    assert balance_metrics(s, p, cost=cost).dist_compute < 0.01


@pytest.mark.parametrize(("n_img", "n_text", "dp"), [(37, 3, 4), (30, 9, 8), (64, 0, 8)])
def test_length_grouping_gives_every_rank_a_batch_from_each_mega_batch(n_img: int, n_text: int, dp: int) -> None:
    rng = np.random.default_rng(1)
    flags = np.r_[np.ones(n_img, int), np.zeros(n_text, int)]
    s = LengthStats.from_arrays(np.ones(n_img + n_text, int), rng.integers(5, 500, n_img + n_text), flags)
    p = length_grouped_batches(s, dp=dp, batch_size=4)
    p.check_exactly_once(len(s))
    sizes = np.diff(p.offsets)[p.steps]
    assert (sizes > 0).all()
    # Within a step the ranks' micro-batches differ by at most one sample (one mega-batch per step).
    assert (sizes.max(axis=1) - sizes.min(axis=1) <= 1).all()


def _hand_packing(layout: str, steps: list[list[int]], capacity: PackShape | None = None):
    """Packs [0, 1], [2], [3, 4, 5], [6] scheduled by ``steps`` (hand-written, no balancer involved)."""
    from omnibal_compile.data.packing import Packing

    return Packing(order=np.array([0, 1, 2, 3, 4, 5, 6]), offsets=np.array([0, 2, 3, 6, 7]), steps=np.array(steps),
                   capacity=capacity, layout=layout, oversized=np.zeros(0, np.int64), oversized_policy="error",
                   method="hand")


# tiles and tokens of samples 0..6
_HAND = LengthStats.from_arrays([1, 0, 4, 0, 2, 1, 0], [3, 4, 5, 1, 2, 6, 2])


def test_loads_and_attention_pairs_against_hand_counts_packed() -> None:
    from omnibal_compile.data.metrics import pack_loads

    p = _hand_packing("packed", [[0, 1], [2, 3]], capacity=PackShape(tiles=4, tokens=10))
    loads = pack_loads(_HAND, p)
    assert loads["tiles"].tolist() == [1, 4, 3, 0]
    assert loads["tokens"].tolist() == [7, 5, 9, 2]
    assert loads["computed"].tolist() == [7, 5, 9, 2]  # a packed row computes its real tokens
    # causal pairs stay inside each sample: L (L + 1) / 2 per sample
    assert loads["pairs"].tolist() == [3 * 4 / 2 + 4 * 5 / 2, 15, 1 + 3 + 21, 3]
    m = balance_metrics(_HAND, p, cost=ShapeCost(flops_per_tile=0, flops_per_token=0, flops_per_attention_pair=1))
    # shapes are Q_t = 10 tokens per pack: padding (3 + 5 + 1 + 8) of 40
    assert m.pad_ratio == pytest.approx(17 / 40)
    # step 0 loads (1, 4), step 1 (3, 0): ((4 - 1) / 8 + (3 - 0) / 6) / 2
    assert m.dist_vision == pytest.approx((3 / 8 + 3 / 6) / 2)
    assert m.dist_language == pytest.approx(((7 - 5) / 14 + (9 - 2) / 18) / 2)
    assert m.dist_compute == pytest.approx(((16 - 15) / 32 + (25 - 3) / 50) / 2)
    assert (m.samples_per_pack, m.num_steps, m.oversized) == (7 / 4, 2, 0)


def test_loads_and_attention_pairs_against_hand_counts_padded() -> None:
    from omnibal_compile.data.metrics import pack_loads

    p = _hand_packing("padded", [[3, 0], [1, 2]])
    loads = pack_loads(_HAND, p)
    assert loads["tokens"].tolist() == [7, 5, 9, 2]
    # every row is padded to the pack's longest sample: rows x longest tokens, rows x L (L + 1) / 2 pairs
    assert loads["computed"].tolist() == [2 * 4, 5, 3 * 6, 2]
    assert loads["pairs"].tolist() == [2 * 10, 15, 3 * 21, 3]
    m = balance_metrics(_HAND, p, cost=ShapeCost(flops_per_tile=1, flops_per_token=10, flops_per_attention_pair=100))
    assert m.pad_ratio == pytest.approx((1 + 0 + 9 + 0) / (8 + 5 + 18 + 2))
    # steps: packs (3, 0) then (1, 2); language loads (2, 8) and (5, 18)
    assert m.dist_language == pytest.approx(((8 - 2) / 16 + (18 - 5) / 36) / 2)
    assert m.dist_vision == pytest.approx(((1 - 0) / 2 + (4 - 3) / 8) / 2)
    # FLOPs tiles + 10 computed + 100 pairs per pack: 2081, 1554, 6483, 320
    assert m.dist_compute == pytest.approx(((2081 - 320) / (2 * 2081) + (6483 - 1554) / (2 * 6483)) / 2)


def test_pack_shape_limits_and_the_unpackable_sample_check_are_inclusive() -> None:
    from contracts import assert_frozen_keyword_only

    from omnibal_compile.data.packing import MAX_PACK_TILES, MAX_PACK_TOKENS, Packing, refuse_unpackable

    assert (MAX_PACK_TILES, MAX_PACK_TOKENS) == (4096, 2_097_152)  # the limits README's error table states
    edge = PackShape(tiles=4096, tokens=2_097_152)  # the largest shape allowed
    assert (edge.tiles, edge.tokens) == (4096, 2_097_152) and PackShape(tiles=0, tokens=1).tiles == 0
    for tiles, tokens, what in ((4097, 10, "tiles"), (-1, 10, "tiles"), (4, 2_097_153, "tokens"), (4, 0, "tokens")):
        with pytest.raises(InputError, match=f"pack shape {what}"):
            PackShape(tiles=tiles, tokens=tokens)
    assert_frozen_keyword_only(edge)
    # a sample exactly at the limits fits; one tile or token more is refused, naming the first such sample
    refuse_unpackable(LengthStats.from_arrays([4096, 1], [2_097_152, 5]))
    for tiles, tokens in (([1, 4097, 4097], [5, 5, 5]), ([1, 1, 1], [5, 2_097_153, 2_097_153])):
        with pytest.raises(InputError, match=r"sample 1 has .* \(4,096 tiles, 2,097,152 tokens; 2 such sample"):
            refuse_unpackable(LengthStats.from_arrays(tiles, tokens))
    refuse_unpackable(LengthStats.from_arrays([1, 4097], [5, 5]), ids=[0])  # only the given ids are checked
    # a Packing holds arrays: compared and hashed by identity, never element-wise
    p = balance_pack(LengthStats.from_arrays([1, 2, 0, 1], [10, 20, 30, 5]), dp=2, samples_per_pack=1)
    assert isinstance(p, Packing) and p == p and p != dataclasses.replace(p) and {p: 1}[p] == 1
    assert_frozen_keyword_only(p)


def _three_packs(steps: list[list[int]], order: list[int] | None = None):
    from omnibal_compile.data.packing import Packing

    return Packing(order=np.array(order or [0, 1, 2, 3, 4]), offsets=np.array([0, 2, 2, 5]), steps=np.array(steps),
                   capacity=None, layout="padded", oversized=np.zeros(0, np.int64), oversized_policy="error",
                   method="hand")


def test_packing_helpers_by_hand() -> None:
    from omnibal_compile.data.packing import even_groups, split_oversized

    p = _three_packs([[0], [1], [2]], order=[4, 3, 2, 1, 0])  # packs [4, 3], [], [2, 1, 0]
    assert p.pack_max(np.array([5, 1, 7, 2, 9])).tolist() == [9, 0, 7]  # the empty pack's maximum is 0
    assert p.samples_per_pack() == 5 / 3
    empty = dataclasses.replace(p, order=np.zeros(0, np.int64), offsets=np.array([0]), steps=np.zeros((0, 1), np.int64))
    assert empty.samples_per_pack() == 0.0 and empty.pack_max(np.zeros(0, np.int64)).tolist() == []
    # the digest: 16 hex digits; equal for equal packs in the same step order, different otherwise
    d = p.digest()
    assert len(d) == 16 and int(d, 16) >= 0 and d == _three_packs([[0], [1], [2]], order=[4, 3, 2, 1, 0]).digest()
    assert d != _three_packs([[1], [0], [2]], order=[4, 3, 2, 1, 0]).digest()  # steps reordered
    assert d != _three_packs([[0], [1], [2]], order=[3, 4, 2, 1, 0]).digest()  # order within a pack
    # consecutive groups whose sizes differ by at most one, the larger first
    assert even_groups(7, 3).tolist() == [0, 3, 5, 7] and even_groups(6, 3).tolist() == [0, 2, 4, 6]
    # oversized samples: strictly over the shape in tiles or tokens; a sample exactly at the shape fits
    stats = LengthStats.from_arrays([2, 3, 2, 1, 1, 1, 1, 1], [10, 10, 11, 10, 11, 11, 11, 11])
    cap = PackShape(tiles=2, tokens=10)
    kept, big = split_oversized(stats, cap, "own-pack")
    assert big.tolist() == [1, 2, 4, 5, 6, 7] and kept is stats
    kept, big = split_oversized(stats, cap, "truncate")
    assert kept.tiles.tolist() == [2, 2, 2, 1, 1, 1, 1, 1] and kept.tokens.max() == 10 and big.size == 6
    with pytest.raises(InputError, match=r"6 sample\(s\) exceed the pack shape \(2 tiles, 10 tokens\)") as err:
        split_oversized(stats, cap, "error")
    assert "e.g. 1 (3 tiles, 10 tokens), 2 (2 tiles, 11 tokens), 4 (1 tiles, 11 tokens), 5 (" in str(err.value)
    assert "6 (1 tiles, 11 tokens); raise" in str(err.value) and "7 (" not in str(err.value)  # the first five
    small = LengthStats.from_arrays([1, 2], [5, 10])
    assert split_oversized(small, cap, "error")[1].size == 0 and split_oversized(small, cap, "truncate")[0] is small
    with pytest.raises(InputError, match="more than any pack may hold"):  # own-pack still refuses the unpackable
        split_oversized(LengthStats.from_arrays([1, 5000], [5, 5]), cap, "own-pack")


def test_groups_steps_and_baselines_by_hand() -> None:
    from omnibal_compile.data.packing import _split_even_chunks, assign_steps, make_divisible, packing_from_groups

    # split the largest group until the count divides by dp; refused only when too few samples
    assert make_divisible(np.array([3, 1]), 4).tolist() == [1, 1, 1, 1]
    assert make_divisible(np.array([4, 2]), 2).tolist() == [4, 2]
    with pytest.raises(InputError, match="3 samples cannot fill whole steps of 4"):
        make_divisible(np.array([2, 1]), 4)
    # empty groups are dropped; steps are random (assign_steps with the seed) unless in_order
    kw = dict(dp=2, capacity=None, layout="padded", oversized=np.zeros(0, np.int64), policy="error", method="m")
    p = packing_from_groups(np.arange(6), np.array([2, 0, 1, 2, 1]), seed=3, **kw)
    assert p.offsets.tolist() == [0, 2, 3, 5, 6] and p.steps.tolist() == assign_steps(4, 2, seed=3).tolist()
    p = packing_from_groups(np.arange(6), np.array([2, 0, 1, 2, 1]), seed=3, in_order=True, **kw)
    assert p.steps.tolist() == [[0, 1], [2, 3]]
    # the greedy split: longest first to the least-loaded rank with room; round-robin when uneven
    tokens = np.array([9, 8, 5, 4, 1, 1])
    assert [c.tolist() for c in _split_even_chunks(np.arange(6), tokens, 2, 3)] == [[0, 3, 4], [1, 2, 5]]
    assert [c.tolist() for c in _split_even_chunks(np.arange(5), tokens, 2, 3)] == [[0, 2, 4], [1, 3]]
    # the baselines' counts are checked; dp samples exactly fill dp ranks
    s = LengthStats.from_arrays([1, 0, 1, 0], [10, 20, 30, 40])
    for f in (random_batches, length_grouped_batches):
        with pytest.raises(InputError, match="dp must be an integer >= 1, got 0"):
            f(s, dp=0, batch_size=1)
        with pytest.raises(InputError, match="batch_size must be an integer >= 1, got 0"):
            f(s, dp=1, batch_size=0)
    assert length_grouped_batches(s, dp=4, batch_size=1).num_steps == 1
    with pytest.raises(InputError, match="4 samples cannot fill 5 data-parallel ranks"):
        length_grouped_batches(s, dp=5, batch_size=1)
    # a modality's tail of exactly dp samples is a mega-batch of its own: 2 image samples, 2 text-only, dp 2
    p = length_grouped_batches(s, dp=2, batch_size=2, seed=0)
    assert sorted(sorted(int(x) for x in p.pack(k)) for k in range(p.num_packs)) == [[0], [1], [2], [3]]
    assert {frozenset(int(p.pack(int(k))[0]) for k in step) for step in p.steps} == {
        frozenset({0, 2}),
        frozenset({1, 3}),
    }


def test_baseline_defaults_tails_digests_and_truncation_by_hand() -> None:
    from omnibal_compile.data.packing import split_oversized

    s = LengthStats.from_arrays([k % 3 for k in range(40)], [10 + 7 * k for k in range(40)])
    for f in (random_batches, length_grouped_batches):
        p = f(s, dp=2, batch_size=2)
        assert p.digest() == f(s, dp=2, batch_size=2, seed=0).digest() != f(s, dp=2, batch_size=2, seed=1).digest()
        assert p.oversized.size == 0 and p.oversized_policy == "error"
    # 5 image samples, dp 2, batch 2: mega-batches of 4; the tail of 1 (< dp) joins the last one -> one
    # uneven mega-batch of 5, dealt round-robin into 2 packs (3 and 2 samples): one step
    five = LengthStats.from_arrays([1] * 5, [10, 20, 30, 40, 50])
    p = length_grouped_batches(five, dp=2, batch_size=2)
    assert (p.num_steps, p.num_packs, sorted(np.diff(p.offsets).tolist())) == (1, 2, [2, 3])
    # the digest separates its arrays: the same bytes split differently are another packing
    a = dataclasses.replace(p, order=np.array([0, 1, 2]), offsets=np.array([0, 3]), steps=np.array([[0]]))
    b = dataclasses.replace(p, order=np.array([0, 1, 2, 0]), offsets=np.array([3]), steps=np.array([[0]]))
    assert a.digest() != b.digest()
    # truncation clips a sample even beyond the pack limits (only own-pack keeps its size)
    huge = LengthStats.from_arrays([5000, 1], [10, 10])
    kept, big = split_oversized(huge, PackShape(tiles=4, tokens=10), "truncate")
    assert kept.tiles.tolist() == [4, 1] and big.tolist() == [0]


def test_shape_cost_constants_and_value_contracts_by_hand():
    """The default FLOP model: InternViT-6B at 1025 patches per tile, a 34B LLM, hidden 7168 over 60 layers."""
    from contracts import assert_frozen_keyword_only

    from omnibal_compile.data.metrics import BalanceMetrics, ShapeCost, dist_ratio

    c = ShapeCost()
    assert_frozen_keyword_only(c)
    assert (c.flops_per_tile, c.flops_per_token, c.flops_per_attention_pair) == (12_095e9, 68e9, 1_720_320)
    got = c(np.array([2.0]), np.array([100.0]), np.array([5050.0]))
    assert got[0] == 2 * 12_095e9 + 100 * 68e9 + 5050 * 1_720_320
    m = BalanceMetrics(method="x", pad_ratio=0.0, dist_vision=0.0, dist_language=0.0, dist_compute=0.0,
                       samples_per_pack=1.0, num_steps=1, oversized=0)
    assert_frozen_keyword_only(m)
    assert m.seconds == 0.0
    assert dist_ratio(np.zeros((0, 4))) == 0.0 and dist_ratio(np.zeros((2, 4))) == 0.0


def test_shape_model_cost_by_hand():
    """Fitted per-block coefficients summed over forward and backward; text = tokens - tiles x tokens per tile."""
    from types import SimpleNamespace

    from omnibal_compile.data.metrics import shape_model_cost

    model = SimpleNamespace(tokens_per_tile=10, coefficients={
        "forward_s": [[1.0, 2.0, 0.5, 0.01], [0.5, 1.0, 0.25, 0.0]],
        "backward_s": [[2.0, 4.0, 1.0, 0.02]],
    })
    cost = shape_model_cost(model)  # summed: (3.5, 7, 1.75, 0.03)
    # one sample of 2 tiles and 30 tokens: text 30 - 20 = 10; pairs (30^2 + 30) / 2 = 465 -> squares 2 x 465 - 30 = 900
    assert cost(np.array([2]), np.array([30]), np.array([465.0]))[0] == pytest.approx(
        3.5 + 7 * 2 + 1.75 * 10 + 0.03 * 900
    )
    # more image tokens than tokens: no negative text
    assert cost(np.array([5]), np.array([30]), np.array([465.0]))[0] == pytest.approx(3.5 + 7 * 5 + 0 + 0.03 * 900)
