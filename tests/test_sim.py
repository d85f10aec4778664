"""Simulator against closed forms, memory in flight per schedule, and properties over random plans."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal_compile._utils.units import format_size, parse_size
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.sim import operation_order, schedule_time, simulate, stage_costs, sweep, sweep_table
from omnibal_compile.sim.simulate import pipeline_processors, shared_work_time


def block(i: int, f: float = 1.0, b: float = 2.0, act: int = 1000, static: int = 50, workspace: int = 0) -> BlockCost:
    return BlockCost(
        name=f"b{i}", kind="layer", flops=0.0, num_params=0, static_bytes=static, forward_s=f, backward_s=b,
        activation_bytes={"none": act, "selective": act // 2, "full": act // 10},
        recompute_s={"none": 0.0, "selective": f / 4, "full": f}, workspace_bytes=workspace,
    )


def table(blocks: list[BlockCost], cut: int = 0, bw: float = 1.0) -> CostTable:
    n = len(blocks)
    return CostTable(
        blocks=blocks, cut_bytes=[0] + [cut] * (n - 1) + [0], link_bandwidth=bw, device="test", source="profiled"
    )


def chain_plan(S: int, *, schedule: str, M: int, v: int = 1, per_stage: int = 1, recompute: str = "none") -> Plan:
    n = S * per_stage
    return Plan(
        block_names=[f"b{i}" for i in range(n)], boundaries=list(range(0, n + 1, per_stage)), schedule=schedule,
        num_microbatches=M, virtual_stages=v, recompute=(recompute,) * n,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "S,M,F,B", [(1, 1, 1.0, 2.0), (2, 4, 1.0, 2.0), (4, 8, 0.5, 1.0), (4, 2, 1.0, 3.0), (8, 32, 1.0, 2.0)]
)
def test_equal_stages_match_closed_form(schedule, S, M, F, B):
    if schedule == "1f1b" and M < S:
        return  # torch's Schedule1F1B needs M >= S (omnibal_compile.ir.schedule); GPipe covers M < S
    res = simulate(chain_plan(S, schedule=schedule, M=M), table([block(i, F, B) for i in range(S)]))
    assert res.iteration_time_s == pytest.approx((M + S - 1) * (F + B))
    assert res.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    assert res.busy_s == pytest.approx([M * (F + B)] * S)
    want = [M] * S if schedule == "gpipe" else [min(S - s, M) for s in range(S)]
    assert res.peak_inflight == tuple(want)
    assert res.peak_activation_bytes == tuple(n * 1000 for n in want)
    assert res.peak_memory_bytes == tuple(50 + n * 1000 for n in want)


@pytest.mark.parametrize(
    "D,v,M,f,b",
    [
        (1, 3, 2, 1.0, 2.0),
        (2, 1, 4, 1.0, 2.0),
        (2, 2, 4, 1.0, 1.0),
        (4, 2, 8, 1.0, 2.0),
        (4, 3, 12, 1.0, 2.0),
        (3, 2, 9, 1.0, 3.0),
        (4, 2, 4, 0.5, 1.0),
    ],
)
def test_interleaved_matches_closed_form(D, v, M, f, b):
    res = simulate(chain_plan(D * v, schedule="interleaved", M=M, v=v), table([block(i, f, b) for i in range(D * v)]))
    assert res.num_devices == D
    assert res.iteration_time_s == pytest.approx((v * M + D - 1) * (f + b))
    assert res.bubble_fraction == pytest.approx((D - 1) / (v * M + D - 1))
    # Chunk-micro-batches in flight per device: warm-up forwards + 1, capped by all of them.
    R = M // max(1, M // D)
    for d in range(D):
        warm = min((v - 1) * R + 2 * (D - 1 - d), v * M)
        assert res.peak_activation_bytes[d] == min(warm + 1, v * M) * 1000


def test_interleaved_beats_1f1b_bubble_by_chunks():
    D, M = 4, 8
    one = simulate(chain_plan(D, schedule="1f1b", M=M, per_stage=2), table([block(i) for i in range(2 * D)]))
    inter = simulate(chain_plan(2 * D, schedule="interleaved", M=M, v=2), table([block(i) for i in range(2 * D)]))
    assert inter.bubble_fraction < one.bubble_fraction
    assert inter.iteration_time_s == pytest.approx(one.iteration_time_s - (D - 1) * 6.0 / 2)  # bubble halves


def test_recompute_adds_time_and_cuts_memory():
    S, M = 4, 8
    costs = table([block(i, workspace=900) for i in range(S)])
    base = simulate(chain_plan(S, schedule="1f1b", M=M), costs)
    full = simulate(chain_plan(S, schedule="1f1b", M=M, recompute="full"), costs)
    # Full recompute reruns the forward (F = 1) before every backward: B' = B + F.
    assert full.iteration_time_s == pytest.approx((M + S - 1) * (1.0 + 2.0 + 1.0))
    assert sum(e.kind == "recompute" for e in full.events) == S * M
    # Activations kept: 100 bytes per micro-batch instead of 1000, plus one block's workspace while it computes
    # (the measured workspace covers what recomputation rebuilds).
    assert full.peak_activation_bytes == tuple(min(S - s, M) * 100 + 900 for s in range(S))
    assert base.peak_activation_bytes == tuple(min(S - s, M) * 1000 + 900 for s in range(S))
    # The saving grows with the micro-batches in flight: 900 per micro-batch.
    assert [b - f for f, b in zip(full.peak_activation_bytes, base.peak_activation_bytes)] == [
        900 * min(S - s, M) for s in range(S)
    ]


def test_sends_delay_each_hop():
    S, M = 3, 4
    res = simulate(chain_plan(S, schedule="gpipe", M=M), table([block(i) for i in range(S)], cut=5, bw=10.0))
    c = 0.5  # 5 bytes at 10 bytes/s
    # GPipe: the pipeline fill and drain each pay one send per hop.
    assert res.iteration_time_s == pytest.approx((M + S - 1) * 3.0 + 2 * (S - 1) * c)
    sends = [e for e in res.events if e.kind.startswith("send")]
    assert len(sends) == 2 * (S - 1) * M and all(e.duration_s == pytest.approx(c) for e in sends)
    free = simulate(chain_plan(S, schedule="gpipe", M=M), table([block(i) for i in range(S)], cut=5, bw=10.0),
                    link_bandwidth=math.inf)
    assert free.iteration_time_s == pytest.approx((M + S - 1) * 3.0)


def test_microbatch_scales_and_tables():
    S, M = 2, 4
    costs = table([block(i) for i in range(S)])
    plan = chain_plan(S, schedule="1f1b", M=M)
    scaled = simulate(plan, costs, microbatch_costs=[2.0] * M)
    assert scaled.iteration_time_s == pytest.approx(2 * simulate(plan, costs).iteration_time_s)
    doubled = table([block(i, 2.0, 4.0, act=2000) for i in range(S)])
    as_tables = simulate(plan, costs, microbatch_costs=[doubled] * M)
    assert as_tables.iteration_time_s == pytest.approx(scaled.iteration_time_s)
    assert as_tables.peak_activation_bytes == scaled.peak_activation_bytes
    # One heavy micro-batch: the whole pipeline waits for it at least once per stage.
    uneven = simulate(plan, costs, microbatch_costs=[1.0, 1.0, 3.0, 1.0])
    assert uneven.iteration_time_s > simulate(plan, costs).iteration_time_s + 2 * 3.0
    with pytest.raises(InputError, match="3 entries for 4"):
        simulate(plan, costs, microbatch_costs=[1.0] * 3, num_microbatches=4)
    with pytest.raises(InputError, match="expected a float scale or a CostTable"):
        simulate(plan, costs, microbatch_costs=["x"] * 4)


def test_errors_name_the_problem():
    costs = table([block(i) for i in range(4)])
    with pytest.raises(PlanError, match="does not match the plan"):
        simulate(chain_plan(3, schedule="1f1b", M=3), costs)
    with pytest.raises(PlanError, match="use schedule 'interleaved'"):
        simulate(chain_plan(4, schedule="1f1b", M=4, v=2), costs)
    with pytest.raises(PlanError, match="multiple of"):
        simulate(chain_plan(4, schedule="interleaved", M=5, v=2), costs)


def test_stage_costs_sum_blocks():
    costs = table([block(i, f=i + 1.0, b=2 * (i + 1.0), workspace=100 * i) for i in range(4)], cut=8, bw=4.0)
    plan = Plan(
        block_names=[f"b{i}" for i in range(4)], boundaries=(0, 3, 4), recompute=("none", "selective", "none", "full")
    )
    sc = stage_costs(plan, costs)
    assert sc[0].forward_s == 6.0 and sc[0].backward_s == 12.0 and sc[0].recompute_s == pytest.approx(2.0 / 4)
    assert sc[0].send_s == 2.0 and sc[1].send_s == 0.0
    # the first stage also holds its output (8 bytes across the cut) until the micro-batch's backward
    assert (
        sc[0].activation_bytes == 1000 + 500 + 1000 + 8
        and sc[0].workspace_bytes == 200
        and sc[1].workspace_bytes == 300
    )
    assert sc[1].activation_bytes == 100 and sc[1].static_bytes == 50
    assert sc[0].running_bytes is None  # no measured peaks: the workspace bound applies


def test_stage_costs_running_peak_from_measured_peaks():
    """With the blocks' peaks: the running micro-batch holds what the blocks before the running one keep
    plus its own peak, and the stage's output (cut bytes) whenever it is in flight."""
    import dataclasses

    blocks = [
        dataclasses.replace(block(i), peak_bytes={"none": 1500, "selective": 1200, "full": 1100}) for i in range(3)
    ]
    plan = Plan(block_names=["b0", "b1", "b2"], boundaries=(0, 2, 3), recompute=("none", "full", "none"))
    sc = stage_costs(plan, table(blocks, cut=8))
    assert sc[0].activation_bytes == 1000 + 100 + 8
    assert sc[0].running_bytes == 8 + max(1500, 1000 + 1100)
    assert sc[1].running_bytes == 1500 and sc[1].activation_bytes == 1000
    res = simulate(dataclasses.replace(plan, num_microbatches=2, schedule="gpipe"), table(blocks, cut=8))
    # two micro-batches in flight on device 0: one keeps all, the running one holds its running peak
    assert res.peak_activation_bytes[0] == (1000 + 100 + 8) + (8 + 2100)


@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.tuples(st.floats(0.01, 5.0), st.floats(0.01, 5.0)), min_size=2, max_size=8),
    M=st.integers(1, 12),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    scales=st.lists(st.floats(0.2, 3.0), min_size=12, max_size=12),
)
def test_properties_random_plans(times, M, schedule, scales):
    S = len(times)
    M = max(M, S) if schedule == "1f1b" else M  # Schedule1F1B needs M >= S
    costs = table([block(i, f, b) for i, (f, b) in enumerate(times)])
    plan = chain_plan(S, schedule=schedule, M=M)
    res = simulate(plan, costs, microbatch_costs=scales[:M])
    work = [sum(scales[:M]) * (f + b) for f, b in times]
    # Never faster than the busiest stage, nor than one micro-batch's trip through every stage.
    assert res.iteration_time_s >= max(work) - 1e-9
    assert res.iteration_time_s >= max(scales[:M]) * sum(f + b for f, b in times) - 1e-9
    assert res.busy_s == pytest.approx(work)
    assert 0.0 <= res.bubble_fraction < 1.0
    # Per device, compute intervals never overlap; every op of every micro-batch happens once.
    for d in range(S):
        ev = sorted((e for e in res.events if e.device == d and not e.kind.startswith("send")), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(ev, ev[1:]))
    assert sum(e.kind == "forward" for e in res.events) == S * M == sum(e.kind == "backward" for e in res.events)
    # Dependencies: forward of s after forward of s-1; backward of s after backward of s+1.
    f_end = {(e.stage, e.microbatch): e.end_s for e in res.events if e.kind == "forward"}
    b_ev = {(e.stage, e.microbatch): e for e in res.events if e.kind == "backward"}
    for e in res.events:
        if e.kind == "forward" and e.stage > 0:
            assert e.start_s >= f_end[(e.stage - 1, e.microbatch)] - 1e-9
    for (s, m), e in b_ev.items():
        assert e.start_s >= f_end[(s, m)] - 1e-9
        if s + 1 < S:
            assert e.start_s >= b_ev[(s + 1, m)].end_s - 1e-9
    assert res.peak_inflight == tuple(M if schedule == "gpipe" else min(S - s, M) for s in range(S))


@settings(max_examples=25, deadline=None)
@given(
    D=st.integers(1, 4),
    v=st.integers(1, 3),
    rounds=st.integers(1, 3),
    schedule=st.sampled_from(["gpipe", "interleaved"]),
)
def test_orders_cover_every_op_once(D, v, rounds, schedule):
    M = D * rounds
    v = 1 if schedule == "gpipe" else v  # ScheduleGPipe runs one stage per device
    orders = operation_order(schedule, D, v, M)
    ops = [op for o in orders for op in o]
    assert len(ops) == len(set(ops)) == 2 * D * v * M
    for d, o in enumerate(orders):
        assert all(s % D == d for _, s, _ in o)
        # Within a stage, backward of m comes after forward of m.
        for k, s, m in o:
            if k == "B":
                assert o.index(("F", s, m)) < o.index(("B", s, m))


def test_sweep_marks_infeasible_values():
    costs = table([block(i) for i in range(4)])

    def make(stages: int) -> Plan:
        if stages > 4:
            raise PlanError("more stages than blocks")
        return chain_plan(stages, schedule="1f1b", M=8, per_stage=4 // stages)

    points = sweep(make, [1, 2, 4, 8], costs)
    table_text = sweep_table(points, label="stages")
    assert "infeasible" in table_text and "[0, 2, 4]" in table_text
    assert "bubble" in points[1].result.summary()
    assert [p.iteration_time_s is None for p in points] == [False, False, False, True]
    assert points[0].iteration_time_s == pytest.approx(8 * 12.0)
    assert points[2].iteration_time_s < points[1].iteration_time_s < points[0].iteration_time_s
    assert "more stages" in points[3].error


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("40GB") == 40 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("123") == 123 and parse_size(7) == 7
    assert parse_size("2g") == 2 * 2**30
    for bad, msg in (("80 parsecs", "unknown unit"), ("lots", "cannot read size"), ("-1GiB", "cannot read size")):
        with pytest.raises(InputError, match=msg):
            parse_size(bad)
    assert format_size(3 * 2**30) == "3.00 GiB" and format_size(12) == "12 B"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_runtime_overheads_extend_every_action_and_the_step(schedule):
    S, M, F, B, h, c = 3, 6, 1.0, 2.0, 0.25, 0.5
    res = simulate(chain_plan(S, schedule=schedule, M=M), table([block(i, F, B) for i in range(S)]),
                   op_overhead_s=h, step_overhead_s=c)
    assert res.iteration_time_s == pytest.approx((M + S - 1) * (F + B + 2 * h) + c)
    with pytest.raises(InputError, match="overhead"):
        simulate(chain_plan(S, schedule=schedule, M=M), table([block(i) for i in range(S)]), op_overhead_s=-1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S", [2, 3, 4])
def test_shared_processors(schedule, S):
    M, F, B = 5, 1.0, 2.0
    plan, costs = chain_plan(S, schedule=schedule, M=M), table([block(i, F, B) for i in range(S)])
    own = simulate(plan, costs)
    # As many processors as devices (or more) changes nothing.
    assert simulate(plan, costs, processors=S).iteration_time_s == pytest.approx(own.iteration_time_s)
    assert simulate(plan, costs, processors=S + 3).iteration_time_s == pytest.approx(own.iteration_time_s)
    # One processor: some operation can always run (no sends), so it never idles: time = all work.
    one = simulate(plan, costs, processors=1)
    assert one.iteration_time_s == pytest.approx(S * M * (F + B))
    # Busy time is wall time computing, stretched by sharing: at least the work itself.
    assert 0 <= one.bubble_fraction <= 1 - 1 / S + 1e-9
    # In between, sharing costs time but never more than serialising everything.
    if S > 2:
        two = simulate(plan, costs, processors=2).iteration_time_s
        assert own.iteration_time_s < two < one.iteration_time_s
        assert two >= S * M * (F + B) / 2 - 1e-9  # two processors do all the work at best in half the time
    assert schedule_time(schedule, S, M, forward_s=F, backward_s=B, processors=1) == pytest.approx(S * M * (F + B))
    assert schedule_time(schedule, S, M, forward_s=F, backward_s=B) == pytest.approx((M + S - 1) * (F + B))
    with pytest.raises(InputError, match="processors"):
        simulate(plan, costs, processors=0)
    # The cost table's processors are the default, split among the data-parallel replicas (one definition
    # with the planner: pipeline_processors); a replica may get part of one.
    for run, dp in ((1, 1), (2, 2), (1, 2)):
        shared_plan = dataclasses.replace(plan, data_parallel=dp)
        share = pipeline_processors(run, dp)
        assert share == run / dp
        assert simulate(shared_plan, dataclasses.replace(costs, processors=run)).iteration_time_s == pytest.approx(
            simulate(shared_plan, costs, processors=share).iteration_time_s)
    assert simulate(plan, costs, processors=0.5).iteration_time_s == pytest.approx(2 * S * M * (F + B))
    assert shared_work_time(12.0, 1, 2) == 12.0 and shared_work_time(12.0, 2, 2) == 0.0


def test_shared_processors_by_hand():
    # GPipe, 2 stages, 1 micro-batch, F = 1, B = 2 on one processor: the pipeline is a chain, only one
    # device computes at a time: F0 [0,1], F1 [1,2], B1 [2,4], B0 [4,6].
    res = simulate(chain_plan(2, schedule="gpipe", M=1), table([block(0, 1.0, 2.0), block(1, 1.0, 2.0)]), processors=1)
    spans = [(e.kind, e.stage, e.start_s, e.end_s) for e in res.events if e.kind in ("forward", "backward")]
    assert spans == [
        ("forward", 0, 0.0, 1.0),
        ("forward", 1, 1.0, 2.0),
        ("backward", 1, 2.0, 4.0),
        ("backward", 0, 4.0, 6.0),
    ]
    # 2 micro-batches: F0(m1) and F1(m0) overlap on [1, 3] at half speed each.
    res = simulate(chain_plan(2, schedule="gpipe", M=2), table([block(0, 1.0, 2.0), block(1, 1.0, 2.0)]), processors=1)
    f = {(e.stage, e.microbatch): (e.start_s, e.end_s) for e in res.events if e.kind == "forward"}
    assert f[(0, 0)] == (0.0, 1.0) and f[(0, 1)] == pytest.approx((1.0, 3.0)) and f[(1, 0)] == pytest.approx((1.0, 3.0))
    assert res.iteration_time_s == pytest.approx(2 * 2 * 3.0)


# -- data parallelism ----------------------------------------------------------------------------------
def dp_plan(S: int, M: int, schedule: str, size: int, shard: str, reshard: bool = True) -> Plan:
    return Plan(block_names=[f"b{i}" for i in range(S)], boundaries=list(range(S + 1)), schedule=schedule,
                num_microbatches=M, data_parallel=size, data_parallel_shard=shard, reshard_after_forward=reshard)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_data_parallel_terms_match_closed_form(schedule, size):
    # Each stage: 1000 parameters at 16 B (bf16 weights and grads = 2000 B each), 1000 B/s links.
    S, M, F, B = 4, 8, 1.0, 2.0
    costs = table([block(i, F, B, static=16_000) for i in range(S)], bw=1000.0)
    r = (size - 1) / size
    pipeline = (M + S - 1) * (F + B)
    ddp = simulate(dp_plan(S, M, schedule, size, "ddp"), costs)
    assert ddp.iteration_time_s == pytest.approx(pipeline + 2 * r * 2000 / 1000)  # ring all-reduce, exposed on stage 0
    G = R = r * 2000 / 1000  # one all-gather of the weights; one reduce-scatter of the gradients
    kept = simulate(dp_plan(S, M, schedule, size, "fsdp", reshard=False), costs)
    assert kept.iteration_time_s == pytest.approx(pipeline + G + R)
    reshard = simulate(dp_plan(S, M, schedule, size, "fsdp"), costs)
    assert reshard.iteration_time_s == pytest.approx((M + S - 1) * (F + B + 2 * G) + R)
    for res in (ddp, kept, reshard):
        assert res.busy_s == pytest.approx([M * (F + B)] * S)  # communication is not compute
    inflight = [M] * S if schedule == "gpipe" else [min(S - s, M) for s in range(S)]
    assert ddp.static_bytes == (16_000,) * S
    assert reshard.static_bytes == ((16_000 // size + (2000 if size > 1 else 0)),) * S
    assert kept.static_bytes == ((16_000 // size + (2000 if size > 1 else 0)),) * S
    assert reshard.peak_memory_bytes == tuple(reshard.static_bytes[s] + 1000 * inflight[s] for s in range(S))
    if size > 1:
        assert {e.kind for e in ddp.events} >= {"dp_reduce"}
        assert sum(e.kind == "dp_gather" for e in reshard.events) == 2 * M * S


def test_planner_predicts_the_simulated_data_parallel_iteration_on_equal_stages():
    from omnibal_compile.ir.costs import DataParallel
    from omnibal_compile.planning import evaluate, problem_from_costs

    costs = table([block(i, 1.0, 2.0, static=16_000) for i in range(4)], bw=1000.0)
    for layout in (
        DataParallel(size=4, shard="ddp"),
        DataParallel(size=4, shard="fsdp"),
        DataParallel(size=4, shard="fsdp", reshard_after_forward=False),
    ):
        P = problem_from_costs(costs, num_stages=4, num_microbatches=8, data_parallel=layout)
        sol = evaluate(P, (0, 1, 2, 3, 4), ["none"] * 4)
        plan = dp_plan(4, 8, "1f1b", layout.size, layout.shard, layout.reshard_after_forward)
        assert sol.iteration_time == pytest.approx(simulate(plan, costs).iteration_time_s)


def test_data_parallel_reduction_hides_behind_later_backwards_on_unequal_stages():
    # Stage 1 holds 9x the parameters; its reduction overlaps stage 0's last backward, the planner charges it in full.
    costs = table([block(0, 1.0, 2.0, static=16_000), block(1, 1.0, 2.0, static=144_000)], bw=1000.0)
    plan = dp_plan(2, 4, "1f1b", 2, "ddp")
    res = simulate(plan, costs)
    pipeline = (4 + 2 - 1) * 3.0
    R1 = 2 * 0.5 * 18_000 / 1000  # 18 s: stage 1's last backward ends B = 2 s before stage 0's
    assert res.iteration_time_s == pytest.approx(pipeline - 2.0 + R1)
    from omnibal_compile.ir.costs import DataParallel
    from omnibal_compile.planning import evaluate, problem_from_costs

    P = problem_from_costs(costs, num_stages=2, num_microbatches=4, data_parallel=DataParallel(size=2, shard="ddp"))
    assert evaluate(P, (0, 1, 2), ["none"] * 2).iteration_time == pytest.approx(pipeline + R1)  # an upper bound


def test_printing_a_simulation_shows_its_summary_not_every_event():
    plan = chain_plan(2, schedule="1f1b", M=4)
    sim = simulate(plan, table([block(0), block(1)]))
    assert len(sim.events) > 8
    assert str(sim) == sim.summary() and "4 micro-batches" in str(sim)
    assert "Event(" not in repr(sim) and len(repr(sim)) < 1000


def test_result_values_are_frozen_and_the_summary_prints_mib():
    from contracts import assert_frozen_keyword_only

    from omnibal_compile.sim.simulate import StageCost

    plan = chain_plan(2, schedule="1f1b", M=2)
    sim = simulate(plan, table([block(0, act=1 << 20, static=1 << 20), block(1, act=1 << 20, static=1 << 20)]))
    assert_frozen_keyword_only(sim.events[0])
    assert_frozen_keyword_only(sim)
    # device 0 holds 1 MiB static and 2 micro-batches of 1 MiB in flight: 3.0 MiB peak
    assert sim.peak_memory_bytes[0] == 3 << 20 and "3.0" in sim.summary().splitlines()[2]
    cost = StageCost(forward_s=1.0, backward_s=1.0, recompute_s=0.0, send_s=0.0, activation_bytes=0, workspace_bytes=0,
                     static_bytes=0)
    assert (cost.gathered_bytes, cost.op_gather_s, cost.step_gather_s, cost.reduce_s, cost.running_bytes) == (
        0,
        0.0,
        0.0,
        0.0,
        None,
    )


def test_fsdp_stage_holds_its_largest_blocks_gathered_weights():
    sizes = (1000, 3000, 2000)
    blocks = [BlockCost(name=f"b{i}", kind="layer", flops=0.0, num_params=p, static_bytes=16 * p, forward_s=1.0,
                        backward_s=2.0, activation_bytes=dict.fromkeys(("none", "selective", "full"), 0),
                        recompute_s=dict.fromkeys(("none", "selective", "full"), 0.0)) for i, p in enumerate(sizes)]
    plan = Plan(block_names=["b0", "b1", "b2"], boundaries=[0, 3], schedule="1f1b", num_microbatches=1,
                data_parallel=2, data_parallel_shard="fsdp", reshard_after_forward=True)
    (cost,) = stage_costs(plan, table(blocks))
    assert cost.gathered_bytes == 3000 * 2  # bf16 weights of the largest block, not the smallest or the sum
    kept = simulate(Plan(**{**plan.__dict__, "reshard_after_forward": False}), table(blocks))
    gathers = [e for e in kept.events if e.kind == "dp_gather"]
    assert gathers and all(e.microbatch == 0 for e in gathers)  # gathered once, before the first micro-batch


def test_chunks_on_one_device_send_nothing():
    """Interleaved on one device: its chunks hand over in memory, so a slow link changes nothing."""
    plan = chain_plan(2, schedule="interleaved", M=2, v=2)
    free = simulate(plan, table([block(0), block(1)], cut=0))
    slow = simulate(plan, table([block(0), block(1)], cut=10**9, bw=1.0))
    assert plan.num_devices == 1 and slow.iteration_time_s == free.iteration_time_s


def test_a_plan_of_free_blocks_takes_no_time():
    sim = simulate(chain_plan(2, schedule="1f1b", M=2), table([block(0, f=0.0, b=0.0), block(1, f=0.0, b=0.0)]))
    assert sim.iteration_time_s == 0.0 and sim.bubble_fraction == 0.0


def test_a_parameter_several_blocks_of_one_device_read_is_charged_once():
    """Tied weights (``CostTable.shared``): each reading block's static bytes count the parameter, a stage or a
    device holding several of those blocks one copy (48 bytes: 3 elements at BF16_ADAM's 16 bytes each)."""
    import dataclasses

    from omnibal_compile.ir.costs import SharedParameter
    from omnibal_compile.planning.problem import problem_from_costs, stage_static, stage_transient

    def tied(*blocks: int) -> CostTable:
        return dataclasses.replace(table([block(i) for i in range(4)]),
                                   shared=(SharedParameter(name="w", blocks=blocks, numel=3),))

    two = chain_plan(2, schedule="1f1b", M=2, per_stage=2)
    assert [c.static_bytes for c in stage_costs(two, tied(0, 1))] == [52, 100]  # both readers on stage 0
    assert [c.static_bytes for c in stage_costs(two, tied(0, 3))] == [100, 100]  # a copy on each stage
    assert simulate(two, tied(0, 1)).static_bytes == (52, 100)
    chunks = chain_plan(4, schedule="interleaved", M=4, v=2)  # device 0 runs stages 0 and 2
    assert simulate(chunks, tied(0, 2)).static_bytes == (52, 100)
    assert simulate(chunks, tied(0, 1)).static_bytes == (100, 100)
    problem = problem_from_costs(tied(0, 1), num_stages=2, num_microbatches=2)
    assert stage_static(problem, 0, 2) - stage_transient(problem, 0, 2) == 52
    assert stage_static(problem, 0, 3) - stage_transient(problem, 0, 3) == 150 - 48
    assert stage_static(problem, 1, 3) - stage_transient(problem, 1, 3) == 100  # one reader: its copy
    assert CostTable.from_json(tied(0, 1).to_json()) == tied(0, 1)
