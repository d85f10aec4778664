import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal_compile import PlanError
from omnibal_compile.passes.blocks import build_blocks
from omnibal_compile.passes.capture import capture
from omnibal_compile.passes.partition import min_max_partition, parameters, uniform


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
