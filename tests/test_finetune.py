"""The documented fine-tune path end to end: ``lengths --model`` -> ``plan`` -> ``run`` (dp=2 x pp=2 on 4 ranks;
InternVL: pp=2 on 2 ranks) on a pretrained tiny Llava, Qwen2-VL or InternVL folder and a LLaVA-format dataset of
real images, checked against the unsplit model on each sample alone; the step's packs carry the images' pixels
(one image changed, the step's loss changes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_internvl, make_tiny_llava, make_tiny_qwen2vl

pytest.importorskip("transformers")

RUN = ["--dp", "2", "--batch-size", "4", "--samples-per-pack", "2", "--num-microbatches", "2"]
"""The run's data layout: 2 dp ranks x 2 rows of 2 samples (one row per micro-batch, as Qwen2-VL's packs need)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2vl(tmp_path_factory.mktemp("tiny_qwen"))


@pytest.fixture(scope="module")
def tiny_internvl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("tiny_internvl"))


def _walk(folder: Path, dp: int = 2) -> tuple[str, dict]:
    """``lengths`` -> ``plan`` -> ``run`` (one SGD step) in the current folder; the model spec and step 0's log."""
    from omnibal_compile.cli import main

    model_spec = f"hf:{folder / 'model'}"
    assert main(["lengths", str(folder / "train.json"), "--model", model_spec, "--out", "lengths.jsonl"]) == 0
    assert main(["plan", model_spec, "--lengths", "lengths.jsonl", "--num-stages", "2", "--dp", str(dp),
                 "--no-pictures", "--out", "plan"]) == 0
    assert main(["run", "--plan", "plan/plan.json", "--model", model_spec, "--dataset", str(folder / "train.json"),
                 *_layout(dp), "--steps", "1", "--optimizer", "sgd", "--log", "steps.jsonl", "--timeout", "400"]) == 0
    (step,) = [json.loads(line) for line in Path("steps.jsonl").read_text().splitlines()]
    ids = [i for rank in step["samples"] for i in rank]
    assert len(step["samples"]) == dp and len(ids) == len(set(ids)) > 2  # every dp rank, distinct records
    return model_spec, step


def _layout(dp: int) -> list[str]:
    """``RUN`` for ``dp`` data-parallel ranks (2 rows of 2 samples each)."""
    return ["--dp", str(dp), "--batch-size", str(2 * dp), *RUN[4:]]


def _alone(model, dataset, ids, extra=lambda sample: {}) -> float:
    """Each sample alone through the pretrained model (its processor's tensors, its own labels), token-weighted."""
    total = count = 0.0
    with torch.no_grad():
        for i in ids:
            sample = dataset[i]
            inputs = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None], **extra(sample)}
            n = int((sample["labels"][1:] != -100).sum())
            total += float(model(**inputs).loss) * n
            count += n
    assert count > 0
    return total / count


def _packed_step_loss(model_spec: str, data: Path, dp: int = 2) -> float:
    """Step 0 of ``run --dataset data`` as this process builds it (every rank's rows), through the unsplit model one
    row at a time (Qwen2-VL: its vision tower as captured, which takes the packs' empty images), token-weighted."""
    from torch.utils import _pytree as pytree

    from omnibal_compile.compile.capture import split_batch
    from omnibal_compile.integrations.hf.grids import grid_free_capture
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.settings import RunConfig

    config = RunConfig(plan="plan/plan.json", model=model_spec, dataset=str(data), dp=dp, batch_size=2 * dp,
                       samples_per_pack=2, num_microbatches=2)
    model = build_model(config)
    leaves, spec = pytree.tree_flatten(batch_source(config, model)(0))
    total = count = 0.0
    with torch.no_grad(), grid_free_capture(model):
        for part in split_batch(leaves, 2 * dp):
            row = pytree.tree_unflatten(list(part), spec)
            n = int((row["labels"][:, 1:] != -100).sum())
            total += float(model(**row).loss) * n
            count += n
    return total / count


def _changed_image(folder: Path, out: Path) -> Path:
    """``folder``'s dataset with one image (images/red.png, records 0 and 7) given other pixels of the same size."""
    from PIL import Image

    shutil.copytree(folder / "images", out / "images")
    shutil.copy(folder / "train.json", out / "train.json")
    with Image.open(out / "images" / "red.png") as im:
        w, h = im.size
    Image.frombytes("RGB", (w, h), bytes((7 * i) % 251 for i in range(w * h * 3))).save(out / "images" / "red.png")
    return out / "train.json"


def _check_pixels_count(model_spec: str, folder: Path, step: dict, tmp_path: Path, dp: int = 2) -> None:
    """The step's packs as built here give the run's loss; with one image's pixels changed, another loss."""
    same = _packed_step_loss(model_spec, folder / "train.json", dp)
    assert abs(same - step["loss"]) <= 1e-5, (same, step["loss"])
    changed = _packed_step_loss(model_spec, _changed_image(folder, tmp_path / "changed"), dp)
    assert abs(changed - same) > 1e-4, (changed, same)


@pytest.mark.slow
@pytest.mark.distributed
def test_lengths_plan_run_on_dp2_x_pp2_trains_the_pretrained_model_on_the_real_samples(tiny, tmp_path, monkeypatch):
    from transformers import LlavaForConditionalGeneration

    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    monkeypatch.chdir(tmp_path)
    model_spec, step = _walk(tiny)
    ids = [i for rank in step["samples"] for i in rank]
    dataset = ConversationDataset(tiny / "train.json", load_processor(tiny / "model"))
    model = LlavaForConditionalGeneration.from_pretrained(tiny / "model", dtype=torch.float32)
    want = _alone(model, dataset, ids,
                  lambda s: {"pixel_values": s["pixel_values"]} if "pixel_values" in s else {})
    assert abs(step["loss"] - want) <= 1e-5, (step["loss"], want)
    _check_pixels_count(model_spec, tiny, step, tmp_path)


QWEN_SAMPLE_0 = (["<|im_start|>", "system", "You", "are", "a", "helpful", "assistant", ".", "<|im_end|>",
                  "<|im_start|>", "user", "<|vision_start|>"] + ["<|image_pad|>"] * 12
                 + ["<|vision_end|>", "What", "is", "in", "the", "picture", "?", "<|im_end|>",
                    "<|im_start|>", "assistant", "A", "red", "bar", ".", "<|im_end|>"])
"""Record 0 rendered by the tiny Qwen2-VL's chat template, by hand: the default system turn, the 200x150 image as
12 placeholders (grid (1, 6, 8) of 4-pixel patches, 2x2 merged), the answer and its end-of-turn token."""


@pytest.mark.slow
@pytest.mark.distributed
def test_qwen2_vl_lengths_plan_run_on_dp2_x_pp2_trains_the_pretrained_model_on_the_real_samples(
        tiny_qwen, tmp_path, monkeypatch):
    from transformers import Qwen2VLForConditionalGeneration

    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    dataset = ConversationDataset(tiny_qwen / "train.json", load_processor(tiny_qwen / "model"))
    sample = dataset[0]  # only the assistant's tokens carry labels, as the chat template renders the record
    words = dataset.tokenizer.convert_ids_to_tokens(sample["input_ids"].tolist())
    assert words == QWEN_SAMPLE_0
    trained = sample["labels"] != -100
    assert trained.tolist() == [False] * (len(words) - 5) + [True] * 5
    assert torch.equal(sample["labels"][trained], sample["input_ids"][trained])
    assert sample["image_grid_thw"].tolist() == [[1, 6, 8]] and sample["pixel_values"].shape == (48, 3 * 2 * 4 * 4)

    monkeypatch.chdir(tmp_path)
    model_spec, step = _walk(tiny_qwen)
    ids = [i for rank in step["samples"] for i in rank]
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen / "model", dtype=torch.float32)
    image = int(model.config.image_token_id)

    def images(s):
        if "pixel_values" not in s:
            return {}
        return {"pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"],
                "mm_token_type_ids": (s["input_ids"][None] == image).int()}

    want = _alone(model, dataset, ids, images)
    assert abs(step["loss"] - want) <= 1e-5, (step["loss"], want)
    for i in ids:  # the samples' tensors are what Hugging Face's own Qwen2VLProcessor makes of the records
        sample, theirs = dataset[i], _qwen_processor_inputs(tiny_qwen, i)
        assert torch.equal(sample["input_ids"], theirs["input_ids"][0]), i
        for key in ("pixel_values", "image_grid_thw"):
            assert (key in sample) == (key in theirs) and (key not in sample or torch.equal(sample[key], theirs[key]))
    _check_pixels_count(model_spec, tiny_qwen, step, tmp_path)


def _qwen_processor_inputs(folder: Path, record: int) -> dict:
    """Record ``record`` of ``folder``'s train.json through ``transformers.Qwen2VLProcessor.__call__`` itself: its chat
    template's text with Qwen2-VL's image marks, the record's images. The processor is made without ``__init__``,
    which builds a video processor that needs torchvision (not installable against this CPU torch); images need
    only the image processor and the tokenizer it is given."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    rec = json.loads((folder / "train.json").read_text())[record]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    turns = rec.get("messages") or [{"role": roles[t["from"]], "content": t["value"]} for t in rec["conversations"]]
    mark = "<|vision_start|><|image_pad|><|vision_end|>"
    messages = [{"role": t["role"], "content": t["content"].replace("<image>", mark)} for t in turns]
    paths = rec.get("image", [])
    images = [Image.open(folder / p).convert("RGB") for p in ([paths] if isinstance(paths, str) else paths)]
    if images and not any("<image>" in t["content"] for t in turns):  # LLaVA's rule: images go before the first turn
        messages[0 if messages[0]["role"] != "system" else 1]["content"] = (
            mark * len(images) + messages[0 if messages[0]["role"] != "system" else 1]["content"])
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    processor = object.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder / "model")
    processor.tokenizer, processor.video_processor, processor.chat_template = tokenizer, None, tokenizer.chat_template
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    return {k: v for k, v in out.items() if k in ("input_ids", "pixel_values", "image_grid_thw")}


@pytest.mark.slow
@pytest.mark.distributed
def test_internvl_lengths_plan_run_on_pp2_trains_the_pretrained_model_on_the_real_tiles(tiny_internvl, tmp_path,
                                                                                        monkeypatch):
    """InternVL's dynamic tiles through the pipeline (2 ranks, pp=2): step 0's loss is the unsplit pretrained model's on
    each trained sample alone (its tiles as ``pixel_values``), token-weighted; another image's pixels, another loss.
    The samples themselves (tokens, labels, tiles == transformers' InternVLProcessor) are checked in
    tests/test_hf_internvl_dataset.py."""
    from transformers import InternVLForConditionalGeneration

    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    monkeypatch.chdir(tmp_path)
    model_spec, step = _walk(tiny_internvl, dp=1)
    ids = [i for rank in step["samples"] for i in rank]
    dataset = ConversationDataset(tiny_internvl / "train.json", load_processor(tiny_internvl / "model"))
    assert any("pixel_values" in dataset[i] for i in ids) and len({dataset[i].get("pixel_values", torch.zeros(0)
                                                                              ).shape[0] for i in ids}) > 1
    model = InternVLForConditionalGeneration.from_pretrained(tiny_internvl / "model", dtype=torch.float32)
    want = _alone(model, dataset, ids, lambda s: {"pixel_values": s["pixel_values"]} if "pixel_values" in s else {})
    assert abs(step["loss"] - want) <= 1e-5, (step["loss"], want)
    _check_pixels_count(model_spec, tiny_internvl, step, tmp_path, dp=1)


@pytest.mark.slow
def test_qwen2_vl_dataset_packs_refuse_cutting_images(tiny_qwen):
    from omnibal_compile.errors import InputError
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.settings import RunConfig

    config = RunConfig(plan="-", model=f"hf:{tiny_qwen / 'model'}", dataset=str(tiny_qwen / "train.json"),
                       batch_size=2, oversized="truncate")
    with pytest.raises(InputError, match=r"oversized \(--oversized\) 'truncate': Qwen2VLForConditionalGeneration"):
        batch_source(config, build_model(config))


@pytest.mark.slow
@pytest.mark.distributed
def test_the_instruction_tuning_recipe_exports_the_trained_model_with_its_tower_unchanged(tiny, tmp_path, monkeypatch):
    """``--freeze vision_tower --lr-schedule cosine --warmup-steps 2 --max-grad-norm 1.0 --export-hf OUT`` on the real
    dataset (pp=2): the export loads with from_pretrained; its vision tower is the pretrained one exactly and every
    other parameter that gets a gradient moved; its logits equal the trained checkpoint's in the unsplit model
    (<= 1e-5); the logged lr is warm-up then cosine; step 0's logged grad_norm is the unsplit model's global norm on
    the same batch (<= 1e-5 relative, fp32)."""
    from transformers import LlavaForConditionalGeneration

    from omnibal_compile.cli import main
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.checkpoint import load_into_model
    from omnibal_compile.runtime.recipe import lr_at
    from omnibal_compile.runtime.settings import RunConfig

    monkeypatch.chdir(tmp_path)
    spec, data = f"hf:{tiny / 'model'}", str(tiny / "train.json")
    layout = ["--batch-size", "2", "--samples-per-pack", "2", "--num-microbatches", "2"]
    assert main(["lengths", data, "--model", spec, "--out", "lengths.jsonl"]) == 0
    assert main(["plan", spec, "--lengths", "lengths.jsonl", "--num-stages", "2", "--freeze", "vision_tower",
                 "--no-pictures", "--out", "plan"]) == 0
    steps, lr = 4, 1e-2
    assert main(["run", "--plan", "plan/plan.json", "--model", spec, "--dataset", data, *layout, "--steps", str(steps),
                 "--optimizer", "adamw", "--lr", str(lr), "--freeze", "vision_tower", "--lr-schedule", "cosine",
                 "--warmup-steps", "2", "--max-grad-norm", "1.0", "--save", "ckpt", "--export-hf", "out",
                 "--log", "steps.jsonl", "--timeout", "400"]) == 0
    logged = [json.loads(line) for line in Path("steps.jsonl").read_text().splitlines()]
    assert [e["lr"] for e in logged] == pytest.approx(
        [lr_at(k, lr=lr, schedule="cosine", warmup_steps=2, steps=steps) for k in range(steps)], rel=1e-9)

    pretrained = LlavaForConditionalGeneration.from_pretrained(tiny / "model", dtype=torch.float32)
    exported = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", local_files_only=True)
    config = RunConfig(plan="plan/plan.json", model=spec, dataset=data, batch_size=2, samples_per_pack=2,
                       num_microbatches=2, freeze=("vision_tower",))
    probe = build_model(config)  # the unsplit model, its tower frozen, on the run's step-0 batch
    batch = batch_source(config, probe)(0)
    probe(**batch).loss.backward()
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in probe.parameters() if p.grad is not None])))
    assert abs(logged[0]["grad_norm"] - norm) <= 1e-5 * norm, (logged[0]["grad_norm"], norm)
    before, after = dict(pretrained.named_parameters()), dict(exported.named_parameters())
    grads = {n: p.grad for n, p in probe.named_parameters()}
    tower = [n for n in before if ".vision_tower." in f".{n}"]
    assert tower and all(torch.equal(after[n], before[n]) for n in tower)
    moved = [n for n in before if n not in tower and grads[n] is not None]
    assert moved and all(not torch.equal(after[n], before[n]) for n in moved), [
        n for n in moved if torch.equal(after[n], before[n])]
    trained = build_model(config)
    assert load_into_model(trained, "ckpt") == steps
    trained.eval()
    exported.eval()
    with torch.no_grad():
        want, have = trained(**batch).logits, exported(**batch).logits
    assert torch.allclose(have, want, atol=1e-5, rtol=0), float((have - want).abs().max())
