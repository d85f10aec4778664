"""The planner registry and ``solver.solve`` (solver/__init__.py): which planner runs, with what, and what it
returns."""

from __future__ import annotations

import dataclasses

import pytest
from contracts import assert_frozen_keyword_only

import omnibal_compile.planning as solver_module
from omnibal_compile import PlanError
from omnibal_compile.planning import PLANNERS, break_ties, solve, solve_dp
from omnibal_compile.planning import interleaved as two_chunks
from omnibal_compile.planning.baselines import BASELINES, min_max_partition, uniform_boundaries
from omnibal_compile.planning.dp import interleaved_incumbent
from omnibal_compile.planning.problem import PartitionProblem


def prob(n: int = 6, **kw) -> PartitionProblem:
    """Uneven blocks (the uniform split is not the fastest); keyword arguments replace any field."""
    fwd = [5.0, 4.0, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0][:n]
    base = dict(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n,
        time=tuple((f, 1.2 * f, 1.5 * f) for f in fwd),
        act=tuple((1000, 500, 100) for _ in range(n)), static=tuple(100 * (i + 1) for i in range(n)),
        cut_time=(0.0,) * (n + 1), cut_bytes=(0,) * (n + 1), num_params=tuple(10 * (i + 1) for i in range(n)),
        flops=tuple(fwd), num_stages=2, num_microbatches=4, schedule="1f1b",
    )
    base.update(kw)
    return PartitionProblem(**base)


def test_registry_entries():
    assert_frozen_keyword_only(PLANNERS["ilp"])
    assert {name for name, p in PLANNERS.items() if not p.needs_costs} == {"uniform", "parameters"}
    kinds, params = ("layer", "module", "layer", "layer", "layer"), [5, 1, 1, 1, 9]
    assert list(PLANNERS["parameters"].cut_points(kinds, params, 2)) == min_max_partition(params, 2)[0]
    assert list(PLANNERS["uniform"].cut_points(kinds, params, 2)) == uniform_boundaries(kinds, 2)


def test_baselines_are_returned_as_they_plan_even_with_a_tie_tolerance():
    P = prob(tie_tolerance=0.5)
    for name in ("uniform", "parameters", "flops"):
        assert solve(P, name).boundaries == BASELINES[name](P).boundaries, name
    assert solve(P, "uniform").boundaries != solve_dp(P).boundaries  # the case is not trivial


def test_exact_planners_go_through_the_tie_break():
    P = prob(tie_tolerance=0.5)
    for name in ("dp", "ilp"):
        sol = solve(P, name)
        assert sol.extra["tie_break"]["tolerance"] == 0.5 and sol.boundaries == break_ties(P, solve_dp(P)).boundaries
    assert "tie_break" not in solve_dp(P).extra and "tie_break" not in solve(P, "uniform").extra


def test_a_baseline_over_budget_is_refused_and_points_to_the_ilp():
    # no recomputation allowed: the uniform split (0, 3, 6) needs 6600 bytes on stage 0 (600 static + 2 x 3000
    # in flight); (0, 2, 6) needs at most 5800 (stage 1: 1800 static + 1 x 4000), so 6000 fits only the latter
    P = prob(allowed=("none",), budget=(6000.0, 6000.0))
    assert max(BASELINES["uniform"](P).stage_memory) == 6600
    with pytest.raises(PlanError, match=r"the uniform split does not fit the memory budget on stages \[0\]"):
        solve(P, "uniform")
    assert solve(P, "dp").feasible and solve(P, "ilp").feasible


def interleaved(**kw) -> PartitionProblem:
    return prob(n=8, num_stages=4, virtual_stages=2, schedule="interleaved", num_microbatches=4, **kw)


@pytest.fixture
def spies(monkeypatch):
    """Record the calls ``_ilp`` makes to the two-chunk search and the ILP (both still run for real)."""
    calls: dict[str, list] = {"search": [], "ilp": []}
    search, ilp = two_chunks.two_chunk_search, solver_module.solve_ilp

    def spy_search(problem, incumbent, *, tolerance, time_limit):
        found = search(problem, incumbent, tolerance=tolerance, time_limit=time_limit)
        calls["search"].append(dict(incumbent=incumbent, tolerance=tolerance, time_limit=time_limit, found=found))
        return calls.get("widen", lambda f: f)(found)

    def spy_ilp(problem, **kw):
        calls["ilp"].append(kw)
        return ilp(problem, **kw)

    monkeypatch.setattr(two_chunks, "two_chunk_search", spy_search)
    monkeypatch.setattr(solver_module, "solve_ilp", spy_ilp)
    return calls


def test_two_chunk_search_answers_alone_when_its_gap_is_small(spies):
    P = interleaved()
    sol = solve(P, "ilp", gap=0.01)
    (call,) = spies["search"]
    assert spies["ilp"] == [] and call["tolerance"] == pytest.approx(0.005)  # half the gap asked for
    # its incumbent: the fastest feasible of the baselines and the DP's interleaved incumbent
    candidates = [b(P) for b in BASELINES.values()] + [interleaved_incumbent(P)]
    assert call["incumbent"].iteration_time == min(c.iteration_time for c in candidates if c.feasible)
    assert sol.planner == "ilp" and sol.extra["solver"] == "two-chunk search"
    assert sol.gap == call["found"].gap <= 0.01 and sol.extra["lower_bound"] == call["found"].lower_bound
    assert sol.status.lower().startswith("optimal") and sol.solve_seconds > 0


def test_a_wide_search_gap_hands_over_to_the_ilp_with_what_it_proved(spies):
    P = interleaved()
    spies["widen"] = lambda found: dataclasses.replace(found, lower_bound=0.5 * found.lower_bound)
    solve(P, "ilp", gap=1e-6, time_limit=30.0)
    (call,), (ilp,) = spies["search"], spies["ilp"]
    assert call["tolerance"] == 1e-4  # never finer than 1e-4
    found = call["found"]
    assert ilp["upper_bound"] == found.solution.iteration_time and ilp["warm"] is found.solution
    assert ilp["proven_bound"] == pytest.approx(0.5 * found.lower_bound)
    assert 1.0 <= ilp["time_limit"] < 30.0  # what is left of the limit, at least a second
    spies["ilp"].clear()
    solve(P, "ilp", gap=1e-6, time_limit=None)
    assert spies["ilp"][0]["time_limit"] is None


def test_without_two_chunks_the_ilp_starts_from_the_dp(spies):
    P = prob()
    solve(P, "ilp")
    assert spies["search"] == [] and spies["ilp"][0]["upper_bound"] == solve_dp(P).iteration_time
    P3 = prob(n=8, num_stages=6, virtual_stages=3, schedule="interleaved", num_microbatches=4)  # three chunks
    solve(P3, "ilp")
    assert spies["search"] == [] and spies["ilp"][-1]["upper_bound"] is not None


def dp_beats_baselines() -> PartitionProblem:
    """Interleaved, two chunks, where the DP's incumbent (94.25) beats every baseline (at best 102.25)."""
    fwd = (4.0, 9.0, 3.0, 6.0, 8.0, 2.0, 1.0, 8.0)
    return prob(n=8, num_stages=4, virtual_stages=2, schedule="interleaved", num_microbatches=4,
                time=tuple((f, 1.2 * f, 1.5 * f) for f in fwd), flops=(5.0, 9.0, 4.0, 4.0, 8.0, 9.0, 9.0, 8.0))


def test_the_search_starts_from_the_dp_incumbent_when_it_is_best(spies):
    P = dp_beats_baselines()
    assert interleaved_incumbent(P).iteration_time == 94.25
    assert min(b(P).iteration_time for b in BASELINES.values()) == 102.25
    solve(P, "ilp", gap=0.01)
    assert spies["search"][0]["incumbent"].iteration_time == 94.25


def test_the_search_starts_from_the_best_baseline_without_a_dp_incumbent(spies, monkeypatch):
    def none(problem):
        raise PlanError("no incumbent")

    monkeypatch.setattr(solver_module, "interleaved_incumbent", none)
    P = dp_beats_baselines()
    solve(P, "ilp", gap=0.01)
    assert spies["search"][0]["incumbent"].iteration_time == 102.25


def test_a_search_gap_equal_to_the_one_asked_for_is_enough(spies):
    P = interleaved()
    found = two_chunks.two_chunk_search(P, interleaved_incumbent(P), tolerance=1e-4, time_limit=None)
    spies["search"].clear()
    solve(P, "ilp", gap=found.gap)  # tolerance max(gap / 2, 1e-4) = 1e-4: the same search again
    assert spies["search"][0]["found"].gap == found.gap and spies["ilp"] == []


def test_the_ilp_gets_the_time_the_search_left(spies):
    import time

    P = interleaved()
    spies["widen"] = lambda found: dataclasses.replace(found, lower_bound=0.5 * found.lower_bound)
    start = time.perf_counter()
    sol = solve(P, "ilp", gap=1e-6, time_limit=30.0)
    wall = time.perf_counter() - start
    assert 30.0 - wall <= spies["ilp"][0]["time_limit"] <= 30.0 and sol.solve_seconds <= wall
    spies["ilp"].clear()
    solve(P, "ilp", gap=1e-6, time_limit=0.5)
    assert spies["ilp"][0]["time_limit"] == 1.0  # never under a second


def test_planner_help_lists_every_planner():
    from omnibal_compile.planning import planner_help

    text = planner_help("ilp")
    assert text.endswith(" (default ilp)") and text.count("; ") == len(PLANNERS) - 1
    assert "uniform: equal numbers of layer blocks per stage (Megatron, torchtitan) (no costs needed)" in text
