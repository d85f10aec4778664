"""Length statistics from a LLaVA-style dataset: tiling, token counts, errors, the command and its output file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from omnibal_compile.cli import main
from omnibal_compile.data.dataset_lengths import TilingOptions, count_tiles, dataset_lengths, tile_grid
from omnibal_compile.data.lengths import load_lengths, save_lengths
from omnibal_compile.errors import InputError

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import test_hf_dataset  # noqa: E402
from test_hf_dataset import IMAGE_TOKENS, SPECIALS  # noqa: E402

llava_data = test_hf_dataset.llava_data  # the fixture: a tiny Llava folder with its processor, real PNG/JPEG images

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", ".", "Describe", "it", "Hello", "Hi"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('system turns are not supported') }}{% endif %}"
            "<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}")


def _tokenizer(path: Path, *, template: str | None) -> Path:
    """A WordLevel tokenizer saved as a transformers folder; the plain one adds a BOS token itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {"plain": _tokenizer(root / "plain", template=None), "chat": _tokenizer(root / "chat", template=TEMPLATE)}


def _image(path: Path, w: int, h: int) -> str:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), (200, 30, 30)).save(path)
    return path.name if path.parent.name == "images" else str(path)


QA = [{"from": "human", "value": "<image>\nWhat is in the picture ?"}, {"from": "gpt", "value": "A red bar ."}]
# Words after removing <image>: 6 + 4. Plain: joined + BOS = 11. Chat: <s> <|user|> 6 </s> <|assistant|> 4 </s> = 15.
QA_PLAIN, QA_CHAT = 11, 15


@pytest.mark.parametrize(("size", "expected"), [
    ((448, 448), 1),      # aspect 1: (1,1); larger square grids tie but the image is too small for them
    ((1792, 1792), 10),   # aspect 1, big: ties go to (2,2) then (3,3): 9 tiles + thumbnail
    ((896, 448), 3),      # aspect 2: (2,1) + thumbnail; (4,2) ties but needs > 4 tiles' worth of pixels
    ((600, 400), 7),      # aspect 1.5: (3,2) + thumbnail
    ((300, 200), 7),      # small images are upscaled: same grid as 600x400
    ((1000, 100), 11),    # aspect 10: (10,1) + thumbnail
    ((100, 1000), 11),    # tall: (1,10) + thumbnail
])
def test_tiles_match_hand_computed_internvl_grids(size: tuple[int, int], expected: int) -> None:
    assert count_tiles(*size) == expected


def test_tiling_options_ties_and_multi_image() -> None:
    # max 2 tiles, aspect 1.5: (1,1) and (2,1) tie at 0.5; (2,1) wins only with more than 1 tile's pixels.
    assert tile_grid(600, 400, max_tiles=2) == (2, 1)       # 240000 px > 0.5 * 448^2 * 2
    assert tile_grid(540, 360, max_tiles=2) == (1, 1)       # 194400 px
    assert count_tiles(896, 448, TilingOptions(thumbnail=False)) == 2
    assert count_tiles(448, 448, TilingOptions(min_tiles=2)) == 5   # (2,2) + thumbnail
    assert count_tiles(1000, 100, TilingOptions(max_tiles=12), images_in_record=2) == 7  # max 6: (6,1) + thumb
    assert count_tiles(224, 224, TilingOptions(tile_size=224, max_tiles=4)) == 1
    assert count_tiles(448, 224, TilingOptions(tile_size=224, max_tiles=4)) == 3
    with pytest.raises(InputError, match="min_tiles"):
        TilingOptions(min_tiles=3, max_tiles=2)


def _dataset(tmp_path: Path, records: list[dict], name: str = "data.json") -> Path:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    return path


@pytest.mark.parametrize("kind", ["plain", "chat"])
def test_tokens_and_tiles_per_record(tmp_path: Path, tokenizers: dict[str, Path], kind: str) -> None:
    text = QA_PLAIN if kind == "plain" else QA_CHAT
    _image(tmp_path / "images/wide.png", 896, 448)
    _image(tmp_path / "images/long.png", 1000, 100)
    _image(tmp_path / "images/square.png", 448, 448)
    records = [
        {"image": "images/wide.png", "conversations": QA},
        {"conversations": QA},                                                    # text-only
        {"image": ["images/long.png", "images/square.png"], "conversations": QA},  # 2 images: max 6 tiles each
    ]
    data = _dataset(tmp_path, records, "data.jsonl")
    r = dataset_lengths(data, tokenizer=tokenizers[kind], tokens_per_tile=10)
    assert r.stats.tiles.tolist() == [3, 0, 8]
    assert r.stats.image_flags.tolist() == [3, 0, 8]
    assert r.stats.tokens.tolist() == [text + 30, text, text + 80]
    assert (r.records, r.text_only, r.images, r.skipped) == (3, 1, 3, ())
    d = dataset_lengths(data, tokenizer=tokenizers[kind], tokens_per_tile=10, dummy_tile=True, image_marker_tokens=2)
    assert d.stats.tiles.tolist() == [3, 1, 8]
    assert d.stats.image_flags.tolist() == [3, 0, 8]
    assert d.stats.tokens.tolist() == [text + 32, text, text + 84]


def test_missing_and_corrupt_images_are_reported(tmp_path: Path, tokenizers: dict[str, Path]) -> None:
    _image(tmp_path / "images/ok.png", 600, 400)
    (tmp_path / "images/corrupt.png").write_bytes(b"this is not a png")
    records = [{"image": "images/ok.png", "conversations": QA},
               {"image": "images/missing.png", "conversations": QA},
               {"image": ["images/ok.png", "images/corrupt.png"], "conversations": QA},
               {"conversations": QA}]
    data = _dataset(tmp_path, records)
    r = dataset_lengths(data, tokenizer=tokenizers["plain"])
    assert r.record_ids.tolist() == [0, 3]
    assert r.stats.tiles.tolist() == [7, 0]
    assert [(s.record, Path(s.image).name) for s in r.skipped] == [(1, "missing.png"), (2, "corrupt.png")]
    assert r.skipped[0].reason == "file not found"
    assert "Pillow" in r.skipped[1].reason
    with pytest.raises(InputError, match=r"record 1: image .*missing\.png: file not found"):
        dataset_lengths(data, tokenizer=tokenizers["plain"], on_error="fail")


def test_header_only_read_counts_a_truncated_image(tmp_path: Path, tokenizers: dict[str, Path]) -> None:
    # The size comes from the header: an image whose pixel data is cut off still counts (and is not decoded).
    from PIL import Image

    path = tmp_path / "cut.jpg"
    Image.effect_noise((1000, 100), 50).convert("RGB").save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(OSError), Image.open(path) as im:
        im.load()  # decoding the pixels fails
    r = dataset_lengths(_dataset(tmp_path, [{"image": "cut.jpg", "conversations": QA}]), tokenizer=tokenizers["plain"])
    assert r.stats.tiles.tolist() == [11]


def test_image_root_and_record_errors(tmp_path: Path, tokenizers: dict[str, Path]) -> None:
    _image(tmp_path / "pics/a.png", 448, 448)
    (tmp_path / "meta").mkdir()
    data = _dataset(tmp_path / "meta", [{"image": "a.png", "conversations": QA}])
    r = dataset_lengths(data, tokenizer=tokenizers["plain"], image_root=tmp_path / "pics")
    assert r.stats.tiles.tolist() == [1]
    with pytest.raises(InputError, match="every record was left out"):
        dataset_lengths(data, tokenizer=tokenizers["plain"])  # default root: the data file's folder
    bad = _dataset(tmp_path, [{"conversations": QA}, {"image": "x.png"}], "bad.json")
    with pytest.raises(InputError, match="record 1: needs a non-empty 'conversations'"):
        dataset_lengths(bad, tokenizer=tokenizers["plain"])
    system = _dataset(tmp_path, [{"conversations": QA}, {"conversations": [{"from": "system", "value": "Hi"}, *QA]}],
                      "system.json")
    with pytest.raises(InputError, match="record 1: the tokenizer's chat template fails"):
        dataset_lengths(system, tokenizer=tokenizers["chat"])
    with pytest.raises(InputError, match="tokenizer folder .* does not exist"):
        dataset_lengths(system, tokenizer=tmp_path / "no-tokenizer")


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_save_lengths_round_trips(tmp_path: Path, suffix: str) -> None:
    from omnibal_compile.data.lengths import LengthStats

    stats = LengthStats.from_arrays([3, 0, 1], [800, 12, 300], [3, 0, 0])
    back = load_lengths(save_lengths(stats, tmp_path / f"l{suffix}"))
    for f in ("tiles", "tokens", "image_flags"):
        assert getattr(back, f).tolist() == getattr(stats, f).tolist()
    with pytest.raises(InputError, match="suffix"):
        save_lengths(stats, tmp_path / "l.txt")


def test_lengths_command(tmp_path: Path, tokenizers: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _image(tmp_path / "images/wide.png", 896, 448)
    records = [{"image": "images/wide.png", "conversations": QA}, {"image": "images/gone.png", "conversations": QA},
               {"conversations": QA}]
    data = _dataset(tmp_path, records)
    out, skipped = tmp_path / "lengths.json", tmp_path / "skipped.jsonl"
    argv = ["lengths", str(data), "--tokenizer", str(tokenizers["chat"]), "--out", str(out), "--no-progress"]
    assert main([*argv, "--skipped-out", str(skipped)]) == 0
    printed = capsys.readouterr().out
    assert "left out 1 of 3 records" in printed and re.search(r"record 1: .*gone\.png: file not found", printed)
    stats = load_lengths(out)  # the file the rest of OmniBal reads
    assert stats.tiles.tolist() == [3, 0] and stats.tokens.tolist() == [QA_CHAT + 3 * 256, QA_CHAT]
    assert [json.loads(line)["record"] for line in skipped.read_text().splitlines()] == [1]
    assert main([*argv, "--on-error", "fail"]) == 2
    assert "gone.png: file not found" in capsys.readouterr().err
    assert main([*argv[:-2], str(tmp_path / "no-folder/l.json"), "--no-progress"]) == 2
    assert "no-folder does not exist" in capsys.readouterr().err
    assert main([*argv, "--max-tiles", "1", "--thumbnail", "off"]) == 0
    assert load_lengths(out).tiles.tolist() == [1, 0]
    assert np.array_equal(load_lengths(out).image_flags, [1, 0])


def test_worker_processes_give_the_same_lengths(tmp_path: Path, tokenizers: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import omnibal_compile.data.dataset_lengths as dl

    monkeypatch.setattr(dl, "_CHUNK", 3)  # 4 chunks of 3 records
    sizes = [(448, 448), (896, 448), (600, 400), (1000, 100), (100, 1000)]
    names = [_image(tmp_path / f"images/{i}.png", w, h) for i, (w, h) in enumerate(sizes)]
    records = [{"image": f"images/{names[i % 5]}", "conversations": QA[: 1 + i % 2]} if i % 4 else {"conversations": QA}
               for i in range(11)]
    records[7]["image"] = "images/missing.png"
    data = _dataset(tmp_path, records)
    one = dataset_lengths(data, tokenizer=tokenizers["chat"], workers=1)
    two = dataset_lengths(data, tokenizer=tokenizers["chat"], workers=2)
    for f in ("tiles", "tokens", "image_flags"):
        assert getattr(two.stats, f).tolist() == getattr(one.stats, f).tolist()
    assert two.record_ids.tolist() == one.record_ids.tolist() == [i for i in range(11) if i != 7]
    assert two.skipped == one.skipped and two.images == one.images == 7
    assert one.stats.tiles.tolist()[:4] == [0, 3, 7, 11]
    with pytest.raises(InputError, match="record 7: image"):
        dataset_lengths(data, tokenizer=tokenizers["chat"], workers=2, on_error="fail")


# -- lengths in a model's own units (--model) -----------------------------------------------------
def _llava_spec(llava_data: dict[str, Path]) -> str:
    return f"hf:LlavaForConditionalGeneration:{llava_data['config']}"


@pytest.fixture(scope="module")
def llava_lengths(llava_data: dict[str, Path]) -> Path:
    """The tiny Llava dataset's length file, measured with --model."""
    out = llava_data["root"] / "model-lengths.jsonl"
    assert main(["lengths", str(llava_data["data"]), "--model", _llava_spec(llava_data), "--out", str(out),
                 "--no-progress"]) == 0
    return out


def test_lengths_with_model_are_the_token_counts_the_run_measures(llava_data, llava_lengths) -> None:
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    stats = load_lengths(llava_lengths)
    ds = ConversationDataset(llava_data["data"], load_processor(llava_data["model"]))
    for i in range(len(ds)):  # per record: the processor's own tokens and images
        sample = ds[i]
        assert int(stats.tokens[i]) == sample["input_ids"].numel()
        assert int(stats.tiles[i]) == (sample["pixel_values"].shape[0] if "pixel_values" in sample else 0)
    assert stats.tiles.tolist() == [1, 0, 2, 1]  # a 200x150 PNG is one image of 17 tokens, not InternVL's tiles
    assert stats.tokens.tolist()[0] == 1 + 1 + IMAGE_TOKENS + 6 + 1 + 1 + 4 + 1  # <s> <|user|> 17 x <image> ...
    assert stats.digest == ds.lengths(progress=False).digest
    h = stats.header
    assert h is not None and (h.units, h.model_type, h.image_token_id) == ("model", "llava", SPECIALS.index("<image>"))
    assert h.info["processor"] == str(llava_data["model"]) and len(h.info["dataset_sha256"]) == 64


def test_lengths_model_and_tokenizer_options(llava_data, tmp_path: Path, tokenizers: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    base = ["lengths", str(llava_data["data"]), "--out", str(tmp_path / "l.json"), "--no-progress"]
    spec = _llava_spec(llava_data)
    for extra, message in (
        ([], "give --model hf:DIR .* or --tokenizer DIR .* not neither"),
        (["--model", spec, "--tokenizer", str(tokenizers["chat"])], "not both"),
        (["--model", spec, "--max-tiles", "6", "--dummy-tile"], "--max-tiles, --dummy-tile apply to InternVL units"),
        (["--model", spec, "--workers", "2"], "--workers apply to InternVL units"),
        (["--tokenizer", str(tokenizers["chat"]), "--processor", str(llava_data["model"])], "--processor goes with"),
        (["--model", "tinyvlm"], "not a Hugging Face model"),
        (["--model", spec, "--processor", str(tmp_path / "elsewhere")], "processor folder .*elsewhere does not exist"),
    ):
        assert main([*base, *extra]) == 2, extra
        assert re.search(message, capsys.readouterr().err), extra
    assert not (tmp_path / "l.json").exists()
    assert main([*base, "--model", spec, "--processor", str(llava_data["model"])]) == 0  # a processor named apart
    assert load_lengths(tmp_path / "l.json").header.info["processor"] == str(llava_data["model"])  # type: ignore[union-attr]
    # InternVL units, as before, now say so in the file's header
    assert main([*base, "--tokenizer", str(llava_data["model"]), "--max-tiles", "6"]) == 0
    h = load_lengths(tmp_path / "l.json").header
    assert h is not None and (h.units, h.tokens_per_tile, h.info["max_tiles"]) == ("internvl", 256, 6)


def _run_config(tmp_path: Path, llava_data: dict[str, Path], **extra: object):  # as tests/test_hf_dataset.py's
    from omnibal_compile.runtime.settings import RunConfig

    return RunConfig(plan=str(tmp_path / "plan.json"), model=_llava_spec(llava_data), batch_size=2,
                     samples_per_pack=2.0, **extra)  # type: ignore[arg-type]


def test_run_on_model_lengths_makes_the_packs_of_run_on_the_dataset(llava_data, llava_lengths, tmp_path) -> None:
    from omnibal_compile.runtime.batches import batch_source, build_model

    on_data = _run_config(tmp_path, llava_data, dataset=str(llava_data["data"]), dp=2)
    on_lengths = _run_config(tmp_path, llava_data, lengths=(str(llava_lengths),), dp=2)
    model = build_model(on_data)
    a, b = batch_source(on_data, model), batch_source(on_lengths, model)
    assert a.data_plan.shape == b.data_plan.shape and a.data_plan.seq_len == b.data_plan.seq_len
    assert a.data_plan.stats.digest == b.data_plan.stats.digest
    assert [a.packs(s, r) for s in range(2) for r in range(2)] == [b.packs(s, r) for s in range(2) for r in range(2)]


def test_run_refuses_lengths_in_other_units(llava_data, llava_lengths, tmp_path) -> None:
    from omnibal_compile.runtime.batches import batch_source, build_model

    model = build_model(_run_config(tmp_path, llava_data))
    other = tmp_path / "other.jsonl"
    lines = llava_lengths.read_text().splitlines()
    head = json.loads(lines[0])
    other.write_text("\n".join([json.dumps({**head, "image_token_id": 3}), *lines[1:]]) + "\n")
    spec = _llava_spec(llava_data)
    with pytest.raises(InputError, match=rf"other.jsonl: its lengths are in the units of a llava model \(image token "
                                         rf"3\).*but the model is llava \(image token 7\).*omnibal-compile lengths "
                                         rf"{llava_data['data']} --model {re.escape(spec)} --out {other}"):
        batch_source(_run_config(tmp_path, llava_data, lengths=(str(other),)), model)
    internvl = tmp_path / "internvl.json"  # InternVL's tiling: 200x150 -> 13 tiles x 256 tokens, nothing Llava sees
    assert main(["lengths", str(llava_data["data"]), "--tokenizer", str(llava_data["model"]), "--out", str(internvl),
                 "--no-progress"]) == 0
    with pytest.raises(InputError, match=r"internvl.json: its lengths are in InternVL units \(256 tokens per tile\)"
                                         r".* a llava model's processor.*omnibal-compile lengths .*train.json --model"):
        batch_source(_run_config(tmp_path, llava_data, lengths=(str(internvl),)), model)
    old = tmp_path / "old.json"  # without a header: InternVL units converted, as before
    old.write_text(json.dumps([{"vit_num": 1, "token_num": 300}] * 4))
    converted = batch_source(_run_config(tmp_path, llava_data, lengths=(str(old),)), model).data_plan.stats
    assert converted.tokens[0] == 17 + 3
