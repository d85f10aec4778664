"""Tensor-parallel costs (omnibal_compile.costs.tensor_parallel) and the layout search over tp: the cost transform
on hand-built tables, the choice of tp where the link is fast and of a pipeline where it is slow, the node-size
rule, the runtime note, and plans that record tp."""

from __future__ import annotations

import dataclasses

import pytest

from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.costs import (
    BlockCost,
    CostTable,
    DataParallel,
    TensorParallelBlock,
    ring_collective_s,
)
from omnibal_compile.ir.plan import Plan
from omnibal_compile.planning.layout import format_candidates, search_layout

MIB = 2**20


def block(name: str, *, f: float = 0.010, params: int = 1000, flops: float = 1e9, act: int = 1000) -> BlockCost:
    return BlockCost(name=name, kind="layer", flops=flops, num_params=params, static_bytes=16 * params,
                     forward_s=f, backward_s=2 * f, weight_grad_s=f,
                     activation_bytes={"none": act, "selective": act // 2, "full": act // 8},
                     recompute_s={"none": 0.0, "selective": f / 4, "full": f}, workspace_bytes=act)


def facts(*, share: float = 0.8, params: int = 800, fwd: int = 10**6, bwd: int = 3 * 10**6) -> TensorParallelBlock:
    return TensorParallelBlock(pairs=2, backward_reduces=5, params=params, flops=share * 1e9, forward_bytes=fwd,
                               backward_bytes=bwd)


def chain(n: int, link: float = 1e9, **kw) -> CostTable:
    return CostTable(blocks=tuple(block(f"b{i}", **kw) for i in range(n)), cut_bytes=(0, *[1000] * (n - 1), 0),
                     link_bandwidth=link, device="test", source="roofline")


def test_ring_collective_is_the_share_each_rank_sends():
    assert ring_collective_s(8e6, 4, 1e9) == pytest.approx(0.75 * 8e6 / 1e9)
    assert ring_collective_s(8e6, 1, 1e9) == 0.0
    with pytest.raises(InputError, match="group"):
        ring_collective_s(1.0, 0, 1e9)


def test_sharded_blocks_are_divided_and_pay_their_all_reduces_replicated_ones_are_unchanged():
    t = chain(3)
    out = tensor_parallel_table(t, 2, sharded={"b1": facts()}, bandwidth=1e9, latency_s=1e-4)
    assert out.tensor_parallel == 2 and out.blocks[0] == t.blocks[0] and out.blocks[2] == t.blocks[2]
    b = out.blocks[1]
    # 80% of the work runs on half shards: 0.2 + 0.4 of it; forward all-reduce 2 x 1/2 x 1 MB / 1 GB/s, 2 calls
    fwd = 2 * 0.5 * 1e6 / 1e9 + 2e-4
    bwd = 2 * 0.5 * 3e6 / 1e9 + 5e-4
    assert b.forward_s == pytest.approx(0.010 * 0.6 + fwd)
    assert b.backward_s == pytest.approx(0.020 * 0.6 + bwd)
    assert b.weight_grad_s == pytest.approx(0.010 * 0.6)  # W has no collective
    assert b.recompute_s["full"] == pytest.approx(0.010 * 0.6 + fwd)  # rerunning the forward reruns its reduces
    assert b.recompute_s["selective"] == pytest.approx(0.0025 * 0.6)
    assert b.tensor_parallel_s == pytest.approx(fwd + bwd)
    assert b.flops == pytest.approx(0.6e9)
    # 800 of 1000 parameters sharded: 200 + 400 per rank in static bytes; the block's count stays the model's
    assert b.num_params == 1000 and b.static_bytes == 16 * 600
    # no sequence parallelism: activations and workspace stay those of the whole block
    assert b.activation_bytes == t.blocks[1].activation_bytes and b.workspace_bytes == t.blocks[1].workspace_bytes
    assert out.cut_bytes == t.cut_bytes


def test_sequence_parallel_moves_the_all_reduce_bytes_in_half_passes_and_divides_its_kept_activations():
    t = chain(1)
    plain = facts(fwd=2 * 10**6, bwd=2 * 10**6)
    # the same pairs sequence-parallel: the row outputs reduce-scattered and the column inputs all-gathered (2 calls
    # of 1 MB each way), no all-reduce left; half the block's activation bytes are sequence shards
    sp = dataclasses.replace(plain, pairs=0, backward_reduces=0, forward_bytes=0, backward_bytes=0,
                             sequence_forward_calls=4, sequence_forward_bytes=4 * 10**6,
                             sequence_backward_calls=4, sequence_backward_bytes=4 * 10**6, sequence_share=0.5)
    a, b = (tensor_parallel_table(t, 4, sharded={"b0": f}, bandwidth=1e9).blocks[0] for f in (plain, sp))
    assert b.forward_s == pytest.approx(a.forward_s) and b.backward_s == pytest.approx(a.backward_s)  # same bytes
    assert b.tensor_parallel_s == pytest.approx(a.tensor_parallel_s) and b.flops == a.flops
    assert a.activation_bytes == t.blocks[0].activation_bytes  # without it, whole
    assert b.activation_bytes == {o: round(v * (0.5 + 0.5 / 4)) for o, v in t.blocks[0].activation_bytes.items()}
    lat = tensor_parallel_table(t, 4, sharded={"b0": sp}, bandwidth=1e9, latency_s=1e-3).blocks[0]
    assert lat.forward_s == pytest.approx(b.forward_s + 4e-3)  # 4 calls, each its latency
    assert sp.scaled(2).sequence_forward_bytes == 8 * 10**6 and sp.scaled(2).sequence_share == 0.5
    with pytest.raises(InputError, match="at most 1"):
        dataclasses.replace(sp, sequence_share=1.5)


def test_a_fully_sharded_block_halves_its_compute_at_tp_2_and_quarters_it_at_4():
    t = chain(1)
    for tp in (2, 4):
        b = tensor_parallel_table(t, tp, sharded={"b0": facts(share=1.0, params=1000, fwd=0, bwd=0)},
                                  bandwidth=1e9).blocks[0]
        assert b.forward_s == pytest.approx(0.010 / tp) and b.backward_s == pytest.approx(0.020 / tp)
        assert b.static_bytes == 16 * 1000 // tp


def test_bad_inputs_are_refused_with_the_input_named():
    t = chain(2)
    assert tensor_parallel_table(t, 1, sharded={"b0": facts()}, bandwidth=1e9) is t
    with pytest.raises(InputError, match="lacks"):
        tensor_parallel_table(t, 2, sharded={"nope": facts()}, bandwidth=1e9)
    with pytest.raises(InputError, match="already for tp=2"):
        tensor_parallel_table(tensor_parallel_table(t, 2, sharded={}, bandwidth=1e9), 2, sharded={}, bandwidth=1e9)
    with pytest.raises(InputError, match="no FLOPs"):
        tensor_parallel_table(chain(1, flops=0.0), 2, sharded={"b0": facts()}, bandwidth=1e9)
    with pytest.raises(InputError, match="more than"):
        tensor_parallel_table(t, 2, sharded={"b0": facts(params=5000)}, bandwidth=1e9)


def _tp_search(link: float):
    # 4 compute-bound blocks of 16 MiB of training state each (1 Mi parameters); a budget that holds half of it:
    # DDP over 2 does not fit, a pipeline of 2 or tp = 2 does; 2 micro-batches per step give the pipeline a bubble
    t = chain(4, link=link, params=MIB, act=1000)
    sharded = {n: facts(share=1.0, params=MIB, fwd=10**6, bwd=10**6) for n in t.names}
    return search_layout(t, devices=2, global_batch=2, memory_budget=40 * MIB, data_parallel=[DataParallel(
        shard="ddp")], tensor_parallel={2: sharded}, prune=None)


def test_search_takes_tp_where_the_link_is_fast_and_a_pipeline_where_it_is_slow():
    fast = _tp_search(1e12)
    assert fast.best.layout.tp == 2 and fast.best.layout.pp == 1 and fast.plan.tensor_parallel == 2
    pipe = next(c for c in fast.candidates if c.layout.tp == 1 and c.planned)
    assert pipe.layout.pp == 2 and fast.best.time_per_unit_s < pipe.time_per_unit_s
    slow = _tp_search(1e7)  # 0.1 s per all-reduce of 1 MB: far more than the blocks' work
    assert slow.best.layout.tp == 1 and slow.best.layout.pp == 2 and slow.plan.tensor_parallel == 1
    text = fast.summary()
    assert "best per tensor-parallel degree:" in text and "PP 1 x DP 1 x TP 2" in text
    assert "PP 1 x DP 1 x TP 2" in fast.table().splitlines()[2]  # the layout column says its TP (best first)


def test_tp_groups_stay_inside_a_node_and_tp_with_dp_is_marked_not_hidden():
    t = chain(4, params=1000)
    sharded = {n: facts() for n in t.names}
    r = search_layout(t, devices=16, num_microbatches=4, devices_per_node=8,
                      tensor_parallel={2: sharded, 4: sharded, 16: sharded})
    assert {c.layout.tp for c in r.candidates} == {1, 2, 4}
    assert any("tp=16 exceeds the node of 8 devices" in n for n in r.notes)
    r6 = search_layout(t, devices=12, num_microbatches=4, devices_per_node=6, tensor_parallel={3: sharded,
                                                                                                4: sharded})
    assert {c.layout.tp for c in r6.candidates} == {1, 3}
    assert any("tp=4 does not divide the node of 6 devices" in n for n in r6.notes)
    assert all(c.layout.runtime_note == "" for c in r.candidates if not (c.layout.zero_bubble and c.layout.tp > 1))
    zb = [c for c in r.candidates if c.layout.zero_bubble and c.layout.tp > 1]
    assert zb and all(c.layout.runtime_note == "not run yet: tp with a split-backward schedule" for c in zb)
    assert "not run yet: tp with a split-backward schedule" in format_candidates(r.candidates)


def test_plans_record_tp_and_read_it_back():
    plan = Plan(block_names=("a", "b"), boundaries=(0, 1, 2), tensor_parallel=2)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.tensor_parallel == 2
    assert "tensor parallel: 2 ranks per stage" in plan.summary()
    assert Plan.from_json(Plan(block_names=("a",), boundaries=(0, 1)).to_json()).tensor_parallel == 1
    for bad in (0, 1.5, "2", True):
        with pytest.raises(PlanError, match="tensor_parallel"):
            dataclasses.replace(plan, tensor_parallel=bad)

