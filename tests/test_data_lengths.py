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
