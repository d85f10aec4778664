"""``omnibal-compile plan`` end to end: the reference VLM and a tiny Hugging Face Llava config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_inspect import assert_picture

from omnibal_compile.cli import main
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan

try:
    from test_hf_dataset import llava_data  # noqa: F401  (a tiny Llava folder with its processor and real images)
except pytest.skip.Exception:  # no transformers: the tests taking it skip, the others run
    @pytest.fixture
    def llava_data():  # type: ignore[no-redef]
        pytest.skip("needs transformers")

ARTEFACTS = ("plan.json", "plan.txt", "costs.json", "torchtitan.json", "megatron.txt", "trace.json", "blocks.png",
             "blocks.svg", "timeline.png", "stages.png")


def check_artefacts(out: Path, stages: int, microbatches: int) -> Plan:
    for name in ARTEFACTS:
        assert (out / name).is_file(), name
    text = (out / "plan.json").read_text()
    plan = Plan.from_json(text)
    assert Plan.from_json(plan.to_json()) == plan and json.loads(plan.to_json()) == json.loads(text)
    assert plan.num_stages == stages and plan.num_microbatches == microbatches
    assert plan.iteration_time_s and plan.iteration_time_s > 0 and len(plan.stage_time_s) == stages
    costs = CostTable.from_json((out / "costs.json").read_text())
    assert costs.names == plan.block_names
    for png in ("blocks.png", "timeline.png", "stages.png"):
        assert_picture(out / png)
    trace = json.loads((out / "trace.json").read_text())
    assert sum(e["ph"] == "X" and e["cat"] == "forward" for e in trace["traceEvents"]) == stages * microbatches
    modules = json.loads((out / "torchtitan.json").read_text())
    assert len(modules) == stages and all(isinstance(m, str) for stage in modules for m in stage)
    assert (out / "megatron.txt").read_text().count("|") == stages - 1
    return plan


def test_plan_tiny_vlm(tmp_path, capsys):
    out = tmp_path / "out"
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([{"vit_num": 1 + i % 5, "token_num": 300 + 97 * (i % 13)} for i in range(300)]))
    code = main(
        [
            "plan",
            "tiny-vlm",
            "--num-stages",
            "3",
            "--num-microbatches",
            "6",
            "--memory-budget",
            "1GiB",
            "--device",
            "a100-80gb",
            "--sweep-stages",
            "2,3",
            "--lengths",
            str(lengths),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    plan = check_artefacts(out, 3, 6)
    assert plan.memory_budget_bytes == (2**30,) * 3 and plan.schedule == "1f1b"
    assert "simulated 1f1b: 3 stages on 3 devices" in printed and "Megatron layout:" in printed
    assert "what-if over stages" in printed and (out / "sweep_stages.png").is_file()
    assert "random batches (padded)" in printed and "balanced packs (ours)" in printed
    assert CostTable.from_json((out / "costs.json").read_text()).source == "roofline"
    # A saved cost table is reused as is, and the interleaved schedule runs chunks.
    again = tmp_path / "again"
    assert (
        main(
            [
                "plan",
                "tiny-vlm",
                "--num-stages",
                "4",
                "--virtual-stages",
                "2",
                "--schedule",
                "interleaved",
                "--num-microbatches",
                "4",
                "--costs",
                str(out / "costs.json"),
                "--no-pictures",
                "--out",
                str(again),
            ]
        )
        == 0
    )
    assert "simulated interleaved: 4 stages on 2 devices" in capsys.readouterr().out
    assert Plan.from_json((again / "plan.json").read_text()).virtual_stages == 2
    assert not (again / "timeline.png").exists() and (again / "trace.json").is_file()
    # A zbv plan names the search that made it, and the sweep re-plans with the planner asked for (ilp)
    zbv = tmp_path / "zbv"
    assert main(["plan", "tiny-vlm", "--num-stages", "4", "--schedule", "zbv", "--virtual-stages", "2",
                 "--num-microbatches", "4", "--costs", str(out / "costs.json"), "--sweep-stages", "4",
                 "--no-pictures", "--out", str(zbv)]) == 0
    printed = capsys.readouterr().out
    assert "Plan by 'zero-bubble search'" in printed and "what-if over stages (planner ilp)" in printed


def test_plan_hf_llava(tmp_path, capsys):
    tf = pytest.importorskip("transformers")
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=95, image_seq_length=17,
                         vision_feature_layer=-1, vision_feature_select_strategy="full")
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    out = tmp_path / "out"
    code = main(["plan", f"hf:LlavaForConditionalGeneration:{path}", "--num-stages", "2", "--num-microbatches", "4",
                 "--memory-budget", "512MiB", "--text-tokens", "8", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = check_artefacts(out, 2, 4)
    assert any("language_model.layers" in n for n in plan.block_names)
    assert "LlavaForConditionalGeneration" in capsys.readouterr().out


def test_plan_hf_on_meta(tmp_path, capsys):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=4)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    args = [
        "plan",
        f"hf:LlamaForCausalLM:{path}",
        "--meta",
        "--num-stages",
        "2",
        "--num-microbatches",
        "4",
        "--text-tokens",
        "256",
        "--no-pictures",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main([*args, "--device", "a100-80gb"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "activations in bfloat16" in out and "attention: memory-efficient (masked) attention" in out
    assert main(args) == 2  # the default device profiles here, which a meta model cannot
    assert "meta device, which has no values to time" in capsys.readouterr().err
    assert main(["plan", "tiny-vlm", "--meta", "--out", str(tmp_path)]) == 2
    assert "--meta builds hf:ClassName:config.json models only" in capsys.readouterr().err


def test_plan_errors_are_reported(tmp_path, capsys):
    assert main(["plan", "tiny-vlm", "--memory-budget", "80 parsecs", "--out", str(tmp_path)]) == 2
    assert "unknown unit" in capsys.readouterr().err
    assert main(["plan", "no_such_module:factory", "--out", str(tmp_path)]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert main(["plan", "hf:NoSuchModel:x.json", "--out", str(tmp_path)]) == 2
    assert "no model class" in capsys.readouterr().err
    assert main(["plan", "tiny-vlm", "--num-stages", "4", "--virtual-stages", "2", "--out", str(tmp_path)]) == 2
    assert "--virtual-stages 2: schedule '1f1b' runs one stage per device" in capsys.readouterr().err
    assert main(["plan", "tiny-vlm", "--num-stages", "4", "--num-microbatches", "2", "--out", str(tmp_path)]) == 2
    assert "2 micro-batches for 4 stages" in capsys.readouterr().err


def test_plan_rejects_costs_of_other_blocks(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(["plan", "tiny-vlm", "--num-stages", "2", "--device", "a100-80gb", "--no-pictures", "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    data = json.loads((out / "costs.json").read_text())
    data["blocks"][0]["name"] = "not_a_block"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert (
        main(["plan", "tiny-vlm", "--num-stages", "2", "--costs", str(other), "--no-pictures", "--out", str(out)]) == 2
    )
    err = capsys.readouterr().err
    assert f"cost table {other} does not hold the" in err and "not_a_block" in err


def test_plan_chooses_the_layout_for_a_device_count(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "plan",
                "tiny-vlm",
                "--devices",
                "8",
                "--device",
                "h100-80gb",
                "--memory-budget",
                "1GiB",
                "--no-pictures",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "layout search: 8 devices" in printed and "predicted ms/micro-batch" in printed
    plan = Plan.from_json((out / "plan.json").read_text())
    best = next(line for line in (out / "layout.txt").read_text().splitlines() if line.rstrip().endswith("best"))
    assert (
        best.startswith(f"PP {plan.num_devices} x DP {plan.dp.size}, ") and f"M {plan.num_microbatches} x b 1" in best
    )
    assert f"simulated {plan.schedule}: {plan.num_stages} stages on {plan.num_devices} devices" in printed


def test_plan_takes_lengths_in_the_models_units_as_the_run_measures_them(llava_data, tmp_path, capsys):
    """plan --lengths on a file from `lengths --model`: no tokens-per-tile conversion, the samples the run's own
    --dataset measures (so the same packs); a file for another model stops plan before any work."""
    from omnibal_compile.cli import build_parser
    from omnibal_compile.cli.plan import _plan_lengths, load_model, plan_settings
    from omnibal_compile.data import balance_pack
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    spec = f"hf:LlavaForConditionalGeneration:{llava_data['config']}"
    lengths = tmp_path / "lengths.csv"
    assert main(["lengths", str(llava_data["data"]), "--model", spec, "--out", str(lengths), "--no-progress"]) == 0
    argv = ["plan", spec, "--num-stages", "2", "--num-microbatches", "2", "--microbatch-size", "2", "--device",
            "a100-80gb", "--text-tokens", "8", "--no-pictures", "--lengths", str(lengths), "--out", str(tmp_path / "o")]
    assert main(argv) == 0, capsys.readouterr().err
    assert f"micro-batches of 2 samples from {lengths} (4 samples)" in capsys.readouterr().out
    cfg = plan_settings(build_parser().parse_args(argv))
    model = load_model(spec, batch=1, tiles=1, text=8, seed=0)[0]
    planned = _plan_lengths(cfg, model)
    measured = ConversationDataset(llava_data["data"], load_processor(llava_data["model"])).lengths(progress=False)
    assert planned.tokens.tolist() == measured.tokens.tolist() and planned.tiles.tolist() == measured.tiles.tolist()
    a, b = (balance_pack(s, dp=2, samples_per_pack=2, seed=0) for s in (planned, measured))
    assert a.order.tolist() == b.order.tolist() and a.capacity == b.capacity
    other = tmp_path / "other.csv"
    other.write_text(lengths.read_text().replace('"model_type": "llava"', '"model_type": "qwen2_vl"'))
    assert main([*argv[:-4], "--lengths", str(other), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert f"{other}: its lengths are in the units of a qwen2_vl model" in err and "but the model is llava" in err
    assert f"omnibal-compile lengths {llava_data['data']} --model {spec} --out {other}" in err
    assert not (tmp_path / "o2" / "plan.json").exists()
