"""InternVL (the Hugging Face port) datasets: each image cut into dynamic tiles plus a thumbnail, one ``pixel_values``
row per tile, ``<img>`` + ``<IMG_CONTEXT>`` x 4 per tile + ``</img>`` in the text, exactly what transformers'
InternVLProcessor makes of a record; labels on the assistant turns only; ``lengths --model`` counts what the dataset
makes; packs of a fixed tile count whose filler tiles add nothing to any sample's loss."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_internvl

pytest.importorskip("transformers")
pytest.importorskip("PIL")

TOKENS_PER_TILE = 4
"""The tiny InternVL's image tokens per tile (16x16-pixel tiles of 4-pixel patches, pixel shuffle 0.5)."""

SAMPLE_0 = (["<|im_start|>", "system", "You", "are", "a", "helpful", "assistant", ".", "<|im_end|>",
             "<|im_start|>", "user", "<img>"] + ["<IMG_CONTEXT>"] * (7 * TOKENS_PER_TILE)
            + ["</img>", "What", "is", "in", "the", "picture", "?", "<|im_end|>",
               "<|im_start|>", "assistant", "A", "red", "bar", ".", "<|im_end|>"])
"""Record 0 rendered by the tiny InternVL's chat template, by hand: the default system turn, the 200x150 image as 7
tiles (aspect 4:3, nearest grid of at most 6 tiles 3x2 = 1.5, plus the thumbnail) of 4 tokens between <img> and
</img>, the question, the answer and its end-of-turn token."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("tiny_internvl"))


@pytest.fixture(scope="module")
def dataset(tiny: Path):
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    return ConversationDataset(tiny / "train.json", load_processor(tiny / "model"))


def _hf_processor(folder: Path):
    """``transformers.InternVLProcessor`` itself, made without ``__init__`` (which builds a video processor that needs
    torchvision, not installable against this CPU torch): its attributes as ``__init__`` sets them from the
    tokenizer, the folder's image processor and ``processor_config.json``'s image_seq_length."""
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = object.__new__(InternVLProcessor)
    processor.image_processor = AutoImageProcessor.from_pretrained(folder)
    processor.tokenizer, processor.video_processor, processor.chat_template = tokenizer, None, tokenizer.chat_template
    processor.image_seq_length = json.loads((folder / "processor_config.json").read_text())["image_seq_length"]
    processor.start_image_token, processor.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
    processor.start_image_token_id, processor.end_image_token_id = (tokenizer.start_image_token_id,
                                                                    tokenizer.end_image_token_id)
    processor.image_token, processor.image_token_id = tokenizer.context_image_token, tokenizer.context_image_token_id
    processor.video_token = tokenizer.video_token
    processor.multimodal_pattern = re.compile(
        f"(?P<image>{re.escape(processor.image_token)})|(?P<video>{re.escape(processor.video_token)})")
    return processor


def _hf_inputs(folder: Path, processor, record: int) -> dict:
    """Record ``record`` through ``InternVLProcessor.__call__``: its chat template's text with InternVL's image mark
    (``<IMG_CONTEXT>``) where the record has ``<image>`` (else before its first user turn, LLaVA's rule)."""
    from PIL import Image

    rec = json.loads((folder / "train.json").read_text())[record]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    turns = rec.get("messages") or [{"role": roles[t["from"]], "content": t["value"]} for t in rec["conversations"]]
    messages = [{"role": t["role"], "content": t["content"].replace("<image>", "<IMG_CONTEXT>")} for t in turns]
    paths = rec.get("image", [])
    images = [Image.open(folder / p).convert("RGB") for p in ([paths] if isinstance(paths, str) else paths)]
    if images and not any("<image>" in t["content"] for t in turns):
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = "<IMG_CONTEXT>" * len(images) + "\n" + first["content"]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    return dict(processor(text=[text], images=images or None, return_tensors="pt"))


def test_a_record_is_its_tiles_and_tokens_labels_on_the_answer_only(dataset):
    sample = dataset[0]
    words = dataset.tokenizer.convert_ids_to_tokens(sample["input_ids"].tolist())
    assert words == SAMPLE_0
    trained = sample["labels"] != -100
    assert trained.tolist() == [False] * (len(words) - 5) + [True] * 5
    assert torch.equal(sample["labels"][trained], sample["input_ids"][trained])
    assert sample["pixel_values"].shape == (7, 3, 16, 16)
    # tile 0 is the top-left 16x16 of the image resized to the 3x2 grid (48x32), the last the whole image (thumbnail)
    from PIL import Image

    processor = dataset.processor.image_processor
    mean, std = torch.tensor(processor.image_mean)[:, None, None], torch.tensor(processor.image_std)[:, None, None]
    with Image.open(dataset.image_root / "images" / "red.png") as im:
        grid = torch.tensor(list(im.convert("RGB").resize((48, 32), Image.BICUBIC).getdata())).float()
    grid = ((grid.T.reshape(3, 32, 48) / 255 - mean) / std)
    assert torch.allclose(sample["pixel_values"][0], grid[:, :16, :16], atol=1e-5)
    # a multi-turn text-only record: both answers trained, no pixels
    text_only = dataset[1]
    assert "pixel_values" not in text_only
    assert dataset.tokenizer.convert_ids_to_tokens(text_only["input_ids"][text_only["labels"] != -100].tolist()) == [
        "Hi", "<|im_end|>", "Sure", "<|im_end|>"]


def test_every_record_is_what_transformers_internvl_processor_makes_of_it(tiny, dataset):
    processor = _hf_processor(tiny / "model")
    for i in range(len(dataset)):
        sample, theirs = dataset[i], _hf_inputs(tiny, processor, i)
        assert torch.equal(sample["input_ids"], theirs["input_ids"][0]), i
        assert ("pixel_values" in sample) == ("pixel_values" in theirs), i
        if "pixel_values" in sample:
            assert torch.equal(sample["pixel_values"], theirs["pixel_values"]), i
    # the two-image record: each image gets up to max_patches tiles, as InternVLProcessor gives them
    assert dataset[2]["pixel_values"].shape[0] == 3 + 7  # 1600x900: 2x1 + thumbnail; 300x500: 2x3 + thumbnail


def test_tiles_per_image_are_internvls_tiling_of_the_length_files(tiny, dataset):
    """One rule of tiles per image: ``count_tiles`` (InternVL units' tiling, ``lengths --tokenizer``) is what the image
    processor cuts, over sizes and tile limits, and each single-image record's tile rows are its count."""
    from transformers import AutoImageProcessor

    from omnibal_compile.data.dataset_lengths import TilingOptions, count_tiles, read_image_size

    images = AutoImageProcessor.from_pretrained(tiny / "model")
    for low, high in ((1, 6), (1, 12), (2, 9)):
        options = TilingOptions(min_tiles=low, max_tiles=high, tile_size=16)
        for w in (1, 7, 16, 17, 31, 32, 48, 50, 64, 100, 160, 333):
            for h in (1, 9, 16, 24, 32, 40, 64, 99, 250):
                want = images.get_number_of_image_patches(h, w, {"min_patches": low, "max_patches": high,
                                                                 "crop_to_patches": True})
                assert count_tiles(w, h, options) == want, (w, h, low, high)
    records = json.loads((tiny / "train.json").read_text())
    options = TilingOptions(max_tiles=images.max_patches, tile_size=images.size["height"])
    for i, rec in enumerate(records):
        if isinstance(rec.get("image"), str):
            assert dataset[i]["pixel_values"].shape[0] == count_tiles(*read_image_size(tiny / rec["image"]), options)


def test_lengths_with_model_are_what_the_dataset_makes_and_plan_takes_them(tiny, dataset, tmp_path):
    from omnibal_compile.cli import main
    from omnibal_compile.data.lengths import load_lengths
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.settings import RunConfig

    spec, out = f"hf:{tiny / 'model'}", tmp_path / "lengths.jsonl"
    assert main(["lengths", str(tiny / "train.json"), "--model", spec, "--out", str(out), "--no-progress"]) == 0
    stats = load_lengths(out)
    for i in range(len(dataset)):
        sample = dataset[i]
        assert int(stats.tokens[i]) == sample["input_ids"].numel()
        assert int(stats.tiles[i]) == (sample["pixel_values"].shape[0] if "pixel_values" in sample else 0)
    assert stats.tiles.tolist() == [7, 0, 10, 7, 5, 0, 3, 7]
    assert stats.tokens[0] == len(SAMPLE_0)
    h = stats.header
    assert h is not None and (h.units, h.model_type, h.image_token_id) == ("model", "internvl", 6)
    common = dict(plan=str(tmp_path / "plan.json"), model=spec, batch_size=2, samples_per_pack=2.0, dp=2)
    on_data = RunConfig(dataset=str(tiny / "train.json"), **common)
    on_lengths = RunConfig(lengths=(str(out),), **common)
    model = build_model(on_data)
    a, b = batch_source(on_data, model), batch_source(on_lengths, model)
    assert a.data_plan.stats.digest == b.data_plan.stats.digest  # taken as they are: no tokens-per-tile conversion
    assert a.data_plan.shape == b.data_plan.shape and a.data_plan.seq_len == b.data_plan.seq_len
    assert [a.packs(s, r) for s in range(2) for r in range(2)] == [b.packs(s, r) for s in range(2) for r in range(2)]
    real, synthetic = a(0), b(0)  # the dataset's rows and the synthetic ones of its lengths fit the same stages
    assert {k: getattr(v, "shape", None) for k, v in real.items()} == {
        k: getattr(v, "shape", None) for k, v in synthetic.items()}


def test_a_tokenizer_without_internvls_named_image_tokens_is_refused(tiny, tmp_path):
    import shutil

    from omnibal_compile.errors import InputError
    from omnibal_compile.integrations.hf.dataset import load_processor

    folder = tmp_path / "model"
    shutil.copytree(tiny / "model", folder)
    (folder / "processor_config.json").unlink()  # image_seq_length then comes from config.json
    assert load_processor(folder).image_seq_length == TOKENS_PER_TILE
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "image_seq_length"}))
    with pytest.raises(InputError, match="neither processor_config.json nor config.json gives InternVL's "
                                         "image_seq_length"):
        load_processor(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    for name in ("start_image_token", "end_image_token", "context_image_token"):  # where transformers saves them
        tokenizer_config.pop(name)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(InputError, match="the tokenizer names no start_image_token, end_image_token, "
                                         "context_image_token"):
        load_processor(folder)


def test_a_processor_of_other_tokens_per_tile_than_the_model_is_refused(tiny, tmp_path, capsys):
    import shutil

    from omnibal_compile.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny / "model", folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                               "image_seq_length": 8}))
    assert main(["lengths", str(tiny / "train.json"), "--model", f"hf:{folder}", "--out", str(tmp_path / "l.jsonl"),
                 "--no-progress"]) == 2
    assert "its image_seq_length is 8 image tokens per tile, but the model's config says 4" in capsys.readouterr().err


SHAPE_TILES, SHAPE_TOKENS = 12, 100
"""A pack shape every pair of records below fits: Q_v tiles, Q_t tokens (row: Q_t + Q_v x 4)."""


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_each_sample_of_a_pack_gets_its_logits_and_loss_alone_and_the_filler_tiles_add_nothing(tiny, dataset, impl):
    from transformers import InternVLForConditionalGeneration

    from omnibal_compile.data.collate import PackingCollator
    from omnibal_compile.data.packing import PackShape
    from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_pack_inputs

    model = InternVLForConditionalGeneration.from_pretrained(tiny / "model", dtype=torch.float32,
                                                             attn_implementation=impl).eval()
    facts = hf_data_facts(model)
    assert facts["tokens_per_tile"] == TOKENS_PER_TILE and facts["image_shape"] == (3, 16, 16)
    image = facts["image_token_id"]
    collate = PackingCollator(shape=PackShape(tiles=SHAPE_TILES, tokens=SHAPE_TOKENS),
                              tokens_per_tile=TOKENS_PER_TILE, image_token_id=image, image_shape=(3, 16, 16))
    shapes = set()
    for pack in ([0, 1], [4, 6], [5]):  # 7 + 0, 5 + 3 and 0 tiles: 5, 4 and 12 filler tiles
        samples = [dataset[i] for i in pack]
        row = collate(samples)
        used = sum(s["input_ids"].numel() for s in samples)
        tiles = sum(s["pixel_values"].shape[0] for s in samples if "pixel_values" in s)
        assert not row["pixel_values"][tiles:].any()  # the filler tiles are zeros, their tokens open the tail
        tail_ids, tail_labels = row["input_ids"][0, used:], row["labels"][0, used:]
        free = (SHAPE_TILES - tiles) * TOKENS_PER_TILE
        assert bool((tail_ids[:free] == image).all()) and not bool((tail_ids[free:] == image).any())
        assert bool((tail_labels == -100).all())
        inputs = hf_pack_inputs(model, row)
        shapes.add(tuple((k, tuple(v.shape)) for k, v in sorted(inputs.items())))
        with torch.no_grad():
            packed = model(**inputs)
        start, total, count = 0, 0.0, 0
        for s in samples:
            alone = {"input_ids": s["input_ids"][None], "labels": s["labels"][None]}
            if "pixel_values" in s:
                alone["pixel_values"] = s["pixel_values"]
            with torch.no_grad():
                out = model(**alone)
            n = s["input_ids"].numel()
            assert float((packed.logits[0, start:start + n] - out.logits[0]).abs().max()) <= 1e-5
            weight = int((s["labels"][1:] != -100).sum())
            total, count, start = total + float(out.loss) * weight, count + weight, start + n
        assert abs(float(packed.loss) - total / count) <= 1e-5, (float(packed.loss), total / count)
    assert len(shapes) == 1  # every pack has the same shapes: 12 tile rows, one row of 148 tokens
