"""Training on balanced packs: the runtime fed by the data balancer's sampler and packing collator."""

import dataclasses
import json

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile.errors import InputError
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM

TOL = 1e-5


def _config(tmp_path, lengths_file, stages=2, **kw):
    model_config = dataclasses.asdict(SMALL_VLM)
    model = build_model(RunConfig(plan="-", model_config=model_config))
    probe = RunConfig(plan="-", model_config=model_config, lengths=(lengths_file,), batch_size=1)
    micro = batch_source(probe, model)(0)
    plan = oc.optimize(model, micro, num_stages=stages, planner="uniform").plan
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    return RunConfig(plan=str(plan_path), model_config=model_config, lengths=(lengths_file,), **kw)


def test_balanced_batches_have_one_fixed_shape_and_are_deterministic(tmp_path, lengths_file):
    config = _config(tmp_path, lengths_file, batch_size=2)
    model = build_model(config)
    source = batch_source(config, model)
    shapes = {k: tuple(v.shape) for k, v in source(0).items()}
    per_epoch = len(source.data_plan.sampler(0))
    for step in (1, 2, per_epoch):  # past the end of the first epoch too
        assert {k: tuple(v.shape) for k, v in source(step).items()} == shapes
    assert shapes["input_ids"][0] == 2 and shapes["pixel_values"][0] == 2 * source.data_plan.shape.tiles
    again = batch_source(config, build_model(config))
    assert all(torch.equal(again(3)[k], source(3)[k]) for k in shapes)  # every rank builds the same batch
    assert torch.isfinite(model(**source(0)))
    with pytest.raises(InputError, match="give one source of batches, not --batches and --lengths"):
        batch_source(dataclasses.replace(config, batches="x:y"), model)


def test_two_ranks_train_on_balanced_packs_like_the_unsplit_model(tmp_path, lengths_file):
    config = _config(
        tmp_path, lengths_file, batch_size=2, steps=2, optimizer="sgd", lr=0.5, num_microbatches=2, schedule="1f1b",
        log=str(tmp_path / "steps.jsonl"),
    )
    logged = launch(config, timeout_s=240, quiet=True)
    assert [e.step for e in logged] == [0, 1]
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step, entry in enumerate(logged):
        opt.zero_grad()
        loss = model(**source(step))
        assert abs(float(loss.detach()) - entry.loss) <= TOL, (step, float(loss), entry.loss)
        loss.backward()
        opt.step()


HF_VLMS = ["llava", "internvl", "qwen2_vl", "qwen2_5_vl", "mistral3", "idefics3", "paligemma", "gemma3"]
"""Every Hugging Face VLM class the tests build (tests/hf_families.py, plus the conftest's Llava)."""
FAMILY_KEYS = {
    "qwen2_vl": {"image_grid_thw", "mm_token_type_ids"},
    "qwen2_5_vl": {"image_grid_thw", "mm_token_type_ids"},
    "mistral3": {"image_sizes"},
    "idefics3": {"pixel_attention_mask"},
    "paligemma": {"token_type_ids"},
    "gemma3": {"token_type_ids"},
}


def _microbatch_loss(model, batch, parts):
    """The unsplit model's loss of a step run as the pipeline splits it: ``parts`` micro-batches along dim 0, each
    one's mean loss weighted by its share of the step's labelled tokens (the whole-batch mean for Llava-like rows)."""
    from torch.utils import _pytree as pytree

    from omnibal_compile.compile.capture import split_batch

    leaves, spec = pytree.tree_flatten(batch)
    total, weights = 0.0, 0
    for part in split_batch(leaves, parts):
        mb = pytree.tree_unflatten(list(part), spec)
        n = int((mb["labels"][:, 1:] != -100).sum())
        total = total + model(**mb).loss * n
        weights += n
    return total / weights


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", HF_VLMS)
def test_run_command_trains_a_hugging_face_vlm_on_balanced_packs(
    tmp_path, lengths_file, tiny_llava, monkeypatch, family
):
    """`omnibal-compile run --model hf:CLASS:config.json --lengths ...` on 2 ranks, from the current directory."""
    from hf_families import build

    from omnibal_compile.cli import main
    from omnibal_compile.models.load import load_model

    monkeypatch.chdir(tmp_path)
    # two samples a pack on average (the default is 4): a pack still holds several samples and multi-tile ones, and
    # the vision towers whose capture grows with the pack's images (Qwen2.5-VL's windows, Mistral 3's per-image
    # patches: ~1 minute at 4 samples a pack) capture in seconds, four times in this test (here, launcher, 2 ranks)
    spp = 2
    config_file = tmp_path / f"{family}.json"
    hf_model = tiny_llava[0] if family == "llava" else build(family)[0]
    hf_model.config.to_json_file(config_file)
    spec = f"hf:{type(hf_model).__name__}:{config_file.name}"
    probe = RunConfig(plan="-", model=spec, lengths=(lengths_file,), batch_size=1, samples_per_pack=spp)
    model = load_model(spec).model
    micro = batch_source(probe, model)(0)
    want_keys = {"pixel_values", "input_ids", "labels", "position_ids", "attention_mask"} | FAMILY_KEYS.get(
        family, set()
    )
    assert set(micro) == want_keys  # the keys the family's processor emits, the samples kept apart by the mask
    # the pack's samples kept apart: the block-causal mask of the samples the positions restart at
    from omnibal_compile.integrations.hf.collate import block_causal_mask

    text_positions = micro["position_ids"][0].reshape(-1)  # Qwen2-VL's (4, 1, L): the first row is the text's
    starts = (text_positions == 0).nonzero().flatten().tolist() + [text_positions.numel()]
    assert len(starts) > 2  # several samples in the pack
    want = block_causal_mask([b - a for a, b in zip(starts, starts[1:])])
    mask = micro["attention_mask"]
    if family in ("gemma3", "paligemma"):  # plus each image's bidirectional block (tests/test_hf_inputs.py)
        mask = mask["full_attention"] if isinstance(mask, dict) else mask
        assert bool(((mask == 0) | (want != 0)).all()) and bool((mask != want).any())
    else:
        assert torch.equal(mask, want)
    result = oc.optimize(model, micro, num_stages=2, planner="uniform")
    assert result.check_parity().ok  # the pack's stages reproduce the unsplit model
    (tmp_path / "plan.json").write_text(result.plan.to_json())
    assert main(["run", "--plan", "plan.json", "--model", spec, "--lengths", lengths_file, "--batch-size", "2",
                 "--num-microbatches", "2", "--steps", "2", "--optimizer", "sgd", "--lr", "0.5", "--log", "steps.jsonl",
                 "--samples-per-pack", str(spp), "--timeout", "300"]) == 0
    logged = [json.loads(line)["loss"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    config = RunConfig(plan="plan.json", model=spec, lengths=(lengths_file,), batch_size=2, num_microbatches=2,
                       samples_per_pack=spp)
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step, entry in enumerate(logged):
        opt.zero_grad()
        loss = _microbatch_loss(model, source(step), 2)
        assert abs(float(loss.detach()) - entry) <= TOL, (step, float(loss), entry)
        loss.backward()
        opt.step()
    assert len(logged) == 2


def test_qwen2_vl_packs_need_one_row_per_microbatch(tmp_path, lengths_file):
    """Its position_ids are (4, 1, L) per row, stacked along dim 0: only one-row micro-batches split right."""
    pytest.importorskip("transformers")
    from hf_families import build

    from omnibal_compile.models.load import load_model

    config_file = tmp_path / "qwen2_vl.json"
    build("qwen2_vl")[0].config.to_json_file(config_file)
    spec = f"hf:Qwen2VLForConditionalGeneration:{config_file}"
    model = load_model(spec).model
    micro = batch_source(RunConfig(plan="-", model=spec, lengths=(lengths_file,), batch_size=1), model)(0)
    (tmp_path / "plan.json").write_text(oc.optimize(model, micro, num_stages=2, planner="uniform").plan.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model=spec, lengths=(lengths_file,), batch_size=4,
                       num_microbatches=2)
    with pytest.raises(InputError, match=r"one row only.*--batch-size.*\(2\), got 4"):
        batch_source(config, model)
    two = batch_source(dataclasses.replace(config, batch_size=2), model)(0)
    assert two["position_ids"].shape[:2] == (8, 1) and two["input_ids"].shape[0] == 2


def test_lengths_whose_samples_cannot_be_made_name_the_file_and_sample(tmp_path):
    """A sample with fewer tokens than its tiles' image tokens (dummy tiles the file does not count) is refused when
    the source is built, naming the file and the sample (it used to fail at its step, naming neither)."""
    rows = [{"vit_num": 1, "token_num": 400, "image_flags": 1}] * 6
    rows[2] = {"vit_num": 3, "token_num": 300, "image_flags": 0}  # a text-only sample with 3 dummy tiles
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(rows))
    config = RunConfig(plan="-", lengths=(str(path),), batch_size=2, samples_per_pack=1.0)
    model = build_model(config)
    with pytest.raises(InputError, match=rf"{path} \(scaled to 16 tokens/tile\): sample 2 has 3 tiles and 19 tokens, "
                                         r"fewer than its 48 image tokens plus one text token \(1 of 6 samples are "
                                         r"so\): 3 of its tiles are dummy ones"):
        batch_source(config, model)
