"""Meta-device start: a rank captures and cuts the model on ``meta``, reads only its own stages' tensors from the
``save_pretrained`` folder, makes its stage examples on meta, and trains as the unsplit model does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_llava

import omnibal_compile as oc
from omnibal_compile.api import compile_for_microbatches
from omnibal_compile.compile.codegen import run_stages
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.pipeline import _run_examples, _stage_examples
from omnibal_compile.runtime.settings import RunConfig
from omnibal_compile.runtime.weights import materialise, meta_start, on_meta, retarget_meta

pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny")) / "model"


def _config(spec: str, plan: str = "plan.json", **kw: Any) -> RunConfig:
    base: dict[str, Any] = {"plan": plan, "model": spec, "batch_size": 4, "text_tokens": 12, "tiles_per_sample": 1,
                            "steps": 2, "optimizer": "sgd", "lr": 0.5, "seed": 0, "num_microbatches": 2}
    return RunConfig(**{**base, **kw})


def _plan(config: RunConfig) -> oc.Plan:
    model = build_model(config)
    return oc.optimize(model, batch_source(config, model)(0), num_stages=2, num_microbatches=2,
                       planner="parameters").plan


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers()))


@pytest.mark.parametrize("extra", [{}, {"lora": "r=2,alpha=4,targets=q_proj,v_proj"}, {"freeze": ("vision_tower",)}],
                         ids=["plain", "lora", "freeze"])
def test_each_rank_reads_only_its_stages_tensors_and_they_are_the_pretrained_ones(tiny, extra):
    config = _config(f"hf:{tiny}", **extra)
    whole = build_model(config)  # the old start: from_pretrained, then LoRA and freeze
    batch = batch_source(config, whole)(0)
    plan = _plan(config)
    expected = _tensors(whole)
    for s in range(plan.num_stages):
        start = meta_start(config)
        assert start is not None and start.weights.files is not None
        result = compile_for_microbatches(start.model, on_meta(batch), plan)
        made = materialise(result.model, [result.stages[s]], start.weights, torch.device("cpu"))
        mine = {n for names in result.stage_info(s).param_map.values() for n in names}
        read = start.weights.files.read_names
        assert read and set(read) <= mine and len(read) == len(set(read))  # each tensor once, its own only
        real = {n: t for n, t in _tensors(result.model).items() if not t.is_meta}
        assert set(real) == mine  # the rest of the model stays on meta
        assert made == sum(t.numel() * t.element_size() for t in {id(t): t for t in real.values()}.values())
        for n, t in real.items():
            assert torch.equal(t, expected[n]) and t.requires_grad == expected[n].requires_grad, n
        assert all(t.requires_grad == expected[n].requires_grad for n, t in _tensors(result.model).items())

    # every stage made real on one rank computes the pretrained model's loss (rotary tables, position ids included)
    start = meta_start(config)
    assert start is not None
    result = compile_for_microbatches(start.model, on_meta(batch), plan)
    materialise(result.model, result.stages, start.weights, torch.device("cpu"))
    for stage in result.stages:
        retarget_meta(stage, torch.device("cpu"))
    micro = {k: v[:2] for k, v in batch.items()}
    with torch.no_grad():
        got = run_stages(result.stages, result.flatten_inputs(**micro))[0]
        assert abs(float(got) - float(whole(**micro).loss)) <= TOL


def test_a_tensor_of_another_shape_in_the_weight_files_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    state = load_file(str(tiny / "model.safetensors"))
    key = next(k for k in state if k.endswith("embeddings.patch_embedding.weight"))
    state[key] = state[key][:, :, :2].contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = _config(f"hf:{folder}")
    start = meta_start(config)
    assert start is not None
    good = _config(f"hf:{tiny}")
    result = compile_for_microbatches(start.model, on_meta(batch_source(good, build_model(good))(0)), _plan(good))
    with pytest.raises(oc.InputError, match="patch_embedding.weight has shape .* the weights are of another config"):
        materialise(result.model, [result.stages[0]], start.weights, torch.device("cpu"))


def test_stage_examples_on_meta_are_those_of_the_real_run(vlm):
    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=3, num_microbatches=4, planner="parameters")
    flops: dict[int, float] = {}
    examples = _stage_examples(result, [0, 1, 2], torch.device("cpu"), flops)
    real_flops: dict[int, float] = {}
    real = _run_examples(result, result.stages, [0, 1, 2], real_flops, on_meta=False)
    values, grads = result.captured.example_flat_inputs, []  # the real run, by hand: which outputs carry gradients
    with torch.enable_grad():
        for stage in result.stages:
            values = stage(*values)
            grads.append([isinstance(v, torch.Tensor) and v.requires_grad for v in values])
            values = tuple(v.detach().requires_grad_(v.requires_grad) for v in values)
    assert [[isinstance(v, torch.Tensor) and v.requires_grad for v in outs] for _, outs in examples] == grads
    assert any(g for gs in grads[:-1] for g in gs)
    for s, (ins, outs) in enumerate(examples):
        for a, b in zip((*ins, *outs), (*real[s][0], *real[s][1])):
            if isinstance(b, torch.Tensor):
                assert (a.shape, a.dtype, a.requires_grad, a.device.type) == (b.shape, b.dtype, b.requires_grad, "cpu")
            else:
                assert a is b or a == b
    assert flops == pytest.approx(real_flops)


def test_the_launcher_checks_an_hf_folder_plan_without_loading_weights(tiny, tmp_path, monkeypatch):
    import safetensors
    import transformers

    from omnibal_compile.runtime.launch import precheck

    path = tmp_path / "plan.json"
    config = _config(f"hf:{tiny}", plan=str(path))
    path.write_text(_plan(config).to_json())

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("the launcher read weights")

    monkeypatch.setattr(transformers.LlavaForConditionalGeneration, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    assert precheck(config).num_stages == 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("spec", ["hf", "tinyvlm"])
def test_two_ranks_started_on_meta_train_like_the_unsplit_model(tiny, tmp_path, spec):
    from omnibal_compile.runtime.launch import launch

    path = tmp_path / "plan.json"
    config = _config(f"hf:{tiny}" if spec == "hf" else "tinyvlm", plan=str(path), log=str(tmp_path / "log.jsonl"))
    path.write_text(_plan(config).to_json())
    logs = launch(config, timeout_s=200)
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step in range(config.steps):
        opt.zero_grad()
        out = model(**source(step))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        assert abs(float(loss.detach()) - logs[step].loss) <= TOL, (step, float(loss), logs[step].loss)
        loss.backward()
        opt.step()
    logged = [json.loads(line) for line in Path(config.log).read_text().splitlines()]  # type: ignore[arg-type]
    assert [e["step"] for e in logged] == [0, 1]


SMALL = {"image_size": 16, "patch_size": 4, "vit_hidden": 32, "vit_layers": 2, "vit_heads": 2, "vit_mlp": 64,
         "llm_hidden": 32, "llm_layers": 3, "llm_heads": 4, "llm_kv_heads": 2, "llm_mlp": 64, "vocab_size": 64,
         "image_token_id": 63}


@pytest.fixture(scope="module")
def llava_config(tiny: Path) -> Path:
    return tiny / "config.json"


@pytest.mark.parametrize("spec", ["tinyvlm", "hf-config"])
def test_a_seeded_spec_starts_on_meta_each_rank_making_only_its_stages_with_the_unsplit_models_values(
        spec, llava_config, tmp_path):
    """Seeded specs (no weights on disk): each stage's parameters, made alone by the per-name init, are the unsplit
    model's, no other stage's parameter is allocated, and all stages made one by one give its loss."""
    config = _config("tinyvlm", model_config=SMALL) if spec == "tinyvlm" else \
        _config(f"hf:LlavaForConditionalGeneration:{llava_config}", lora="r=2,alpha=4,targets=q_proj,v_proj")
    whole = build_model(config)
    batch = batch_source(config, whole)(0)
    plan = _plan(config)
    expected = _tensors(whole)
    params = dict(whole.named_parameters(remove_duplicate=False))
    result = None
    for s in range(plan.num_stages):
        start = meta_start(config)
        assert start is not None and start.weights.files is None and start.weights.seed == config.seed
        assert all(p.is_meta for p in start.model.parameters())  # nothing allocated before the cut
        result = compile_for_microbatches(start.model, on_meta(batch), plan)
        made = materialise(result.model, [result.stages[s]], start.weights, torch.device("cpu"))
        mine = {n for names in result.stage_info(s).param_map.values() for n in names}
        real = {n for n, p in result.model.named_parameters(remove_duplicate=False) if not p.is_meta}
        assert real == mine & set(params)  # the other stages' parameters stay on meta
        held = {id(t): t for n, t in _tensors(result.model).items() if n in mine}
        assert made == sum(t.numel() * t.element_size() for t in held.values())  # its own tensors' bytes only
        for n, t in _tensors(result.model).items():
            if not t.is_meta:
                assert torch.equal(t, expected[n]) and t.requires_grad == expected[n].requires_grad, n
        assert 0 < made < sum(p.numel() * p.element_size() for p in {id(p): p for p in params.values()}.values())
    # every stage, each made by its own rank, computes the unsplit model's loss
    stages = []
    for s in range(plan.num_stages):
        start = meta_start(config)
        assert start is not None
        result = compile_for_microbatches(start.model, on_meta(batch), plan)
        materialise(result.model, [result.stages[s]], start.weights, torch.device("cpu"))
        retarget_meta(result.stages[s], torch.device("cpu"))
        stages.append(result.stages[s])
    assert result is not None
    micro = {k: v[:2] for k, v in batch.items()}
    with torch.no_grad():
        got = float(run_stages(stages, result.flatten_inputs(**micro))[0])
        out = whole(**micro)
        assert abs(got - float(out if isinstance(out, torch.Tensor) else out.loss)) <= TOL


def test_seeded_weights_are_those_of_the_seed_and_a_module_without_its_own_init_is_named():
    from omnibal_compile.models.load import load_model
    from omnibal_compile.models.seeded import seeded_model

    a, b = (dict(load_model("tinyvlm", config=SMALL, seed=s).model.named_parameters()) for s in (0, 1))
    assert torch.equal(a["lm_head.weight"], dict(load_model("tinyvlm", config=SMALL).model.named_parameters())[
        "lm_head.weight"])
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    # each parameter of its own init: not the same values under two names, the init's distribution
    assert not torch.equal(a["llm.layers.0.attn.q_proj.weight"], a["llm.layers.1.attn.q_proj.weight"])
    assert torch.equal(a["llm.norm.weight"], torch.ones(32))
    assert 0.015 < float(a["vision.patch_embed.pos"].detach().std()) < 0.025

    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

    with pytest.raises(oc.InputError, match=r"module 1 \(Scale\) holds parameters but has no reset_parameters"):
        seeded_model(lambda: torch.nn.Sequential(torch.nn.Linear(2, 3), Scale()), 0)


def test_a_factory_is_built_as_the_factory_builds_it():
    assert meta_start(_config("my_package.models:build")) is None  # its own values: a meta build would lose them



def test_a_model_whose_capture_on_meta_fails_starts_whole_with_a_note(tiny, monkeypatch, capsys):
    import omnibal_compile.api as api
    from omnibal_compile.runtime.weights import compile_on_meta

    config = _config(f"hf:{tiny}")
    plan = _plan(config)
    start = meta_start(config)
    assert start is not None
    batch = batch_source(config, start.model)(0)
    assert compile_on_meta(config, start, batch, plan) is not None

    # as a capture that reads values on meta inputs fails
    def refuse(model: Any, batch: Any, plan: Any, **kw: Any) -> None:
        raise oc.InputError("a value read on meta")

    monkeypatch.setattr(api, "compile_for_microbatches", refuse)
    assert compile_on_meta(config, start, batch, plan) is None
    assert "every rank builds the whole model, as its capture on meta fails (InputError" in capsys.readouterr().err


def test_a_folder_saved_in_bf16_starts_in_float32_as_from_pretrained_loads_it(tiny, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    saved = json.loads((folder / "config.json").read_text())
    saved["dtype"] = saved["text_config"]["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(saved))
    config = _config(f"hf:{folder}")
    start = meta_start(config)
    assert start is not None
    expected = {n: t.dtype for n, t in _tensors(build_model(config)).items()}
    got = {n: t.dtype for n, t in _tensors(start.model).items()}
    assert got == expected and torch.float32 in got.values()
