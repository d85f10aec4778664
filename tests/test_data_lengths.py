"""Loading length statistics: formats, errors naming file/record/field, unit scaling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omnibal_compile.data import LengthStats, load_lengths, scale_lengths
from omnibal_compile.data.lengths import bundled_length_files
from omnibal_compile.errors import InputError

RECORDS = [{"vit_num": 5, "token_num": 1420, "image_flags": 5}, {"vit_num": 1, "token_num": 300, "image_flags": 0}]


def test_json_jsonl_csv_and_arrays_agree(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(RECORDS))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    (tmp_path / "a.csv").write_text("vit_num,token_num,image_flags\n5,1420,5\n1,300,0\n")
    arrays = load_lengths((np.array([5, 1]), np.array([1420, 300]), np.array([5, 0])))
    for name in ("a.json", "a.jsonl", "a.csv"):
        s = load_lengths(tmp_path / name)
        assert s.tiles.tolist() == arrays.tiles.tolist() == [5, 1]
        assert s.tokens.tolist() == [1420, 300]
        assert s.image_flags.tolist() == [5, 0]
    both = load_lengths([tmp_path / "a.json", tmp_path / "a.csv"])
    assert both.tokens.tolist() == [1420, 300, 1420, 300]


def test_image_flags_optional_defaults_to_tiles(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps([{"vit_num": 3, "token_num": 900}]))
    assert load_lengths(tmp_path / "b.json").image_flags.tolist() == [3]
    assert LengthStats.from_arrays([2], [10]).image_flags.tolist() == [2]


@pytest.mark.parametrize(
    ("text", "suffix", "needles"),
    [
        ('[{"vit_num": 1, "token_num": 3}, {"vit_num": 2}]', ".json", ["record 1", "token_num"]),
        ('[{"vit_num": -1, "token_num": 3}]', ".json", ["record 0", "vit_num", "negative"]),
        ('[{"vit_num": 1.5, "token_num": 3}]', ".json", ["record 0", "vit_num", "must be an integer", "1.5"]),
        ('[{"vit_num": true, "token_num": 3}]', ".json", ["record 0", "vit_num"]),
        ("", ".json", ["empty"]),
        ("[]", ".json", ["empty"]),
        ('{"vit_num": 1}', ".json", ["JSON list"]),
        (
            '{"vit_num": 1, "token_num": 2}\n{"vit_num": 1, "token_num": "x"}\n',
            ".jsonl",
            ["record 1", "line 2", "token_num"],
        ),
        ("vit_num,token_num\n1,2\n3,-4\n", ".csv", ["record 1", "line 3", "token_num", "negative"]),
        ("vit_num,tokens\n1,2\n", ".csv", ["token_num"]),
        ('[{"vit_num": 1, "token_num": 3, "image_flags": 2}]', ".json", ["record 0", "image_flags"]),
    ],
)
def test_malformed_input_names_file_record_and_field(
    tmp_path: Path, text: str, suffix: str, needles: list[str]
) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_lengths(path)
    msg = str(e.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg


def test_array_errors_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"tokens\[1\] = -3 is negative"):
        LengthStats.from_arrays([1, 1], [5, -3])
    with pytest.raises(InputError, match="differ in length"):
        LengthStats.from_arrays([1, 1], [5])
    with pytest.raises(InputError, match="does not exist"):
        load_lengths(tmp_path / "nope.json")
    with pytest.raises(InputError, match="cannot read"):
        load_lengths(42)


def test_scale_lengths_keeps_image_text_ratio() -> None:
    s = LengthStats.from_arrays([2, 1, 1], [512 + 64, 256 + 1, 300], [2, 1, 0])
    t = scale_lengths(s, tokens_per_tile=16)
    # image tokens 256 -> 16 per real tile; text scaled by 16/256, rounded up, at least 2
    assert t.tokens.tolist() == [2 * 16 + 4, 16 + 2, 19]
    assert t.tiles.tolist() == [2, 1, 1]
    with pytest.raises(InputError, match="record 0"):
        scale_lengths(LengthStats.from_arrays([2], [100]), tokens_per_tile=16)


def test_shared_files_load() -> None:
    s = load_lengths(bundled_length_files())
    assert len(s) == 12_413 + 18_317
    assert s.tiles.max() == 5 and s.tokens.max() == 1_832


MODEL_HEADER = {"units": "model", "model_type": "llava", "image_token_id": 7, "processor": "llava-dir",
                "dataset": "train.json", "dataset_sha256": "ab" * 32}


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_a_header_record_round_trips_and_rows_keep_their_numbers(tmp_path: Path, suffix: str) -> None:
    from omnibal_compile.data.lengths import LengthHeader, save_lengths

    header = LengthHeader.from_json(MODEL_HEADER, "test")
    stats = LengthStats.from_arrays([1, 0, 2], [32, 13, 57], source="x")
    path = save_lengths(LengthStats(tiles=stats.tiles, tokens=stats.tokens, image_flags=stats.image_flags,
                                    header=header), tmp_path / f"l{suffix}")
    first = path.read_text().splitlines()[0 if suffix != ".json" else 1]
    assert json.loads(first.lstrip("#").rstrip(",")) == MODEL_HEADER  # the header is the first record / line
    back = load_lengths(path)
    assert back.header == header and back.header.to_json() == MODEL_HEADER
    assert back.tokens.tolist() == [32, 13, 57] and back.digest == stats.digest  # the header is no sample
    # an error in a record still names the sample index (and the file's own line)
    text = path.read_text().replace("57", "-57")
    path.write_text(text)
    line = {".json": "", ".jsonl": r" \(line 4\)", ".csv": r" \(line 5\)"}[suffix]
    with pytest.raises(InputError, match=rf"record 2{line}: field 'token_num'"):
        load_lengths(path)


def test_files_without_a_header_and_bad_headers(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps(RECORDS))
    assert load_lengths(tmp_path / "old.json").header is None  # today's files: InternVL units, as before
    cases = {
        "units.jsonl": ([{"units": "pixels"}, *RECORDS], "units must be one of"),
        "late.jsonl": ([*RECORDS, MODEL_HEADER], "record 2 .*header record .* belongs first"),
        "tpt.jsonl": ([{"units": "internvl"}, *RECORDS], "tokens_per_tile"),
        "kind.jsonl": ([{"units": "model", "image_token_id": 7}, *RECORDS], "needs a model_type"),
    }
    for name, (records, message) in cases.items():
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in records))
        with pytest.raises(InputError, match=rf"{name}.*{message}"):
            load_lengths(tmp_path / name)
    (tmp_path / "bad.csv").write_text("# {units: model}\nvit_num,token_num\n1,2\n")
    with pytest.raises(InputError, match="bad.csv line 1: a '#' line holds the header"):
        load_lengths(tmp_path / "bad.csv")
    (tmp_path / "model.jsonl").write_text("\n".join(json.dumps(r) for r in [MODEL_HEADER, *RECORDS]))
    with pytest.raises(InputError, match=r"different units \(.*old.json: no header .*model.jsonl: the units of a "):
        load_lengths([tmp_path / "old.json", tmp_path / "model.jsonl"])
    assert len(load_lengths([tmp_path / "model.jsonl", tmp_path / "model.jsonl"])) == 4  # one model's units: fine


def _facts(**extra: object) -> dict[str, object]:
    return {"tokens_per_tile": 17, "image_token_id": 7, "image_shape": (3, 16, 16), **extra}


def test_model_units_are_taken_as_they_are_by_that_model_only(tmp_path: Path) -> None:
    from omnibal_compile.data.data_plan import DataOptions, model_lengths

    path = tmp_path / "model.jsonl"
    rows = [{"vit_num": 1, "token_num": 32}, {"vit_num": 0, "token_num": 13}, {"vit_num": 2, "token_num": 57}]
    path.write_text("\n".join(json.dumps(r) for r in [MODEL_HEADER, *rows]))
    same = model_lengths(path, DataOptions(**_facts(model_type="llava")))  # type: ignore[arg-type]
    assert same.tokens.tolist() == [32, 13, 57]  # as is: no tokens-per-tile conversion (57 < 2 x 256)
    for facts, said in ((_facts(model_type="qwen2_vl"), "qwen2_vl"), (_facts(model_type="llava", image_token_id=9),
                                                                       "image token 9")):
        with pytest.raises(InputError, match=rf"model.jsonl: its lengths are in the units of a llava model "
                                             rf"\(image token 7\), measured by processor llava-dir, but the model is "
                                             rf".*{said}.*omnibal-compile lengths train.json --model hf:X "
                                             rf"--out {path}"):
            model_lengths(path, DataOptions(**facts), model_spec="hf:X")  # type: ignore[arg-type]


def test_internvl_units_convert_for_internvl_and_the_reference_model_only(tmp_path: Path) -> None:
    from omnibal_compile.data.data_plan import DataOptions, model_lengths

    path = tmp_path / "internvl.json"
    path.write_text(json.dumps([{"units": "internvl", "tokens_per_tile": 128, "dataset": "d.jsonl"},
                                {"vit_num": 2, "token_num": 2 * 128 + 64, "image_flags": 2}]))
    for kind in (None, "internvl"):  # the reference VLM (no model_type) or InternVL: scaled from the header's 128
        got = model_lengths(path, DataOptions(**_facts(tokens_per_tile=16, model_type=kind)))  # type: ignore[arg-type]
        assert got.tokens.tolist() == [2 * 16 + 8]
    with pytest.raises(InputError, match=r"internvl.json: its lengths are in InternVL units \(128 tokens per tile\)"
                                         r".*a llava model's processor.*omnibal-compile lengths d.jsonl "
                                         r"--model hf:DIR"):
        model_lengths(path, DataOptions(**_facts(model_type="llava")))  # type: ignore[arg-type]
    for tile in (16, 448):  # InternVL's tiling converts only when its tiles are the model's (16 pixels here)
        path.write_text(json.dumps([{"units": "internvl", "tokens_per_tile": 128, "dataset": "d.jsonl",
                                     "tile_size": tile}, {"vit_num": 2, "token_num": 2 * 128 + 64, "image_flags": 2}]))
        options = DataOptions(**_facts(tokens_per_tile=16, model_type="internvl"))  # type: ignore[arg-type]
        if tile == 16:
            assert model_lengths(path, options).tokens.tolist() == [2 * 16 + 8]
            continue
        with pytest.raises(InputError, match=r"internvl.json: its lengths are in InternVL units \(128 tokens per "
                                             r"tile\) of 448-pixel tiles, but the internvl model's tiles are 16 pixels"
                                             r".*--tile-size 16.*omnibal-compile lengths d.jsonl --model hf:DIR"):
            model_lengths(path, options)
    (tmp_path / "old.json").write_text(json.dumps([{"vit_num": 2, "token_num": 2 * 256 + 64}]))
    old = model_lengths(tmp_path / "old.json", DataOptions(**_facts(tokens_per_tile=16, model_type="llava")))  # type: ignore[arg-type]
    assert old.tokens.tolist() == [2 * 16 + 4]  # no header: today's meaning, source_tokens_per_tile (256)
