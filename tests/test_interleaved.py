"""The two-chunk interleaved search: least bottleneck and bounds against brute force."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from contracts import assert_frozen_keyword_only
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibal_compile.planning import PartitionProblem, interleaved, least_memory_split, solve
from omnibal_compile.planning.baselines import BASELINES
from omnibal_compile.planning.dp import interleaved_incumbent
from omnibal_compile.planning.interleaved import (
    _Intervals,
    _least_sum,
    _plan,
    _polish,
    _reachable,
    applies,
    two_chunk_search,
)
from omnibal_compile.planning.problem import OPTIONS, evaluate, stage_figures

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
    short = dataclasses.replace(found.solution, iteration_time=0.5)  # an iteration under a second
    assert dataclasses.replace(found, solution=short, lower_bound=0.25).gap == pytest.approx(0.5)
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


# -- the search's internal tables against brute force ------------------------------------------------
# Integer block times (and cut times in quarters) keep every sum exact, so ties and "exactly at the
# bound" cases are common and the tables can be compared with ==.


@st.composite
def exact_problems(draw):
    """Two-chunk problems with integer times, memory that binds in most draws, optional transients."""
    p = draw(st.integers(1, 3))
    S = 2 * p
    n = draw(st.integers(S, S + (3 if p < 3 else 2)))
    M = p * draw(st.integers(1, 2))
    time, act = [], []
    for _ in range(n):
        f = float(draw(st.integers(1, 4)))
        sel = f + draw(st.integers(0, 1))
        time.append((f, sel, sel + draw(st.integers(0, 2))))
        a = draw(st.integers(0, 8)) * GiB // 2
        a_sel = draw(st.integers(0, a // (GiB // 2))) * GiB // 2
        act.append((a, a_sel, draw(st.integers(0, a_sel // (GiB // 2))) * GiB // 2))
    static = [draw(st.integers(0, 4)) * GiB // 2 for _ in range(n)]
    cut_q = [0] + [draw(st.integers(0, 2)) for _ in range(n - 1)] + [0]
    # bytes on the model's input and output links: no stage receives or sends them
    ends = [draw(st.integers(0, 2)) * GiB // 4, draw(st.integers(0, 2)) * GiB // 4]
    transient = draw(st.booleans())
    free = PartitionProblem(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n, time=tuple(time), act=tuple(act),
        static=tuple(static), cut_time=tuple(q / 4 for q in cut_q),
        cut_bytes=(ends[0], *(q * GiB // 4 for q in cut_q[1:-1]), ends[1]),
        num_params=(1,) * n, flops=tuple(t[0] for t in time), num_stages=S, num_microbatches=M,
        schedule="interleaved", virtual_stages=2,
        gathered=tuple(draw(st.integers(0, 2)) * GiB // 2 for _ in range(n)) if transient else (),
        workspace=tuple(draw(st.integers(0, 2)) * GiB // 4 for _ in range(n)) if transient else (),
    )
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return free
    if kind == 1:
        # a device budget half a byte above or below one stage's memory (allowance included): the fit
        # is decided at the byte
        s = draw(st.integers(0, S - 1))
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(i + 1, n))
        # the fastest vector (no recomputation: on every frontier) or any other
        choice = [0] * (j - i) if draw(st.booleans()) else [draw(st.sampled_from(range(3))) for _ in range(i, j)]
        need = stage_figures(free, s, i, j, choice)[1] + draw(st.sampled_from([-0.5, 0.5]))
        return dataclasses.replace(free, budget=(2 * (need - 1e-6) / (1 + 1e-9),) * p)
    # a device budget from just above the least-memory plan's up to the unconstrained plan's
    least = least_memory_split(free)[2]
    most = max(m * 2 for m in interleaved_incumbent(free).stage_memory)
    u = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]))
    return dataclasses.replace(free, budget=(least + u * max(most - least, 0.0),) * p)


def stage_least_times(P, max_time):
    """{(s, i, j): least time of stage s on [i, j) over option vectors that fit, or inf}, by enumeration."""
    out = {}
    opts = P.option_indices()
    for i in range(P.n):
        for j in range(i + 1, P.n + 1):
            figures = {s: math.inf for s in range(P.num_stages)}
            for choice in itertools.product(opts, repeat=j - i):
                for s in range(P.num_stages):
                    t, m = stage_figures(P, s, i, j, choice)
                    if m <= P.memory_limit(s) and t <= max_time * (1 + 1e-9):
                        figures[s] = min(figures[s], t)
            for s, t in figures.items():
                out[s, i, j] = t
    return out


def paths(P):
    for cuts in itertools.combinations(range(1, P.n), P.num_stages - 1):
        yield (0, *cuts, P.n)


def table_time(iv, b, s):
    a = b[s + 1] - b[s]
    return iv.T[s, a, b[s]] if a <= iv.L else math.inf


def device_times(P, iv, b):
    p = P.num_devices
    t = [table_time(iv, b, s) for s in range(P.num_stages)]
    return [t[d] + t[p + d] for d in range(p)], t


def least_bottleneck(P, iv):
    return min((max(device_times(P, iv, b)[0]) for b in paths(P)), default=math.inf)


def reachable_by_hand(P, iv, tau):
    """The reachability sets the search should build: states (m, i, j) after devices 0..d-1 of plans
    with every device time <= tau, less those whose remaining blocks cannot fit the remaining devices
    (fastest work within (p - d - 1) tau, a block per stage)."""
    n, p = P.n, P.num_devices
    fast = [0.0]
    for b in range(n):
        fast.append(fast[-1] + min(P.time[b][o] for o in P.option_indices()))
    sets = [{(m, 0, m) for m in range(p, n - p + 1)}]
    for d in range(p):
        left = p - d - 1
        nxt = set()
        for m, i, j in sets[-1]:
            for a in range(1, n - i + 1):
                for b in range(1, n - j + 1):
                    ta = iv.T[d, a, i] if a <= iv.L else math.inf
                    tb = iv.T[p + d, b, j] if b <= iv.L else math.inf
                    if not ta + tb <= tau:
                        continue
                    i2, j2 = i + a, j + b
                    rest = (fast[m] - fast[i2]) + (fast[n] - fast[j2])
                    if rest <= left * tau * (1 + 1e-9) and m - i2 >= left and n - j2 >= left:
                        nxt.add((m, i2, j2))
        sets.append(nxt)
    return sets


def score_by_hand(P, iv, b):
    """The polish's objective: (iteration time, sum of squared device times) from the table; inf off it."""
    S, p = P.num_stages, P.num_devices
    if len(b) != S + 1 or b[0] != 0 or b[-1] != P.n or any(y <= x or y - x > iv.L for x, y in zip(b, b[1:])):
        return (math.inf, math.inf)
    dev, t = device_times(P, iv, b)
    if math.isinf(max(t)):
        return (math.inf, math.inf)
    return (P.num_microbatches * max(dev) + (p - 1) / (2 * p) * sum(t), sum(x * x for x in dev))


def polish_by_hand(P, iv, b):
    """The documented local search: scan k = 1..S-1, last = k..S-1, shift +1 then -1 of cut points
    k..last, taking every move that lowers the score; repeat the scan until one takes none."""
    S = P.num_stages
    best, moved = score_by_hand(P, iv, b), True
    while moved:
        moved = False
        for k in range(1, S):
            for last in range(k, S):
                for delta in (1, -1):
                    cand = [x + delta if k <= q <= last else x for q, x in enumerate(b)]
                    if score_by_hand(P, iv, cand) < best:
                        b, best, moved = cand, score_by_hand(P, iv, cand), True
    return b


def some_max_time(P, data):
    """inf, or a stage-time cap that cuts some intervals out of the table."""
    if data.draw(st.booleans(), label="capped"):
        return math.inf
    total = sum(max(t) for t in P.time)
    return data.draw(st.sampled_from([total / 4, total / 3, total / 2]), label="max_time")


@given(exact_problems(), st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_interval_table_and_least_sum_against_brute_force(P, data):
    max_time = some_max_time(P, data)
    iv = _Intervals(P, max_time)
    oracle = stage_least_times(P, max_time)
    built = [len(a) for a in iv.frontiers.acts]
    assert iv.L == max(built) and iv.T.shape == (P.num_stages, iv.L + 1, P.n + 1) == iv.point.shape
    assert np.isinf(iv.T[:, 0, :]).all()
    for (s, i, j), t in oracle.items():
        a = j - i
        if a > iv.L:
            assert math.isinf(t) or a > built[i]  # an interval longer than any built: no stage can be it
            continue
        assert iv.T[s, a, i] == t, (s, i, j)
        if math.isfinite(t):  # its options are real: that time, within the stage's memory
            opts = iv.options(s, i, j)
            ft, fm = stage_figures(P, s, i, j, opts)
            assert ft == t and fm <= P.memory_limit(s)
        else:
            assert iv.point[s, a, i] == -1
    # Sigma_min: the least sum of stage times over every cut path
    sums = [sum(device_times(P, iv, b)[1]) for b in paths(P)]
    assert _least_sum(P, iv) == min(sums)


@given(exact_problems(), st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reachability_sets_and_read_back_plan_against_brute_force(P, data):
    iv = _Intervals(P, some_max_time(P, data))
    maxima = sorted({max(device_times(P, iv, b)[0]) for b in paths(P)} - {math.inf})
    if not maxima:
        assert _reachable(P, iv, 1e9) is None
        return
    star = maxima[0]
    taus = {star, star * (1 - 1e-6), data.draw(st.sampled_from(maxima), label="tau"), maxima[-1] * 2}
    for tau in sorted(taus):
        expected = reachable_by_hand(P, iv, tau)
        history = _reachable(P, iv, tau)
        splits = [m for m, i, j in expected[-1] if i == m and j == P.n]
        if tau < star:
            assert history is None and not splits
            continue
        assert history is not None and len(history) == P.num_devices + 1
        for d, (R, want) in enumerate(zip(history, expected)):
            assert {tuple(int(x) for x in k) for k in np.argwhere(R)} == want, (d, tau)
        sol = _plan(P, iv, tau, history)
        b = sol.boundaries
        assert len(b) == P.num_stages + 1 and b[0] == 0 and b[-1] == P.n and b[P.num_devices] == min(splits)
        dev, t = device_times(P, iv, b)
        assert max(dev) <= tau and sol.feasible and list(sol.stage_time) == t


@given(st.one_of(exact_problems(), two_chunk_problems()), st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_polish_ends_at_a_local_optimum_no_worse_than_its_start(P, data):
    iv = _Intervals(P, some_max_time(P, data))
    starts = [list(b) for b in paths(P) if math.isfinite(score_by_hand(P, iv, b)[0])]
    if not starts:
        return
    start = data.draw(st.sampled_from(starts), label="start")  # a plan on the table, as the search's are
    got = _polish(P, iv, list(start))
    assert score_by_hand(P, iv, got) <= score_by_hand(P, iv, start)
    assert got == polish_by_hand(P, iv, start)
    S = P.num_stages
    best = score_by_hand(P, iv, got)
    for k in range(1, S):
        for last in range(k, S):
            for delta in (1, -1):
                cand = got[:k] + [x + delta for x in got[k : last + 1]] + got[last + 1 :]
                assert not score_by_hand(P, iv, cand) < best, (got, cand)


def random_incumbent(P, data):
    """A feasible plan drawn at random (random cuts, each stage at a random option vector that fits)."""
    opts = P.option_indices()
    for _ in range(5):
        b = data.draw(st.sampled_from(list(paths(P))), label="cuts")
        choice = [OPTIONS[data.draw(st.sampled_from(opts))] for _ in range(P.n)]
        sol = evaluate(P, b, choice)
        if sol.feasible:
            return sol
    return min((s for s in (f(P) for f in BASELINES.values()) if s.feasible), key=lambda s: s.iteration_time,
               default=None)


@given(exact_problems(), st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_search_from_any_incumbent_brackets_the_least_bottleneck(P, data):
    start = random_incumbent(P, data)
    if start is None:
        return
    tol = data.draw(st.sampled_from([1e-4, 1e-2]), label="tolerance")
    full = _Intervals(P, math.inf)
    star, sigma = least_bottleneck(P, full), _least_sum(P, full)
    calls = []
    real = interleaved._reachable

    def counted(*args):
        calls.append(args[2])
        return real(*args)

    interleaved._reachable = counted
    try:
        found = two_chunk_search(P, start, tolerance=tol) if tol != 1e-4 else two_chunk_search(P, start)
    finally:
        interleaved._reachable = real
    sol = found.solution
    p, M = P.num_devices, P.num_microbatches
    c = (p - 1) / (2 * p)
    assert found.decisions == len(calls)
    assert star <= found.bottleneck <= star * (1 + tol)  # the bracket closed on tau*
    # the bound: M tau_lo + c Sigma_min with tau_lo within the tolerance below tau*, never above the plan
    assert found.lower_bound <= sol.iteration_time
    assert found.lower_bound >= min(M * star * (1 - tol) + c * sigma, sol.iteration_time) * (1 - 1e-12)
    assert found.lower_bound <= M * star + c * sigma or found.lower_bound == sol.iteration_time
    # the plan: real, never worse than the start, and the start itself unless strictly bettered
    again = evaluate(P, sol.boundaries, sol.recompute)
    assert again.feasible and again.iteration_time == sol.iteration_time
    assert sol is start or sol.iteration_time < start.iteration_time
    # decisions: galloping then bisecting takes logarithmically many
    assert found.decisions <= 2 * math.ceil(math.log2(1 / tol)) + 10
    # a generous time limit changes nothing; none at all stops before the first decision
    later = two_chunk_search(P, start, tolerance=tol, time_limit=3600.0)
    assert (later.bottleneck, later.lower_bound, later.decisions) == (
        found.bottleneck,
        found.lower_bound,
        found.decisions,
    )
    now = two_chunk_search(P, start, tolerance=tol, time_limit=0.0)
    assert now.decisions == 0 or math.isclose(now.bottleneck, found.bottleneck)


def uniform_blocks(n, p, M=2):
    """n blocks of 1 s whatever the option, no memory bound, two chunks on each of p devices."""
    return PartitionProblem(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n, time=((1.0, 1.0, 1.0),) * n,
        act=((2, 1, 0),) * n, static=(0,) * n, cut_time=(0.0,) * (n + 1), cut_bytes=(0,) * (n + 1),
        num_params=(1,) * n, flops=(1.0,) * n, num_stages=2 * p, num_microbatches=M, schedule="interleaved",
        virtual_stages=2,
    )


def test_reachability_by_hand_at_exactly_the_bound():
    # Five 1 s blocks, 2 devices x 2 chunks: every plan has stages 1, 1, 1, 2 in some order and largest
    # device time 3 s. At tau = 3 from (m, 0, m), m in {2, 3}, device 0 takes a + b <= 3 blocks; a state
    # is kept when the rest fits device 1 (fastest work <= 3 s: (m - i) + (5 - j) <= 3, exactly 3 for
    # (2, 1, 3) and (3, 1, 4)) and leaves a block per stage (m - i >= 1, 5 - j >= 1).
    P = uniform_blocks(5, 2)
    iv = _Intervals(P, math.inf)
    assert iv.L == 5 and _least_sum(P, iv) == 5.0
    history = _reachable(P, iv, 3.0)
    states = [{tuple(int(x) for x in k) for k in np.argwhere(R)} for R in history]
    assert states == [{(2, 0, 2), (3, 0, 3)}, {(2, 1, 3), (2, 1, 4), (3, 1, 4), (3, 2, 4)}, {(2, 2, 5), (3, 3, 5)}]
    assert _reachable(P, iv, 3.0 * (1 - 1e-9)) is None
    # read back: the least split (2); device 1 from (2, 5) takes one block of each half first (to
    # (2, 1, 4)), device 0 then one and two blocks
    assert _plan(P, iv, 3.0, history).boundaries == (0, 1, 2, 4, 5)
    # the search: sigma / p = 2.5 s below, 3 s found; the bound M x tau_lo + c x sigma within the tolerance
    start = evaluate(P, (0, 1, 2, 3, 5), ("none",) * 5)
    found = two_chunk_search(P, start)
    assert found.bottleneck == 3.0 and found.solution is start and found.decisions > 0
    assert 2 * 3.0 * (1 - 1e-4) + 0.25 * 5 <= found.lower_bound <= start.iteration_time == 7.25
    # at a 10% tolerance: [2.5, 3], the first decision is the midpoint 2.75 (above 3 x 0.9), a no; the bracket
    # [2.75, 3] is then within 10% of 3, so the bound is 2 x 2.75 + 0.25 x 5 = 6.75
    coarse = two_chunk_search(P, start, tolerance=0.1)
    assert coarse.decisions == 1 and coarse.bottleneck == 3.0 and coarse.lower_bound == pytest.approx(6.75)


def test_search_closes_at_once_when_the_average_is_reached():
    # Four 1 s blocks on 2 devices x 2 chunks: one plan, every device 2 s = sigma / p. The bracket
    # [sigma / p (1 - 1e-12), 2] is closed before any decision; the bound is the plan's time to 1e-12.
    P = uniform_blocks(4, 2)
    start = evaluate(P, (0, 1, 2, 3, 4), ("none",) * 4)
    found = two_chunk_search(P, start)
    assert found.decisions == 0 and found.bottleneck == 2.0 and found.solution is start
    assert 0 <= found.gap <= 1e-11


@given(exact_problems(), st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_search_gallops_then_bisects_and_keeps_the_first_best_plan(P, data):
    """The search's documented rule, step by step: hi starts at the best polished plan's largest device
    time (at most the interval cap), lo at sigma / p; each decision asks tau = max(midpoint, hi (1 - step))
    with step = tolerance x 4^k while every answer was yes, the midpoint after the first no; a no raises
    lo to tau, a yes lowers hi to the found plan's largest device time; it stops when hi - lo <= tol hi.
    It returns the first plan of least iteration time among the incumbent and every plan it evaluated."""
    start = random_incumbent(P, data)
    if start is None:
        return
    tol = data.draw(st.sampled_from([1e-4, 1e-2, 0.1, 0.3]), label="tolerance")
    seen = {"caps": [], "sigma": [], "decisions": [], "device_max": [], "plans": []}
    real = {k: getattr(interleaved, k) for k in ("_Intervals", "_least_sum", "_reachable", "_device_max")}

    class Recorded(real["_Intervals"]):
        def __init__(self, problem, max_time):
            seen["caps"].append(max_time)
            super().__init__(problem, max_time)

        def plan(self, problem, bounds):
            sol = super().plan(problem, bounds)
            seen["plans"].append(sol)
            return sol

    def least_sum(*args):
        seen["sigma"].append(real["_least_sum"](*args))
        return seen["sigma"][-1]

    def reachable(P_, iv, tau):
        history = real["_reachable"](P_, iv, tau)
        seen["decisions"].append((tau, history is not None))
        return history

    def device_max(*args):
        seen["device_max"].append(real["_device_max"](*args))
        return seen["device_max"][-1]

    fakes = {"_Intervals": Recorded, "_least_sum": least_sum, "_reachable": reachable, "_device_max": device_max}
    if data.draw(st.booleans(), label="without the polish"):  # it gallops far from a plan the polish leaves be
        real["_polish"] = interleaved._polish
        fakes["_polish"] = lambda P_, iv, bounds: bounds
    for k, f in fakes.items():
        setattr(interleaved, k, f)
    try:
        found = two_chunk_search(P, start, tolerance=tol)
    finally:
        for k, f in real.items():
            setattr(interleaved, k, f)
    p, M = P.num_devices, P.num_microbatches
    c = (p - 1) / (2 * p)
    work = sum(min(t) for t in P.time)
    [cap], [sigma] = seen["caps"], seen["sigma"]
    assert cap == (start.iteration_time - c * work) / M * (1 + 1e-9)  # better plans' stages are below it
    lo, hi, step = sigma / p * (1 - 1e-12), min(cap, seen["device_max"][0]), tol
    maxima = iter(seen["device_max"][1:])
    for tau, yes in seen["decisions"]:
        assert hi - lo > tol * hi
        assert tau == (max((lo + hi) / 2, hi * (1 - step)) if step else (lo + hi) / 2)
        step *= 4
        if yes:
            hi = min(hi, next(maxima))
        else:
            lo, step = tau, 0.0
    assert not hi - lo > tol * hi and next(maxima, None) is None
    assert found.decisions == len(seen["decisions"]) and found.bottleneck == hi
    assert found.lower_bound == min(M * lo + c * sigma, found.solution.iteration_time)
    # the plans evaluated: the polished incumbent, then per yes the read-back plan and its polished one
    plans = seen["plans"]
    assert len(plans) == 1 + 2 * sum(yes for _, yes in seen["decisions"])
    candidates = [start] + [s for s in [plans[0]] + plans[2::2] if s.feasible]
    least = min(s.iteration_time for s in candidates)
    assert found.solution is next(s for s in candidates if s.iteration_time == least)


def test_read_back_plan_keeps_every_device_within_tau_with_slow_links():
    # Blocks 1, 2, 1, 3, 3, 3 s, links after blocks 2 and 4 cost 0.75 and 0.25 s on both sides: the least
    # largest device time is 7 s (brute force). The remaining-work filter counts no link time, so a state
    # it keeps can have predecessors that are reachable but too slow: the read-back must check the times.
    P = dataclasses.replace(uniform_blocks(6, 2), time=tuple((float(t),) * 3 for t in (1, 2, 1, 3, 3, 3)),
                            cut_time=(0.0, 0.0, 0.75, 0.0, 0.25, 0.0, 0.0))
    iv = _Intervals(P, math.inf)
    assert least_bottleneck(P, iv) == 7.0
    sol = _plan(P, iv, 7.0, _reachable(P, iv, 7.0))
    assert max(device_times(P, iv, sol.boundaries)[0]) <= 7.0 and max(
        sol.stage_time[d] + sol.stage_time[2 + d] for d in range(2)) <= 7.0
