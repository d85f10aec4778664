"""The two-chunk interleaved search: least bottleneck and bounds against brute force."""

import dataclasses
import itertools
import math

import pytest
from contracts import assert_frozen_keyword_only

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibal_compile.solver import PartitionProblem, solve
from omnibal_compile.solver.baselines import BASELINES
from omnibal_compile.solver.interleaved import applies, two_chunk_search
from omnibal_compile.solver.problem import OPTIONS, evaluate, stage_figures

GiB = 2**30


@st.composite
def two_chunk_problems(draw):
    p = draw(st.integers(1, 3))
    S = 2 * p
    n = draw(st.integers(S, S + 3))
    M = p * draw(st.integers(1, 3))
    time, act = [], []
    for _ in range(n):
        f = draw(st.floats(0.1, 10))
        time.append((f, f * draw(st.floats(1.0, 1.2)), f * draw(st.floats(1.2, 2.0))))
        a = draw(st.integers(0, 4 * GiB))
        act.append((a, a // 2, a // 8))
    static = [draw(st.integers(0, 2 * GiB)) for _ in range(n)]
    cut_bytes = [0] + [draw(st.integers(0, GiB // 4)) for _ in range(n - 1)] + [0]
    budget = draw(st.one_of(st.none(), st.floats(4, 60)))
    return PartitionProblem(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n, time=tuple(time), act=tuple(act),
        static=tuple(static), cut_time=tuple(c / (2 * GiB) for c in cut_bytes), cut_bytes=tuple(cut_bytes),
        num_params=tuple(s // 16 for s in static), flops=tuple(t[0] for t in time), num_stages=S,
        num_microbatches=M, schedule="interleaved", virtual_stages=2,
        budget=(budget * GiB,) * p if budget is not None else (),
    )


def brute_force(P):
    """(best iteration time, least largest device time) over every cut path, each stage at its fastest
    option vector that fits (stages are independent given their cuts); None when nothing fits."""
    best_it, best_max = math.inf, math.inf
    stage_best = {}
    for cuts in itertools.combinations(range(1, P.n), P.num_stages - 1):
        b = (0, *cuts, P.n)
        times = []
        for s in range(P.num_stages):
            key = (s, b[s], b[s + 1])
            if key not in stage_best:
                fits = []
                for choice in itertools.product(range(3), repeat=b[s + 1] - b[s]):
                    t, m = stage_figures(P, s, b[s], b[s + 1], choice)
                    if m <= P.memory_limit(s):
                        fits.append(t)
                stage_best[key] = min(fits, default=math.inf)
            times.append(stage_best[key])
        if math.isinf(max(times)):
            continue
        p = P.num_devices
        dev = max(times[d] + times[p + d] for d in range(p))
        best_max = min(best_max, dev)
        best_it = min(best_it, P.num_microbatches * dev + (p - 1) / (2 * p) * sum(times))
    return (best_it, best_max) if best_it < math.inf else None


@given(two_chunk_problems())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_two_chunk_search_brackets_the_optimum_and_finds_the_least_bottleneck(P):
    assert applies(P)
    oracle = brute_force(P)
    if oracle is None:
        return
    best_it, best_max = oracle
    start = min((b for b in (f(P) for f in BASELINES.values() if P.n >= P.num_stages) if b.feasible),
                key=lambda s: s.iteration_time, default=None)
    if start is None:
        return
    found = two_chunk_search(P, start, tolerance=1e-6)
    sol = found.solution
    again = evaluate(P, sol.boundaries, sol.recompute)
    assert again.feasible and math.isclose(again.iteration_time, sol.iteration_time)
    assert sol.iteration_time >= best_it * (1 - 1e-9)  # a real plan: never better than the optimum
    assert found.lower_bound <= best_it * (1 + 1e-9)  # a real bound: never above it
    assert found.bottleneck <= best_max * (1 + 1e-5)  # the least largest device time, found
    assert found.bottleneck >= best_max * (1 - 1e-9)  # and a real one: no plan has a smaller largest device time
    assert found.solution.feasible and found.solution.iteration_time >= best_it * (1 - 1e-9)  # a real plan
    assert found.lower_bound <= found.solution.iteration_time * (1 + 1e-9)
    # and the planner as a whole is exact on these (the ILP closes what the search leaves open)
    assert math.isclose(solve(P, "ilp").iteration_time, best_it, rel_tol=1e-5)


def test_recompute_options_of_the_plan_are_real():
    P = PartitionProblem(
        names=tuple(f"b{i}" for i in range(8)), kinds=("layer",) * 8, time=((1.0, 1.1, 1.4),) * 8,
        act=((4 * GiB, 2 * GiB, GiB // 2),) * 8, static=(GiB,) * 8, cut_time=(0.0,) * 9, cut_bytes=(0,) * 9,
        num_params=(1,) * 8, flops=(1.0,) * 8, num_stages=4, num_microbatches=4, schedule="interleaved",
        virtual_stages=2, budget=(24 * GiB,) * 2,
    )
    start = min((f(P) for f in BASELINES.values()), key=lambda s: s.iteration_time)
    found = two_chunk_search(P, start)
    assert found.solution.feasible and set(found.solution.recompute) <= set(OPTIONS)
    assert found.gap <= 1e-6 or found.lower_bound < found.solution.iteration_time
    # the gap by hand: (iteration time - bound) / iteration time, never negative, 0 for a zero-time plan
    it = found.solution.iteration_time
    assert dataclasses.replace(found, lower_bound=0.75 * it).gap == pytest.approx(0.25)
    assert dataclasses.replace(found, lower_bound=1.5 * it).gap == 0.0
    assert dataclasses.replace(found, solution=dataclasses.replace(found.solution, iteration_time=0.0)).gap == 0.0
    assert_frozen_keyword_only(found)
    # memory-bound (and with gathered parameters): the least bottleneck is brute force's, the bound below it
    for Q in (P, dataclasses.replace(P, gathered=(0,) * 4 + (6 * GiB,) + (0,) * 3)):
        best_it, best_max = brute_force(Q)
        got = two_chunk_search(Q, min((f(Q) for f in BASELINES.values()), key=lambda s: s.iteration_time))
        assert got.bottleneck == pytest.approx(best_max, rel=1e-5) and got.lower_bound <= best_it * (1 + 1e-9)
        assert got.solution.feasible and got.solution.iteration_time >= best_it * (1 - 1e-9)
    # the first stage receives nothing: bytes given for the model's input link change no plan
    sent = dataclasses.replace(P, cut_bytes=(100 * GiB,) + P.cut_bytes[1:])
    again = two_chunk_search(sent, start)
    assert again.solution.iteration_time == pytest.approx(it) and again.bottleneck == pytest.approx(found.bottleneck)
