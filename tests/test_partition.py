import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal_compile import PlanError
from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.planning.build import min_max_partition, parameters, uniform


@pytest.fixture(scope="module")
def graph(vlm):
    model, batch = vlm
    return build_blocks(capture(model, batch), model)


def brute_force(weights, s):
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), s - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(weights[b[i] : b[i + 1]]) for i in range(s)))
    return best


@given(st.lists(st.integers(0, 100), min_size=1, max_size=9), st.data())
@settings(max_examples=150, deadline=None)
def test_min_max_partition_is_optimal(weights, data):
    s = data.draw(st.integers(1, len(weights)))
    bounds, worst = min_max_partition(weights, s)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == s + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert worst == max(sum(weights[bounds[i] : bounds[i + 1]]) for i in range(s))
    assert worst == brute_force(weights, s)


@pytest.mark.parametrize("s", [1, 2, 3, 4, 5])
def test_uniform_splits_layers_evenly(graph, s):
    plan = uniform(graph, s)
    counts = [sum(1 for k in plan.block_kinds[st.start : st.stop] if k == "layer") for st in plan.stages]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 5
    assert plan.planner == "uniform"


def test_parameters_is_never_worse_than_uniform(graph):
    for s in range(1, 6):
        def worst(p):
            return max(sum(p.block_params[st.start : st.stop]) for st in p.stages)
        assert worst(parameters(graph, s)) <= worst(uniform(graph, s))


def test_too_many_stages(graph):
    with pytest.raises(PlanError, match="exceeds the .* blocks"):
        parameters(graph, graph.num_blocks + 1)
    with pytest.raises(PlanError, match="at least num_stages=6 layer blocks"):
        uniform(graph, 6)
    with pytest.raises(PlanError, match="positive integer"):
        parameters(graph, 0)


def test_stage_counts_up_to_one_block_each_and_the_largest_stage_is_noted(graph):
    plan = parameters(graph, graph.num_blocks)  # as many stages as blocks: one block each
    assert [st.stop - st.start for st in plan.stages] == [1] * graph.num_blocks
    for s in range(1, 6):
        for p in (parameters(graph, s), uniform(graph, s)):
            sums = [sum(p.block_params[st.start : st.stop]) for st in p.stages]
            assert p.notes["max_stage_params"] == max(sums)


def test_costs_must_hold_the_graphs_blocks_in_order(graph):
    from types import SimpleNamespace

    from omnibal_compile.errors import InputError
    from omnibal_compile.planning.build import check_costs

    check_costs(graph, SimpleNamespace(names=tuple(graph.names)), "costs.json")
    names = list(graph.names)
    names[1] = "other"
    with pytest.raises(InputError, match=rf"costs.json does not hold the {graph.num_blocks} blocks .*#1: model "):
        check_costs(graph, SimpleNamespace(names=tuple(names)), "costs.json")
    with pytest.raises(InputError, match=rf"it has {graph.num_blocks - 1}\)"):  # a prefix: no differences to list
        check_costs(graph, SimpleNamespace(names=tuple(graph.names[:-1])), "costs.json")


def _hand_costs(graph):
    from omnibal_compile.ir.costs import BlockCost, CostTable

    GiB = 2**30
    blocks = tuple(BlockCost(name=name, kind=b.kind, flops=1.0, num_params=b.num_params, static_bytes=GiB,
                             forward_s=1.0 + i, backward_s=2.0 + 2 * i,
                             activation_bytes={"none": 4 * GiB, "selective": 2 * GiB, "full": GiB // 4},
                             recompute_s={"none": 0.0, "selective": 0.5, "full": 1.0 + i})
                   for i, (name, b) in enumerate(zip(graph.names, graph.blocks)))
    return CostTable(blocks=blocks, cut_bytes=(0,) * (len(blocks) + 1), link_bandwidth=10 * GiB, device="test",
                     source="profiled")


def test_plan_stages_with_and_without_costs(graph):
    from omnibal_compile.errors import InputError
    from omnibal_compile.ir.costs import DataParallel
    from omnibal_compile.ir.schedule import Schedule
    from omnibal_compile.planning import problem_from_costs
    from omnibal_compile.planning.build import plan_stages
    from omnibal_compile.planning.problem import evaluate

    costs, sched, n = _hand_costs(graph), Schedule(num_microbatches=4), graph.num_blocks
    # with costs: the ILP's plan, carrying the solver's figures and notes
    plan = plan_stages(graph, num_stages=2, schedule=sched, costs=costs)
    P = problem_from_costs(costs, num_stages=2, num_microbatches=4)
    sol = evaluate(P, plan.boundaries, plan.block_recompute)
    assert plan.planner == "ilp" and plan.iteration_time_s == pytest.approx(sol.iteration_time)
    assert plan.stage_time_s == pytest.approx(sol.stage_time) and plan.stage_memory_bytes == tuple(
        map(int, sol.stage_memory)
    )
    assert plan.memory_budget_bytes == () and {"binding", "status", "solve seconds"} <= set(plan.notes)
    assert (plan.schedule, plan.num_microbatches, plan.virtual_stages, plan.data_parallel) == ("1f1b", 4, 1, 1)
    budget = 20 * 2**30
    tight = plan_stages(graph, num_stages=2, schedule=sched, costs=costs, memory_budget=budget,
                        data_parallel=DataParallel(size=2))
    assert tight.memory_budget_bytes == (budget, budget) and tight.data_parallel == 2
    assert max(tight.stage_memory_bytes) <= budget
    # a callable planner's plan is predicted by the same accounting; its notes are kept
    def halves(g, s):
        return parameters(g, s)
    mine = plan_stages(graph, num_stages=2, schedule=sched, planner=halves, costs=costs)
    ref = parameters(graph, 2)
    want = evaluate(P, ref.boundaries, ref.block_recompute)
    assert mine.boundaries == ref.boundaries and mine.iteration_time_s == pytest.approx(want.iteration_time)
    assert mine.notes["max_stage_params"] == ref.notes["max_stage_params"] and mine.notes["binding"] == want.binding
    # without costs: cut by parameters, recompute only when forced
    free = plan_stages(graph, num_stages=2, schedule=Schedule(kind="gpipe", num_microbatches=2))
    assert free.planner == "parameters" and free.recompute == () and free.schedule == "gpipe"
    assert free.num_microbatches == 2 and free.iteration_time_s is None
    forced = plan_stages(graph, num_stages=2, schedule=sched, recompute="full")
    assert forced.recompute == ("full",) * n
    with pytest.raises(InputError, match="memory_budget needs block costs"):
        plan_stages(graph, num_stages=2, schedule=sched, memory_budget=budget)
    with pytest.raises(InputError, match="returned int, not a Plan"):
        plan_stages(graph, num_stages=2, schedule=sched, planner=lambda g, s: 3)
    with pytest.raises(InputError, match="a name or a callable, got int"):
        plan_stages(graph, num_stages=2, schedule=sched, planner=3)


def test_plan_from_solution_notes_and_plan_stages_checks(graph):
    import dataclasses

    from omnibal_compile.errors import InputError
    from omnibal_compile.ir.schedule import Schedule
    from omnibal_compile.planning import problem_from_costs, solve
    from omnibal_compile.planning.build import plan_from_solution, plan_stages, plan_with_costs

    costs = _hand_costs(graph)
    plan = plan_with_costs(costs, num_stages=2, num_microbatches=4)  # defaults: ILP, 1F1B, one chunk per device
    assert (plan.planner, plan.schedule, plan.virtual_stages) == ("ilp", "1f1b", 1)
    P = problem_from_costs(costs, num_stages=2, num_microbatches=4)
    sol = dataclasses.replace(solve(P, "dp"), solve_seconds=0.12345)
    assert plan_from_solution(sol, costs, P).notes == {"binding": sol.binding, "status": sol.status,
                                                       "solve seconds": 0.123, "gap": 0.0}
    assert "gap" not in plan_from_solution(dataclasses.replace(sol, gap=None), costs, P).notes
    sched = Schedule(num_microbatches=4)
    with pytest.raises(PlanError, match="exceeds the"):
        plan_stages(graph, num_stages=graph.num_blocks + 1, schedule=sched, costs=costs)
    for with_costs in (costs, None):
        with pytest.raises(PlanError, match="at least one micro-batch per stage"):
            plan_stages(graph, num_stages=3, schedule=Schedule(num_microbatches=2), costs=with_costs)
    with pytest.raises(InputError, match="unknown planner 'magic'"):
        plan_stages(graph, num_stages=2, schedule=sched, costs=costs, planner="magic")
