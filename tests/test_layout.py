"""The layout search (omnibal_compile.planning.layout): paper scale against the paper's layout, pruning, budgets,
costs."""

from __future__ import annotations

import itertools
import math

import pytest

from bench.studies.paper_layout import paper_layout_times
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.costs.mix import scale_costs
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.planning import problem_from_costs
from omnibal_compile.planning.layout import PRUNE_MARGIN, Layout, search_layout
from omnibal_compile.sim import simulate

MIB = 2**20


def table(n: int = 10) -> CostTable:
    """A small chain: a heavy first block (a vision tower), alternating layer sizes, 64 MiB of weights each."""
    blocks = []
    for i in range(n):
        f = 0.004 if i == 0 else 0.001 * (1 + i % 2)
        act = 40 * MIB * (1 + i % 2)
        blocks.append(BlockCost(
            name=f"b{i}", kind="layer", flops=f * 1e12, num_params=4 * MIB, static_bytes=64 * MIB, forward_s=f,
            backward_s=2 * f, activation_bytes={"none": act, "selective": act // 2, "full": act // 8},
            recompute_s={"none": 0.0, "selective": f / 4, "full": f},
        ))
    return CostTable(blocks=tuple(blocks), cut_bytes=(0, *[4 * MIB] * (n - 1), 0), link_bandwidth=50e9,
                     device="test", source="roofline")


def test_scaled_costs_are_the_simulators_micro_batch_scale():
    t = table()
    plan = Plan(block_names=t.names, boundaries=(0, 3, 6, 10), recompute=("selective",) * 10, num_microbatches=4)
    assert simulate(plan, scale_costs(t, 3)).iteration_time_s == pytest.approx(
        simulate(plan, t, microbatch_costs=[3.0] * 4).iteration_time_s)
    s = scale_costs(t, 3).blocks[1]
    assert (
        s.static_bytes == t.blocks[1].static_bytes
        and s.activation_bytes["full"] == 3 * t.blocks[1].activation_bytes["full"]
    )


def test_pruned_search_finds_the_exhaustive_best_and_beats_every_listed_layout():
    kwargs = dict(devices=8, global_batch=32, memory_budget=900 * MIB, microbatch_sizes=(1, 2))
    pruned = search_layout(table(), **kwargs)
    every = search_layout(table(), **kwargs, prune=None)
    assert every.best.layout == pruned.best.layout
    assert pruned.best.time_per_unit_s == pytest.approx(every.best.time_per_unit_s)
    # without pruning, only what the planner does not take is left unplanned (this table has no B/W split)
    assert not any(c.status == "not planned" and "estimate" in c.reason for c in every.candidates)
    assert all(c.layout.zero_bubble or c.layout.num_stages > 10 for c in every.candidates if c.status == "not planned")
    for c in pruned.candidates:
        if c.planned:
            assert pruned.best.time_per_unit_s <= c.time_per_unit_s
        elif c.status == "not planned" and "estimate" in c.reason:
            assert c.estimate_s > pruned.best.time_per_unit_s * (1 + PRUNE_MARGIN)
    # the best plan fits and is the one the table's first row describes
    assert pruned.best.peak_memory_bytes <= 900 * MIB and pruned.candidates[0] is pruned.best
    assert pruned.plan.num_stages == pruned.best.layout.num_stages and pruned.plan.dp.size == pruned.best.layout.dp


def test_candidates_are_a_table_with_reasons():
    result = search_layout(table(), devices=8, global_batch=8, memory_budget=900 * MIB, microbatch_sizes=(1, 2))
    text = result.table()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layout", "schedule", "estimate"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(result.candidates)
    # 1F1B needs a micro-batch per stage: 8 samples in micro-batches of 2 are too few for a pipeline of 8
    short = [c for c in result.candidates if c.layout.schedule == "1f1b" and c.layout.num_microbatches < c.layout.pp]
    assert short and all(
        c.status == "rejected" and "needs at least one micro-batch per stage" in c.reason for c in short
    )
    best = result.best.layout
    assert "best" in lines[2] and best.describe(schedule=False) in lines[2] and best.schedule_label in lines[2]
    assert "chosen: " + result.best.layout.describe() in result.summary()


def test_too_small_a_budget_names_the_least_that_fits():
    with pytest.raises(PlanError, match=r"fits the memory budget of 100\.00 MiB per device.*at least") as err:
        search_layout(table(), devices=4, global_batch=16, memory_budget=100 * MIB, microbatch_sizes=(1,))
    least = err.value.least_budget
    assert least > 100 * MIB
    search_layout(table(), devices=4, global_batch=16, memory_budget=least * 1.001, microbatch_sizes=(1,))
    with pytest.raises(PlanError):
        search_layout(table(), devices=4, global_batch=16, memory_budget=least * 0.99, microbatch_sizes=(1,))


def test_inputs_are_checked():
    with pytest.raises(InputError, match="devices"):
        search_layout(table(), devices=0, global_batch=8)
    with pytest.raises(InputError, match="do not divide"):
        search_layout(table(), devices=8, global_batch=8, pipeline=[3])
    with pytest.raises(PlanError, match="splits a global batch of 3"):
        search_layout(table(), devices=2, global_batch=3, pipeline=[1], microbatch_sizes=(2,))


def test_topology_puts_pipelines_on_nvlink_and_replicas_across_nodes():
    result = search_layout(table(), devices=16, global_batch=64, device=A100_80G, pipeline=[8], virtual_stages=[1])
    assert result.costs.link_bandwidth == A100_80G.link_bandwidth("nvlink")
    assert result.costs.dp_link_bandwidth == A100_80G.link_bandwidth("infiniband")
    inside = search_layout(table(), devices=8, global_batch=64, device=A100_80G, pipeline=[2], virtual_stages=[1])
    assert inside.costs.dp_link_bandwidth == A100_80G.link_bandwidth("nvlink")


# -- paper scale ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def internvl_128():
    from bench.studies.paper_layout import PAPER_BUDGET_FRACTION, PAPER_GLOBAL_BATCH, sample_costs
    from omnibal_compile.costs.analytic import INTERNVL_6B_20B

    costs = sample_costs(INTERNVL_6B_20B, device=A100_80G)
    budget = PAPER_BUDGET_FRACTION * A100_80G.memory_bytes
    result = search_layout(costs, devices=128, global_batch=PAPER_GLOBAL_BATCH, memory_budget=budget,
                           microbatch_sizes=(1, 4), device=A100_80G)
    return costs, budget, result


def test_internvl_on_128_devices_beats_the_papers_pp8_dp16(internvl_128):
    costs, budget, result = internvl_128
    best = result.best
    assert best.layout.devices == 128 and best.peak_memory_bytes <= budget
    # The paper's layout, planned and simulated here on its own: PP 8 x DP 16, 1F1B, 16 micro-batches of 4 samples.
    paper = list(paper_layout_times(costs, budget).values())
    assert paper, "the paper's layout fits under some data-parallel layout"
    assert best.time_per_unit_s <= min(paper)
    for c in result.candidates:
        shown = c.time_per_unit_s if c.planned else c.estimate_s
        if c.status != "rejected" and not math.isnan(shown):
            assert best.time_per_unit_s <= shown


def test_internvl_search_lists_every_layout_once(internvl_128):
    _, _, result = internvl_128
    layouts = [c.layout for c in result.candidates]
    assert len(layouts) == len(set(layouts))
    assert {lay.pp for lay in layouts} == {1, 2, 4, 8, 16, 32, 64}  # 128 > the 97 blocks
    assert all(c.reason for c in result.candidates if c.status in ("rejected", "not planned"))
    assert set(RECOMPUTE_OPTIONS) >= set(result.plan.block_recompute)


def test_a_plan_whose_simulated_peak_overflows_is_planned_again_or_rejected():
    from omnibal_compile.planning.layout import _plan_and_simulate

    t = table()
    lay = Layout(pp=2, virtual_stages=2, microbatch_size=1, num_microbatches=4)
    problem = problem_from_costs(t, num_stages=4, num_microbatches=4, schedule="interleaved", virtual_stages=2,
                                 budget=2000 * MIB)
    first = _plan_and_simulate(problem, t, lay, 0.0, 2000 * MIB)
    # the simulator is the judge: a budget under the first plan's simulated peak forces a tighter plan
    tighter = 0.8 * first.peak_memory_bytes
    again = _plan_and_simulate(problem, t, lay, 0.0, tighter)
    assert (again.planned and again.peak_memory_bytes <= tighter) or "over the budget" in again.reason
    assert again.planned  # this chain can trade recomputation for memory
    assert again.time_per_unit_s >= first.time_per_unit_s


# -- optimize(devices=...) --------------------------------------------------------------------------
def test_optimize_chooses_the_layout_for_a_device_count(vlm, capsys):
    import omnibal_compile as oc

    model, batch = vlm
    result = oc.optimize(model, batch, devices=4, device="a100-80gb", memory_budget="2GiB")
    out = capsys.readouterr().err
    assert "layout search: 4 devices" in out and "chosen: " + result.layout.best.layout.describe() in out
    best = result.layout.best.layout
    assert (result.plan.num_stages, result.plan.num_microbatches, result.plan.dp.size) == (
        best.num_stages, best.num_microbatches, best.dp)
    assert len(result.stages) == best.num_stages and result.check_parity().ok
    # the plan is the one the search simulated, on the costs it kept
    assert simulate(result.plan, result.costs).iteration_time_s == pytest.approx(result.layout.best.iteration_s)
    # what the caller fixes is pinned: 2 stages of 8 devices leave DP 4
    pinned = oc.optimize(model, batch, devices=8, num_stages=2, device="a100-80gb")
    assert pinned.plan.num_stages == 2 and pinned.plan.dp.size == 4
    assert {c.layout.pp for c in pinned.layout.candidates} == {2}


def test_optimize_without_stages_or_devices_says_what_it_assumed(vlm, capsys, monkeypatch):
    import omnibal_compile as oc

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    model, batch = vlm
    result = oc.optimize(model, batch, device="a100-80gb")
    assert "1 device assumed" in capsys.readouterr().err
    assert result.plan.num_stages == 1 and result.layout.devices == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert oc.optimize(model, batch, device="a100-80gb").layout.devices == 2
    assert "2 devices from torchrun's WORLD_SIZE" in capsys.readouterr().err


# -- the schedule among the choices ------------------------------------------------------------------
ONE_DEVICE_CHUNKS = (("1f1b", 1), ("interleaved", 2), ("interleaved-zb", 1), ("interleaved-zb", 2), ("zbv", 2),
                     ("dualpipev", 2))


def split_table(blocks, *, send: float = 0.0, recompute: tuple[float, float] = (0.3, 1.0), act: int = 1000):
    """Blocks of (forward, backward, weight-gradient part) seconds, B/W split; ``send`` seconds per cut;
    selective and full recomputation at those fractions of the forward."""
    made = [BlockCost(name=f"b{i}", kind="layer", flops=0.0, num_params=0, static_bytes=100, forward_s=f,
                      backward_s=b, weight_grad_s=w,
                      activation_bytes={"none": act, "selective": act // 2, "full": act // 10},
                      recompute_s={"none": 0.0, "selective": recompute[0] * f, "full": recompute[1] * f})
            for i, (f, b, w) in enumerate(blocks)]
    n = len(made)
    return CostTable(blocks=tuple(made), cut_bytes=(0, *[1] * (n - 1), 0),
                     link_bandwidth=1 / send if send else float("inf"), device="test", source="modelled")


def vlm_table(*, frozen: bool = False, vit: int = 3, llm: int = 5, vit_f: float = 1.0, send: float = 0.0):
    """A ViT (W half its backward; none when frozen) before heavier LLM blocks."""
    tower = [(vit_f, vit_f * (1.0 if frozen else 2.0), 0.0 if frozen else vit_f)] * vit
    return split_table(tower + [(1.0, 2.2, 1.2)] * llm, send=send)


def brute_force(costs: CostTable, M: int) -> tuple[float, str]:
    """(least simulated seconds per micro-batch, schedule) over every schedule on 2 devices and every cut vector,
    no recomputation."""
    n, best = len(costs.blocks), None
    for kind, v in ONE_DEVICE_CHUNKS:
        S = 2 * v
        try:
            Schedule(kind=kind, num_microbatches=M, virtual_stages=v).check(S)
        except PlanError:
            continue
        for c in itertools.combinations(range(1, n), S - 1):
            plan = Plan(block_names=costs.names, boundaries=(0, *c, n), schedule=kind, num_microbatches=M,
                        virtual_stages=v)
            t = simulate(plan, costs).iteration_time_s / M
            if best is None or t < best[0] * (1 - 1e-12):
                best = (t, f"{kind} x{v}")
    assert best is not None
    return best


def test_zbv_wins_by_the_simulators_figure():
    # a V on 2 devices fits 8 KiB with the least recomputation: zbv beats every 1F1B layout and the other
    # zero-bubble schedules; the sentence says by how much, from the simulated times
    costs = vlm_table()
    result = search_layout(costs, devices=2, num_microbatches=3, pipeline=[2], memory_budget=8 * 1024)
    best, one = result.best, result.best_of(zero_bubble=False)
    assert best.layout.schedule == "zbv" and best.layout.virtual_stages == 2 and one is not None
    for c in (best, one):
        assert c.plan is not None
        sim = simulate(c.plan, result.costs)
        assert c.time_per_unit_s == pytest.approx(sim.iteration_time_s / 3, rel=1e-12)
        assert max(sim.peak_memory_bytes) <= 8 * 1024
    # the zero-bubble estimate is optimistic (no bubble at all), so it never prunes a better plan away
    assert all(c.estimate_s <= c.time_per_unit_s for c in result.candidates if c.planned and c.layout.zero_bubble)
    others = [c for c in result.candidates if c.planned and c is not best]
    assert others and all(c.time_per_unit_s > best.time_per_unit_s * 1.01 for c in others)
    less = 1 - best.time_per_unit_s / one.time_per_unit_s
    assert less > 0.05
    assert f"schedule: zbv won: {less:.1%} less time per sample" in result.verdict()
    assert one.layout.describe() in result.verdict()
    assert best.plan.planner == "zero-bubble search"
    text = result.summary()
    assert result.verdict() in text and text.splitlines()[1].split()[:3] == ["layout", "schedule", "estimate"]


def test_1f1b_wins_where_the_budget_makes_the_zero_bubble_schedules_recompute():
    # little W to fill the bubble, costly sends and costly recomputation: under 5 KB the zero-bubble schedules
    # hold more micro-batches and must recompute, so 1F1B wins; without the budget a zero-bubble schedule does
    costs = split_table([(1.0, 2.0, 0.2)] * 6, send=2.0, recompute=(1.5, 3.0))
    kwargs = dict(devices=2, num_microbatches=4, pipeline=[2])
    tight = search_layout(costs, memory_budget=5000, **kwargs)
    zb = tight.best_of(zero_bubble=True)
    assert tight.best.layout.schedule == "1f1b" and zb is not None
    more = zb.time_per_unit_s / tight.best.time_per_unit_s - 1
    assert more > 0.02
    assert f"schedule: 1F1B won: the best zero-bubble layout ({zb.layout.describe()}" in tight.verdict()
    assert f"takes {more:.1%} more time" in tight.verdict()
    assert search_layout(costs, **kwargs).best.layout.zero_bubble
    # the zero-bubble plans that recompute are marked as the runtime's gap (ScheduleRule.runtime_gaps), not hidden
    recomputing = [c for c in tight.candidates if c.planned and c.layout.zero_bubble
                   and any(o != "none" for o in c.plan.block_recompute)]
    assert recomputing and all(c.runtime_note == "not run yet: recomputation with a split-backward schedule"
                               for c in recomputing)
    assert all(c.runtime_note == "" for c in tight.candidates if not c.layout.zero_bubble)
    assert "not run yet: recomputation with a split-backward schedule" in tight.table()


def test_a_frozen_tower_changes_the_schedule_as_brute_force_does():
    # W = 0 on a frozen ViT leaves less to fill the bubble with: the choice moves from zbv to ZB-H1
    # (interleaved-zb, one stage per device), the schedule and cuts brute force over every schedule finds
    chosen = {}
    for frozen in (False, True):
        costs = vlm_table(frozen=frozen, vit=3, llm=4, vit_f=2.0, send=2.0)
        result = search_layout(costs, devices=2, num_microbatches=2, pipeline=[2], recompute="none")
        t, kind = brute_force(costs, 2)
        best = result.best.layout
        assert result.best.time_per_unit_s == pytest.approx(t, rel=1e-12)
        assert f"{best.schedule} x{best.virtual_stages}" == kind
        chosen[frozen] = kind
    assert chosen == {False: "zbv x2", True: "interleaved-zb x1"}


def test_schedules_the_planner_does_not_take_are_listed_with_the_reason(monkeypatch):
    # no B/W split in the costs; data parallelism (planned at DP 1 only); more cut vectors than the exact search takes
    whole = search_layout(table(), devices=4, global_batch=8)
    zb = [c for c in whole.candidates if c.layout.zero_bubble]
    assert {c.layout.schedule for c in zb} == {"interleaved-zb", "zbv", "dualpipev"}
    assert all(c.status == "not planned" and "does not split the backward" in c.reason for c in zb)
    assert "no zero-bubble layout was planned" in whole.verdict()
    costs = vlm_table()
    result = search_layout(costs, devices=4, num_microbatches=4)
    replicated = [c for c in result.candidates if c.layout.zero_bubble and c.layout.dp > 1]
    assert replicated and all("without data parallelism only" in c.reason for c in replicated)
    assert len({(c.layout.pp, c.layout.schedule, c.layout.virtual_stages) for c in replicated}) == len(replicated)
    monkeypatch.setattr("omnibal_compile.planning.zero_bubble.MAX_CUT_VECTORS", 5)
    bounded = search_layout(costs, devices=2, num_microbatches=4, pipeline=[2])
    large = [c for c in bounded.candidates if c.layout.zero_bubble]
    assert large and all(c.status == "not planned" and "cut vector" in c.reason for c in large)
    assert not bounded.best.layout.zero_bubble
    with pytest.raises(InputError, match="on 1 device there is no pipeline"):
        search_layout(costs, devices=1, num_microbatches=4, schedules=["zbv"])


def test_a_tie_goes_to_1f1b():
    # no weight gradients at all: ZB-H1 runs as 1F1B does, in the same time and memory; 1F1B is kept
    result = search_layout(split_table([(1.0, 2.0, 0.0)] * 4), devices=2, num_microbatches=4, pipeline=[2],
                           virtual_stages=[1])
    zb = result.best_of(zero_bubble=True)
    assert zb is not None and zb.layout.schedule == "interleaved-zb"
    assert zb.time_per_unit_s == pytest.approx(result.best.time_per_unit_s, rel=1e-12)
    assert result.best.layout.schedule == "1f1b" and "ties it; the tie goes to 1F1B" in result.verdict()


def test_the_zero_bubble_search_is_bounded_in_time():
    # past its time limit the exact search's best plan so far scores the layout, and the table says so
    costs = split_table([(1.0 + 0.1 * (i % 3), 2.0, 1.0) for i in range(20)])
    result = search_layout(costs, devices=4, num_microbatches=8, pipeline=[4], schedules=["zbv"],
                           zero_bubble_time_limit=0.05, recompute="none")
    (zbv,) = result.candidates
    assert zbv.planned and "stopped at its 0.05 s limit: its best plan so far" in zbv.reason
    assert zbv.plan is not None and zbv.plan.notes["status"] == "time limit"
