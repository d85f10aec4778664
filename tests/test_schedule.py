"""One schedule rule: the planner, the simulator and the runtime accept exactly what torch's schedules run."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from omnibal_compile import Plan, PlanError
from omnibal_compile.ir.costs import BlockCost, CostTable
from omnibal_compile.ir.schedule import CLASSIC_SCHEDULES, SCHEDULE_KINDS, SCHEDULES, Schedule
from omnibal_compile.planning import problem_from_costs, solve
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.planning.problem import PLANNED_SCHEDULES
from omnibal_compile.runtime import check_pipeline, get_schedule_class
from omnibal_compile.runtime.pipeline import RUNTIME_SCHEDULES
from omnibal_compile.sim import simulate

SIMULATED_SCHEDULES = frozenset(SCHEDULE_KINDS)

STAGES = range(1, 7)
VIRTUAL = range(1, 4)
MICROBATCHES = range(1, 10)


class _FakeStage:
    """What torch's schedule constructors read from a PipelineStage (no process group needed)."""

    def __init__(self, index: int, num_stages: int, num_ranks: int, rank: int | None = None) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = num_ranks, index % num_ranks if rank is None else rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = None  # the zero-bubble schedules look for a compiled module here


def torch_pipeline_order(kind: str, M: int, v: int, D: int) -> dict[int, list]:
    """Torch's own ``pipeline_order`` of schedule ``kind`` (multi-stage classes), built from fake stages."""
    cls = get_schedule_class(kind)
    sched = Schedule(kind=kind, num_microbatches=M, virtual_stages=v)
    S = D * v
    order = {}
    for rank in range(D):
        stages = [_FakeStage(s, S, D, rank) for s in sched.stages_of(rank, S)]
        order = cls(stages, M, loss_fn=lambda out, target: out).pipeline_order
    return order


def torch_runs(kind: str, M: int, v: int, S: int) -> bool:
    """Whether torch 2.13 builds this schedule on every rank (and, multi-stage, its dry run completes)."""
    if S % v:
        return False  # stage s runs on rank s % (S / v): every rank needs v stages
    D = S // v
    cls = get_schedule_class(kind)
    multi = issubclass(cls, PipelineScheduleMulti)
    if not multi and v > 1:
        return False  # a single-stage schedule takes one stage per rank
    loss = lambda out, target: out  # noqa: E731
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if not multi:
                cls(_FakeStage(0, S, D), M, loss_fn=loss)
                return True
            if Schedule(kind=kind, num_microbatches=M, virtual_stages=v).rule.split_backward:
                torch_pipeline_order(kind, M, v, D)  # builds on every rank (its own checks raise)
                return True
            order = None
            for rank in range(D):
                order = cls(
                    [_FakeStage(rank + c * D, S, D) for c in range(v)], M, loss_fn=loss
                ).pipeline_order_with_comms
            keep = {torch_schedules.F, torch_schedules.B, torch_schedules.SEND_F, torch_schedules.RECV_F,
                    torch_schedules.SEND_B, torch_schedules.RECV_B}
            compute = {
                r: [a for a in acts if a is not None and a.computation_type in keep] for r, acts in order.items()
            }
            torch_schedules._simulate_comms_compute(compute, lambda s: s % D, S)  # raises on a deadlock
    except (ValueError, RuntimeError, AssertionError, PlanError):
        return False
    return True


def _costs(S: int) -> CostTable:
    blocks = [
        BlockCost(name=f"b{i}", kind="layer", flops=1.0, num_params=10, static_bytes=100, forward_s=1.0, backward_s=2.0,
                  weight_grad_s=1.0,
                  activation_bytes={"none": 1000, "selective": 500, "full": 100},
                  recompute_s={"none": 0.0, "selective": 0.25, "full": 1.0})
        for i in range(S)
    ]
    return CostTable(blocks=blocks, cut_bytes=[0] * (S + 1), link_bandwidth=1.0, device="test", source="profiled")


def _plan(kind: str, M: int, v: int, S: int) -> Plan:
    return Plan(block_names=[f"b{i}" for i in range(S)], boundaries=range(S + 1), schedule=kind, num_microbatches=M,
                virtual_stages=v)


def _accepts(fn) -> bool:
    try:
        fn()
    except PlanError:
        return False
    return True


def planner_accepts(kind: str, M: int, v: int, S: int) -> bool:
    # The solver on its own (its problem and a solution, no Plan), then the planning pass that returns a Plan.
    kw = dict(num_stages=S, num_microbatches=M, schedule=kind, virtual_stages=v)
    solver = _accepts(lambda: solve(problem_from_costs(_costs(S), **kw), "parameters"))
    planner = _accepts(lambda: plan_with_costs(_costs(S), planner="parameters", **kw))
    assert solver == planner, (kind, M, v, S)
    return planner


def simulator_accepts(kind: str, M: int, v: int, S: int) -> bool:
    # The simulator's own check: a plan valid for the asked kind's placement, simulated under the kind and M.
    base = lambda: _plan("zbv" if v == 2 and SCHEDULES[kind].placement == "v" else "interleaved", S, v, S)  # noqa: E731
    return _accepts(lambda: simulate(base(), _costs(S), schedule=kind, num_microbatches=M))


def runtime_accepts(kind: str, M: int, v: int, S: int) -> bool:
    return _accepts(lambda: check_pipeline(_plan(kind, M, v, S), world_size=S // v))


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_planner_simulator_runtime_and_torch_accept_the_same_schedules(kind):
    logging.disable(logging.INFO)  # torch logs every schedule it builds
    try:
        mismatches, accepted = [], 0
        for S, v, M in itertools.product(STAGES, VIRTUAL, MICROBATCHES):
            verdicts = {
                "torch": torch_runs(kind, M, v, S),
                # the lambdas run at once, inside _accepts, so they read this iteration's values
                "schedule": _accepts(
                    lambda: Schedule.for_stages(S, kind=kind, num_microbatches=M, virtual_stages=v)  # noqa: B023
                ),
                "planner": planner_accepts(kind, M, v, S),
                "simulator": simulator_accepts(kind, M, v, S),
                "runtime": runtime_accepts(kind, M, v, S),
            }
            accepted += verdicts["torch"]
            for part, handled in (("planner", PLANNED_SCHEDULES), ("runtime", RUNTIME_SCHEDULES)):
                if kind not in handled:  # refused whatever torch says (test_unhandled_schedules_are_refused)
                    assert not verdicts.pop(part), (part, kind, M, v, S)
            if kind not in SIMULATED_SCHEDULES:
                assert not verdicts.pop("simulator"), ("simulator", kind, M, v, S)
            if len(set(verdicts.values())) > 1:
                mismatches.append((f"M={M} v={v} S={S}", verdicts))
    finally:
        logging.disable(logging.NOTSET)
    assert not mismatches, mismatches[:5]
    assert 0 < accepted < len(STAGES) * len(VIRTUAL) * len(MICROBATCHES)  # the table has both verdicts


def test_the_rules_in_words():
    Schedule.for_stages(4, kind="gpipe", num_microbatches=1)  # GPipe: any micro-batch count
    Schedule.for_stages(4, kind="interleaved", num_microbatches=3, virtual_stages=2)  # 1 round of 3 < 4 stages
    Schedule.for_stages(2, kind="interleaved", num_microbatches=2)  # one stage per rank is fine for torch
    with pytest.raises(PlanError, match="3 micro-batches for 4 stages: schedule '1f1b'"):
        Schedule.for_stages(4, kind="1f1b", num_microbatches=3)
    with pytest.raises(PlanError, match="runs one stage per device but virtual_stages=2; use schedule 'interleaved'"):
        Schedule(kind="gpipe", num_microbatches=4, virtual_stages=2)
    with pytest.raises(PlanError, match="multiple of 2; got 5"):
        Schedule.for_stages(4, kind="interleaved", num_microbatches=5, virtual_stages=2)
    with pytest.raises(PlanError, match="multiple of virtual_stages"):
        Schedule.for_stages(3, kind="interleaved", num_microbatches=6, virtual_stages=2)
    with pytest.raises(PlanError, match="unknown"):
        Schedule(kind="zero-bubble", num_microbatches=4)
    with pytest.raises(PlanError, match="num_microbatches must be an integer >= 1"):
        Schedule(num_microbatches=0)
    assert Schedule.for_stages(4).num_microbatches == 4  # default: one micro-batch per stage
    assert Schedule(kind="interleaved", num_microbatches=10, virtual_stages=2).microbatches_per_round(4) == 5


def test_kind_maps_to_one_torch_class():
    assert get_schedule_class("gpipe") is torch_schedules.ScheduleGPipe
    assert get_schedule_class("1f1b") is torch_schedules.Schedule1F1B
    assert get_schedule_class("interleaved") is torch_schedules.ScheduleInterleaved1F1B
    for kind in SCHEDULE_KINDS:  # several stages per device exactly where the torch class takes several
        multi = issubclass(get_schedule_class(kind), PipelineScheduleMulti)
        assert _accepts(lambda: Schedule(kind=kind, num_microbatches=4, virtual_stages=2)) == multi, kind  # noqa: B023
    with pytest.raises(PlanError, match="unknown"):
        get_schedule_class("looped-bfs")


def test_plans_keep_flat_schedule_fields_in_json():
    plan = _plan("interleaved", 6, 2, 4)
    data = json.loads(plan.to_json())
    assert (data["schedule"], data["num_microbatches"], data["virtual_stages"]) == ("interleaved", 6, 2)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.pipeline_schedule == Schedule(kind="interleaved", num_microbatches=6, virtual_stages=2)
    # A plan written before the default changed still reads; one that torch cannot run says why.
    old = {"format": 1, "block_names": ["a", "b"], "boundaries": [0, 1, 2], "schedule": "1f1b", "num_microbatches": 2,
           "virtual_stages": 1}
    assert Plan.from_dict(old).num_microbatches == 2
    with pytest.raises(PlanError, match="1 micro-batch for 2 stages"):
        Plan.from_dict({**old, "num_microbatches": 1})
    assert (
        Plan.from_json(json.dumps({**old, "num_microbatches": 1}), overrides={"num_microbatches": 4}).num_microbatches
        == 4
    )
    assert Plan(block_names=("a", "b", "c"), boundaries=(0, 1, 2, 3)).num_microbatches == 3  # one per stage
    assert "3 micro-batches" in Plan(block_names=("a", "b", "c"), boundaries=(0, 1, 2, 3)).summary()


def test_schedule_value_contract_and_limits():
    from contracts import assert_frozen_keyword_only

    from omnibal_compile.ir.schedule import MAX_MICROBATCHES

    one = Schedule(num_microbatches=4)
    assert_frozen_keyword_only(one)
    assert (one.kind, one.virtual_stages) == ("1f1b", 1)  # the defaults
    assert MAX_MICROBATCHES == 65_536
    assert Schedule(kind="gpipe", num_microbatches=MAX_MICROBATCHES).num_microbatches == 65_536
    with pytest.raises(PlanError, match="num_microbatches must be <= 65,536"):
        Schedule(kind="gpipe", num_microbatches=MAX_MICROBATCHES + 1)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(PlanError, match="num_stages must be an integer >= 1"):
            Schedule(kind="gpipe", num_microbatches=4).check(bad)
    Schedule(kind="gpipe", num_microbatches=4).check(1)


ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")


def test_each_schedule_names_its_torch_class_and_rules():
    for kind in ZERO_BUBBLE:
        rule = SCHEDULES[kind]
        assert rule.split_backward and get_schedule_class(kind).__name__ == rule.torch_class
    assert get_schedule_class("zbv") is torch_schedules.ScheduleZBVZeroBubble
    assert get_schedule_class("dualpipev") is torch_schedules.ScheduleDualPipeV
    assert get_schedule_class("interleaved-zb") is torch_schedules.ScheduleInterleavedZeroBubble
    assert not any(SCHEDULES[k].split_backward for k in CLASSIC_SCHEDULES)
    # V placement: stages s and 2D-1-s on device s, as torch's generate_stage_to_rank_mapping(style="v")
    for D in (1, 2, 3, 4):
        want = torch_schedules.generate_stage_to_rank_mapping(D, 2 * D, style="v")
        zbv = Schedule(kind="zbv", num_microbatches=4, virtual_stages=2)
        assert {s: zbv.device_of(s, 2 * D) for s in range(2 * D)} == want
        assert all(zbv.device_of(s, 2 * D) == d for d in range(D) for s in zbv.stages_of(d, 2 * D))
        loop = Schedule(kind="interleaved", num_microbatches=4, virtual_stages=2)
        assert {s: loop.device_of(s, 2 * D) for s in range(2 * D)} == torch_schedules.generate_stage_to_rank_mapping(
            D, 2 * D)
    with pytest.raises(PlanError, match="exactly 2 stages per device .* set virtual_stages=2"):
        Schedule(kind="zbv", num_microbatches=4)
    with pytest.raises(PlanError, match="schedule 'dualpipev' needs at least one micro-batch per stage"):
        Schedule.for_stages(4, kind="dualpipev", num_microbatches=3, virtual_stages=2)


@pytest.mark.parametrize("kind", ZERO_BUBBLE)
def test_zero_bubble_schedules_are_planned_run_and_pinned_in_the_layout_search(kind):
    v = 2
    assert kind in PLANNED_SCHEDULES  # planned by planning.zero_bubble (tests/test_plan_zbv.py)
    assert plan_with_costs(_costs(4), planner="parameters", num_stages=4, num_microbatches=4, schedule=kind,
                           virtual_stages=v).schedule == kind
    check_pipeline(_plan(kind, 4, v, 4), world_size=2)  # the runtime runs them (tests/test_runtime_zero_bubble.py)
    from omnibal_compile.planning.layout import choose_layout

    search = choose_layout(_costs(4), devices=2, schedule=kind, num_microbatches=4)  # tests/test_layout.py
    assert {c.layout.schedule for c in search.candidates} == {kind} and search.best.layout.schedule == kind
    assert search.plan.schedule == kind and search.plan.num_devices == 2
    with pytest.raises(PlanError, match="the layout search .* does not handle schedule 'gpipe'"):
        choose_layout(_costs(4), devices=2, schedule="gpipe")


def test_what_the_runtime_does_not_run_yet_is_one_rule():
    # run's refusals (check_pipeline, check_tensor_parallel) and the layout search's notes all read it
    for name, rule in SCHEDULES.items():
        assert rule.runtime_gaps() == ()
        split = rule.split_backward
        assert bool(rule.runtime_gaps(recomputes=True)) == split == bool(rule.runtime_gaps(tp=2)), name
        assert rule.runs_recomputation == rule.runs_tensor_parallel == (not split)
    assert SCHEDULES["zbv"].runtime_gaps(tp=2, recomputes=True) == (
        "recomputation with a split-backward schedule", "tp with a split-backward schedule")
