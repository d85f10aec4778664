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
from omnibal_compile.sim import simulate, stage_costs
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
    costs = table(
        [block(i, f, b, static=16_000 * p, params=1000 * p) for i, ((f, b), p) in enumerate(zip(times, params))],
        cuts,
        bw=draw(st.sampled_from([100.0, 1000.0, math.inf])),
    )
    plan = Plan(block_names=costs.names, boundaries=[0, *inner, n], recompute=recompute, schedule=schedule,
                num_microbatches=M, virtual_stages=v, data_parallel=dp[0], data_parallel_shard=dp[1],
                reshard_after_forward=dp[2])
    return plan, costs, scales


@settings(max_examples=120, deadline=None)
@given(case=cases(), overhead=st.sampled_from([0.0, 0.05]), step=st.sampled_from([0.0, 0.3]))
def test_batch_replay_is_the_simulator(case, overhead, step):
    plan, costs, scales = case
    want = simulate(plan, costs, microbatch_costs=scales, op_overhead_s=overhead, step_overhead_s=step).iteration_time_s
    assert replay(plan, costs, microbatch_costs=scales, op_overhead_s=overhead, step_overhead_s=step) == pytest.approx(
        want, rel=REL
    )


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
    got = pipeline_times(
        **stacked,
        gather=arrays[0]["gather"],
        reduce=arrays[0]["reduce"],
        step_gather=arrays[0]["step_gather"],
        schedule=plan.schedule,
        virtual_stages=plan.virtual_stages,
    )
    want = [simulate(plan, costs, microbatch_costs=r).iteration_time_s for r in runs]
    assert got == pytest.approx(want, rel=REL)


# -- the solver's closed form as a surrogate of the simulator ------------------------------------------
@st.composite
def uniform_cases(draw, schedules=("gpipe", "1f1b")):
    """A GPipe or 1F1B plan of drawn blocks and cut points, every micro-batch alike, no data parallelism."""
    schedule = draw(st.sampled_from(schedules))
    S = draw(st.integers(1, 5))
    n = S + draw(st.integers(0, 4))
    M = draw(st.integers(1, 9))
    M = max(M, S) if schedule == "1f1b" else M
    ratio = draw(st.none() | st.floats(0.5, 3.0))  # backward a fixed multiple of forward, or drawn freely
    times = draw(st.lists(st.tuples(st.floats(0.01, 3.0), st.floats(0.01, 6.0)), min_size=n, max_size=n))
    times = [(f, f * ratio if ratio is not None else b) for f, b in times]
    cuts = draw(st.lists(st.integers(0, 3000), min_size=n - 1, max_size=n - 1))
    inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1))) if S > 1 else []
    recompute = draw(st.lists(st.sampled_from(RECOMPUTE_OPTIONS), min_size=n, max_size=n))
    costs = table([block(i, f, b) for i, (f, b) in enumerate(times)], cuts,
                  bw=draw(st.sampled_from([math.inf, 1000.0])))
    plan = Plan(block_names=costs.names, boundaries=[0, *inner, n], recompute=recompute, schedule=schedule,
                num_microbatches=M)
    return plan, costs


def closed_form(plan: Plan, costs: CostTable):
    """The solver's iteration time of ``plan`` and its stage times T_s."""
    from omnibal_compile.planning import evaluate, problem_from_costs

    problem = problem_from_costs(costs, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches,
                                 schedule=plan.schedule, virtual_stages=plan.virtual_stages, data_parallel=plan.dp)
    sol = evaluate(problem, plan.boundaries, plan.block_recompute)
    return sol.iteration_time, sol.stage_time


def two_flow_shops(plan: Plan, costs: CostTable) -> float:
    """All forwards as one flow shop, then all backwards as another: sum F + (M - 1) max F + sum B + (M - 1) max B."""
    M = plan.num_microbatches
    F = [c.forward_s for c in stage_costs(plan, costs)]
    B = [c.backward_s + c.recompute_s for c in stage_costs(plan, costs)]
    return sum(F) + (M - 1) * max(F) + sum(B) + (M - 1) * max(B)


@settings(max_examples=30, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), S=st.integers(1, 6), M=st.integers(1, 12),
       F=st.floats(0.01, 3.0), B=st.floats(0.01, 6.0), dp=st.sampled_from([(1, "ddp", True), (4, "ddp", True),
                                                                          (4, "fsdp", True), (4, "fsdp", False)]))
def test_closed_form_is_exact_on_equal_stages_without_sends(schedule, S, M, F, B, dp):
    """Exact case 1: equal stages, free sends, every micro-batch alike (data parallelism included)."""
    M = max(M, S) if schedule == "1f1b" else M
    costs = table([block(i, F, B, static=16_000) for i in range(S)], [0] * (S - 1))
    plan = Plan(block_names=costs.names, boundaries=list(range(S + 1)), schedule=schedule, num_microbatches=M,
                data_parallel=dp[0], data_parallel_shard=dp[1], reshard_after_forward=dp[2])
    assert closed_form(plan, costs)[0] == pytest.approx(simulate(plan, costs).iteration_time_s, rel=REL)


@settings(max_examples=120, deadline=None)
@given(case=uniform_cases())
def test_closed_form_is_exact_where_it_should_be_and_bounds_the_simulator_elsewhere(case):
    """Every micro-batch alike, no data parallelism, GPipe or 1F1B. With free sends:

    - GPipe runs two flow shops, so it takes sum F + (M - 1) max F + sum B + (M - 1) max B exactly:
      the closed form sum T + (M - 1) max T (T = F + B) is a lower bound, exact when one stage has both
      the largest forward and the largest backward (e.g. backward a fixed multiple of forward);
    - 1F1B never takes longer than GPipe (the same bound from above), and is exact when the last stage
      is a bottleneck; elsewhere the closed form may be a few per cent off either way;
    - either schedule: device k cannot start before micro-batch 0 has crossed the stages before it,
      nor finish before the last gradient has crossed them back, so the simulated time is at least
      sum_{s<k} T_s + M T_k: the closed form less the stages after the (last) bottleneck.
    With sends (the closed form charges each as busy time at both ends, the simulator overlaps it):
    the closed form bounds 1F1B from above.
    """
    plan, costs = case
    sim = simulate(plan, costs).iteration_time_s
    closed, T = closed_form(plan, costs)
    S, tol = plan.num_stages, REL * sim + 1e-12
    if math.isinf(costs.link_bandwidth) or S == 1:  # free sends
        k = max(s for s in range(S) if T[s] == max(T))
        assert closed - sum(T[k + 1:]) <= sim + tol
        assert sim <= two_flow_shops(plan, costs) + tol
        if plan.schedule == "gpipe":
            assert sim == pytest.approx(two_flow_shops(plan, costs), rel=REL)
            assert closed <= sim + tol
            F = [c.forward_s for c in stage_costs(plan, costs)]
            B = [t - f for t, f in zip(T, F)]
            if any(F[s] == max(F) and B[s] == max(B) for s in range(S)):
                assert closed == pytest.approx(sim, rel=REL)
        elif k == S - 1:
            assert closed == pytest.approx(sim, rel=REL)
    elif plan.schedule == "1f1b":
        assert sim <= closed + tol


# -- the layout search's estimate ----------------------------------------------------------------------
@st.composite
def layout_costs(draw):
    """A chain of 4-10 blocks of drawn times, activations, weights and cut sizes."""
    n = draw(st.integers(4, 10))
    blocks = []
    for i in range(n):
        f = draw(st.floats(0.001, 0.01))
        blocks.append(BlockCost(
            name=f"b{i}", kind="layer", flops=f * 1e12, num_params=draw(st.integers(1, 8)) * 2**20,
            static_bytes=draw(st.integers(8, 128)) * 2**20, forward_s=f, backward_s=f * draw(st.floats(1.0, 3.0)),
            activation_bytes=(a := {"none": draw(st.integers(4, 80)) * 2**20} | {}) | {"selective": a["none"] // 2,
                                                                                         "full": a["none"] // 8},
            recompute_s={"none": 0.0, "selective": f / 4, "full": f},
        ))
    cuts = tuple(draw(st.integers(0, 8)) * 2**20 for _ in range(n - 1))
    return CostTable(blocks=tuple(blocks), cut_bytes=(0, *cuts, 0), link_bandwidth=draw(st.sampled_from([5e9, 50e9])),
                     device="test", source="roofline")


def _search(costs, **kwargs):
    from omnibal_compile.planning.layout import search_layout

    try:
        return search_layout(costs, microbatch_sizes=(1, 2), prune=None, **kwargs)
    except PlanError:
        assume(False)


def test_layout_estimate_overestimates_a_1f1b_pipeline_whose_first_stage_is_the_bottleneck():
    """Blocks of 2, 2, 1, 2 units (F = B): the best 2-stage split is {0, 1} | {2, 3}, stage 0 the bottleneck
    (T = 4, 3). The estimate charges W + (M - 1) T_max = 7 + 7 * 4 = 35; 1F1B runs it in M T_0 + F_1 + B_1 = 34
    (the second stage's last forward and backward are all that follow the first stage's last op)."""
    u = 1 / 256
    blocks = tuple(
        BlockCost(
            name=f"b{i}",
            kind="layer",
            flops=1.0,
            num_params=1,
            static_bytes=1,
            forward_s=k * u / 2,
            backward_s=k * u / 2,
            activation_bytes={"none": 1, "selective": 1, "full": 1},
            recompute_s={"none": 0.0, "selective": 0.0, "full": 0.0},
        )
        for i, k in enumerate((2, 2, 1, 2))
    )
    costs = CostTable(blocks=blocks, cut_bytes=(0, 0, 0, 0, 0), link_bandwidth=1e9, device="test", source="roofline")
    found = _search(costs, devices=2, num_microbatches=8, pipeline=[2], virtual_stages=(1,))
    (c,) = [c for c in found.candidates if c.planned and c.layout.microbatch_size == 1]
    assert c.plan.boundaries == (0, 2, 4)
    assert c.estimate_s * c.layout.units_per_step == pytest.approx(35 * u)
    assert c.iteration_s == pytest.approx(34 * u) == simulate(c.plan, found.costs).iteration_time_s


@settings(max_examples=15, deadline=None)
@given(costs=layout_costs(), devices=st.sampled_from([2, 3, 4]), M=st.integers(4, 12))
def test_layout_estimate_is_within_one_trip_of_the_simulated_time(costs, devices, M):
    """What holds without a budget or data parallelism, 1F1B: every device runs M micro-batches of its stage,
    so the simulated time is at least M max(W / S, least largest part of a contiguous split), which the
    estimate W + (M - 1) max(...) exceeds by at most W - max(...) (W: one micro-batch's work)."""
    from omnibal_compile.planning.baselines import min_max_partition

    found = _search(costs, devices=devices, num_microbatches=M, pipeline=[devices], virtual_stages=(1,))
    for c in (c for c in found.candidates if c.planned):
        scale = c.layout.microbatch_size
        fastest = [scale * (b.forward_s + b.backward_s) for b in costs.blocks]
        ideal = max(sum(fastest) / devices, min_max_partition(fastest, devices)[1])
        est = c.estimate_s * c.layout.units_per_step
        assert M * ideal <= c.iteration_s * (1 + 1e-9)
        assert est - (sum(fastest) - ideal) <= c.iteration_s * (1 + 1e-9)
