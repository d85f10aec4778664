"""The data-parallel layout (cost_table.DataParallel): bytes per device and communication, by hand."""

from __future__ import annotations

import dataclasses

import pytest

import omnibal_compile as oc
from omnibal_compile import InputError
from omnibal_compile.ir.costs import BF16_ADAM, BlockCost, CostTable, DataParallel, Precision

P = 1000
"""Parameters of the test block: bf16 weights 2000 B, gradients 2000 B, fp32 master 4000 B, Adam 8000 B."""


def block(precision: Precision = BF16_ADAM) -> BlockCost:
    return BlockCost(name="b", kind="layer", flops=0.0, num_params=P, static_bytes=round(P * precision.bytes_per_param),
                     forward_s=1.0, backward_s=2.0, activation_bytes=dict.fromkeys(("none", "selective", "full"), 0),
                     recompute_s=dict.fromkeys(("none", "selective", "full"), 0.0))


@pytest.mark.parametrize("size,ddp,fsdp,fsdp_kept", [
    (1, 16_000, 16_000, 16_000),
    (2, 16_000, 8_000, 8_000 + 2_000),   # FSDP: all 16 B / 2; keeping weights gathered adds the whole 2000 B
    (4, 16_000, 4_000, 4_000 + 2_000),
])
def test_static_bytes_per_device_by_hand(size, ddp, fsdp, fsdp_kept):
    b = block()
    assert DataParallel(size=size, shard="ddp").block_cost(b, BF16_ADAM, 1000.0).static_bytes == ddp
    sharded = DataParallel(size=size, shard="fsdp").block_cost(b, BF16_ADAM, 1000.0)
    assert sharded.static_bytes == fsdp
    assert sharded.gathered_bytes == (2_000 if size > 1 else 0)  # the block's whole bf16 weights while it computes
    kept = DataParallel(size=size, shard="fsdp", reshard_after_forward=False).block_cost(b, BF16_ADAM, 1000.0)
    assert kept.static_bytes == fsdp_kept and kept.gathered_bytes == 0


def test_zero1_and_fsdp_share_one_rule():
    zero1 = Precision(optimizer_shards=4)
    assert zero1.bytes_per_param == 2 + 2 + 12 / 4  # unchanged meaning without a layout
    assert zero1.bytes_per_param_on(DataParallel(size=4, shard="ddp")) == 2 + 2 + 12 / 4  # DDP + ZeRO-1
    assert zero1.bytes_per_param_on(DataParallel(size=4, shard="fsdp")) == 16 / 4  # FSDP shards everything
    assert BF16_ADAM.bytes_per_param_on(DataParallel(size=4, shard="fsdp")) == 4
    # a table costed with ZeRO-1 over 4 ranks, planned with DDP over 4: its own static bytes
    assert DataParallel(size=4, shard="ddp").block_cost(block(zero1), zero1, 1.0).static_bytes == 7_000
    with pytest.raises(InputError, match="optimizer_shards=2 disagrees with dp=4"):
        Precision(optimizer_shards=2).bytes_per_param_on(DataParallel(size=4, shard="ddp"))


def test_communication_seconds_by_hand():
    b, bw = block(), 1000.0
    ddp = DataParallel(size=4, shard="ddp").block_cost(b, BF16_ADAM, bw)
    assert ddp.reduce_s == pytest.approx(2 * 3 / 4 * 2000 / bw) and ddp.gather_s == 0
    fsdp = DataParallel(size=4, shard="fsdp").block_cost(b, BF16_ADAM, bw)
    assert fsdp.reduce_s == pytest.approx(3 / 4 * 2000 / bw) and fsdp.gather_s == pytest.approx(3 / 4 * 2000 / bw)
    dp = DataParallel(size=4, shard="fsdp")
    assert fsdp.op_gather_s(dp) == fsdp.gather_s and fsdp.step_gather_s(dp) == 0
    one = DataParallel(size=1, shard="fsdp").block_cost(b, BF16_ADAM, bw)
    assert (one.reduce_s, one.gather_s, one.static_bytes) == (0, 0, 16_000)


def test_collective_call_latency_by_hand():
    """Each collective of a block with parameters pays the call latency once; dp=1 and parameter-less blocks pay
    none."""
    b, bw, a = block(), 1000.0, 0.25
    fsdp = DataParallel(size=4, shard="fsdp").block_cost(b, BF16_ADAM, bw, a)
    assert fsdp.gather_s == pytest.approx(a + 3 / 4 * 2000 / bw) and fsdp.reduce_s == pytest.approx(
        a + 3 / 4 * 2000 / bw
    )
    ddp = DataParallel(size=4, shard="ddp").block_cost(b, BF16_ADAM, bw, a)
    assert ddp.reduce_s == pytest.approx(a + 2 * 3 / 4 * 2000 / bw) and ddp.gather_s == 0
    empty = dataclasses.replace(b, num_params=0, static_bytes=0)
    none = DataParallel(size=4, shard="fsdp").block_cost(empty, BF16_ADAM, bw, a)
    assert (none.gather_s, none.reduce_s) == (0, 0)
    one = DataParallel(size=1, shard="fsdp").block_cost(b, BF16_ADAM, bw, a)
    assert (one.gather_s, one.reduce_s) == (0, 0)
    with pytest.raises(InputError, match="latency"):
        DataParallel(size=4, shard="fsdp").block_cost(b, BF16_ADAM, bw, -1.0)


def test_bad_layouts_name_the_input():
    with pytest.raises(InputError, match=r"dp\) must be a positive integer"):
        DataParallel(size=0, shard="ddp")
    with pytest.raises(InputError, match="dp_shard"):
        DataParallel(size=2, shard="zero3")


def test_cost_table_json_keeps_its_precision():
    t = CostTable(blocks=(block(),), cut_bytes=(0, 0), link_bandwidth=1.0, device="t", source="profiled",
                  precision=Precision(optimizer_shards=2))
    assert CostTable.from_json(t.to_json()).precision == Precision(optimizer_shards=2)


def test_optimize_threads_dp_into_the_plan_and_the_simulator(vlm):
    model, batch = vlm
    base = oc.optimize(model, batch, num_stages=2, device="a100-80gb", planner="dp", num_microbatches=4)
    fsdp = oc.optimize(
        model, batch, num_stages=2, planner="dp", num_microbatches=4, costs=base.costs, dp=4, dp_shard="fsdp"
    )
    assert (fsdp.plan.data_parallel, fsdp.plan.data_parallel_shard) == (4, "fsdp")
    assert max(fsdp.plan.stage_memory_bytes) < max(base.plan.stage_memory_bytes)
    sim = oc.simulate(fsdp.plan, fsdp.costs)  # picks the layout up from the plan
    assert sim.iteration_time_s > oc.simulate(base.plan, base.costs).iteration_time_s
    assert any(e.kind == "dp_reduce" for e in sim.events)
    assert "4 data-parallel replicas, FSDP" in fsdp.plan.summary()
    with pytest.raises(InputError, match="optimizer_shards=2 disagrees with dp=4"):
        oc.optimize(model, batch, num_stages=2, costs=base.costs, dp=4, precision=Precision(optimizer_shards=2))


def test_plan_command_takes_dp_flags():
    from omnibal_compile.cli import build_parser

    args = build_parser().parse_args(["plan", "tiny-vlm", "--dp", "4", "--dp-shard", "fsdp"])
    assert (args.dp, args.dp_shard) == (4, "fsdp")


def test_data_parallel_collectives_use_their_own_link():
    """CostTable.dp_link_bandwidth prices gathers and reductions (planner and simulator); sends keep link_bandwidth."""
    from omnibal_compile.ir.plan import Plan
    from omnibal_compile.planning import problem_from_costs
    from omnibal_compile.sim import simulate

    blocks = tuple(dataclasses.replace(block(), name=f"b{i}") for i in range(2))
    fast = CostTable(blocks=blocks, cut_bytes=(0, 500, 0), link_bandwidth=1000.0, device="x", source="roofline")
    slow = dataclasses.replace(fast, dp_link_bandwidth=100.0)
    assert CostTable.from_json(slow.to_json()) == slow
    dp = DataParallel(size=4, shard="ddp")
    p_fast, p_slow = (problem_from_costs(t, num_stages=2, num_microbatches=2, data_parallel=dp) for t in (fast, slow))
    assert p_slow.sync[0] == pytest.approx(10 * p_fast.sync[0]) and p_slow.cut_time == p_fast.cut_time
    plan = Plan(
        block_names=("b0", "b1"), boundaries=(0, 1, 2), num_microbatches=2, data_parallel=4, data_parallel_shard="ddp"
    )
    reduce_fast = 2 * 3 / 4 * 2000 / 1000.0
    assert simulate(plan, slow).iteration_time_s - simulate(plan, fast).iteration_time_s == pytest.approx(
        9 * reduce_fast
    )
    with pytest.raises(InputError, match="dp_link_bandwidth"):
        dataclasses.replace(fast, dp_link_bandwidth=0.0)
    # CostTable.dp_link_latency_s: both pay it per block and call; DDP reduces each block once after its
    # stage's last backward, and the first stage's reduction ends the iteration
    late = dataclasses.replace(fast, dp_link_latency_s=0.5)
    assert CostTable.from_json(late.to_json()) == late
    p_late = problem_from_costs(late, num_stages=2, num_microbatches=2, data_parallel=dp)
    assert [y - x for x, y in zip(p_fast.sync, p_late.sync)] == pytest.approx([0.5, 0.5])
    assert simulate(plan, late).iteration_time_s - simulate(plan, fast).iteration_time_s == pytest.approx(0.5)
    with pytest.raises(InputError, match="dp_link_latency_s"):
        dataclasses.replace(fast, dp_link_latency_s=-1e-3)
