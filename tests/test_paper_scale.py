"""Paper-scale models, the vectorised epoch simulation, the ablation's monotonicity and the bench-all runner."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from bench.studies.bench_all import run_all
from bench.studies.paper_scale import (
    SPLITS,
    MicroBatches,
    PlanChoice,
    Setup,
    baseline_boundaries,
    chain_ratios,
    data_parallel_times,
    format_ablation,
    format_distance,
    make_batches,
    pack_cost,
    pipeline_times,
    retile_internvl15,
    run_ablation,
    stage_times,
    vit_first_setup,
)
from omnibal_compile.costs.analytic import (
    INTERNLM2_20B,
    INTERNVL_6B_20B,
    SCALE_MODELS,
    MicroBatch,
    cost_table,
    layer_activation_bytes,
    type_costs,
)
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.data import LengthStats, load_lengths
from omnibal_compile.data.lengths import bundled_length_files
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, Precision
from omnibal_compile.ir.plan import Plan
from omnibal_compile.planning import problem_from_costs, solve
from omnibal_compile.sim import simulate


def test_internlm2_20b_layer_flops_match_hand_arithmetic():
    t = 4096  # one sequence of 4096 tokens
    pairs = t * (t + 1) / 2
    tc = type_costs(INTERNVL_6B_20B, np.array([0.0]), np.array([float(t)]), np.array([pairs]))
    h, kv, ffn = 6144, 8 * 128, 16384
    hand = (2 * t * h * h  # Q
            + 2 * t * h * 2 * kv  # K and V (8 KV heads of 128)
            + 2 * t * h * h  # output projection
            + 3 * 2 * t * h * ffn  # SwiGLU: gate, up, down
            + 4 * h * pairs)  # QK^T and AV over causal pairs
    assert tc.flops["llm.layer"][0] == pytest.approx(hand, rel=1e-12)
    # ~2 x parameters per token plus attention: 2 x 390M params x 4096 + 4 h pairs
    assert INTERNVL_6B_20B.type_params()["llm.layer"] == 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert INTERNLM2_20B.layers * INTERNVL_6B_20B.type_params()["llm.layer"] == pytest.approx(18.7e9, rel=0.01)


def test_activation_bytes_reduce_to_korthikanti_for_their_gpt_layer():
    s, b, h, a = 2048, 1, 4096, 32
    got = layer_activation_bytes(np.array([s * b]), np.array([s * s * b]), width=h, kv_width=h, mlp=4 * h, heads=a,
                                 swiglu=False, flash=False, dropout=True)
    assert got["none"][0] == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert got["full"][0] == 2 * s * b * h
    assert got["selective"][0] < 34 * s * b * h  # drops the score term and norm/activation outputs


def test_eager_formulas_match_the_compiled_hf_layer():
    """The cost pass on Hugging Face's Llama layer (meta, bf16) and the analytic 'eager' formulas agree."""
    tf = pytest.importorskip("transformers")
    import dataclasses

    import torch

    from omnibal_compile.compile.blocks import build_blocks
    from omnibal_compile.compile.capture import capture
    from omnibal_compile.costs.analytic import LLMSpec
    from omnibal_compile.costs.annotate import annotate_costs

    w, f, heads, kv, t = 1024, 2816, 16, 4, 512
    cfg = tf.LlamaConfig(hidden_size=w, intermediate_size=f, num_hidden_layers=3, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, t, dtype=torch.long, device="meta")
    graph = build_blocks(capture(model, {"input_ids": ids, "labels": ids}), model)
    layer = annotate_costs(graph, model, device="a100-80gb").blocks[graph.names.index("model.layers.1")]
    llm = LLMSpec(name="l", layers=3, width=w, mlp=f, heads=heads, kv_heads=kv, vocab=32000)
    spec = dataclasses.replace(INTERNVL_6B_20B, llm=llm, kernels="eager")
    tc = type_costs(spec, np.array([0.0]), np.array([float(t)]), np.array([t * (t + 1) / 2]))
    assert layer.flops == pytest.approx(tc.flops["llm.layer"][0], rel=1e-9)
    for option in RECOMPUTE_OPTIONS:
        assert layer.activation_bytes[option] == pytest.approx(tc.activation_bytes["llm.layer"][option][0], rel=0.01)
    fused = type_costs(dataclasses.replace(spec, kernels="fused"), np.array([0.0]), np.array([float(t)]),
                       np.array([t * (t + 1) / 2]))
    # Fused kernels keep less: no fp32 norm copies (10w), no silu(gate) (2f), k and v not repeated per head.
    gap = tc.activation_bytes["llm.layer"]["none"][0] - fused.activation_bytes["llm.layer"]["none"][0]
    assert gap == t * (10 * w + 2 * f + 4 * (w - w // heads * kv))


def test_parameter_counts_match_published_sizes():
    assert SCALE_MODELS["internvl-6b-20b"].num_params() == pytest.approx(25.5e9, rel=0.02)
    assert SCALE_MODELS["internvl-6b-34b"].num_params() == pytest.approx(40.1e9, rel=0.02)
    assert SCALE_MODELS["llava-1.5-7b"].num_params() == pytest.approx(7.06e9, rel=0.02)
    assert SCALE_MODELS["llava-1.5-13b"].num_params() == pytest.approx(13.35e9, rel=0.02)


@pytest.mark.parametrize("name", sorted(SCALE_MODELS))
def test_cost_tables_are_well_formed(name):
    model = SCALE_MODELS[name]
    shape = MicroBatch(tiles=8, tokens=4096, attention_pairs=4 * 1024 * 1025 / 2)
    table = cost_table(model, shape)
    assert cost_table(model, shape) is table  # cached per shape
    n = model.num_blocks
    assert len(table.blocks) == n == len(set(table.names))
    assert len(table.cut_bytes) == n + 1 and table.cut_bytes[0] == table.cut_bytes[-1] == 0
    assert all(c > 0 for c in table.cut_bytes[1:-1])
    assert table.source == "roofline" and table.device == "a100-80gb"
    for b in table.blocks:
        a = b.activation_bytes
        assert a["none"] >= a["selective"] >= a["full"] >= 0
        assert b.recompute_s["full"] == b.forward_s and b.backward_s == 2 * b.forward_s
        assert 0 <= b.recompute_s["selective"] < b.forward_s
        assert b.static_bytes == 16 * b.num_params
    assert sum(b.num_params for b in table.blocks) == model.num_params()
    # Twice the micro-batch: twice the matmul FLOPs of a ViT layer (attention is per tile, so linear too).
    double = cost_table(model, MicroBatch(tiles=16, tokens=4096, attention_pairs=shape.attention_pairs))
    assert double.blocks[1].flops == pytest.approx(2 * table.blocks[1].flops)
    sharded = cost_table(model, shape, precision=Precision(optimizer_shards=16))  # fp32 states over 16 DP ranks
    assert sum(b.static_bytes for b in sharded.blocks) == pytest.approx(4.75 * model.num_params(), rel=1e-6)
    problem = problem_from_costs(sharded, num_stages=8, num_microbatches=8, budget=0.9 * A100_80G.memory_bytes)
    assert solve(problem, "dp").feasible


@pytest.mark.parametrize("dp_shard", ["ddp", "fsdp"])
def test_pipeline_replay_matches_the_simulator(dp_shard):
    """Per micro-batch costs, sends, data-parallel gathers and reductions: the replay is the simulator."""
    model = INTERNVL_6B_20B
    rng = np.random.default_rng(0)
    M, n = 6, model.num_blocks
    setup = Setup(model=model, pp=4, dp=4, global_batch=24, samples_per_microbatch=1, dp_shard=dp_shard,
                  link="infiniband", dp_link="infiniband")  # one link, as the simulator has
    tiles = rng.integers(4, 20, M).astype(float)
    tokens = rng.integers(1500, 6000, M).astype(float)
    pairs = tokens * 600.0
    bounds = (0, 20, 45, 70, n)
    rec = tuple(rng.choice(RECOMPUTE_OPTIONS) for _ in range(n))
    plan = PlanChoice(boundaries=bounds, recompute=rec, planner="manual")
    tables = [cost_table(model, MicroBatch(tiles=int(a), tokens=int(b), attention_pairs=float(c)), link="infiniband",
                         precision=setup.precision) for a, b, c in zip(tiles, tokens, pairs)]
    full = Plan(block_names=tables[0].names, boundaries=bounds, recompute=rec, schedule="1f1b", num_microbatches=M,
                data_parallel=4, data_parallel_shard=dp_shard)
    expected = simulate(full, tables[0], microbatch_costs=tables).iteration_time_s
    f, b, s = stage_times(model, type_costs(model, tiles, tokens, pairs), plan, tables[0].link_bandwidth)
    gather, reduce = data_parallel_times(setup, plan)
    assert reduce.min() > 0 and (gather.min() > 0) == (dp_shard == "fsdp")
    got = pipeline_times(f[None], b[None], s[None], gather=gather, reduce=reduce)
    assert got.shape == (1,)
    assert got[0] == pytest.approx(expected, rel=1e-9)
    without = simulate(dataclasses.replace(full, data_parallel=1), tables[0], microbatch_costs=tables).iteration_time_s
    assert got[0] > without * 1.001  # the collectives are charged


def test_tensor_parallel_splits_work_and_adds_collectives():
    t, tiles = 4096.0, 8.0
    args = (np.array([tiles]), np.array([t]), np.array([t * (t + 1) / 2]))
    one, two = type_costs(INTERNVL_6B_20B, *args), type_costs(INTERNVL_6B_20B, *args, tensor_parallel=2)
    h = INTERNLM2_20B.width
    comm = 4 * 0.5 * 2 * t * h / A100_80G.link_bandwidth("nvlink")  # 4 all-gathers / reduce-scatters per layer
    assert two.forward_s["llm.layer"][0] == pytest.approx(one.forward_s["llm.layer"][0] / 2 + comm, rel=1e-12)
    assert two.backward_s["llm.layer"][0] == pytest.approx(one.backward_s["llm.layer"][0] / 2 + comm, rel=1e-12)
    assert two.flops["vision.layer"][0] == pytest.approx(one.flops["vision.layer"][0] / 2)
    for option in RECOMPUTE_OPTIONS:
        assert two.activation_bytes["llm.layer"][option][0] == pytest.approx(
            one.activation_bytes["llm.layer"][option][0] / 2
        )
    assert two.out_bytes["llm.layer"][0] == one.out_bytes["llm.layer"][0] / 2  # sequence-parallel sends
    shape = MicroBatch(tiles=8, tokens=4096, attention_pairs=float(args[2][0]))
    whole, half = cost_table(INTERNVL_6B_20B, shape), cost_table(INTERNVL_6B_20B, shape, tensor_parallel=2)
    assert sum(b.static_bytes for b in half.blocks) == pytest.approx(
        sum(b.static_bytes for b in whole.blocks) / 2, rel=1e-6
    )
    with pytest.raises(InputError):
        type_costs(INTERNVL_6B_20B, *args, tensor_parallel=0)


def test_retiling_to_internvl15_limits_by_hand():
    stats = LengthStats.from_arrays([1, 3, 4, 5, 5], [300, 800, 1100, 1400, 3000])
    got = retile_internvl15(stats)
    # 1 crop stays; 1x2 -> 2x4, 1x3 -> 2x6, 2x2 -> 3x3 crops, each + a thumbnail and 256 tokens per added tile.
    assert got.tiles.tolist() == [1, 9, 13, 10, 10]
    assert got.tokens.tolist() == [300, 800 + 6 * 256, 1100 + 9 * 256, 1400 + 5 * 256, 4096]  # cut at 4096
    assert got.image_flags.tolist() == got.tiles.tolist()
    assert retile_internvl15(stats, max_tiles=4).tiles.tolist() == stats.tiles.tolist()  # the measured limit: unchanged


def test_length_grouped_steps_are_dealt_round_robin_and_baselines_split_as_named():
    mb = MicroBatches(name="length-grouped", tiles=np.ones(12), tokens=np.ones(12), pairs=np.ones(12),
                      steps=np.arange(12).reshape(1, 12), seconds=0.0, round_robin=True)
    assert mb.rank_steps(3, 4)[0].tolist() == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]  # c -> rank c % dp
    model = INTERNVL_6B_20B
    params = [model.type_params()[t] for t in model.block_types()]

    def largest(bounds):
        return max(sum(params[i:j]) for i, j in zip(bounds, bounds[1:]))

    by_params = baseline_boundaries(model, "parameters", 8)
    assert largest(by_params) < largest(baseline_boundaries(model, "uniform", 8))
    vit = baseline_boundaries(model, "vit-first", 8)
    assert model.block_types()[vit[1] - 1] == "llm.layer" and "vision.layer" not in model.block_types()[vit[1]:]


def _stats(n: int) -> LengthStats:
    return retile_internvl15(load_lengths(bundled_length_files()).resample(n, seed=1))


MARGIN = 0.01
"""Each step of our chain must be at least 1% faster: far above the ILP's relative gap (1e-4) and the
acceptance check, so a step that merely ties cannot pass."""


def test_ablation_chains_are_monotone_on_a_reduced_configuration():
    # The bench's layout (PP 8 x DP 16, M = 16) on an epoch of ~10 steps instead of ~1,200.
    setup = Setup(model=INTERNVL_6B_20B, pp=8, dp=16, planner="dp")  # the ILP's exact warm start, without the ILP
    batches = make_batches(_stats(10_000), per_step=setup.per_step, samples_per_microbatch=4,
                           cost=pack_cost(setup.model))
    vit = vit_first_setup(setup, batches["length-grouped"])
    assert vit is not None and (vit.pp, vit.tp, vit.dp) == (8, 2, 8)  # the ViT's stage does not fit without TP
    rows = run_ablation({"uniform": setup, "parameters": setup, "vit-first": vit}, batches)
    for split in SPLITS:
        ours = chain_ratios(rows, split, "ours")
        assert len(ours) == 4
        assert all(b <= a * (1 - MARGIN) for a, b in zip(ours, ours[1:])), (split, ours)
        assert all(r.fits for r in rows if r.split == split and r.chain in ("baseline", "ours"))
        paper = chain_ratios(rows, split, "paper")
        assert paper[-1] < paper[0] and ours[-1] <= paper[-1] * (1 + MARGIN)  # ours is never clearly behind
    base = next(r for r in rows if r.chain == "baseline" and r.split == "vit-first")
    assert base.plan.recompute == ("full",) * INTERNVL_6B_20B.num_blocks and base.setup.gpus == setup.gpus
    text = format_ablation(rows, paper=(61.8, 51.9, 29.0, 21.3))  # the tables the bench prints
    assert all(r.name in text for r in rows) and "0.469" in text and "closest reading" in text
    assert "vit-first *" in format_distance(rows, (61.8, 51.9, 29.0, 21.3))


def test_bench_all_runs_every_script_and_records_failures(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "good.py").write_text("print('figure: 42.0 ms')\n")
    (bench / "bad.py").write_text("import sys\nprint('half a result')\nsys.exit(3)\n")
    (bench / "slow.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    (bench / "_helper.py").write_text("raise SystemExit('never run')\n")
    (bench / "notes.txt").write_text("not a script\n")
    out = tmp_path / "RESULTS.md"
    results = run_all(bench, out=out, timeout=3.0, include_kernels=False, echo=False, command="test bench all")
    status = {r.script.name: r.status for r in results}
    assert status == {"bad.py": "failed (exit 3)", "good.py": "ok", "slow.py": "timed out after 3 s"}
    page = out.read_text()
    for name in ("good.py", "bad.py", "slow.py"):
        assert f"## {name}" in page and f"python bench/{name}" in page
    assert "figure: 42.0 ms" in page and "half a result" in page and "started" in page
    assert "_helper" not in page and "notes.txt" not in page
    assert "test bench all" in page and f"{__import__('os').cpu_count()} CPUs" in page and "torch" in page
    assert sys.executable not in page  # commands are shown as a reader types them


@pytest.fixture(scope="module")
def compiled_small():
    """InternVL-6+20B's widths with 4 + 4 layers, compiled (3 per stack) on meta at 5 shapes and checked on one."""
    pytest.importorskip("transformers")
    from bench.studies.compiled_costs import CHECK_SHAPES, FIT_SHAPES, compile_costs

    spec = dataclasses.replace(INTERNVL_6B_20B, name="internvl-small",
                               vision=dataclasses.replace(INTERNVL_6B_20B.vision, layers=4),
                               llm=dataclasses.replace(INTERNLM2_20B, layers=4))
    return compile_costs(spec, shapes=FIT_SHAPES[:5], check=CHECK_SHAPES[:1])


def test_compiled_tables_are_the_compilers_and_fit_study_shapes(compiled_small):
    """The fitted per-type costs reproduce the compiler's own tables at a study shape, and the replicated chain keeps
    every byte and parameter the compiled chain has."""
    from bench.studies.compiled_costs import CHECK_SHAPES, _example, _per_type, _stack_layers, block_types, hf_config
    from omnibal_compile.costs.annotate import profile_costs

    cc = compiled_small
    assert cc.fit_error < 0.02 and cc.check_error < 0.02  # real widths: the roofline is linear in the shape
    assert "bfloat16" in cc.notes and "flash" in cc.notes
    # The compiled reduced model (3 layers per stack) at an unseen shape, costed directly ...
    shape = CHECK_SHAPES[0]
    cls, config = hf_config(cc.model, vision_layers=3, llm_layers=3)
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, cls)(config).to(torch.bfloat16)
    table = profile_costs(model, _example(cc.model, shape, config.image_token_id), device="a100-80gb")
    # ... against the fitted chain of the same layer counts, at that shape in the study's terms.
    three = dataclasses.replace(cc.model, vision=dataclasses.replace(cc.model.vision, layers=3),
                                llm=dataclasses.replace(cc.model.llm, layers=3))
    rows, per_row = shape.sequences, (shape.tiles * 256 + shape.text_tokens) // shape.sequences
    study = MicroBatch(tiles=shape.tiles, tokens=rows * per_row, attention_pairs=rows * per_row * (per_row + 1) / 2)
    fitted = dataclasses.replace(cc, model=three).cost_table(
        study, device=A100_80G, precision=Precision(), link="nvlink"
    )
    assert sum(b.num_params for b in fitted.blocks) == sum(b.num_params for b in table.blocks)
    for got, want in (
        ((lambda t: sum(b.flops for b in t.blocks)), 1e-3),
        ((lambda t: sum(b.forward_s + b.backward_s for b in t.blocks)), 0.02),
    ):
        assert got(fitted) == pytest.approx(got(table), rel=want)
    for option in RECOMPUTE_OPTIONS:
        kept = [sum(b.activation_bytes[option] for b in t.blocks) for t in (fitted, table)]
        assert kept[0] == pytest.approx(kept[1], rel=0.02), option
    types = block_types(table.names)
    assert types.count("vision.layer") == 3 and types.count("llm.layer") == 3 and types[-1] == "llm.head"
    # Exactly (no fit): per-type figures x the reduced model's counts = the compiled chain's totals, the first
    # and last layers' excess (skip tensors charged to their last reader) included once.
    per, params, _ = _per_type(table, types, _stack_layers(table.names, types))
    count = {t: types.count(t) if t in ("vision.layer", "llm.layer") else 1 for t in per}
    for option in RECOMPUTE_OPTIONS:
        total = sum(b.activation_bytes[option] for b in table.blocks)
        assert sum(count[t] * per[t][f"activation:{option}"] for t in per) == pytest.approx(total, rel=1e-12), option
    assert sum(count[t] * params[t] for t in per) == sum(b.num_params for b in table.blocks)
    # FLOPs are the formulas' (matmuls and attention): the ViT layer and projector as fused, the LLM layer as
    # Hugging Face's masked attention computes them (every pair of a row: the 'eager' formulas).
    args = (np.array([8.0]), np.array([4096.0]), np.array([4 * 1024 * 1025 / 2]))
    c = cc.type_costs(*args, device=A100_80G)
    fused = type_costs(cc.model, *args)
    eager = type_costs(dataclasses.replace(cc.model, kernels="eager"), *args)
    for t, ref in (("vision.layer", fused), ("projector", fused), ("llm.layer", eager), ("llm.head", fused)):
        assert c.flops[t][0] == pytest.approx(ref.flops[t][0], rel=0.01), t
    assert c.activation_bytes["llm.layer"]["none"][0] == pytest.approx(
        eager.activation_bytes["llm.layer"]["none"][0], rel=0.02
    )
    two = cc.type_costs(*args, device=A100_80G, tensor_parallel=2)  # the analytic path's Megatron rule
    assert two.flops["llm.layer"][0] == pytest.approx(c.flops["llm.layer"][0] / 2)
    assert two.forward_s["llm.layer"][0] > c.forward_s["llm.layer"][0] / 2
    with pytest.raises(InputError, match="compile for it"):
        cc.type_costs(*args, device=dataclasses.replace(A100_80G, name="h100-80gb"))


def test_ablation_runs_on_compiled_tables_next_to_the_analytic_row(compiled_small):
    """Both cost sources give a full ablation; the compiled one costs more (eager kernels) but not wildly, and the
    chains end within 0.1 of each other."""
    from bench.studies.compiled_costs import format_difference
    from bench.studies.paper_scale import format_cost_sources

    analytic = Setup(model=compiled_small.model, pp=2, dp=4, planner="dp", global_batch=64)
    compiled = dataclasses.replace(analytic, costs=compiled_small)
    assert compiled.cost_source.startswith("compiled from Hugging Face code")
    stats = _stats(2_000)
    batches = make_batches(stats, per_step=analytic.per_step, samples_per_microbatch=4, cost=pack_cost(analytic.model))
    ours = make_batches(stats, per_step=analytic.per_step, samples_per_microbatch=4, methods=("ours",),
                        cost=pack_cost(compiled.model, costs=compiled_small))
    a_rows = run_ablation({s: analytic for s in SPLITS}, batches)
    c_rows = run_ablation({s: compiled for s in SPLITS}, {**batches, **ours})
    assert len(c_rows) == len(a_rows) == 8 * len(SPLITS) and all(r.plan is not None and r.fits for r in c_rows)
    for split in SPLITS:
        a_base = next(r for r in a_rows if r.split == split and r.chain == "baseline")
        c_base = next(r for r in c_rows if r.split == split and r.chain == "baseline")
        assert 1.05 < c_base.gpu_days / a_base.gpu_days < 1.6, split  # eager HF code does more than the fused formulas
        for chain in ("paper", "ours"):
            assert chain_ratios(c_rows, split, chain)[-1] == pytest.approx(
                chain_ratios(a_rows, split, chain)[-1], abs=0.1
            )
    text = format_cost_sources(a_rows, c_rows)
    assert "compiled GPU-days" in text and all(r.name in text for r in c_rows)
    assert "costs: compiled from Hugging Face code" in format_ablation(c_rows)
    diff = format_difference(compiled_small, batches["ours"].mean_shape(), device=A100_80G)
    assert "QK-norm" in diff and "llm.layer" in diff


def test_zero_bubble_rows_at_the_papers_layout():
    # the paper's layout under 1F1B, ZB-H1 on the same cuts, and the V on the DP's interleaved cuts: W fills
    # the bubble (faster, smaller bubble), the deferral holds more memory, and a raised row fits
    from bench.studies.paper_scale import format_schedule_rows, zero_bubble_rows

    setup = Setup(model=INTERNVL_6B_20B, pp=8, dp=16, planner="dp")
    batches = make_batches(_stats(10_000), per_step=setup.per_step, samples_per_microbatch=4, methods=("ours",))
    n = INTERNVL_6B_20B.num_blocks
    uniform = PlanChoice(boundaries=baseline_boundaries(INTERNVL_6B_20B, "uniform", 8), recompute=("full",) * n,
                         planner="uniform")
    rows, notes = zero_bubble_rows(setup, batches["ours"], {"uniform": uniform})
    one, zb = rows[0], rows[1]
    assert (one.schedule, zb.schedule) == ("1f1b", "interleaved-zb") and one.fits
    assert zb.iteration_s < one.iteration_s and zb.bubble < one.bubble and zb.peak_gib > one.peak_gib
    zbv = [r for r in rows if r.schedule == "zbv"]
    assert zbv and zbv[-1].fits and zbv[-1].bubble < one.bubble
    assert all(r.fits == (r.peak_gib * 2**30 <= setup.budget) for r in rows)
    over = [r for r in rows if not r.fits]  # the DP's interleaved plan, counted for interleaved's in-flight
    assert over and all(any(x.name.startswith(r.name + ", recomputation raised") and x.fits for x in rows)
                        for r in over)
    assert len(notes) == 2 and all("more than 2,000,000" in x and "DP 1 only" in x for x in notes)
    text = format_schedule_rows(rows, setup.budget / 2**30)
    assert text.splitlines()[2].split()[:2] == ["1F1B:", "uniform"] and "1.000" in text.splitlines()[2]
