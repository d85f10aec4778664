"""A real conversation dataset through a tiny Llava's own processor: tokens, pixels, assistant-only labels, and a
pipeline run trained on packs of these samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from omnibal_compile.errors import InputError  # noqa: E402
from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor  # noqa: E402

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", ".", "Describe", "it", "Hello", "Hi", "and",
         "blue", "box", "Thanks", "Sure", "a"]
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<image>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
IMAGE = 16  # pixels per side: 4 x 4 patches of 4, plus CLS under the "full" strategy = 17 image tokens
IMAGE_TOKENS = 17


def _processor(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=SPECIALS[4:])
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    proc = LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=4, vision_feature_select_strategy="full",
                          num_additional_image_tokens=1, chat_template=TEMPLATE, image_token="<image>")
    proc.save_pretrained(str(folder))


def _model_config(folder: Path) -> Path:
    import transformers as tf

    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=IMAGE, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        pad_token_id=0)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=SPECIALS.index("<image>"),
                         image_seq_length=IMAGE_TOKENS, vision_feature_layer=-1, vision_feature_select_strategy="full")
    cfg.save_pretrained(str(folder))
    return folder / "config.json"


def _image(path: Path, w: int, h: int, color: tuple[int, int, int], fmt: str) -> str:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), color).save(path, format=fmt)
    return str(path.relative_to(path.parent.parent))


@pytest.fixture(scope="module")
def llava_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava-data")
    model = root / "model"
    _processor(model)
    config = _model_config(model)
    records = [
        {"image": _image(root / "images" / "a.png", 200, 150, (200, 30, 30), "PNG"),
         "conversations": [{"from": "human", "value": "<image>\nWhat is in the picture ?"},
                           {"from": "gpt", "value": "A red bar ."}]},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi"},
                           {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "Sure"}]},
        {"image": [_image(root / "images" / "b.jpg", 1600, 900, (20, 20, 220), "JPEG"),
                   _image(root / "images" / "c.png", 300, 500, (20, 200, 20), "PNG")],
         "messages": [{"role": "system", "content": "Describe it"},
                      {"role": "user", "content": "What is in the picture ?"},
                      {"role": "assistant", "content": "A blue box and a red bar ."}]},
        {"image": "images/a.png", "conversations": [{"from": "human", "value": "Describe it <image>"},
                                                     {"from": "gpt", "value": "A red bar"}]},
    ]
    data = root / "train.json"
    data.write_text(json.dumps(records))
    return {"root": root, "model": model, "config": config, "data": data}


def _dataset(llava_data: dict[str, Path]) -> ConversationDataset:
    return ConversationDataset(llava_data["data"], load_processor(llava_data["model"]))


def test_labels_are_the_assistant_turns_only(llava_data):
    ds = _dataset(llava_data)
    tok = ds.tokenizer
    sample = ds[0]
    ids, labels = sample["input_ids"], sample["labels"]
    # by hand: <s> <|user|> <image> x 17 What is in the picture ? </s> <|assistant|> A red bar . </s>
    words = ["<s>", "<|user|>", *["<image>"] * IMAGE_TOKENS, "What", "is", "in", "the", "picture", "?", "</s>",
             "<|assistant|>", "A", "red", "bar", ".", "</s>"]
    assert tok.convert_ids_to_tokens(ids.tolist()) == words
    trained = [w for w, label in zip(words, labels.tolist()) if label != -100]
    assert trained == ["A", "red", "bar", ".", "</s>"]
    assert torch.equal(labels[labels != -100], ids[labels != -100])
    assert sample["pixel_values"].shape == (1, 3, IMAGE, IMAGE)
    # the processor's own tokenization of the whole rendering gives the same ids
    proc = ds.processor
    text = proc.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in the picture ?"},
                                     {"role": "assistant", "content": "A red bar ."}], tokenize=False)
    from PIL import Image

    ref = proc(text=text, images=[Image.open(llava_data["root"] / "images" / "a.png").convert("RGB")],
               add_special_tokens=False, return_tensors="pt")
    assert torch.equal(ref["input_ids"][0], ids) and torch.equal(ref["pixel_values"], sample["pixel_values"])


def test_multi_turn_text_only_and_multi_image_records(llava_data):
    ds = _dataset(llava_data)
    tok = ds.tokenizer
    chat = ds[1]
    assert "pixel_values" not in chat
    trained = tok.convert_ids_to_tokens(chat["input_ids"][chat["labels"] != -100].tolist())
    assert trained == ["Hi", "</s>", "Sure", "</s>"]  # both assistant turns, no user or system text
    two = ds[2]
    assert two["pixel_values"].shape == (2, 3, IMAGE, IMAGE)  # a 1600x900 JPEG and a 300x500 PNG
    assert int((two["input_ids"] == SPECIALS.index("<image>")).sum()) == 2 * IMAGE_TOKENS  # marks added in turn 1
    # the system turn ("Describe it") and the user turn carry no labels
    assert tok.convert_ids_to_tokens(two["input_ids"][two["labels"] != -100].tolist()) == [
        "A", "blue", "box", "and", "a", "red", "bar", ".", "</s>"]
    stats = ds.lengths(progress=False)
    assert stats.tiles.tolist() == [1, 0, 2, 1]
    assert stats.tokens.tolist() == [len(ds[i]["input_ids"]) for i in range(4)]


def test_bad_records_name_the_record_and_what_is_wrong(llava_data, tmp_path):
    proc = load_processor(llava_data["model"])
    cases = [
        ({"conversations": [{"from": "human", "value": "Hello"}]}, "has no assistant turn"),
        ({"image": "images/missing.png",
          "conversations": [{"from": "human", "value": "<image> Hello"}, {"from": "gpt", "value": "Hi"}]},
         "missing.png cannot be read"),
        ({"image": "images/a.png", "conversations": [{"from": "human", "value": "<image> <image> Hello"},
                                                      {"from": "gpt", "value": "Hi"}]}, "marks 2 images but it has 1"),
        ({"conversations": [{"from": "robot", "value": "Hello"}]}, "turn 0 needs a role"),
    ]
    for record, message in cases:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps([record]))
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "images" / "a.png").write_bytes((llava_data["root"] / "images" / "a.png").read_bytes())
        with pytest.raises(InputError, match=rf"{path}.*record 0.*{message}|{path}.*{message}"):
            ConversationDataset(path, proc)[0]
    with pytest.raises(InputError, match="processor folder .* does not exist"):
        load_processor(tmp_path / "nowhere")


def _run_config(tmp_path: Path, llava_data: dict[str, Path], **extra):
    from omnibal_compile.runtime.settings import RunConfig

    return RunConfig(plan=str(tmp_path / "plan.json"), model=f"hf:LlavaForConditionalGeneration:{llava_data['config']}",
                     dataset=str(llava_data["data"]), batch_size=2, samples_per_pack=2.0, **extra)


def test_packs_hold_the_real_samples(llava_data, tmp_path):
    """Each row of a step is a pack of real samples: their own ids and labels, their own pixels, padding after."""
    from omnibal_compile.runtime.batches import batch_source, build_model

    config = _run_config(tmp_path, llava_data)
    model = build_model(config)
    source = batch_source(config, model)
    step = source(0)
    ds = _dataset(llava_data)
    for row, ids in enumerate(source.packs(0, 0)):
        want = torch.cat([ds[i]["input_ids"] for i in ids])
        assert torch.equal(step["input_ids"][row, : want.numel()], want)
        pixels = [ds[i]["pixel_values"] for i in ids if "pixel_values" in ds[i]]
        if pixels:
            got = step["pixel_values"].reshape(2, -1, 3, IMAGE, IMAGE)[row]
            assert torch.equal(got[: sum(p.shape[0] for p in pixels)], torch.cat(pixels))
    # the pack's loss is the samples' own: the unsplit model on the row equals the token-weighted mean of each
    # sample run alone through model(**inputs)
    model.eval()
    with torch.no_grad():
        row_loss = float(model(**{k: v[:1] if k != "pixel_values" else v[: step["pixel_values"].shape[0] // 2]
                                   for k, v in step.items() if k != "attention_mask"},
                               attention_mask=step["attention_mask"][:1]).loss)
        total, count = 0.0, 0
        for i in source.packs(0, 0)[0]:
            s = ds[i]
            labels = s["labels"].clone()
            labels[0] = -100  # a sample's first token is never predicted in a pack
            n = int((labels[1:] != -100).sum())
            out = model(input_ids=s["input_ids"][None], labels=labels[None],
                        **({"pixel_values": s["pixel_values"]} if "pixel_values" in s else {}))
            total += float(out.loss) * n
            count += n
    assert abs(row_loss - total / count) < 1e-5


def test_an_epoch_and_an_eval_set_of_a_dataset_hold_each_record_once(llava_data, tmp_path):
    """--epochs 1 trains every record once (the last step padded with empty rows); --eval-data's records (another
    file of the same format) are packed once each into the training packs' shapes."""
    from omnibal_compile.runtime.batches import batch_source, build_model, eval_source, run_steps

    records = json.loads(llava_data["data"].read_text())
    held_out = llava_data["root"] / "held_out.json"  # next to train.json: the same relative image paths
    held_out.write_text(json.dumps(records[1:4]))
    config = _run_config(tmp_path, llava_data, epochs=1, eval_data=str(held_out))
    model = build_model(config)
    source = batch_source(config, model)
    steps = run_steps(config, source)
    assert sorted(i for k in range(steps) for ids in source.sample_ids(k, 0) for i in ids) == list(range(4))
    evals, eval_steps = eval_source(config, model, source)
    shapes = {k: tuple(v.shape) for k, v in source(0).items()}
    for k in range(eval_steps):
        assert {n: tuple(v.shape) for n, v in evals(k).items()} == shapes
    assert sorted(i for k in range(eval_steps) for ids in evals.sample_ids(k, 0) for i in ids) == [0, 1, 2]


@pytest.mark.distributed
def test_run_trains_on_the_real_samples_like_the_unsplit_model(llava_data, tmp_path, monkeypatch):
    """`omnibal-compile run --dataset train.json --model hf:...` on 2 pipeline ranks: each step's loss equals the
    unsplit model's on the same packs of real samples (SGD, 2 steps), and changing one image's pixels changes it."""
    import omnibal_compile as oc
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.batches import batch_source, build_model

    monkeypatch.chdir(tmp_path)
    config = _run_config(tmp_path, llava_data, num_microbatches=2)
    model = build_model(config)
    source = batch_source(config, model)
    micro = {k: (v[:1] if k != "pixel_values" else v[: v.shape[0] // 2]) for k, v in source(0).items()}
    result = oc.optimize(model, micro, num_stages=2, planner="uniform")
    assert result.check_parity().ok
    (tmp_path / "plan.json").write_text(result.plan.to_json())
    args = ["run", "--plan", "plan.json", "--model", config.model, "--dataset", str(llava_data["data"]),
            "--batch-size", "2", "--samples-per-pack", "2", "--num-microbatches", "2", "--steps", "2",
            "--optimizer", "sgd", "--lr", "0.5", "--log", "steps.jsonl", "--timeout", "300", "--data-workers", "2"]
    assert main(args) == 0
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    logged = [line["loss"] for line in lines]
    for step, line in enumerate(lines):  # the log names the dataset records each dp rank trained on
        assert line["samples"] == [[i for ids in source.sample_ids(step, 0) for i in ids]]
    model = build_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step, entry in enumerate(logged):
        opt.zero_grad()
        batch = source(step)
        parts = [{k: (v[r : r + 1] if k != "pixel_values" else v.reshape(2, -1, *v.shape[1:])[r]) for k, v in
                  batch.items()} for r in range(2)]
        weights = [int((p["labels"][:, 1:] != -100).sum()) for p in parts]
        loss = sum(model(**p).loss * w for p, w in zip(parts, weights)) / sum(weights)
        assert abs(float(loss.detach()) - entry) <= 1e-5, (step, float(loss), entry)
        loss.backward()
        opt.step()
    assert len(logged) == 2
    # the images are read: other pixels in one image of the first step give another loss
    from PIL import Image

    def step0_loss(batch):
        torch.manual_seed(0)
        with torch.no_grad():
            return float(build_model(config)(**{k: v[:1] if k != "pixel_values" else v.reshape(2, -1, *v.shape[1:])[0]
                                                for k, v in batch.items()}).loss)

    before = source(0)
    first = source.packs(0, 0)[0]
    record = json.loads(llava_data["data"].read_text())[next(i for i in first if i in (0, 2, 3))]
    path = llava_data["root"] / (record["image"] if isinstance(record["image"], str) else record["image"][0])
    original = path.read_bytes()
    try:
        with Image.open(path) as im:
            fmt, size = im.format, im.size
        Image.new("RGB", size, (5, 250, 5)).save(path, format=fmt)
        after = source(0)  # images are read when a step is made
    finally:
        path.write_bytes(original)
    assert torch.equal(before["input_ids"], after["input_ids"]) and not torch.equal(before["pixel_values"],
                                                                                    after["pixel_values"])
    assert abs(step0_loss(before) - step0_loss(after)) > 1e-6


def test_bad_records_stop_the_run_or_are_left_out_with_skip_bad_records(llava_data, tmp_path):
    from omnibal_compile.runtime.batches import batch_source, build_model

    records = json.loads(llava_data["data"].read_text())
    records.insert(1, {"image": "images/gone.png", "conversations": [{"from": "human", "value": "Hello"},
                                                                    {"from": "gpt", "value": "Hi"}]})
    path = llava_data["root"] / "with-bad.json"  # beside the images
    path.write_text(json.dumps(records))
    config = _run_config(tmp_path, llava_data)
    config = config.replace(dataset=str(path))
    model = build_model(config)
    with pytest.raises(InputError, match=r"with-bad.json.*record 1.*gone.png cannot be read"):
        batch_source(config, model)
    source = batch_source(config.replace(skip_bad_records=True), model)
    seen = sorted(i for r in range(1) for ids in source.sample_ids(0, r) for i in ids)
    assert 1 not in seen and set(seen) <= {0, 2, 3, 4}  # record ids of the file, the bad one left out
    ds = ConversationDataset(path, load_processor(llava_data["model"]), skip_bad=True)
    stats = ds.lengths(progress=False)
    assert ds.kept == [0, 2, 3, 4] and [r for r, _ in ds.skipped] == [1] and len(stats) == 4


def test_every_sample_of_an_epoch_is_trained_once_across_dp_ranks(llava_data, tmp_path):
    from collections import Counter

    from omnibal_compile.runtime.batches import batch_source, build_model

    config = _run_config(tmp_path, llava_data, dp=2).replace(samples_per_pack=1.0)
    source = batch_source(config, build_model(config))
    per_epoch = len(source.data_plan.sampler(0))  # packs per dp rank per epoch
    rows = config.batch_size // 2
    seen = Counter(i for step in range(per_epoch // rows) for r in range(2)
                   for ids in source.sample_ids(step, r) for i in ids)
    assert seen == Counter(range(4)), seen


def test_dataloader_workers_make_the_same_batches(llava_data, tmp_path):
    from omnibal_compile.runtime.batches import batch_source, build_model, step_batches

    config = _run_config(tmp_path, llava_data)
    source = batch_source(config, build_model(config))
    here = list(step_batches(source, 1, 4))
    ahead = list(step_batches(source, 1, 4, workers=2))  # two worker processes, two steps ahead each
    assert len(here) == len(ahead) == 3
    for a, b in zip(here, ahead):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
