"""The ILP's own parts, checked without the DP's bound or warm start in front of them.

``solve(P, "ilp")`` starts the ILP from the DP's plan and bounds it by the DP's optimum, which hides
most mistakes in the model; here the ILP runs cold against brute force, and its helpers (stage
windows, interval floors, the exact repair, the read-back, the tie-break, the warm start) are
checked against hand-worked values.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from test_solver import brute_force, close, memory_bound, problems

from omnibal_compile import PlanError
from omnibal_compile.planning import PartitionProblem, solve_dp
from omnibal_compile.planning.dp import Frontiers
from omnibal_compile.planning.ilp import (
    _fastest_fitting,
    _interval_floors,
    _joint_model,
    _paths_model,
    _read,
    _stage_windows,
    _status_note,
    make_solver,
    solve_ilp,
)
from omnibal_compile.planning.problem import evaluate, stage_figures


def problem(time, act=None, *, S=2, M=1, schedule="gpipe", budget=(), static=None, cut_bytes=None, cut_time=None,
            v=1):
    """A small problem: times and activations per block and option (none, selective, full)."""
    n = len(time)
    cut_bytes = cut_bytes or (0,) * (n + 1)
    return PartitionProblem(
        names=tuple(f"b{i}" for i in range(n)),
        kinds=("layer",) * n,
        time=tuple(map(tuple, time)),
        act=tuple(map(tuple, act or [(0, 0, 0)] * n)),
        static=tuple(static or (0,) * n),
        cut_time=tuple(cut_time or (0.0,) * (n + 1)),
        cut_bytes=tuple(cut_bytes),
        num_params=(0,) * n,
        flops=(1e12,) * n,
        num_stages=S,
        num_microbatches=M,
        schedule=schedule,
        virtual_stages=v,
        budget=tuple(budget) if not isinstance(budget, (int, float)) else (float(budget),) * (S // v),
    )


@pytest.mark.xfail(strict=True, reason="known bug: on this GPipe problem CBC reports objective 5 for the plan it "
                   "returns, whose iteration time (and HiGHS's objective) is 4; found by the property test below")
def test_cbc_objective_is_the_plans_iteration_time_on_a_memory_bound_gpipe_case():
    P = PartitionProblem(
        names=("b0", "b1", "b2"), kinds=("layer",) * 3, time=((1.0, 1.5, 2.0), (1.0, 1.0, 2.0), (1.0, 1.0, 1.0)),
        act=((30, 29, 2), (25, 25, 0), (0, 0, 0)), static=(49966, 0, 0),
        cut_time=(0.0, 5.401670932769775e-10, 3.725290298461914e-11, 0.0), cut_bytes=(0, 29, 2, 0),
        num_params=(3122, 0, 0), flops=(1e12,) * 3, num_stages=2, num_microbatches=1, schedule="gpipe",
        virtual_stages=1, budget=(49996.5, 49996.5), allowed=("none", "selective", "full"),
    )
    ilp = solve_ilp(P, time_limit=30, gap=1e-9, solver="cbc")
    assert close(ilp.iteration_time, brute_force(P).iteration_time)  # the plan itself is optimal
    assert close(ilp.extra["objective"], ilp.iteration_time)


@pytest.mark.parametrize("solver", ["auto", "cbc"])
@given(P=problems(max_n=5).filter(memory_bound))
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_cold_ilp_matches_brute_force_when_memory_decides(solver, P):
    """Memory-bound, multi-stage problems: the ILP alone (no bound, no warm start) finds the optimum."""
    oracle = brute_force(P)
    ilp = solve_ilp(P, time_limit=30, gap=1e-9, solver=solver)
    assert ilp.feasible and close(ilp.iteration_time, oracle.iteration_time), (ilp, oracle)
    assert close(ilp.extra["objective"], ilp.iteration_time)


@given(problems(max_n=5, schedules=("interleaved",), virtual=(1, 2)).filter(lambda P: brute_force(P) is not None))
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_cold_interleaved_ilp_matches_brute_force(P):
    oracle = brute_force(P)
    ilp = solve_ilp(P, time_limit=30, gap=1e-9)
    assert ilp.feasible and close(ilp.iteration_time, oracle.iteration_time), (ilp, oracle)
    assert close(ilp.extra["objective"], ilp.iteration_time)


def test_stage_windows_by_hand():
    """Four unit blocks on two stages: without a bound block 0 is on stage 0, block 3 on stage 1 and
    the rest anywhere; a bound of 2 per stage (met exactly by the even split) fixes the cut at 2."""
    P = problem([(1, 1, 1)] * 4)
    assert _stage_windows(P, None) == ([0, 0, 0, 1], [0, 1, 1, 1])
    assert _stage_windows(P, 2.0) == ([0, 0, 1, 1], [0, 0, 1, 1])
    assert _stage_windows(P, 2.5) == ([0, 0, 1, 1], [0, 0, 1, 1])
    assert _stage_windows(P, 3.0) == ([0, 0, 0, 1], [0, 1, 1, 1])
    three = problem([(1, 1, 1)] * 5, S=3)
    assert _stage_windows(three, None) == ([0, 0, 0, 1, 2], [0, 1, 2, 2, 2])
    # prefix 1, 2, 3, 4, 5 over tau 2 -> lo 0, 0, 1, 1, 2; suffix 5, 4, 3, 2, 1 -> hi 0, 1, 1, 2, 2
    assert _stage_windows(three, 2.0) == ([0, 0, 1, 1, 2], [0, 1, 1, 2, 2])
    with pytest.raises(PlanError, match="leaves block 0 no stage"):
        _stage_windows(P, 1.5)  # 4 units of work cannot fit 2 stages of 1.5: block 0's window is empty


def _oracle_floor(P, s, i, j):
    """Least time of stage s on [i, j) over every option vector that fits, by enumeration."""
    best = None
    for vec in itertools.product(P.option_indices(), repeat=j - i):
        t, mem = stage_figures(P, s, i, j, vec)
        if mem <= P.memory_limit(s) and (best is None or t < best):
            best = t
    return best


def test_interval_floors_are_each_stages_least_fitting_time():
    """Three blocks on two stages with budgets 10 and 5 bytes and a 4-byte send at cut 2."""
    P = problem([(1, 2, 3), (1, 1.5, 3), (2, 2.5, 4)], [(4, 4, 0), (6, 6, 6), (6, 5, 0)], budget=(10, 5),
                cut_bytes=(0, 0, 4, 0))
    lo, hi = _stage_windows(P, None)
    floor, _ = _interval_floors(P, lo, hi, None)
    # [1, 3) on stage 1 holds block 1's 6 bytes whatever its option: over 5, left out
    assert set(floor) == {(0, 1, 0), (0, 2, 0), (2, 3, 1)}
    for (i, j, s), value in floor.items():
        assert value == pytest.approx(_oracle_floor(P, s, i, j), rel=1e-8)
    # by hand: [0, 1) with no recomputation, 1; [0, 2) holds 4 sent bytes + 6 of block 1, so block 0
    # is recomputed in full, 3 + 1; [2, 3) receives 4 bytes, so block 2 is recomputed in full, 4
    assert floor[0, 1, 0] == pytest.approx(1) and floor[0, 2, 0] == pytest.approx(4)
    assert floor[2, 3, 1] == pytest.approx(4)
    # a bound below an interval's floor drops it; a floor equal to the bound stays
    assert set(_interval_floors(P, lo, hi, 3.9)[0]) == {(0, 1, 0)}
    assert set(_interval_floors(P, lo, hi, 4.0)[0]) == {(0, 1, 0), (0, 2, 0), (2, 3, 1)}
    with pytest.raises(PlanError, match="no stage range fits"):
        _interval_floors(problem([(1, 1, 1)] * 2, [(9, 9, 9)] * 2, budget=1), [0, 1], [0, 1], None)


def test_interval_floors_leave_out_intervals_outside_the_windows():
    """Five blocks on three stages: every kept interval starts and ends where the windows allow."""
    P = problem([(1, 1.5, 2)] * 5, [(1, 0, 0)] * 5, S=3, budget=100)
    lo, hi = _stage_windows(P, 2.0)
    floor, _ = _interval_floors(P, lo, hi, 2.0)
    # windows lo 0, 0, 1, 1, 2 and hi 0, 1, 1, 2, 2 (test_stage_windows_by_hand); at most 2 blocks of 1 s
    # in 2 s; stage 1 cannot end at 2 (block 2 is on stage 1 only) and cannot start at 3 (block 2 would
    # have to end stage 0)
    expected = {(0, 1, 0), (0, 2, 0), (1, 3, 1), (2, 3, 1), (2, 4, 1), (3, 5, 2), (4, 5, 2)}
    assert set(floor) == expected


def test_fastest_fitting_repairs_slow_or_over_budget_stages_and_keeps_ties():
    """Budget 10. Stage 0 on [0, 2) fits with no recomputation (4 + 6 bytes); stage 1 on [2, 4) holds
    11 bytes with none, so block 2 or block 3 is recomputed: 2.5 + 1 = 2 + 1.5, a tie."""
    P = problem([(1, 2, 3), (1, 1.5, 3), (2, 2.5, 4), (1, 1.5, 2)], [(4, 4, 0), (6, 0, 0), (6, 0, 0), (5, 0, 0)],
                budget=10)
    fr = Frontiers(P)
    # stage 0 slower than it needs, stage 1 over the budget although fastest: both replaced
    out = _fastest_fitting(P, fr, (0, 2, 4), ["full", "selective", "none", "none"])
    assert out[:2] == ["none", "none"] and out[2:] in (["selective", "none"], ["none", "selective"])
    # either of the tied fits is kept as the solver chose it
    assert _fastest_fitting(P, fr, (0, 2, 4), ["none", "none", "none", "selective"]) == [
        "none",
        "none",
        "none",
        "selective",
    ]
    assert _fastest_fitting(P, fr, (0, 2, 4), ["none", "none", "selective", "none"]) == [
        "none",
        "none",
        "selective",
        "none",
    ]
    # a slower fit on stage 1 (block 3 in full: 2 + 2) is replaced by a tied fastest one
    assert _fastest_fitting(P, fr, (0, 2, 4), ["none", "none", "none", "full"])[2:] in (
        ["selective", "none"],
        ["none", "selective"],
    )


def test_fastest_fitting_replaces_a_stage_over_its_budget_and_keeps_one_exactly_at_it():
    P = problem([(1, 1.5, 2), (1, 1.5, 2)], [(10, 0, 0), (10, 0, 0)], S=1, budget=(10,))
    assert _fastest_fitting(P, Frontiers(P), (0, 2), ["none", "none"]) in (["none", "selective"], ["selective", "none"])
    at = problem([(1, 1.5, 2), (1, 1.5, 2)], [(5, 0, 0), (5, 0, 0)], S=1, budget=(10,))
    assert _fastest_fitting(at, Frontiers(at), (0, 2), ["none", "none"]) == ["none", "none"]


class _Var:
    def __init__(self, value):
        self._value = value

    def value(self):
        return self._value


def test_read_back_of_stage_assignments():
    w = {(0, 0, 0): _Var(1.0), (0, 1, 0): _Var(0.0), (1, 0, 2): _Var(0.0), (1, 1, 2): _Var(0.9999), (2, 1, 1): _Var(1)}
    assert _read(w, 3, 2, (0, 1, 2)) == ([0, 1, 3], ["none", "full", "selective"])
    with pytest.raises(PlanError, match="not 3 contiguous"):
        _read(w, 3, 3, (0, 1, 2))  # two stages found where three were asked
    back = {(0, 1, 0): _Var(1), (1, 0, 0): _Var(1)}
    with pytest.raises(PlanError, match="not 2 contiguous"):
        _read(back, 2, 2, (0,))  # stage 1 then stage 0: the right count of boundaries, not in order


def test_status_note():
    assert _status_note("Optimal", None) == "Optimal"
    assert _status_note("Optimal", 1e-6) == "Optimal"
    assert _status_note("Optimal", 2e-6) == "Optimal, gap 0.00%"
    assert _status_note("Feasible", 0.0512) == "Feasible, gap 5.12%"
    assert _status_note("Feasible", math.inf) == "Feasible, no lower bound yet"


def test_make_solver_names_and_missing_highspy(monkeypatch):
    import sys

    import pulp

    cbc = make_solver("cbc", gap=1e-3, time_limit=7.0)
    assert isinstance(cbc, pulp.PULP_CBC_CMD)
    # the relative gap is the only stopping rule (an absolute one would stop before the tie-break)
    assert (cbc.optionsDict["gapRel"], cbc.optionsDict["gapAbs"], cbc.timeLimit) == (1e-3, 0.0, 7.0)
    highs = make_solver("auto", gap=1e-3, time_limit=7.0)
    assert (highs.gapRel, highs.gapAbs, highs.timeLimit) == (1e-3, 0.0, 7.0)
    with pytest.raises(PlanError, match="'auto', 'highs' or 'cbc'"):
        make_solver("gurobi")
    assert make_solver().gapRel == 1e-4 and make_solver().timeLimit is None  # the documented defaults
    monkeypatch.setitem(sys.modules, "highspy", None)  # import fails as if not installed
    assert isinstance(make_solver("auto"), pulp.PULP_CBC_CMD)
    with pytest.raises(PlanError, match="pip install 'omnibal-compile\\[highs\\]'"):
        make_solver("highs")


@pytest.mark.parametrize("solver", ["auto", "cbc"])
def test_recompute_tie_break_prefers_fewer_recomputed_blocks(solver):
    """One stage, 20 bytes of activations, a 10-byte budget: recomputing X (+1) or both Y and Z
    (+0.5 each) cost the same time; the tie-break takes the one recomputed block, in any order."""
    X = ((1, 2, 3), (10, 0, 0))
    Y = ((1, 1.5, 3), (5, 0, 0))
    for order in itertools.permutations([X, Y, Y]):
        P = problem([t for t, _ in order], [a for _, a in order], S=1, budget=(10,))
        sol = solve_ilp(P, time_limit=30, gap=1e-9, solver=solver)
        assert sol.iteration_time == pytest.approx(4.0)
        assert sum(r != "none" for r in sol.recompute) == 1, (order, sol.recompute)


@pytest.mark.parametrize("solver", ["auto", "cbc"])
def test_recompute_tie_break_never_outweighs_a_faster_plan(solver):
    """Recomputing two blocks is 3e-5 s faster than one: time comes first."""
    X = ((1, 2, 3), (10, 0, 0))
    Y = ((1, 1.5 - 1.5e-5, 3), (5, 0, 0))  # 1e-5 of the 3 s bottleneck bound: ten times the tie-break's weight
    P = problem([X[0], Y[0], Y[0]], [X[1], Y[1], Y[1]], S=1, budget=(10,))
    sol = solve_ilp(P, time_limit=30, gap=1e-12, solver=solver)
    assert sol.recompute == ("none", "selective", "selective")


def _warm_plan(P):
    """The slowest feasible plan with every block recomputed in full: no solver reaches it on its own."""
    plans = [evaluate(P, (0, *b, P.n), ["full"] * P.n) for b in itertools.combinations(range(1, P.n), P.num_stages - 1)]
    return max((sol for sol in plans if sol.feasible), key=lambda sol: sol.iteration_time)


@pytest.mark.parametrize("schedule,S,v", [("1f1b", 2, 1), ("gpipe", 3, 1), ("interleaved", 4, 2)])
@pytest.mark.parametrize("budget", [None, "tight"])
@pytest.mark.parametrize("sync", [False, True])
def test_warm_start_is_the_plan_returned_when_the_solver_has_no_time(schedule, S, v, budget, sync):
    """With no time to search, the ILP returns its starting point: the warm plan's cuts (under a
    budget each stage's options are then repaired to its interval's fastest fit)."""
    times = [(1, 1.5, 2), (3, 3.5, 5), (2, 2.2, 3), (1, 1.1, 2), (2.5, 3, 4), (1.5, 2, 3)]
    P = problem(times, [(4, 1, 0)] * 6, S=S, M=4, schedule=schedule, v=v)
    if sync:  # data-parallel sync per block: the warm start sets D too
        P = dataclasses.replace(P, sync=(0.5, 0.25, 0.75, 0.5, 0.25, 1.0))
    if budget:
        free = solve_ilp(P, time_limit=30)
        P = dataclasses.replace(P, budget=(max(free.stage_memory) * v * 0.8,) * (S // v))
    warm = _warm_plan(P)
    sol = solve_ilp(P, warm=warm, time_limit=0.0)
    assert sol.boundaries == warm.boundaries  # (presolve may still drop recomputation no memory row asks for)
    assert solve_ilp(P, time_limit=30).iteration_time < warm.iteration_time  # the warm plan is not the optimum


@pytest.mark.parametrize("schedule,S,v", [("1f1b", 2, 1), ("interleaved", 4, 2)])
def test_cbc_starts_from_the_warm_plan_too(schedule, S, v):
    times = [(1, 1.5, 2), (3, 3.5, 5), (2, 2.2, 3), (1, 1.1, 2), (2.5, 3, 4), (1.5, 2, 3)]
    P = problem(times, [(4, 1, 0)] * 6, S=S, M=4, schedule=schedule, v=v)
    warm = _warm_plan(P)
    assert solve_ilp(P, warm=warm, time_limit=0.0, solver="cbc").boundaries == warm.boundaries


def test_a_warm_plan_with_a_dominated_option_is_not_used():
    """Block 0's full recomputation is no smaller than selective and slower: the ILP has no variable for
    it, so a warm plan using it is dropped (a cold start) rather than passed on in part."""
    P = problem([(1, 1.5, 2), (1, 1.5, 2), (1, 1.5, 2)], [(4, 0, 0)] * 3, S=2, M=2)
    warm = evaluate(P, (0, 1, 3), ["full", "none", "none"])
    sol = solve_ilp(P, warm=warm, time_limit=30)
    assert sol.recompute == ("none",) * 3 and sol.iteration_time == pytest.approx(solve_dp(P).iteration_time)


def test_upper_bound_and_proven_bound_are_rows_of_the_model():
    """A bound below every plan leaves nothing; a proven lower bound above the optimum (a wrong one)
    lifts the objective to it: both reach the solver."""
    times = [(1, 1.5, 2), (3, 3.5, 5), (2, 2.2, 3), (1, 1.1, 2)]
    P = problem(times, [(4, 1, 0)] * 4, S=2, M=4, schedule="1f1b")
    best = solve_dp(P).iteration_time
    assert solve_ilp(P, upper_bound=best).iteration_time == pytest.approx(best)
    with pytest.raises(PlanError):
        solve_ilp(P, upper_bound=best * 0.9)
    Q = problem(times + [(2, 2.5, 3), (1, 1.5, 2)], [(4, 1, 0)] * 6, S=4, M=4, schedule="interleaved", v=2)
    best = solve_ilp(Q, time_limit=30).iteration_time
    at = solve_ilp(Q, proven_bound=best)
    # a bound at the optimum leaves it (and its objective, to within the bound's 1e-5 margin) alone
    assert at.iteration_time == pytest.approx(best) and at.extra["objective"] == pytest.approx(best, rel=1e-6)
    # the device maximum is a free variable >= each device's time: the row lifts it, not the plan
    assert solve_ilp(Q, proven_bound=best * 1.2, time_limit=30).extra["objective"] >= best * 1.2 * (1 - 1e-4)
    with pytest.raises(PlanError):
        solve_ilp(Q, upper_bound=best * 0.9)


def test_solve_seconds_and_objective_are_reported():
    P = problem([(1, 1.5, 2), (3, 3.5, 5), (2, 2.2, 3)], S=2, M=2, schedule="1f1b")
    t0 = time.perf_counter()
    sol = solve_ilp(P)
    wall = time.perf_counter() - t0
    assert 0 < sol.solve_seconds <= wall
    Q = problem([(1, 1.5, 2), (3, 3.5, 5), (2, 2.2, 3), (1, 1.1, 2)], S=4, M=4, schedule="interleaved", v=2)
    t0 = time.perf_counter()
    paths = solve_ilp(Q)
    assert 0 < paths.solve_seconds <= time.perf_counter() - t0
    assert sol.extra["objective"] == pytest.approx(sol.iteration_time, rel=1e-6)
    assert sol.planner == "ilp" and sol.extra["solver"] in ("WarmHiGHS", "PULP_CBC_CMD")
    if sol.extra["solver"] == "WarmHiGHS":  # HiGHS reports its proven gap; CBC through PuLP does not
        assert sol.gap is not None and 0 <= sol.gap <= 1e-6 and sol.status == "Optimal"
    cbc = solve_ilp(P, solver="cbc")
    assert cbc.gap is None and cbc.status == "Optimal" and cbc.iteration_time == pytest.approx(sol.iteration_time)


def test_zero_work_problem_reports_a_zero_objective():
    """All times 0: the unit falls back to 1 and the objective read back is 0, not the unit."""
    P = problem([(0, 0, 0), (0, 0, 0)], S=2)
    sol = solve_ilp(P)
    assert sol.iteration_time == 0 and sol.extra["objective"] == 0
    Q = problem([(0, 0, 0)] * 4, S=4, M=4, schedule="interleaved", v=2)
    assert solve_ilp(Q).extra["objective"] == 0
    # 1F1B with 3 micro-batches weighs the bottleneck twice more: still 0 (no stage time is held above 0)
    R = problem([(0, 0, 0)] * 3, S=3, M=3, schedule="1f1b")
    assert solve_ilp(R).extra["objective"] == 0
    # bounded by a DP optimum of 0: a stage-time bound of 0 prunes nothing (no division by it)
    for R in (P, Q):
        assert solve_ilp(R, upper_bound=0.0).iteration_time == 0


def test_tiny_send_times_do_not_mislead_highs():
    """Sends of 2e-9 to 8e-8 of the bottleneck (found by hypothesis): HiGHS's presolve reported the plan
    (0, 1, 2, 3, 5), 3% slower than the DP's (0, 2, 3, 4, 5), as optimal while they were in the model."""
    P = PartitionProblem(
        names=("b0", "b1", "b2", "b3", "b4"),
        kinds=("layer", "layer", "module", "layer", "module"),
        time=(
            (7.765192265478818, 8.146495838996222, 8.642360905616824),
            (0.13020199133383065, 0.4059236040599602, 0.4059236040599602),
            (5.505917071315433, 5.887220644832837, 13.328870831321218),
            (9.10509064408046, 9.195320427922258, 21.212334494217338),
            (0.5, 1.0, 1.2900664509027622),
        ),
        act=((15389, 1706, 1024), (4031, 2427, 530), (4511592, 1013, 219), (0, 0, 0), (19, 11, 0)),
        static=(1, 227, 0, 1970, 8216),
        cut_time=(
            0.0,
            2.2258609533309937e-07,
            1.9874423742294312e-07,
            1.862645149230957e-11,
            7.234327495098114e-07,
            0.0,
        ),
        cut_bytes=(0, 11950, 10670, 1, 38839, 0),
        num_params=(0, 14, 0, 123, 513),
        flops=(7765192265478.818, 130201991333.83064, 5505917071315.433, 9105090644080.46, 500000000000.0),
        num_stages=4,
        num_microbatches=4,
        schedule="1f1b",
    )
    dp = solve_dp(P)
    assert dp.boundaries == (0, 2, 3, 4, 5)
    ilp = solve_ilp(P, time_limit=30, gap=1e-9)
    # (0, 1, 3, 4, 5) is as fast to 1e-9: what the model leaves out is a few millionths at most
    assert ilp.boundaries != (0, 1, 2, 3, 5) and close(ilp.iteration_time, dp.iteration_time)


def test_stdout_silenced_hides_fd_1_and_puts_it_back_in_order(capfd, monkeypatch):
    """What C code writes to fd 1 inside is dropped; Python's pending output (block-buffered, as on a
    pipe) is written out before, and fd 1 is the same file afterwards."""
    import io
    import os
    import sys

    from omnibal_compile.planning.ilp import _stdout_silenced

    buffered = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    monkeypatch.setattr(sys, "stdout", buffered)
    print("before ", end="")
    with _stdout_silenced():
        os.write(1, b"hidden ")
    os.write(1, b"after")
    buffered.flush()
    assert capfd.readouterr().out == "before after"


@pytest.mark.parametrize("msg", [False, True])
def test_highs_prints_its_log_only_when_asked(capfd, msg):
    import pulp

    pytest.importorskip("highspy")
    prob = pulp.LpProblem("tiny", pulp.LpMinimize)
    x = pulp.LpVariable("x", lowBound=0, cat="Integer")
    prob += x
    prob += x >= 1.5
    prob.solve(make_solver("highs", msg=msg))
    assert x.value() == 2
    out = capfd.readouterr().out
    assert ("HiGHS" in out) == msg, out


def _fixed_objective(model, stage_of, options):
    """The model's iteration time with every block's (stage, option) fixed; None when infeasible,
    ``"no variable"`` when the model cannot express the assignment (outside the windows or dominated)."""
    import pulp

    if any((i, s, o) not in model.w for i, (s, o) in enumerate(zip(stage_of, options))):
        return "no variable"
    saved = {key: (var.lowBound, var.upBound) for key, var in model.w.items()}
    for (i, s, o), var in model.w.items():
        on = (s, o) == (stage_of[i], options[i])
        var.lowBound, var.upBound = (1, 1) if on else (0, 0)
    if any(saved[i, s, o][1] == 0 for i, (s, o) in enumerate(zip(stage_of, options))):
        result = None  # the model fixed this choice at 0 (over the whole budget on its own)
    else:
        model.prob.solve(make_solver("highs", gap=1e-12))
        result = pulp.value(model.objective) if model.prob.status == pulp.LpStatusOptimal else None
    for key, var in model.w.items():
        var.lowBound, var.upBound = saved[key]
    return result


def _boundaries(stage_of, S):
    """The plan's boundaries when ``stage_of`` is contiguous, non-decreasing and uses every stage, else None."""
    if list(stage_of) != sorted(stage_of) or set(stage_of) != set(range(S)):
        return None
    return (0, *(i for i in range(1, len(stage_of)) if stage_of[i] != stage_of[i - 1]), len(stage_of))


_TIMES = [(1, 1.5, 2), (2, 2.25, 3), (1.5, 1.75, 2.5), (1, 1.25, 1.5), (1.2, 1.4, 2)]
_ACTS = [(6, 2, 1), (8, 3, 0), (5, 4, 1), (7, 1, 0), (4, 2, 0)]
MODEL_CASES = {
    # 1F1B under a budget that rules some plans out: sends, static memory, gathered weights and workspace
    "1f1b-budget": dict(time=_TIMES, act=_ACTS, S=2, M=3, schedule="1f1b", budget=34, static=(3, 1, 4, 2, 1),
                        cut_bytes=(0, 2, 3, 1, 2, 0), cut_time=(0, 0.1, 0.2, 0.05, 0.15, 0), gathered=(1, 2, 0, 1, 0),
                        workspace=(0, 1, 1, 0, 2)),
    # GPipe on three stages with no budget (the block-level form of the model)
    # (with send entries at cut 0 and cut n, which every planner adds to the first and last stage)
    "gpipe-free": dict(time=_TIMES, act=_ACTS, S=3, M=2, schedule="gpipe", cut_time=(0.3, 0.1, 0.2, 0.05, 0.15, 0.4)),
    # three stages under per-stage budgets, with data-parallel sync per block
    "1f1b-sync": dict(time=_TIMES, act=_ACTS, S=3, M=4, schedule="1f1b", budget=(40, 30, 35),
                      cut_bytes=(0, 2, 3, 1, 2, 0), sync=(0.5, 0.25, 0.75, 0.5, 0.25)),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_the_model_with_a_plan_fixed_is_that_plans_iteration_time(case):
    """Every assignment of blocks to stages with some option vectors, fixed in the model: feasible
    exactly when it is a plan (contiguous, every stage used) that fits, and then its objective is
    evaluate()'s iteration time. Checks every row and coefficient of the block-level model at once."""
    import random

    spec = dict(MODEL_CASES[case])
    extra = {k: tuple(spec.pop(k)) for k in ("gathered", "workspace", "sync") if k in spec}
    P = dataclasses.replace(problem(**spec), **extra)
    n, S = P.n, P.num_stages
    lo, hi = _stage_windows(P, None)
    model = _joint_model(P, lo, hi, None, upper_bound=None)
    rng = random.Random(0)
    checked = fits = 0
    for stage_of in itertools.product(range(S), repeat=n):
        b = _boundaries(stage_of, S)
        in_windows = all(lo[i] <= s <= hi[i] for i, s in enumerate(stage_of))
        vectors = [(0,) * n, (1,) * n, (2,) * n]
        vectors += [tuple(rng.choice((0, 1, 2)) for _ in range(n)) for _ in range(12 if in_windows else 0)]
        for vec in vectors:
            got = _fixed_objective(model, stage_of, vec)
            if got == "no variable":
                # only non-plans and dominated options lack variables
                assert b is None or any(o not in model.useful[i] for i, o in enumerate(vec)), (stage_of, vec)
                continue
            checked += 1
            if b is None:
                assert got is None, (stage_of, vec, got)
                continue
            sol = evaluate(P, b, [("none", "selective", "full")[o] for o in vec])
            if not sol.feasible:
                assert got is None, (stage_of, vec, got, sol.stage_memory)
            else:
                fits += 1
                assert got == pytest.approx(sol.iteration_time, rel=1e-7), (stage_of, vec)
    assert checked >= 100 and fits >= 20 and checked - fits >= 20, (checked, fits)  # both sides reached


def test_the_model_under_an_upper_bound_rules_out_slower_plans():
    P = problem([(1, 1.5, 2), (2, 2.25, 3), (1.5, 1.75, 2.5), (1, 1.25, 1.5)], [(6, 2, 1)] * 4, S=2, M=3,
                schedule="1f1b")
    best = solve_dp(P).iteration_time
    bound = best * 1.1
    lo, hi = _stage_windows(P, None)
    model = _joint_model(P, lo, hi, None, upper_bound=bound)
    seen = set()
    for stage_of in itertools.product(range(2), repeat=4):
        b = _boundaries(stage_of, 2)
        if b is None:
            continue
        for vec in ((0,) * 4, (1, 0, 0, 0), (0, 2, 0, 1)):
            if any(o not in model.useful[i] for i, o in enumerate(vec)):
                continue
            t = evaluate(P, b, [("none", "selective", "full")[o] for o in vec]).iteration_time
            got = _fixed_objective(model, stage_of, vec)
            seen.add(t <= bound)
            assert (got is not None) == (t <= bound * (1 + 1e-5)), (stage_of, vec, t, bound)
    assert seen == {True, False}


def _fixed_path(model, keys):
    """The path model's iteration time with exactly the intervals ``keys`` on; None when infeasible or
    when an interval has no variable (it does not fit its stage)."""
    import pulp

    if not set(keys) <= model.z.keys():
        return None
    saved = {key: (var.lowBound, var.upBound) for key, var in model.z.items()}
    for key, var in model.z.items():
        var.lowBound, var.upBound = (1, 1) if key in keys else (0, 0)
    model.prob.solve(make_solver("highs", gap=1e-12))
    result = pulp.value(model.objective) if model.prob.status == pulp.LpStatusOptimal else None
    for key, var in model.z.items():
        var.lowBound, var.upBound = saved[key]
    return result


@pytest.mark.parametrize("budget,sync", [(None, None), (16, None), (16, (0.5, 0.25, 0.75, 0.5, 0.25, 1.0))])
def test_the_path_model_with_a_path_fixed_is_that_plans_iteration_time(budget, sync):
    """Interleaved, 2 devices x 2 chunks, 6 blocks: every cut path fixed in the path model is feasible
    exactly when each stage has an option vector that fits, and then costs evaluate()'s iteration time
    with each stage's fastest fitting vector (found here by enumeration); a stage run twice, or one
    left out, is infeasible."""
    P = problem(_TIMES + [(0.8, 1.0, 1.6)], _ACTS + [(5, 1, 0)], S=4, M=4, schedule="interleaved", v=2,
                budget=() if budget is None else budget, cut_bytes=(0, 2, 3, 1, 2, 1, 0))
    if sync:
        P = dataclasses.replace(P, sync=sync)
    lo, hi = _stage_windows(P, None)
    model = _paths_model(P, lo, hi, None, upper_bound=None, proven_bound=None)
    names = ("none", "selective", "full")
    fits = misses = 0
    paths = []
    for cuts in itertools.combinations(range(1, P.n), P.num_stages - 1):
        b = (0, *cuts, P.n)
        keys = [(b[s], b[s + 1], s) for s in range(P.num_stages)]
        best = []
        for s, (i, j, _) in enumerate(keys):
            fitting = [vec for vec in itertools.product(range(3), repeat=j - i)
                       if stage_figures(P, s, i, j, vec)[1] <= P.memory_limit(s)]
            best.append(min(fitting, key=lambda vec: stage_figures(P, s, i, j, vec)[0]) if fitting else None)
        got = _fixed_path(model, keys)
        if any(v is None for v in best):
            assert got is None, (b, got)
            misses += 1
            continue
        fits += 1
        paths.append(keys)
        plan = [names[o] for vec in best for o in vec]
        assert got == pytest.approx(evaluate(P, b, plan).iteration_time, rel=1e-7), b
    assert fits >= 3 and (budget is None or misses >= 1)
    # not paths: a stage's interval left out, a second interval on a stage, or stages that do not meet
    first, second = paths[0], paths[-1]
    assert _fixed_path(model, first[:-1]) is None
    extra = next(k for k in second if k not in first)
    assert _fixed_path(model, first + [extra]) is None
    for a, b in itertools.permutations(paths, 2):
        for s in range(1, P.num_stages):
            mixed = a[:s] + b[s:]
            if a[s - 1][1] != b[s][0]:  # stage s starts where stage s - 1 does not end
                assert _fixed_path(model, mixed) is None, mixed


@pytest.mark.parametrize("budget", [None, 40])
def test_with_recomputation_not_allowed_the_ilp_still_minimises_time(budget):
    """No option to recompute: no tie-break term, the objective is the iteration time alone."""
    P = dataclasses.replace(problem(_TIMES + [(0.8, 1.0, 1.6)], _ACTS + [(5, 1, 0)], S=3, M=4, schedule="1f1b",
                                    budget=() if budget is None else budget), allowed=("none",))
    assert close(solve_ilp(P, time_limit=30).iteration_time, brute_force(P).iteration_time)


def test_an_interleaved_budget_no_path_meets_is_refused_by_name():
    """Each stage alone fits somewhere, but no cut path fits every stage: the solver finds nothing."""
    P = problem(_TIMES + [(0.8, 1.0, 1.6)], _ACTS + [(5, 1, 0)], S=4, M=4, schedule="interleaved", v=2,
                budget=14, cut_bytes=(0, 2, 3, 1, 2, 1, 0))
    lo, hi = _stage_windows(P, None)
    assert _interval_floors(P, lo, hi, None)[0]  # some intervals fit
    with pytest.raises(PlanError, match="the ILP found no plan that fits the memory budget"):
        solve_ilp(P, time_limit=30)


def test_fastest_fitting_compares_compute_time_net_of_the_stage_sends():
    """Interval floors include the sends at both ends; the repair compares them net of those sends, so a
    tie stays the solver's choice also when the sends take time."""
    P = dataclasses.replace(
        problem([(1, 2, 3), (1, 1.5, 3), (2, 2.5, 4), (1, 1.5, 2)], [(4, 4, 0), (6, 0, 0), (6, 0, 0), (5, 0, 0)],
                budget=10), cut_time=(0.0, 0.0, 0.25, 0.0, 0.0))
    fr = Frontiers(P)
    for mine in (["none", "none", "none", "selective"], ["none", "none", "selective", "none"]):
        assert _fastest_fitting(P, fr, (0, 2, 4), mine) == mine
    # stage 0 [0, 2) with block 1 selective computes 2.5, 0.5 s slower than no recomputation (2 + the send)
    assert _fastest_fitting(P, fr, (0, 2, 4), ["none", "selective", "none", "selective"])[:2] == ["none", "none"]
    # block 3 in full computes 4, 0.5 s slower than the fastest fit (3.5 + the 0.25 s send): replaced
    assert _fastest_fitting(P, fr, (0, 2, 4), ["none", "none", "none", "full"])[2:] in \
        (["selective", "none"], ["none", "selective"])


@pytest.mark.parametrize("case", ["1f1b-budget", "1f1b-sync", "gpipe-free"])
def test_the_model_holds_a_plan_exactly_at_its_memory(case):
    """Each plan (cuts and a sampled option vector) under per-stage budgets equal to its own stage
    memory by evaluate(): the model, with the plan fixed, takes it; a budget a byte (or 0.1%) smaller on
    any one stage refuses it. This pins every memory coefficient (static, activations times k_s, the
    receive buffer, held outputs, gathered weights and workspace) to problem.stage_figures."""
    import random

    spec = dict(MODEL_CASES[case])
    extra = {k: tuple(spec.pop(k)) for k in ("gathered", "workspace", "sync") if k in spec}
    spec.pop("budget", None)
    spec.setdefault("cut_bytes", (0, 2, 3, 1, 2, 0))
    base = dataclasses.replace(problem(**spec), **extra)
    n, S = base.n, base.num_stages
    lo, hi = _stage_windows(base, None)
    rng = random.Random(1)
    checked = 0
    for stage_of in itertools.product(range(S), repeat=n):
        b = _boundaries(stage_of, S)
        if b is None or not all(lo[i] <= s <= hi[i] for i, s in enumerate(stage_of)):
            continue
        for vec in [(0,) * n] + [tuple(rng.choice((0, 1, 2)) for _ in range(n)) for _ in range(3)]:
            names = [("none", "selective", "full")[o] for o in vec]
            memory = evaluate(base, b, names).stage_memory
            P = dataclasses.replace(base, budget=tuple(memory))
            model = _joint_model(P, lo, hi, None, upper_bound=None)
            if any(o not in model.useful[i] for i, o in enumerate(vec)):
                continue
            assert _fixed_objective(model, stage_of, vec) is not None, (stage_of, vec, memory)
            for s in range(S):
                if memory[s] <= 0:
                    continue
                less = list(memory)
                less[s] -= max(1.0, 1e-3 * memory[s])
                tight = _joint_model(dataclasses.replace(P, budget=tuple(less)), lo, hi, None, upper_bound=None)
                assert _fixed_objective(tight, stage_of, vec) in (None, "no variable"), (stage_of, vec, s, less)
            checked += 1
    assert checked >= 10


def test_models_are_frozen_keyword_only():
    from contracts import assert_frozen_keyword_only

    P = problem(_TIMES, _ACTS, S=2, M=2, schedule="1f1b", budget=40)
    lo, hi = _stage_windows(P, None)
    assert_frozen_keyword_only(_joint_model(P, lo, hi, None, upper_bound=None))
    Q = problem(_TIMES + [(0.8, 1.0, 1.6)], _ACTS + [(5, 1, 0)], S=4, M=4, schedule="interleaved", v=2)
    lo, hi = _stage_windows(Q, None)
    assert_frozen_keyword_only(_paths_model(Q, lo, hi, None, upper_bound=None, proven_bound=None))


def test_stdout_silenced_leaves_no_file_descriptor_open():
    import os

    from omnibal_compile.planning.ilp import _stdout_silenced

    fds = "/proc/self/fd"
    if not os.path.isdir(fds):
        pytest.skip("needs /proc to count open file descriptors")
    before = len(os.listdir(fds))
    for _ in range(5):
        with _stdout_silenced():
            pass
    assert len(os.listdir(fds)) == before


def test_the_tie_break_weighs_each_recomputed_block():
    """The solved objective is the iteration time plus TIE_WEIGHT per recomputed block: in the block
    model on each w[i, s, o] with o != none, in the path model on each interval by its vector's count."""
    from omnibal_compile.planning.ilp import TIE_WEIGHT

    P = problem(_TIMES, _ACTS, S=2, M=2, schedule="1f1b", budget=40)
    lo, hi = _stage_windows(P, None)
    m = _joint_model(P, lo, hi, None, upper_bound=None)
    solved, plain = dict(m.prob.objective.items()), dict(m.objective.items())
    for (i, s, o), var in m.w.items():
        assert solved.get(var, 0) - plain.get(var, 0) == pytest.approx(TIE_WEIGHT if o else 0.0), (i, s, o)
    Q = problem(_TIMES + [(0.8, 1.0, 1.6)], _ACTS + [(5, 1, 0)], S=4, M=4, schedule="interleaved", v=2, budget=16,
                cut_bytes=(0, 2, 3, 1, 2, 1, 0))
    lo, hi = _stage_windows(Q, None)
    pm = _paths_model(Q, lo, hi, None, upper_bound=None, proven_bound=None)
    solved, plain = dict(pm.prob.objective.items()), dict(pm.objective.items())
    counts = {key: sum(o != 0 for o in vec) for key, vec in pm.vectors.items()}
    assert len(set(counts.values())) >= 2  # the intervals recompute different numbers of blocks
    for key, var in pm.z.items():
        assert solved.get(var, 0) - plain.get(var, 0) == pytest.approx(TIE_WEIGHT * counts[key]), key


def test_the_model_fixes_at_0_a_choice_over_the_whole_budget():
    """Budget 0 bytes: a block's none option alone (2**32 bytes) is over it, so its variable is fixed at 0
    (and left out of the row); the options that hold nothing remain."""
    P = problem([(7.0, 7.5, 21.0), (9.5, 9.5, 19.0)], [(2**32, 0, 0), (2**32, 0, 0)], S=2, budget=(0.0, 0.0))
    lo, hi = _stage_windows(P, None)
    model = _joint_model(P, lo, hi, None, upper_bound=None)
    assert all(var.upBound == 0 for (i, s, o), var in model.w.items() if o == 0)
    assert _fixed_objective(model, (0, 1), (0, 1)) is None
    assert _fixed_objective(model, (0, 1), (1, 1)) == pytest.approx(7.5 + 9.5)


@pytest.mark.parametrize("budget", [None, 100])
def test_an_option_as_fast_as_another_and_larger_is_never_chosen(budget):
    """Block 1's selective recomputation is as fast as keeping everything and holds less: keeping
    everything is dominated, has no variable, and is not the plan even though it recomputes nothing."""
    P = problem([(1, 1.5, 2), (2, 2, 3), (1, 1.5, 2)], [(4, 0, 0), (6, 1, 0), (4, 0, 0)], S=2, M=2, schedule="1f1b",
                budget=() if budget is None else budget)
    lo, hi = _stage_windows(P, None)
    assert _joint_model(P, lo, hi, None, upper_bound=None).useful[1] == [1, 2]
    assert solve_ilp(P, time_limit=30).recompute[1] == "selective"


def test_a_plan_that_fills_a_stage_to_the_budget_is_found():
    """The least-memory plan (0, 3, 4) fills stage 0 to within the budget's 1e-9 allowance (found by
    bench/ilp_cold.py): HiGHS's presolve called the model infeasible; without presolve it solves."""
    P = PartitionProblem(
        names=("b0", "b1", "b2", "b3"),
        kinds=("module", "layer", "layer", "layer"),
        time=(
            (0.12808789360538486, 0.12818789360538485, 0.12818789360538485),
            (2.9788912838919757, 2.9789523190482257, 5.769817763598338),
            (0.12808789360538486, 0.12808789360538486, 0.2555552744985948),
            (1.0, 1.469908938711736, 3.4600268370410063),
        ),
        act=((305, 0, 0), (679057, 43, 23), (554435070, 305, 278), (2979, 809, 301)),
        static=(3679, 17196, 1348913127, 11623),
        cut_time=(0.0, 1.6307458281517028e-07, 1.8274784088134766e-06, 5.401670932769775e-09, 0.0),
        cut_bytes=(0, 8755, 98112, 290, 0),
        num_params=(229, 1074, 84307070, 726),
        flops=(128087893605.38486, 2978891283891.9756, 128087893605.38486, 1000000000000.0),
        num_stages=2,
        num_microbatches=4,
        schedule="1f1b",
        budget=(1348935184.0, 1348935184.0),
    )
    dp = solve_dp(P)
    assert (dp.boundaries, dp.recompute) == ((0, 3, 4), ("selective", "full", "full", "none"))
    assert dp.stage_memory[0] == pytest.approx(P.budget[0], rel=1e-8)  # at the budget
    for solver in ("auto", "cbc"):
        ilp = solve_ilp(P, time_limit=30, gap=1e-9, solver=solver)
        assert ilp.feasible and close(ilp.iteration_time, dp.iteration_time), solver
