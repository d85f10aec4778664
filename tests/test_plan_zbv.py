"""The zbv planner (planning.zero_bubble): its choice equals brute force by the simulator over every cut vector and
recompute option, it follows the weight gradients (a frozen tower has none), and it fits the V's memory (two
stages per device, each micro-batch alive until its W). Torch-free: tiny hand-built cost tables."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.planning import evaluate, in_flight, problem_from_costs, solve
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.planning.zero_bubble import solve_zero_bubble
from omnibal_compile.sim import simulate, stage_schedule_time
from omnibal_compile.sim.simulate import live_counts


def _block(i: int, f: float, b: float, w: float, act: int = 1000) -> BlockCost:
    return BlockCost(name=f"b{i}", kind="layer", flops=0.0, num_params=0, static_bytes=100, forward_s=f,
                     backward_s=b, weight_grad_s=w,
                     activation_bytes={"none": act, "selective": act // 2, "full": act // 10},
                     recompute_s={"none": 0.0, "selective": 0.3 * f, "full": f})


def _vlm(*, frozen: bool = False, vit: int = 3, llm: int = 4) -> CostTable:
    """A ViT of ``vit`` blocks (W half the backward; none when frozen) before ``llm`` heavier LLM blocks."""
    blocks = [_block(i, 1.0, 1.0 if frozen else 2.0, 0.0 if frozen else 1.0, act=1500) for i in range(vit)]
    blocks += [_block(vit + i, 1.0, 2.2, 1.2) for i in range(llm)]
    return CostTable(blocks=blocks, cut_bytes=[0] * (len(blocks) + 1), link_bandwidth=float("inf"), device="test",
                     source="modelled")


def _plan(costs: CostTable, b, rec, M: int) -> Plan:
    return Plan(block_names=costs.names, boundaries=tuple(b), recompute=tuple(rec), schedule="zbv",
                num_microbatches=M, virtual_stages=2)


def _brute(costs: CostTable, S: int, M: int, budget=None, recompute="auto"):
    """Least simulated iteration time over every cut vector and per-block option that fits (planner's memory)."""
    P = problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule="zbv", virtual_stages=2, budget=budget,
                           recompute=recompute)
    n, best = len(costs.blocks), None
    for c in itertools.combinations(range(1, n), S - 1):
        b = (0, *c, n)
        for rec in itertools.product(P.allowed, repeat=n):
            if not evaluate(P, b, rec).feasible:
                continue
            t = simulate(_plan(costs, b, rec, M), costs).iteration_time_s
            if best is None or t < best[0] * (1 - 1e-12):
                best = (t, b, rec)
    return best


def test_solver_is_torch_free():
    code = ("import sys, omnibal_compile.planning.zero_bubble, omnibal_compile.planning.build; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("D", "M"), [(1, 2), (2, 2), (2, 4), (2, 5), (3, 6)])
def test_stage_time_is_the_simulators(D, M):
    # the planner's objective: the simulator's time of the stages' F, I, W and sends (none across the V's turn)
    base = _vlm(vit=3, llm=2 * D + 1)
    n = len(base.blocks)
    costs = CostTable(blocks=base.blocks, cut_bytes=[0] + [1] * (n - 1) + [0], link_bandwidth=2.0, device="test",
                      source="modelled")
    b = [0, *range(1, 2 * D), n]
    P = problem_from_costs(costs, num_stages=2 * D, num_microbatches=M, schedule="zbv", virtual_stages=2)
    sol = evaluate(P, b, ["selective"] * n)
    sim = simulate(_plan(costs, b, ["selective"] * n, M), costs)
    assert sol.iteration_time == pytest.approx(sim.iteration_time_s, rel=1e-12)
    parts = [costs.blocks[b[s]:b[s + 1]] for s in range(2 * D)]
    direct = stage_schedule_time(
        "zbv", D, M, forward_s=[sum(x.forward_s for x in p) for p in parts],
        backward_s=[sum(x.backward_s + x.recompute_s["selective"] for x in p) for p in parts],
        weight_s=[sum(x.weight_grad_s or 0.0 for x in p) for p in parts],
        send_s=[0.5] * (2 * D - 1) + [0.0], virtual_stages=2)
    assert direct == pytest.approx(sim.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("M", [2, 4, 6])
def test_choice_equals_brute_force_without_budget(frozen, M):
    costs = _vlm(frozen=frozen)
    plan = plan_with_costs(costs, num_stages=4, num_microbatches=M, schedule="zbv", virtual_stages=2,
                           recompute="none")
    t, _, _ = _brute(costs, 4, M, recompute="none")
    assert plan.schedule == "zbv" and plan.virtual_stages == 2 and plan.num_devices == 2
    assert "the simulator's, in the schedule's operation order" in plan.summary()
    assert plan.iteration_time_s == pytest.approx(t, rel=1e-12)
    assert simulate(plan, costs).iteration_time_s == pytest.approx(t, rel=1e-12)


@pytest.mark.parametrize("budget", [1.0e4, 5.0e3, 3.0e3])
def test_choice_equals_brute_force_with_recompute_under_a_budget(budget):
    costs = _vlm(vit=2, llm=3)
    M = 4
    P = problem_from_costs(costs, num_stages=4, num_microbatches=M, schedule="zbv", virtual_stages=2, budget=budget)
    sol = solve(P, "ilp")
    t, _, _ = _brute(costs, 4, M, budget=budget)
    assert sol.feasible
    assert sol.iteration_time == pytest.approx(t, rel=1e-12)
    sim = simulate(_plan(costs, sol.boundaries, sol.recompute, M), costs)
    assert sim.iteration_time_s == pytest.approx(t, rel=1e-12)
    # the V: device d holds stages d and 3 - d; with no workspace and no sends the bound is the simulated peak
    for d in range(2):
        device = sol.stage_memory[d] + sol.stage_memory[3 - d]
        assert device == pytest.approx(sim.peak_memory_bytes[d], rel=1e-12)
        assert sim.peak_memory_bytes[d] <= budget
    free = solve(problem_from_costs(costs, num_stages=4, num_microbatches=M, schedule="zbv", virtual_stages=2))
    assert max(free.stage_memory[d] + free.stage_memory[3 - d] for d in range(2)) > budget  # the budget binds
    assert sol.iteration_time > free.iteration_time


def test_frozen_tower_moves_the_cuts_where_brute_force_does():
    # With W = 0 on the ViT its blocks are cheaper and have nothing to fill the bubble with: the V moves the cuts
    # towards the LLM, as brute force over every cut vector finds.
    M = 4
    live, frozen = _vlm(), _vlm(frozen=True)
    a = plan_with_costs(live, num_stages=4, num_microbatches=M, schedule="zbv", virtual_stages=2, recompute="none")
    b = plan_with_costs(frozen, num_stages=4, num_microbatches=M, schedule="zbv", virtual_stages=2, recompute="none")
    assert a.boundaries == _brute(live, 4, M, recompute="none")[1]
    assert b.boundaries == _brute(frozen, 4, M, recompute="none")[1]
    assert a.boundaries != b.boundaries
    kept = simulate(_plan(frozen, a.boundaries, a.block_recompute, M), frozen).iteration_time_s
    assert b.iteration_time_s < kept * (1 - 1e-3)  # keeping the unfrozen cuts would be slower


@pytest.mark.parametrize(("kind", "D", "v", "M"), [("zbv", 2, 2, 4), ("zbv", 3, 2, 7), ("interleaved-zb", 4, 1, 8),
                                                ("interleaved-zb", 2, 2, 4), ("dualpipev", 2, 2, 6)])
def test_live_counts_are_the_simulators_in_flight(kind, D, v, M):
    # alive from F until W: the planner's count per stage is the simulator's peak in flight
    S = D * v
    costs = _vlm(vit=2, llm=S)
    P = problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule=kind, virtual_stages=v)
    b = list(range(S)) + [len(costs.blocks)]
    sim = simulate(Plan(block_names=costs.names, boundaries=b, schedule=kind, num_microbatches=M, virtual_stages=v),
                   costs)
    assert [in_flight(P, s) for s in range(S)] == list(sim.peak_inflight)


def test_deferred_w_memory_counts_under_zb_h1():
    # ZB-H1: device d holds d weight gradients back while its forwards go on, so their activations stay alive:
    # the last device holds S micro-batches at its peak (1F1B's holds 1), and the plan's memory says so.
    S, M = 4, 8
    assert [max(c[0] for c in live_counts("interleaved-zb", S, 1, M)[d]) for d in range(S)] == [S] * S
    costs = _vlm(vit=1, llm=3)
    zb = evaluate(problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule="interleaved-zb"),
                  range(S + 1), ["none"] * S)
    one = evaluate(problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule="1f1b"), range(S + 1),
                   ["none"] * S)
    assert zb.stage_memory[S - 1] == pytest.approx(100 + S * 1000)
    assert one.stage_memory[S - 1] == pytest.approx(100 + 1 * 1000)


@pytest.mark.parametrize(("kind", "D", "v", "M", "budget"), [("interleaved-zb", 3, 1, 6, None),
                                                           ("interleaved-zb", 3, 1, 6, 3.5e3),
                                                           ("dualpipev", 2, 2, 4, None),
                                                           ("dualpipev", 2, 2, 4, 5e3)])
def test_other_split_schedules_equal_brute_force(kind, D, v, M, budget):
    costs = _vlm(vit=2, llm=3)
    S = D * v
    P = problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule=kind, virtual_stages=v, budget=budget)
    sol = solve(P, "dp")
    n, best = len(costs.blocks), None
    for c in itertools.combinations(range(1, n), S - 1):
        b = (0, *c, n)
        for rec in itertools.product(P.allowed if budget else ("none",), repeat=n):
            if not evaluate(P, b, rec).feasible:
                continue
            plan = Plan(block_names=costs.names, boundaries=b, recompute=rec, schedule=kind, num_microbatches=M,
                        virtual_stages=v)
            t = simulate(plan, costs).iteration_time_s
            best = t if best is None else min(best, t)
    assert sol.feasible and sol.iteration_time == pytest.approx(best, rel=1e-12)
    sim = simulate(Plan(block_names=costs.names, boundaries=sol.boundaries, recompute=sol.recompute, schedule=kind,
                        num_microbatches=M, virtual_stages=v), costs)
    for d in range(D):
        assert sim.peak_memory_bytes[d] <= (budget or float("inf"))
    if budget:  # it binds: the plan is slower than the unconstrained one
        free = solve(problem_from_costs(costs, num_stages=S, num_microbatches=M, schedule=kind, virtual_stages=v))
        assert sol.iteration_time > free.iteration_time


def test_budget_binds_the_device_not_the_stage():
    # Two stages per device share its budget: a plan must fit their sum, not each stage half of it.
    costs = _vlm(vit=2, llm=4)
    P = problem_from_costs(costs, num_stages=4, num_microbatches=4, schedule="zbv", virtual_stages=2,
                           budget=6e3)
    sol = solve_zero_bubble(P)
    for d in range(2):
        assert sol.stage_memory[d] + sol.stage_memory[3 - d] <= 6e3
    assert max(sol.stage_memory) > 3e3  # a stage may hold more than half of its device's budget
    with pytest.raises(PlanError, match="no zbv plan .* fits the memory budget"):
        solve_zero_bubble(problem_from_costs(costs, num_stages=4, num_microbatches=4, schedule="zbv", virtual_stages=2,
                                     budget=500))


def test_refusals_name_the_fix():
    costs = _vlm()
    no_w = CostTable(blocks=[BlockCost(**{**b.__dict__, "weight_grad_s": None}) for b in costs.blocks],
                     cut_bytes=costs.cut_bytes, link_bandwidth=costs.link_bandwidth, device="test", source="modelled")
    with pytest.raises(InputError, match="does not split the backward"):
        plan_with_costs(no_w, num_stages=4, num_microbatches=4, schedule="zbv", virtual_stages=2)
    with pytest.raises(PlanError, match="plans .* without data parallelism only"):
        P = problem_from_costs(costs, num_stages=4, num_microbatches=4, schedule="zbv", virtual_stages=2)
        type(P)(**{**P.__dict__, "sync": (0.1,) * len(costs.blocks)})


@pytest.mark.parametrize("planner", ["ilp", "dp"])
def test_the_plan_names_the_search_that_made_it(planner):
    # the exact planners hand the split-backward schedules to the zero-bubble search; the plan says so
    plan = plan_with_costs(_vlm(), num_stages=4, num_microbatches=4, schedule="zbv", virtual_stages=2,
                           planner=planner, recompute="none")
    assert plan.planner == "zero-bubble search"
    assert plan.summary().startswith("Plan by 'zero-bubble search': 7 blocks in 4 stages, schedule zbv")



def test_the_time_limit_stops_a_search_that_has_a_plan():
    P = problem_from_costs(_vlm(vit=6, llm=14), num_stages=8, num_microbatches=8, schedule="zbv", virtual_stages=2,
                           recompute="none")  # 50,388 cut vectors: seconds to search them all
    sol = solve_zero_bubble(P, time_limit=0.0)  # the first plan found, then the limit
    assert sol.feasible and sol.status == "time limit" and sol.gap is None and sol.extra["simulated"] >= 1
