"""The solver's problem and its shared accounting (solver/problem.py), by hand on tiny cases."""

from __future__ import annotations

import dataclasses

import pytest
from contracts import assert_frozen_keyword_only

from omnibal_compile import InputError, PlanError
from omnibal_compile.ir.costs import BF16_ADAM, BlockCost, CostTable, DataParallel
from omnibal_compile.planning.problem import (
    PartitionProblem,
    Solution,
    evaluate,
    in_flight,
    lower_bound,
    problem_from_costs,
    stage_io,
    stage_peak,
    stage_transient,
)
from omnibal_compile.sim.simulate import operation_order


def prob(n: int = 4, **kw) -> PartitionProblem:
    """``n`` blocks with distinct figures; keyword arguments replace any field."""
    base = dict(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n,
        time=tuple((1.0 + i, 1.5 + i, 2.0 + i) for i in range(n)),
        act=tuple((100 * (i + 1), 50 * (i + 1), 10 * (i + 1)) for i in range(n)),
        static=tuple(1000 * (i + 1) for i in range(n)),
        cut_time=(0.0,) * (n + 1), cut_bytes=(0,) + tuple(7 * (i + 1) for i in range(n - 1)) + (0,),
        num_params=(1,) * n, flops=(1.0,) * n, num_stages=2, num_microbatches=4, schedule="1f1b",
    )
    base.update(kw)
    return PartitionProblem(**base)


def test_problem_and_solution_are_frozen_keyword_only():
    P = prob()
    assert_frozen_keyword_only(P)
    sol = Solution(boundaries=(0, 2, 4), recompute=("none",) * 4, stage_time=(1.0, 1.0), stage_memory=(1.0, 1.0),
                   iteration_time=5.0, feasible=True)
    assert_frozen_keyword_only(sol)
    assert (sol.solve_seconds, sol.sync_time, sol.gap, sol.stage_peak) == (0.0, 0.0, None, ())


@pytest.mark.parametrize("field,value,error,match", [
    ("cut_bytes", (0, 7, 14, 21), InputError, "cut_time and cut_bytes"),      # one short, cut_time right
    ("cut_time", (0.0,) * 4, InputError, "cut_time and cut_bytes"),           # one short, cut_bytes right
    ("num_stages", 0, PlanError, "num_stages=0"),
    ("num_stages", 5, PlanError, "num_stages=5"),
    ("allowed", (), InputError, "allowed recompute"),
    ("allowed", ("none", "half"), InputError, "allowed recompute"),
    ("tie_tolerance", 1.0, InputError, "tie_tolerance"),
    ("tie_tolerance", -0.01, InputError, "tie_tolerance"),
])
def test_bad_problems_name_the_field(field, value, error, match):
    with pytest.raises(error, match=match):
        prob(**{field: value})


def test_edge_values_that_are_allowed():
    assert prob(num_stages=1).num_stages == 1 and prob(num_stages=4).num_stages == 4
    assert prob(tie_tolerance=0.999).tie_tolerance == 0.999 and prob(allowed=("full",)).allowed == ("full",)


def test_interleaved_stage_budget_is_its_devices_share():
    P = prob(n=4, num_stages=4, virtual_stages=2, schedule="interleaved", num_microbatches=2, budget=(8000.0, 6000.0))
    assert P.num_devices == 2
    assert [P.stage_budget(s) for s in range(4)] == [4000.0, 3000.0, 4000.0, 3000.0]
    assert prob().stage_budget(0) == float("inf")


def _in_flight_from_order(schedule: str, D: int, v: int, M: int, d: int) -> float:
    """Most forwards begun and not yet run backward on device ``d``, per chunk (the schedule's own order)."""
    live = most = 0
    for kind, _, _ in operation_order(schedule, D, v, M)[d]:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most / v


@pytest.mark.parametrize("schedule,D,v,M", [
    ("gpipe", 2, 1, 3), ("1f1b", 2, 1, 2), ("1f1b", 3, 1, 3), ("1f1b", 3, 1, 5), ("1f1b", 4, 1, 8),
    ("interleaved", 2, 2, 2), ("interleaved", 2, 2, 4), ("interleaved", 2, 3, 4), ("interleaved", 3, 2, 3),
    ("interleaved", 3, 2, 6), ("interleaved", 4, 2, 4), ("interleaved", 2, 2, 8),
])
def test_in_flight_matches_the_schedules_order(schedule, D, v, M):
    """k_s against a count over the very operation order the simulator runs (forwards minus backwards)."""
    S = D * v
    P = prob(n=S, num_stages=S, virtual_stages=v, schedule=schedule, num_microbatches=M)
    for s in range(S):
        assert in_flight(P, s) == _in_flight_from_order(schedule, D, v, M, s % D), (s, in_flight(P, s))


def test_transient_io_and_peak_by_hand():
    P = prob(n=4, gathered=(1.0, 5.0, 2.0, 0.0), workspace=(3.0, 0.0, 7.0, 1.0), cut_bytes=(0, 10, 20, 30, 99),
             peak=((400.0, 300.0, 200.0),) * 4)
    assert stage_transient(P, 1, 3) == 5 + 7 and stage_transient(P, 0, 1) == 1 + 3 and stage_transient(P, 3, 4) == 0 + 1
    k0, k1 = in_flight(P, 0), in_flight(P, 1)
    assert (k0, k1) == (2.0, 1.0)  # 1F1B, 2 stages, 4 micro-batches
    assert stage_io(P, 0, 0, 2) == 0 + k0 * 20       # the first stage receives nothing
    assert stage_io(P, 0, 1, 3) == 10 + k0 * 30      # a stage starting at block 1 receives cut 1
    assert stage_io(P, 1, 2, 4) == 20                # the last stage keeps no outputs (cut n is not sent)
    # stage 1 on blocks [2, 4) with options (none, full): keeps 300 and 40; its own peaks 400 and 200
    # running: block 2 alone peaks at 400; block 3 runs over block 2's kept 300: 300 + 200 = 500
    expected = (3000 + 4000) + 2.0 + (k1 - 1) * (300 + 40) + 500 + stage_io(P, 1, 2, 4)
    assert stage_peak(P, 1, 2, 4, (0, 2)) == expected
    # stage 0 on [0, 2) with (full, none): the larger gathered is the last block's (5); running max(200, 10 + 400)
    assert stage_peak(P, 0, 0, 2, (2, 0)) == (1000 + 2000) + 5.0 + (k0 - 1) * (10 + 200) + 410 + stage_io(P, 0, 0, 2)


def test_boundaries_must_be_contiguous_non_empty_stages():
    P = prob(n=4, num_stages=3)
    opts = ("none",) * 4
    assert evaluate(P, (0, 1, 2, 4), opts).boundaries == (0, 1, 2, 4)
    for bad in [(0, 2, 2, 4), (1, 2, 3, 4), (0, 1, 2, 3), (0, 2, 4), (0, 3, 2, 4)]:
        with pytest.raises(PlanError, match="contiguous non-empty"):
            evaluate(P, bad, opts)


def test_lower_bound_by_hand():
    assert lower_bound(prob(n=3, time=((1, 2, 3), (1, 2, 3), (10, 11, 12)))) == 10  # the largest block
    assert lower_bound(prob(n=4, time=((3, 4, 5),) * 4)) == 6                        # the work over 2 stages
    assert lower_bound(prob(n=4, time=((3, 4, 5),) * 4, allowed=("full",))) == 10    # only full allowed


def _costs(n: int = 4) -> CostTable:
    blocks = tuple(
        BlockCost(
            name=f"b{i}",
            kind="layer",
            flops=1.0,
            num_params=1000,
            static_bytes=16_000,
            forward_s=1.0,
            backward_s=2.0,
            activation_bytes={"none": 300, "selective": 200, "full": 100},
            recompute_s={"none": 0.0, "selective": 0.25, "full": 1.0},
        )
        for i in range(n)
    )
    return CostTable(blocks=blocks, cut_bytes=(0,) + (50,) * (n - 1) + (0,), link_bandwidth=1000.0, device="x",
                     source="roofline", precision=BF16_ADAM)


def test_problem_from_costs_by_hand():
    fsdp = DataParallel(size=4, shard="fsdp")
    P = problem_from_costs(_costs(), num_stages=2, num_microbatches=2, data_parallel=fsdp)
    gather = 3 / 4 * 2000 / 1000.0  # r * P * bf16 weight bytes / bandwidth
    assert P.time[0] == pytest.approx((1 + 2 + 0 + 2 * gather, 1 + 2 + 0.25 + 2 * gather, 1 + 2 + 1 + 2 * gather))
    assert P.sync == pytest.approx((3 / 4 * 2000 / 1000.0,) * 4)  # the reduce-scatter (weights kept: none)
    single = problem_from_costs(_costs(), num_stages=2, num_microbatches=2)
    assert single.sync == () and single.time[0] == (3.0, 3.25, 4.0)
    inter = problem_from_costs(_costs(), num_stages=4, num_microbatches=2, schedule="interleaved", virtual_stages=2,
                               budget=1e6)
    assert inter.budget == (1e6, 1e6)  # one per device: 4 stages / 2 chunks each
    assert problem_from_costs(_costs(), num_stages=2, num_microbatches=2, budget=0.5).budget == (0.5, 0.5)
    assert problem_from_costs(_costs(), num_stages=2, num_microbatches=2, recompute="full").allowed == ("full",)
    for budget in (0.0, -1.0):
        with pytest.raises(InputError, match="memory budgets must be positive"):
            problem_from_costs(_costs(), num_stages=2, num_microbatches=2, budget=budget)
    with pytest.raises(InputError, match="recompute must be"):
        problem_from_costs(_costs(), num_stages=2, num_microbatches=2, recompute="half")


def _shared_core_costs(processors: float | None) -> CostTable:
    """Three blocks (3, 3 and 6 s per micro-batch) and a budget under which the even cut [0, 2, 3] must
    recompute a block on stage 0 (two micro-batches in flight) while the uneven [0, 1, 3] fits as is."""
    blocks = tuple(
        BlockCost(name=f"b{i}", kind="layer", flops=f, num_params=10, static_bytes=1000, forward_s=f,
                  backward_s=2 * f, activation_bytes={"none": 100, "selective": 100, "full": 10},
                  recompute_s={"none": 0.0, "selective": f / 2, "full": f})
        for i, f in enumerate((1.0, 1.0, 2.0))
    )
    return CostTable(blocks=blocks, cut_bytes=(0, 0, 0, 0), link_bandwidth=1e12, device="x", source="roofline",
                     precision=BF16_ADAM, processors=processors)


@pytest.mark.parametrize("planner", ["dp", "ilp", "tie-break"])
def test_ranks_sharing_processors_plan_for_the_shared_work(planner):
    # Two ranks on one core: the simulator runs the stages' work one after the other, so the even cut, which
    # recomputes a block, is slower than the uneven one that recomputes nothing, although 1F1B's closed form
    # prefers it (7 + 6 + 7 = 20 s against 3 + 9 + 9 = 21 s).
    from omnibal_compile import simulate
    from omnibal_compile.planning.build import plan_with_costs

    kw = dict(num_stages=2, num_microbatches=2, memory_budget=2250, planner="ilp" if planner == "ilp" else "dp",
              tie_tolerance=0.01 if planner == "tie-break" else 0.0)
    own, shared = _shared_core_costs(None), _shared_core_costs(1)
    even, uneven = plan_with_costs(own, **kw), plan_with_costs(shared, **kw)
    assert even.boundaries == (0, 2, 3) and even.block_recompute.count("full") == 1
    assert uneven.boundaries == (0, 1, 3) and set(uneven.block_recompute) == {"none"}
    assert simulate(uneven, shared).iteration_time_s < simulate(even, shared).iteration_time_s
    assert uneven.iteration_time_s == pytest.approx(2 * 12.0)  # M sum_s T_s / P: the shared work binds
    assert simulate(uneven, shared).iteration_time_s == pytest.approx(24.0)


def test_processors_reach_the_problem_per_replica_and_bound_gpipe_and_1f1b_only():
    P = problem_from_costs(_costs(), num_stages=2, num_microbatches=2, data_parallel=DataParallel(size=2))
    assert P.processors is None and not P.shares_processors
    costs = dataclasses.replace(_costs(), processors=2)
    P = problem_from_costs(costs, num_stages=2, num_microbatches=2, data_parallel=DataParallel(size=2))
    assert P.processors == 1 and P.shares_processors  # two replicas of two stages on two cores: one each
    assert not problem_from_costs(costs, num_stages=2, num_microbatches=2).shares_processors  # one replica, two
    sol = evaluate(P, (0, 2, 4), ("none",) * 4)
    closed = sum(sol.stage_time) + max(sol.stage_time)
    assert sol.iteration_time == pytest.approx(max(closed, 2 * sum(sol.stage_time)) + sol.sync_time)
    with pytest.raises(PlanError, match="share processors"):
        problem_from_costs(costs, num_stages=4, num_microbatches=2, schedule="interleaved", virtual_stages=2,
                           data_parallel=DataParallel(size=2))
    with pytest.raises(InputError, match="processors"):
        dataclasses.replace(_costs(), processors=0)
