"""--lora r=...,alpha=...,targets=...: peft's LoRA adapters injected into the model the run builds, the base weights
frozen; plan and run agree on the adapted blocks; the export is the adapter (PeftModel.from_pretrained loads it onto
the base model, equal to the trained one); a resumed LoRA run continues exactly."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile import progress
from omnibal_compile.config import Config, LoraSpec, lora_spec
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.models.lora import apply_lora, lora_names
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM

pytest.importorskip("peft")

WRITE = "--lora r=16,alpha=32,targets=q_proj,v_proj"


# -- the setting ------------------------------------------------------------------------------------
def test_the_spec_is_parsed_from_the_flag_text_and_round_trips_through_run_json():
    spec = lora_spec("r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj")
    assert spec == LoraSpec(r=16, alpha=32.0, dropout=0.05, targets=("q_proj", "v_proj"))
    assert lora_spec(str(spec)) == spec  # str() is the flag text
    assert lora_spec("targets=q_proj, r=4") == LoraSpec(r=4, targets=("q_proj",))  # any order, defaults for the rest
    assert lora_spec(None) is None and lora_spec("none") is None
    assert Config().lora is None  # off by default
    config = RunConfig(plan="p.json", lora="r=4,alpha=8,targets=q_proj,v_proj")
    assert isinstance(config.lora, LoraSpec)
    assert RunConfig.from_json(config.to_json()).lora == config.lora  # run.json: a dict back to the spec
    assert Config(lora="r=4,targets=q_proj").to_dict()["lora"] == "r=4,alpha=16,dropout=0,targets=q_proj"


@pytest.mark.parametrize(("text", "said"), [
    ("rank=4,targets=q_proj", "unknown key 'rank'"),
    ("r=0,targets=q_proj", "r must be a whole number > 0, got 0"),
    ("r=-2,targets=q_proj", "r must be a whole number > 0"),
    ("r=4", "names no targets"),
    ("r=4,targets=", "names no targets"),
    ("r=four,targets=q_proj", "four"),
    ("q_proj", "'q_proj' is not key=value"),
    ("r=4,r=8,targets=q_proj", "r is given twice"),
    ("r=4,dropout=1,targets=q_proj", r"dropout must be in \[0, 1\)"),
    ("r=4,alpha=0,targets=q_proj", "alpha must be > 0"),
])
def test_a_wrong_spec_is_an_input_error_naming_the_flag_and_what_to_write(text, said):
    with pytest.raises(InputError, match=said) as e:
        Config(lora=text)
    assert "lora (--lora)" in str(e.value)
    if "key=value" not in said and "unknown key" not in said:
        assert WRITE in str(e.value)


def test_the_flag_is_generated_for_plan_and_run():
    from omnibal_compile.cli import build_parser

    parser = build_parser()
    for command in ("plan", "run"):
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        assert "--lora" in sub.format_help(), command


# -- the adapted model --------------------------------------------------------------------------------
def test_only_the_adapters_train_and_the_adapted_model_starts_as_the_base_model():
    config = RunConfig(plan="-", model_config=dataclasses.asdict(SMALL_VLM), lora="r=2,alpha=4,targets=q_proj,v_proj")
    model, base = build_model(config), build_model(dataclasses.replace(config, lora=None))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and trained == list(lora_names(model))
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert any(n == "llm.layers.0.attn.q_proj.lora_A.default.weight" for n in trained)
    assert type(model) is type(base)  # not wrapped: the plan's block paths are the base model's
    batch = batch_source(config, model)(0)
    with torch.no_grad():  # lora_B starts at zero
        assert torch.equal(model(**batch), base(**batch))
    again = build_model(config)  # every rank builds the same adapters
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    # --freeze applies after --lora: it may freeze adapters too
    frozen = build_model(dataclasses.replace(config, freeze=(r"llm\.layers\.0\.",)))
    left = [n for n, p in frozen.named_parameters() if p.requires_grad]
    assert left == [n for n in trained if not n.startswith("llm.layers.0.")] and len(left) < len(trained)


def test_a_target_naming_no_linear_module_and_a_missing_peft_are_named(monkeypatch):
    from omnibal_compile.models import TinyVLM

    with pytest.raises(InputError, match=r"target 'q_porj' names no linear module of TinyVLM; .*q_proj"):
        apply_lora(TinyVLM(SMALL_VLM), "r=2,targets=q_porj")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ModuleNotFoundError
    with pytest.raises(InputError, match="pip install peft"):
        apply_lora(TinyVLM(SMALL_VLM), "r=2,targets=q_proj")


def test_the_plan_is_made_with_the_runs_lora_and_a_plan_without_it_is_refused_with_that_hint(tmp_path: Path):
    """optimize(lora=) adapts a copy (the user's model keeps its modules), its blocks are the base model's names with
    the adapters' parameters, its plan notes the spec; the run's precheck takes that plan and names the missing
    --lora when given a base-model plan."""
    from omnibal_compile.models import TinyVLM
    from omnibal_compile.runtime.launch import precheck

    spec = "r=2,alpha=4,targets=q_proj,v_proj"
    model = TinyVLM(SMALL_VLM)
    names = [n for n, _ in model.named_parameters()]
    with progress.quiet():
        adapted = oc.optimize(model, num_stages=2, planner="uniform", device="cpu", lora=spec)
        plain = oc.optimize(model, num_stages=2, planner="uniform", device="cpu")
    assert [n for n, _ in model.named_parameters()] == names  # not modified
    assert lora_names(adapted.model) and adapted.plan.notes["lora"] == str(lora_spec(spec))
    assert adapted.plan.block_names == plain.plan.block_names
    assert sum(adapted.plan.block_params) > sum(plain.plan.block_params)
    with pytest.raises(InputError, match="already holds LoRA adapters"):
        oc.optimize(adapted.model, num_stages=2, lora=spec)
    model_config = dataclasses.asdict(SMALL_VLM)
    for which, plan in (("lora", adapted.plan), ("plain", plain.plan)):
        (tmp_path / f"{which}.json").write_text(plan.to_json())
    config = RunConfig(plan=str(tmp_path / "lora.json"), model_config=model_config, lora=spec, batch_size=4)
    with progress.quiet():
        assert precheck(config).block_names == adapted.plan.block_names
        with pytest.raises(PlanError, match=r"made without --lora, this run trains --lora r=2.*make the plan with"):
            precheck(dataclasses.replace(config, plan=str(tmp_path / "plain.json")))
        with pytest.raises(PlanError, match=r"made with --lora r=2,.* this run trains without --lora"):
            precheck(dataclasses.replace(config, lora=None))


# -- a 2-rank run: trains the adapters only, exports them, resumes exactly ------------------------------
def _save_llava(folder: Path) -> None:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(7)
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=95, image_seq_length=17,
                         vision_feature_layer=-1, vision_feature_select_strategy="full")
    tf.LlavaForConditionalGeneration(cfg).save_pretrained(str(folder))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_rank_lora_run_trains_the_adapters_only_exports_them_and_resumes_exactly(tmp_path, monkeypatch):
    """pp=2, AdamW: 4 steps in one run vs 2 steps then --resume to 4 give the same losses (<= 1e-6); the base weights
    are the pretrained ones exactly, every adapter moved; the export is adapter_config.json and
    adapter_model.safetensors, and PeftModel.from_pretrained(base, DIR) computes the trained model's logits (1e-5)."""
    from peft import PeftModel

    from omnibal_compile.cli import main
    from omnibal_compile.models.load import load_model
    from omnibal_compile.runtime.checkpoint import load_into_model

    folder = tmp_path / "llava"
    _save_llava(folder)
    monkeypatch.chdir(tmp_path)
    spec, lora = f"hf:{folder}", "r=4,alpha=8,dropout=0.1,targets=q_proj,v_proj"
    assert main(["plan", spec, "--num-stages", "2", "--planner", "uniform", "--lora", lora, "--num-microbatches",
                 "2", "--microbatch-size", "1", "--out", "p", "--no-pictures"]) == 0
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["notes"]["lora"] == str(lora_spec(lora))
    run = ["run", "--plan", "p/plan.json", "--model", spec, "--lora", lora, "--batch-size", "2", "--lr", "1e-2",
           "--timeout", "300", "--log"]
    assert main([*run, "whole.jsonl", "--steps", "4", "--save", "whole"]) == 0
    assert main([*run, "parts.jsonl", "--steps", "2", "--save", "parts", "--export-hf", "out"]) == 0
    assert main([*run, "parts.jsonl", "--steps", "4", "--save", "parts", "--export-hf", "out",
                 "--resume", "parts"]) == 0
    whole, parts = ([json.loads(line)["loss"] for line in Path(f).read_text().splitlines()]
                    for f in ("whole.jsonl", "parts.jsonl"))
    assert len(whole) == len(parts) == 4 and len(set(whole)) == 4  # the loss changes step to step
    assert parts == pytest.approx(whole, abs=1e-6, rel=0)
    # the trained model: the checkpoint in the adapted model
    trained = build_model(RunConfig(plan="-", model=spec, lora=lora))
    start = {n: p.detach().clone() for n, p in trained.named_parameters()}
    assert load_into_model(trained, tmp_path / "parts") == 4
    pretrained = dict(load_model(spec).model.named_parameters())
    adapters = set(lora_names(trained))
    assert len(adapters) == 2 * 2 * (2 + 3)  # A and B of q and v, in 2 vision and 3 text layers
    for n, p in trained.named_parameters():
        if n in adapters:
            assert not torch.equal(p, start[n]), n  # trained
        else:
            assert torch.equal(p, pretrained[n.replace(".base_layer.", ".")]), n  # never moved
    out = tmp_path / "out"
    written = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "omnibal-export.json"} <= written
    assert json.loads((out / "omnibal-export.json").read_text())["step"] == 4
    assert not (out / "model.safetensors").exists()  # the adapter only, not the base weights
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert main(["export", "parts", "again"]) == 0  # the export command: the same adapter
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == (
        out / "adapter_model.safetensors").read_bytes()
    loaded = PeftModel.from_pretrained(load_model(spec).model, str(out))
    loaded.eval()
    trained.eval()
    sample = batch_source(RunConfig(plan="-", model=spec, batch_size=2, seed=5), trained)(0)
    with torch.no_grad():
        want, have = trained(**sample).logits, loaded(**sample).logits
    assert torch.allclose(have, want, atol=1e-5, rtol=0), float((have - want).abs().max())
    # resuming without --lora (or with another) is refused before any rank starts
    with pytest.raises(InputError, match="was trained with --lora r=4"):
        from omnibal_compile.runtime.launch import precheck

        precheck(RunConfig(plan="p/plan.json", model=spec, batch_size=2, steps=6, resume="parts"))
