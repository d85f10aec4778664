"""Paper-scale models, the vectorised epoch simulation, the ablation's monotonicity and the bench-all runner."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from omnibal_compile.cost_table import RECOMPUTE_OPTIONS, Precision
from omnibal_compile.data import LengthStats, load_lengths
from omnibal_compile.data.lengths import bundled_length_files
from omnibal_compile.models.analytic import (
    INTERNLM2_20B,
    INTERNVL_6B_20B,
    SCALE_MODELS,
    MicroBatch,
    cost_table,
    layer_activation_bytes,
    type_costs,
)
from omnibal_compile.plan import Plan
from omnibal_compile.sim import simulate
from omnibal_compile.solver import problem_from_costs, solve
from omnibal_compile.studies.bench_all import run_all
from omnibal_compile.studies.paper_scale import (
    PlanChoice,
    Setup,
    format_ablation,
    make_batches,
    pipeline_times,
    run_ablation,
    stage_times,
)


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

    from omnibal_compile.passes.blocks import build_blocks
    from omnibal_compile.passes.capture import capture
    from omnibal_compile.passes.cost import annotate_costs
    from omnibal_compile.models.analytic import LLMSpec

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
    problem = problem_from_costs(sharded, num_stages=8, num_microbatches=8, budget=72e9)
    assert solve(problem, "dp").feasible


def test_pipeline_replay_matches_the_simulator():
    model = INTERNVL_6B_20B
    rng = np.random.default_rng(0)
    M, n = 6, model.num_blocks
    tiles = rng.integers(4, 20, M).astype(float)
    tokens = rng.integers(1500, 6000, M).astype(float)
    pairs = tokens * 600.0
    bounds = (0, 20, 45, 70, n)
    rec = tuple(rng.choice(RECOMPUTE_OPTIONS) for _ in range(n))
    plan = PlanChoice(boundaries=bounds, recompute=rec, planner="manual")
    tables = [cost_table(model, MicroBatch(tiles=int(a), tokens=int(b), attention_pairs=float(c)), link="infiniband")
              for a, b, c in zip(tiles, tokens, pairs)]
    full = Plan(block_names=tables[0].names, boundaries=bounds, recompute=rec, schedule="1f1b", num_microbatches=M)
    expected = simulate(full, tables[0], microbatch_costs=tables).iteration_time_s
    f, b, s = stage_times(model, type_costs(model, tiles, tokens, pairs), plan, tables[0].link_bandwidth)
    got = pipeline_times(f[None], b[None], s[None])
    assert got.shape == (1,)
    assert got[0] == pytest.approx(expected, rel=1e-9)


def _stats(n: int) -> LengthStats:
    return load_lengths(bundled_length_files()).resample(n, seed=1)


def test_ablation_is_monotone_on_a_reduced_configuration():
    setup = Setup(model=INTERNVL_6B_20B, pp=8, dp=2, global_batch=128, ilp_time_limit=3.0)  # M = 16
    batches = make_batches(_stats(12_000), per_step=setup.dp * setup.microbatches, samples_per_microbatch=4)
    rows = run_ablation(setup, batches)
    chain = [r.gpu_days for r in rows if r.chain]
    assert len(chain) == 4
    assert all(b <= a * (1 + 1e-9) for a, b in zip(chain, chain[1:])), chain
    assert chain[-1] < 0.9 * chain[0]  # the whole thing helps, by a margin
    assert all(r.fits for r in rows if r.chain)
    assert rows[0].plan.recompute == ("full",) * INTERNVL_6B_20B.num_blocks
    text = format_ablation(setup, rows, paper=(1.0, 0.84, 0.469, 0.345))  # the table the bench prints
    assert all(r.name in text for r in rows) and "1.000" in text and "0.345" in text


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
