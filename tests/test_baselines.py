"""The baseline planners (solver/baselines.py): their recomputation rule and OmniBal's anchor-and-search, by hand."""

from __future__ import annotations

from omnibal_compile.planning.baselines import least_recompute, omnibal
from omnibal_compile.planning.problem import PartitionProblem


def prob(none, selective=None, **kw) -> PartitionProblem:
    """Blocks with forward+backward times ``none`` (``selective`` per block, full = 2 x none); kwargs replace fields."""
    n = len(none)
    selective = selective or [1.25 * t for t in none]
    base = dict(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n,
        time=tuple((t, s, 2 * t) for t, s in zip(none, selective)),
        act=((400, 200, 100),) * n, static=(1000,) * n, cut_time=(0.0,) * (n + 1), cut_bytes=(0,) * (n + 1),
        num_params=(1,) * n, flops=(1.0,) * n, num_stages=2, num_microbatches=2, schedule="1f1b",
    )
    base.update(kw)
    return PartitionProblem(**base)


def test_least_recompute_per_stage_and_for_the_whole_model():
    # 4 blocks on (0, 2, 4), 1F1B, 2 micro-batches: stage 0 holds 2 in flight, stage 1 one.
    # none: stage 0 = 2000 + 2 x 800 + 2 x 50 (its outputs) = 3700, stage 1 = 2000 + 800 + 50 (received) = 2850
    # selective: stage 0 = 2000 + 2 x 400 + 100 = 2900
    P = prob([1.0] * 4, cut_bytes=(0, 0, 50, 0, 0), budget=(3000.0, 3000.0))
    assert least_recompute(P, (0, 2, 4), per_stage=True) == ["selective"] * 2 + ["none"] * 2
    assert least_recompute(P, (0, 2, 4), per_stage=False) == ["selective"] * 4
    # nothing fits: the most saving option allowed
    tight = prob([1.0] * 4, budget=(10.0, 10.0), allowed=("none", "selective"))
    assert least_recompute(tight, (0, 2, 4), per_stage=True) == ["selective"] * 4


def test_omnibal_anchor_by_hand():
    """max_candidates=1 leaves the search radius 0: the plan is the greedy anchor itself."""
    # target = 4 / 2 = 2; block 1 reaches 1 + 2 / 2 = 2, not over the target; block 2: 3 + 0.5 > 2 cuts there
    assert omnibal(prob([1.0, 2.0, 1.0]), max_candidates=1).boundaries == (0, 2, 3)
    assert omnibal(prob([1.0, 2.0, 1.0]), max_candidates=0).boundaries == (0, 2, 3)
    # S = 3: a stage closes where its load passes the average (5); the last blocks each get a stage when needed
    assert omnibal(prob([3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0], num_stages=3, num_microbatches=3),
                   max_candidates=1).boundaries == (0, 2, 4, 7)
    assert omnibal(prob([9.0, 1.0, 1.0], num_stages=3, num_microbatches=3), max_candidates=1).boundaries == (0, 1, 2, 3)


def test_omnibal_balances_the_no_recompute_times():
    """The anchor and the spread read each block's time without recomputation, not the selective one."""
    P = prob([1.0] * 4, selective=[5.0, 1.0, 1.0, 1.0])
    assert omnibal(P).boundaries == (0, 2, 4)


def test_omnibal_searches_around_the_anchor():
    # anchor (0, 1, 5) for times 6, 1, 1, 1, 1 (target 5): spread 5; the search finds (0, 1, 5) at best too,
    # while times 2, 2, 2, 2, 2, 2 with S = 2 anchor at 3 (spread 0)
    assert omnibal(prob([2.0] * 6)).boundaries == (0, 3, 6)
    P = prob(
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    )  # target 6: the greedy cuts at 6 (5 + 0.5 ... ) and the search moves it
    anchor = omnibal(P, max_candidates=1).boundaries
    best = omnibal(P).boundaries
    spread = lambda b: abs(sum(P.time[i][0] for i in range(b[0], b[1])) - sum(P.time[i][0] for i in range(b[1], b[2])))  # noqa: E731
    assert spread(best) <= spread(anchor) and spread(best) == min(
        spread((0, c, 8)) for c in range(max(1, anchor[1] - 2), min(8, anchor[1] + 3))
    )


def test_baselines_pick_recomputation_for_the_whole_model_and_omnibal_per_stage():
    """Uniform, parameters and flops choose one option for every block (the least that fits every stage);
    OmniBal chooses per stage. Stage 0 of (0, 2, 4) needs selective (see the test above), stage 1 fits none."""
    from omnibal_compile.planning.baselines import flops, parameters, uniform

    P = prob([1.0] * 4, cut_bytes=(0, 0, 50, 0, 0), budget=(3000.0, 3000.0))
    for planner in (uniform, parameters, flops):
        sol = planner(P)
        assert sol.boundaries == (0, 2, 4) and sol.recompute == ("selective",) * 4, planner.__name__
        assert 0 <= sol.solve_seconds < 60
    assert omnibal(P).boundaries == (0, 2, 4) and omnibal(P).recompute == ("selective",) * 2 + ("none",) * 2
    one = prob([1.0] * 4, num_stages=1, num_microbatches=1, budget=(5000.0,))
    # one stage: 4000 static + 1 x 1600 kept without recomputation, 4000 + 800 with selective
    assert omnibal(one).boundaries == (0, 4) and omnibal(one).recompute == ("selective",) * 4


def test_nothing_fits_falls_back_to_the_most_saving_option_for_the_whole_model_too():
    tight = prob([1.0] * 4, budget=(10.0, 10.0), allowed=("none", "selective"))
    assert least_recompute(tight, (0, 2, 4), per_stage=False) == ["selective"] * 4


def test_split_helpers_refuse_impossible_stage_counts():
    import pytest

    from omnibal_compile import PlanError
    from omnibal_compile.planning.baselines import min_max_partition, uniform_boundaries

    for bad in (0, 4):
        with pytest.raises(PlanError):
            min_max_partition([1.0, 2.0, 3.0], bad)
        with pytest.raises(PlanError):
            uniform_boundaries(("layer",) * 3, bad)
    assert min_max_partition([1.0, 2.0, 3.0], 1)[0] == [0, 3] and list(uniform_boundaries(("layer",) * 3, 3)) == [
        0,
        1,
        2,
        3,
    ]


def test_omnibal_ties_keep_the_first_candidate():
    """Times 1, 1, 2, 1, 1: cuts 2 and 3 both leave stages of 2 and 4 (spread 2, largest 4); the search keeps
    the first candidate in its order (offsets -2 .. 2 around the anchor at 3), cut 2."""
    assert omnibal(prob([1.0, 1.0, 2.0, 1.0, 1.0])).boundaries == (0, 2, 5)
