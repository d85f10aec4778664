"""The simulator under the zero-bubble schedules: torch's own operation orders, the ZB-H1 closed form, the V
placement's free hop, and the memory a deferred weight gradient keeps alive."""

from __future__ import annotations

import logging

import pytest
from test_schedule import torch_pipeline_order
from torch.distributed.pipelining import schedules as torch_schedules

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import BlockCost, CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.sim import operation_order, schedule_time, simulate

_LETTER = {torch_schedules.F: "F", torch_schedules.FULL_BACKWARD: "B", torch_schedules.BACKWARD_INPUT: "I",
           torch_schedules.BACKWARD_WEIGHT: "W"}


def _torch_order(kind: str, M: int, v: int, D: int) -> list[list[tuple[str, int, int]]]:
    """torch's ``pipeline_order`` per rank, empty steps dropped and overlapped pairs in their order."""
    order = torch_pipeline_order(kind, M, v, D)
    return [
        [(_LETTER[x.computation_type], x.stage_index, x.microbatch_index)
         for a in order[r] if a is not None for x in (a.sub_actions or (a,))]
        for r in range(D)
    ]


def _runs(kind: str, M: int, v: int, D: int) -> bool:
    try:
        Schedule.for_stages(D * v, kind=kind, num_microbatches=M, virtual_stages=v)
    except PlanError:
        return False
    return True


def test_orders_are_torchs_own():
    logging.disable(logging.INFO)  # torch logs every schedule it builds
    try:
        checked = 0
        for kind, chunks in (("interleaved-zb", (1, 2, 3)), ("zbv", (2,)), ("dualpipev", (2,))):
            for D in range(1, 5):
                for M in range(1, 11):
                    for v in chunks:
                        if _runs(kind, M, v, D):
                            assert operation_order(kind, D, v, M) == _torch_order(kind, M, v, D), (kind, D, v, M)
                            checked += 1
    finally:
        logging.disable(logging.NOTSET)
    assert checked > 150


@pytest.mark.parametrize("S", [2, 3, 4, 6])
@pytest.mark.parametrize(("F", "B", "W"), [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0)])
def test_zb_h1_matches_its_closed_form(S, F, B, W):
    # ZB-H1 (Qi et al. 2024, section 2.1; torch's interleaved-zb at one stage per rank): a device idles
    # (S - 1)(F + B - W) in all, against 1F1B's (S - 1)(F + B + W). (S - 1)(F + B - 2W) is ZB-H2's, which holds
    # more micro-batches in flight; torch has no ZB-H2 class.
    for M in (S, 2 * S, 3 * S):
        T = schedule_time("interleaved-zb", S, M, forward_s=F, backward_s=B + W, weight_s=W)
        assert T == pytest.approx(M * (F + B + W) + (S - 1) * (F + B - W))
        one_f_one_b = schedule_time("1f1b", S, M, forward_s=F, backward_s=B + W)
        assert one_f_one_b == pytest.approx((M + S - 1) * (F + B + W))  # unchanged
        # with no weight gradient to move the schedule is 1F1B's
        no_w = schedule_time("interleaved-zb", S, M, forward_s=F, backward_s=B + W, weight_s=0.0)
        assert no_w == pytest.approx(one_f_one_b)


def _block(i: int, *, w: float | None = 1.0) -> BlockCost:
    return BlockCost(name=f"b{i}", kind="layer", flops=0.0, num_params=0, static_bytes=50, forward_s=1.0,
                     backward_s=2.0, weight_grad_s=w, activation_bytes={"none": 1000, "selective": 500, "full": 100},
                     recompute_s={"none": 0.0, "selective": 0.25, "full": 1.0})


def _table(n: int, *, cut: int = 0, w: float | None = 1.0) -> CostTable:
    return CostTable(blocks=[_block(i, w=w) for i in range(n)], cut_bytes=[0] + [cut] * (n - 1) + [0],
                     link_bandwidth=1.0, device="test", source="profiled")


def _plan(S: int, schedule: str, M: int, v: int = 1) -> Plan:
    return Plan(block_names=[f"b{i}" for i in range(S)], boundaries=list(range(S + 1)), schedule=schedule,
                num_microbatches=M, virtual_stages=v)


def test_simulated_plan_reports_bubble_and_deferred_weight_memory():
    S, M = 4, 8
    zb = simulate(_plan(S, "interleaved-zb", M), _table(S))
    base = simulate(_plan(S, "1f1b", M), _table(S))
    # F = 1, I = 1, W = 1 per stage: (S - 1)(F + B - W) = 3 idle per device against 1F1B's 9
    assert zb.iteration_time_s == pytest.approx(M * 3 + 3)
    assert base.iteration_time_s == pytest.approx(M * 3 + 9)
    assert zb.bubble_fraction == pytest.approx(3 / (M * 3 + 3))
    assert {e.kind for e in zb.events} >= {"forward", "backward", "backward_weight"}
    # ZB-H1 keeps 1F1B's peak on the first device, but device d holds d weight gradients back: what they need
    # stays alive, so the last device holds as many micro-batches as the first
    assert zb.peak_inflight[0] == base.peak_inflight[0] == S
    assert base.peak_inflight[S - 1] == 1 and zb.peak_inflight[S - 1] == S
    assert zb.peak_activation_bytes[S - 1] > base.peak_activation_bytes[S - 1]


def test_v_placement_keeps_the_turn_on_one_device():
    D, M = 2, 4
    plan = _plan(2 * D, "zbv", M, v=2)
    sim = simulate(plan, _table(2 * D, cut=1))  # a send costs 1 s between devices
    assert sim.device_stages == ((0, 3), (1, 2))
    sends = {(e.stage, e.kind) for e in sim.events if e.kind.startswith("send")}
    assert (D - 1, "send_forward") not in sends and (D, "send_backward") not in sends  # stages 1 and 2 share device 1
    assert (0, "send_forward") in sends and (D, "send_forward") in sends
    free = simulate(plan, _table(2 * D))
    assert free.iteration_time_s == pytest.approx(schedule_time("zbv", D, M, forward_s=1, backward_s=2, weight_s=1,
                                                                virtual_stages=2))
    assert sum(free.busy_s) == pytest.approx(2 * D * M * 3)


def test_split_schedules_need_the_split_costs():
    with pytest.raises(InputError, match="does not split the backward of 4 blocks .* cost the model again"):
        simulate(_plan(4, "zbv", 4, v=2), _table(4, w=None))
    simulate(_plan(4, "1f1b", 4), _table(4, w=None))  # a whole backward needs no split
    with pytest.raises(InputError, match="weight_s must lie within"):
        schedule_time("zbv", 2, 4, backward_s=1.0, weight_s=2.0, virtual_stages=2)
