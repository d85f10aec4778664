"""The layout search (omnibal_compile.planning.layout): paper scale against the paper's layout, pruning, budgets,
costs."""

from __future__ import annotations

import math

import pytest

from bench.studies.paper_layout import paper_layout_times
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.costs.mix import scale_costs
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
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
    assert not any(c.status == "not planned" for c in every.candidates)
    for c in pruned.candidates:
        if c.planned:
            assert pruned.best.time_per_unit_s <= c.time_per_unit_s
        elif c.status == "not planned":
            assert c.estimate_s > pruned.best.time_per_unit_s * (1 + PRUNE_MARGIN)
    # the best plan fits and is the one the table's first row describes
    assert pruned.best.peak_memory_bytes <= 900 * MIB and pruned.candidates[0] is pruned.best
    assert pruned.plan.num_stages == pruned.best.layout.num_stages and pruned.plan.dp.size == pruned.best.layout.dp


def test_candidates_are_a_table_with_reasons():
    result = search_layout(table(), devices=8, global_batch=8, memory_budget=900 * MIB, microbatch_sizes=(1, 2))
    text = result.table()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layout", "tp", "estimate"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(result.candidates)
    # 1F1B needs a micro-batch per stage: 8 samples in micro-batches of 2 are too few for a pipeline of 8
    short = [c for c in result.candidates if c.layout.schedule == "1f1b" and c.layout.num_microbatches < c.layout.pp]
    assert short and all(
        c.status == "rejected" and "needs at least one micro-batch per stage" in c.reason for c in short
    )
    assert "best" in lines[2] and result.best.layout.describe() in lines[2]
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
