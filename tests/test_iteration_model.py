"""One iteration-time model: the simulator, its batch form, the solver's closed form and the layout estimate.

- the batch form (:func:`omnibal_compile.sim.replay.pipeline_times`) equals ``simulate()`` on the
  same inputs, over drawn plans of every schedule, per-micro-batch costs, sends and data parallelism;
- the solver's closed form (:func:`omnibal_compile.planning.evaluate`) is a surrogate of the
  simulator: equal to it where it is exact, on the right side of it where it bounds it;
- the layout search's estimate never exceeds the simulated time of the plan the search makes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.sim import simulate
from omnibal_compile.sim.replay import pipeline_times, plan_arrays, replay

REL = 1e-9


def block(i: int, f: float, b: float, *, act: int = 1000, static: int = 16_000, params: int = 1000) -> BlockCost:
    return BlockCost(
        name=f"b{i}", kind="layer", flops=0.0, num_params=params, static_bytes=static, forward_s=f, backward_s=b,
        activation_bytes={"none": act, "selective": act // 2, "full": act // 10},
        recompute_s={"none": 0.0, "selective": f / 4, "full": f},
    )


def table(blocks: list[BlockCost], cuts: list[int], bw: float = 1000.0) -> CostTable:
    return CostTable(blocks=blocks, cut_bytes=[0, *cuts, 0], link_bandwidth=bw, device="test", source="profiled")


@st.composite
def cases(draw, schedules=("gpipe", "1f1b", "interleaved")):
    """A plan and its costs: stages, cut points, recompute options, sends, data parallelism, micro-batch scales."""
    schedule = draw(st.sampled_from(schedules))
    v = draw(st.integers(2, 3)) if schedule == "interleaved" else 1
    D = draw(st.integers(1, 4))
    S = D * v
    n = S + draw(st.integers(0, 4))
    M = draw(st.integers(1, 9))
    if schedule == "1f1b":
        M = max(M, S)
    try:
        Schedule.for_stages(S, kind=schedule, num_microbatches=M, virtual_stages=v)
    except PlanError:
        assume(False)
    times = draw(st.lists(st.tuples(st.floats(0.01, 3.0), st.floats(0.01, 6.0)), min_size=n, max_size=n))
    params = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    cuts = draw(st.lists(st.integers(0, 3000), min_size=n - 1, max_size=n - 1))
    inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1))) if S > 1 else []
    recompute = draw(st.lists(st.sampled_from(RECOMPUTE_OPTIONS), min_size=n, max_size=n))
    dp = draw(st.sampled_from([(1, "ddp", True), (2, "ddp", True), (4, "fsdp", True), (2, "fsdp", False)]))
    scales = draw(st.none() | st.lists(st.floats(0.2, 3.0), min_size=M, max_size=M))
    costs = table([block(i, f, b, static=16_000 * p, params=1000 * p) for i, ((f, b), p) in enumerate(zip(times, params))],
                  cuts, bw=draw(st.sampled_from([100.0, 1000.0, math.inf])))
    plan = Plan(block_names=costs.names, boundaries=[0, *inner, n], recompute=recompute, schedule=schedule,
                num_microbatches=M, virtual_stages=v, data_parallel=dp[0], data_parallel_shard=dp[1],
                reshard_after_forward=dp[2])
    return plan, costs, scales


@settings(max_examples=120, deadline=None)
@given(case=cases(), overhead=st.sampled_from([0.0, 0.05]), step=st.sampled_from([0.0, 0.3]))
def test_batch_replay_is_the_simulator(case, overhead, step):
    plan, costs, scales = case
    want = simulate(plan, costs, microbatch_costs=scales, op_overhead_s=overhead, step_overhead_s=step).iteration_time_s
    assert replay(plan, costs, microbatch_costs=scales, op_overhead_s=overhead, step_overhead_s=step) == pytest.approx(want, rel=REL)


@settings(max_examples=30, deadline=None)
@given(case=cases(), bw=st.sampled_from([50.0, 5000.0]))
def test_batch_replay_scales_links_as_the_simulator(case, bw):
    plan, costs, scales = case
    if math.isinf(costs.link_bandwidth):  # a free link's times are 0: they cannot be rescaled, both say so
        for model in (simulate, replay):
            with pytest.raises(InputError, match="infinite bandwidth"):
                model(plan, costs, microbatch_costs=scales, link_bandwidth=bw)
        return
    want = simulate(plan, costs, microbatch_costs=scales, link_bandwidth=bw).iteration_time_s
    assert replay(plan, costs, microbatch_costs=scales, link_bandwidth=bw) == pytest.approx(want, rel=REL)


@settings(max_examples=20, deadline=None)
@given(case=cases(), more=st.lists(st.lists(st.floats(0.2, 3.0), min_size=9, max_size=9), min_size=1, max_size=4))
def test_many_pipelines_at_once_are_each_their_own_simulation(case, more):
    """The batch dimension: N pipelines of one plan with their own micro-batch costs, each its own ``simulate``."""
    plan, costs, _ = case
    M = plan.num_microbatches
    runs = [[*row[:M]] for row in more]
    arrays = [plan_arrays(plan, costs, microbatch_costs=r) for r in runs]
    stacked = {k: np.concatenate([a[k] for a in arrays]) for k in ("forward", "backward", "send")}
    got = pipeline_times(**stacked, gather=arrays[0]["gather"], reduce=arrays[0]["reduce"],
                         step_gather=arrays[0]["step_gather"], schedule=plan.schedule, virtual_stages=plan.virtual_stages)
    want = [simulate(plan, costs, microbatch_costs=r).iteration_time_s for r in runs]
    assert got == pytest.approx(want, rel=REL)
