"""Tensor parallelism at paper scale (bench/tp_paper_scale.py, bench.studies.tp_paper_scale): the pass's facts derived
from the analytic shapes (omnibal_compile.costs.analytic.tensor_parallel_blocks), the planner's column against
tensor_parallel_table, the analytic column against the analytic tables, and the (dp, pp, tp) layout search."""

from __future__ import annotations

import math

import bench_scripts
import pytest

from bench.studies.paper_layout import mean_sample, sample_costs
from bench.studies.paper_scale import PAPER_GPU_DAYS, retile_internvl15
from bench.studies.tp_paper_scale import (
    best_at_degree,
    best_pp_only,
    compare_block_costs,
    format_comparison,
    format_search_verdict,
    gpu_days,
    tp_search,
)
from omnibal_compile.costs.analytic import (
    BLOCK_TYPES,
    INTERNVL_6B_20B,
    MicroBatch,
    cost_table,
    tensor_parallel_blocks,
    tensor_parallel_replicated,
)
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.data.lengths import bundled_length_files, load_lengths
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import ring_collective_s

MODEL = INTERNVL_6B_20B
SHAPE = MicroBatch(tiles=32, tokens=8529, attention_pairs=1.0865685e7)  # the study's 4 mean samples


def facts(tp: int, shape: MicroBatch = SHAPE):
    return tensor_parallel_blocks(MODEL, tiles=shape.tiles, tokens=shape.tokens, attention_pairs=shape.attention_pairs,
                                  tp=tp)


def test_llm_layer_facts_are_its_two_pairs_from_the_shapes():
    f = facts(4)["llm.layers.0"]
    h, kv, ffn, t = 6144, 8 * 128, 16384, SHAPE.tokens
    assert (f.pairs, f.backward_reduces) == (2, 5)  # q, k, v | o and gate, up | down
    assert f.params == 2 * h * h + 2 * h * kv + 3 * h * ffn  # weights: the layer's count less its two norms
    assert f.params == MODEL.type_params()["llm.layer"] - 2 * h
    assert f.forward_bytes == round(2 * 2.0 * t * h)  # o's and down's 16-bit outputs
    assert f.backward_bytes == round(5 * 2.0 * t * h)  # the input gradient of each column-wise layer
    block = cost_table(MODEL, SHAPE).blocks[MODEL.block_names().index("llm.layers.0")]
    assert f.flops == pytest.approx(block.flops, rel=1e-6)  # every matmul and the attention: the whole block's FLOPs


def test_a_pair_whose_heads_tp_does_not_divide_stays_replicated():
    # InternViT-6B's 25 heads: attention whole at tp = 2, 4, 8; sharded at tp = 5 (25 heads, 12800 MLP width)
    for tp in (2, 4, 8):
        v = facts(tp)["vision.layers.0"]
        assert (v.pairs, v.backward_reduces, v.params) == (1, 1, 2 * 3200 * 12800)  # the MLP pair only
        assert "25 heads do not split over tp=" + str(tp) in tensor_parallel_replicated(MODEL, tp)["vision.layer"]
    five = facts(5)["vision.layers.0"]
    assert (five.pairs, five.backward_reduces) == (2, 4) and "vision.layer" not in tensor_parallel_replicated(MODEL, 5)
    # the LLM's 8 key/value heads do not split over 16: its MLP pair alone is sharded
    assert facts(16)["llm.layers.0"].pairs == 1
    assert "8 key/value heads" in tensor_parallel_replicated(MODEL, 16)["llm.layer"]
    named = facts(2)
    assert len(named) == 45 + 1 + 48 + 2 and "vision.embed" not in named
    # the vocabulary-parallel parts, as the pass shards them: the head's loss all-reduces 3 floats per token
    tokens, width, vocab = 1000, MODEL.llm.width, MODEL.llm.vocab
    head, embed = (tensor_parallel_blocks(MODEL, tiles=4, tokens=tokens, attention_pairs=10**5, tp=2)[n]
                   for n in ("llm.head", "llm.embed"))
    assert (head.pairs, head.forward_bytes, head.backward_bytes) == (3, 12 * tokens, 2 * tokens * width)
    assert (head.flops, head.params) == (2.0 * tokens * width * vocab, vocab * width)
    assert (embed.pairs, embed.forward_bytes, embed.flops) == (1, 2 * tokens * width, 0.0)
    assert "llm.head" not in tensor_parallel_blocks(MODEL, tiles=4, tokens=tokens, attention_pairs=10**5, tp=7)
    with pytest.raises(InputError, match="tp"):
        facts(1)


def test_facts_are_linear_in_the_micro_batch():
    one = tensor_parallel_blocks(MODEL, tiles=8.0, tokens=2132.0, attention_pairs=2.7e6, tp=2)
    four = tensor_parallel_blocks(MODEL, tiles=32.0, tokens=8528.0, attention_pairs=1.08e7, tp=2)
    for name in ("vision.layers.3", "projector", "llm.layers.7"):
        s = one[name].scaled(4)
        assert s.flops == pytest.approx(four[name].flops) and s.forward_bytes == four[name].forward_bytes
        assert s.params == four[name].params


def test_the_planner_column_is_tensor_parallel_tables_and_the_analytic_column_its_tables():
    rows = compare_block_costs(MODEL, SHAPE, (2, 8))
    assert [(r.tp, r.block_type) for r in rows] == [(tp, k) for tp in (2, 8) for k in BLOCK_TYPES]
    base = cost_table(MODEL, SHAPE)
    nvlink = A100_80G.link_bandwidth("nvlink")
    for r in rows:
        i = MODEL.block_types().index(r.block_type)
        p = tensor_parallel_table(base, r.tp, sharded=facts(r.tp), bandwidth=nvlink).blocks[i]
        a = cost_table(MODEL, SHAPE, tensor_parallel=r.tp).blocks[i]
        assert r.planner_compute_s + r.planner_collective_s == pytest.approx(p.forward_s + p.backward_s, rel=1e-12)
        assert r.planner_collective_s == p.tensor_parallel_s
        assert (r.planner_activation_bytes, r.planner_static_bytes) == (p.activation_bytes["none"], p.static_bytes)
        assert r.analytic_compute_s + r.analytic_collective_s == pytest.approx(a.forward_s + a.backward_s, rel=1e-12)
        assert (r.analytic_activation_bytes, r.analytic_static_bytes) == (a.activation_bytes["none"], a.static_bytes)
    by = {(r.tp, r.block_type): r for r in rows}
    for tp in (2, 8):  # the analytic rule: a layer's compute / tp, plus 4 all-gathers / reduce-scatters per direction
        r = by[(tp, "llm.layer")]
        b = base.blocks[MODEL.block_types().index("llm.layer")]
        assert r.analytic_compute_s == pytest.approx((b.forward_s + b.backward_s) / tp)
        ring = ring_collective_s(4 * 2.0 * SHAPE.tokens * 6144, tp, A100_80G.link_bandwidth("nvlink"))
        assert r.analytic_collective_s == pytest.approx(2 * ring)
    llm = by[(2, "llm.layer")]
    # both divide the fully sharded layer's compute and weights; no sequence parallelism keeps activations whole
    assert llm.planner_compute_s == pytest.approx(llm.analytic_compute_s)
    assert llm.planner_activation_bytes == base.blocks[MODEL.block_types().index("llm.layer")].activation_bytes["none"]
    # all-reduces: 2 forward + 5 backward, each 2 ring passes of the whole output, against the analytic 4 + 4 passes
    assert llm.planner_collective_s / llm.analytic_collective_s == pytest.approx(14 / 8, rel=1e-3)
    assert "1.75x" in llm.why and "q, k, v apart" in llm.why
    head = by[(8, "llm.head")]
    # vocabulary-parallel in both: the weight / tp (the planner keeps the final norm's weight whole), with collectives
    assert head.planner_static_bytes == pytest.approx(head.analytic_static_bytes, rel=1e-3)
    assert head.planner_collective_s > 0 and "vocabulary-parallel in both" in head.why
    text = format_comparison(rows)
    assert "25 heads do not split over tp=2" in text and "no sequence parallelism" in text


@pytest.fixture(scope="module")
def stats():
    return retile_internvl15(load_lengths(bundled_length_files()))


@pytest.fixture(scope="module")
def search(stats):
    # 16 devices in nodes of 8, 1F1B only and the paper's micro-batches of 4 samples: the bench's form, smaller
    return tp_search(MODEL, stats, devices=16, degrees=(2, 4, 8, 16), microbatch_sizes=(4,), schedules=("1f1b",))


def test_the_search_chooses_the_least_predicted_time_and_keeps_tp_groups_in_a_node(search):
    planned = [c for c in search.candidates if c.planned]
    assert search.best.time_per_unit_s == min(c.time_per_unit_s for c in planned)
    assert {c.layout.tp for c in search.candidates} == {1, 2, 4, 8}  # 16 left out: it exceeds the node
    assert all(8 % c.layout.tp == 0 and c.layout.devices == 16 for c in search.candidates)
    assert any("tp=16 exceeds the node of 8 devices" in n for n in search.notes)
    pp = best_pp_only(search)
    assert pp is not None and pp.layout.tp == 1
    assert pp.time_per_unit_s == min(c.time_per_unit_s for c in planned if c.layout.tp == 1)


def test_the_best_with_tp_fixed_is_the_full_searchs_figure_for_that_layout(stats, search):
    fixed = best_at_degree(MODEL, stats, 2, devices=16, microbatch_sizes=(4,), schedules=("1f1b",))
    lay = fixed.layout
    assert lay.tp == 2 and lay.devices == 16 and fixed.plan is not None and fixed.plan.tensor_parallel == 2
    # the same layout in the full search over (dp, pp, tp), planned there (no pruning at its depth): same figures
    full = tp_search(MODEL, stats, devices=16, degrees=(2,), microbatch_sizes=(4,), schedules=("1f1b",),
                     pipeline=[lay.pp], prune=None)
    same = next(c for c in full.candidates if c.layout == lay)
    assert same.time_per_unit_s == pytest.approx(fixed.time_per_unit_s, rel=1e-9)
    assert same.peak_memory_bytes == pytest.approx(fixed.peak_memory_bytes, rel=1e-9)
    assert fixed.time_per_unit_s >= search.best.time_per_unit_s * (1 - 1e-9)  # the full search chose no worse
    text = format_search_verdict(search, 1_200_000, PAPER_GPU_DAYS[MODEL.name], {2: fixed})
    assert "SIMULATED: best with tp=2 fixed" in text and lay.describe() in text
    with pytest.raises(InputError, match="tp=3"):
        best_at_degree(MODEL, stats, 3, devices=16)
    with pytest.raises(InputError, match="rule"):
        best_at_degree(MODEL, stats, 2, devices=16, rule="megatron")


def test_the_analytic_rule_contrast_costs_each_rank_by_the_analytic_tables(stats, search):
    # Megatron with sequence parallelism divides activations, the head and the embedding too: cheaper ranks here
    fixed = best_at_degree(MODEL, stats, 2, rule="analytic", devices=16, microbatch_sizes=(4,), schedules=("1f1b",))
    planner = best_at_degree(MODEL, stats, 2, devices=16, microbatch_sizes=(4,), schedules=("1f1b",))
    assert fixed.layout.tp == 2 and fixed.time_per_unit_s < planner.time_per_unit_s
    shape = sample_costs(MODEL, stats)(4).batch_shape
    table = sample_costs(MODEL, stats, tensor_parallel=2)(4)
    assert table.tensor_parallel == 2 and table.batch_shape == shape
    text = format_search_verdict(search, 1_200_000, PAPER_GPU_DAYS[MODEL.name], {2: planner}, {2: fixed})
    assert "SIMULATED: best with tp=2 fixed, analytic rule" in text


def test_the_verdict_prints_the_chosen_the_pp_only_best_and_the_papers_rows(search):
    paper = PAPER_GPU_DAYS[MODEL.name]
    text = format_search_verdict(search, 1_200_000, paper)
    days = gpu_days(search.best, 1_200_000, 16)
    assert days == pytest.approx(search.best.time_per_unit_s * 1_200_000 * 16 / 86400)
    chosen = next(line for line in text.splitlines() if line.startswith("SIMULATED: chosen"))
    assert search.best.layout.describe() in chosen and f"{days:.1f}" in chosen
    assert "SIMULATED: best tp=1 (pp-only)" in text
    for p in paper:
        assert f"{p:g}" in text and f"{p / days:.3f}" in text
    assert not math.isnan(days)


def test_mean_sample_is_the_shape_the_costs_scale():
    stats = load_lengths(bundled_length_files())
    tiles, tokens, pairs = mean_sample(stats)
    assert tiles == pytest.approx(stats.tiles.mean()) and pairs >= tokens * (tokens + 1) / 2  # Jensen: E[t^2] >= E[t]^2


@pytest.mark.slow
def test_the_bench_runs_in_its_quick_form(capsys):
    argv = ["--quick", "--devices", "16", "--rows", "4", "--schedules", "1f1b"]
    assert bench_scripts.load("tp_paper_scale").main(argv) == 0
    out = capsys.readouterr().out
    for part in ("== tensor-parallel costs per rank", "why they differ", "== layout search over (dp, pp, tp)",
                 "chosen:", "SIMULATED: chosen", "SIMULATED: best tp=1 (pp-only)", "SIMULATED: best with tp=8 fixed",
                 "SIMULATED: best with tp=8 fixed, analytic rule", "paper: + memory (per stage)"):
        assert part in out
