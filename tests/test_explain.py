"""Why no plan fits (solver/explain.py): the least-memory split against brute force, and the message."""

from __future__ import annotations

import itertools
import random

import pytest

from omnibal_compile.planning.explain import explain_infeasible, least_memory_split
from omnibal_compile.planning.problem import OPTIONS, PartitionProblem, stage_figures


def random_problem(rng: random.Random) -> PartitionProblem:
    schedule = rng.choice(("gpipe", "1f1b", "interleaved"))
    v = rng.choice((1, 2)) if schedule == "interleaved" else 1
    n = rng.randint(2 * v, 7)
    S = v * rng.randint(1, min(n, 4) // v)
    M = rng.choice([m for m in range(1, 7) if schedule != "1f1b" or m >= S] if schedule != "interleaved"
                   else [S // v * k for k in (1, 2)])
    act = []
    for _ in range(n):
        a = rng.randint(0, 1000)
        s = rng.randint(0, a)
        act.append((a, s, rng.randint(0, s)))
    return PartitionProblem(
        names=tuple(f"b{i}" for i in range(n)), kinds=("layer",) * n,
        time=tuple((1.0, 1.1, 1.3) for _ in range(n)), act=tuple(act),
        static=tuple(rng.randint(0, 1000) for _ in range(n)),
        cut_time=(0.0,) * (n + 1),
        cut_bytes=tuple(rng.randint(0, 500) for _ in range(n + 1)),  # both ends too: stage_io ignores them
        num_params=(1,) * n, flops=(1.0,) * n, num_stages=S, num_microbatches=M, schedule=schedule,
        virtual_stages=v, allowed=tuple(rng.sample(OPTIONS, rng.randint(1, 3))),
        gathered=tuple(float(rng.randint(0, 300)) for _ in range(n)) if rng.random() < 0.5 else (),
        workspace=tuple(float(rng.randint(0, 300)) for _ in range(n)) if rng.random() < 0.5 else (),
    )


def brute_force_least(P: PartitionProblem) -> float:
    """Smallest per-device budget of any split, every block on the option that keeps least in total."""
    least = min((OPTIONS.index(o) for o in P.allowed), key=lambda o: sum(a[o] for a in P.act))
    best = float("inf")
    for cuts in itertools.combinations(range(1, P.n), P.num_stages - 1):
        b = (0, *cuts, P.n)
        need = max(P.virtual_stages * stage_figures(P, s, b[s], b[s + 1], [least] * (b[s + 1] - b[s]))[1]
                   for s in range(P.num_stages))
        best = min(best, need)
    return best


@pytest.mark.parametrize("seed", range(300))
def test_least_memory_split_matches_brute_force(seed):
    P = random_problem(random.Random(seed))
    boundaries, mems, needed = least_memory_split(P)
    assert needed == pytest.approx(brute_force_least(P), rel=1e-12, abs=1e-9)
    least = min((OPTIONS.index(o) for o in P.allowed), key=lambda o: sum(a[o] for a in P.act))
    assert boundaries[0] == 0 and boundaries[-1] == P.n and all(x < y for x, y in zip(boundaries, boundaries[1:]))
    for s in range(P.num_stages):
        i, j = boundaries[s], boundaries[s + 1]
        assert mems[s] == pytest.approx(stage_figures(P, s, i, j, [least] * (j - i))[1], rel=1e-12)
    assert max(P.virtual_stages * m for m in mems) == pytest.approx(needed, rel=1e-12, abs=1e-9)


def test_nothing_to_hold_needs_nothing():
    P = PartitionProblem(names=("a", "b"), kinds=("layer",) * 2, time=((1.0, 1.0, 1.0),) * 2, act=((0, 0, 0),) * 2,
                         static=(0, 0), cut_time=(0.0,) * 3, cut_bytes=(0, 0, 0), num_params=(0, 0), flops=(0.0, 0.0),
                         num_stages=2, num_microbatches=2)
    assert least_memory_split(P) == ([0, 1, 2], [0.0, 0.0], 0.0)


def test_the_message_names_stage_overflow_and_the_smallest_budget():
    P = PartitionProblem(names=("vit", "proj", "llm"), kinds=("layer",) * 3, time=((1.0, 1.0, 1.0),) * 3,
                         act=((4096, 2048, 1024),) * 3, static=(512, 1024, 8192), cut_time=(0.0,) * 4,
                         cut_bytes=(0, 0, 0, 0), num_params=(1,) * 3, flops=(1.0,) * 3, num_stages=2,
                         num_microbatches=2, allowed=("none", "selective"), budget=(4096.0, 4096.0))
    text = explain_infeasible(P)
    # least memory: selective everywhere. Split (0, 2, 3): stage 0 holds 1536 static + 2 in flight x 2 x 2048
    # = 9.5 KiB, stage 1 8192 + 1 x 2048 = 10 KiB; split (0, 1, 3) needs 13 KiB on stage 1
    assert "(selective recomputation everywhere, 1f1b with 2 micro-batches)" in text
    assert "needs 10.00 KiB on stage 1 (blocks llm .. llm, on device 1) whose budget is 4.00 KiB" in text
    assert "over by 6.00 KiB" in text and "smallest per-device budget that fits is 10.00 KiB" in text
    assert "Allowing recomputation (recompute='auto' or 'full')" in text
    assert "Allowing" not in explain_infeasible(PartitionProblem(**{**P.__dict__, "allowed": ("none", "full")}))
