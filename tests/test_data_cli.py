"""``omnibal-compile data``: the comparison table and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omnibal_compile.cli import main


def test_data_command_prints_the_four_methods(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 6, 3000)
    records = [{"vit_num": int(v), "token_num": int(v * 256 + rng.integers(30, 300)), "image_flags": int(v)}
               for v in tiles]
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(records))
    assert main(["data", str(path), "--dp", "8", "--samples-per-pack", "4", "--iterations", "10", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            ("random", "length-grouped", "isf", "ours")}
    assert set(rows) == {"random", "length-grouped", "isf", "ours"}
    assert float(rows["ours"][1]) == pytest.approx(float(rows["isf"][1]), abs=0.01)  # same samples per pack
    assert float(rows["ours"][3]) < float(rows["random"][3])  # vision Dist


def test_data_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"vit_num": 1}]')
    assert main(["data", str(bad), "--no-progress"]) == 2
    assert "record 0" in capsys.readouterr().err
    assert main(["data", str(bad), "--methods", "magic", "--no-progress"]) == 2
    assert "magic" in capsys.readouterr().err


def test_one_huge_sample_is_named_alone_and_the_oversized_flag_exists(tmp_path: Path, capsys) -> None:
    """A 16M-token sample among 1-3K-token ones: ISF used to size its shape by the mean (1 tile, 4096 tokens),
    blame 160 normal samples and suggest a Python keyword the command lacks."""
    rng = np.random.default_rng(0)
    records = [{"vit_num": int(rng.integers(1, 7)), "token_num": int(rng.integers(300, 3000)), "image_flags": 1}
               for _ in range(200)]
    records[17] = {"vit_num": 1, "token_num": 16_000_000, "image_flags": 1}
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(records))
    assert main(["data", str(path), "--methods", "isf", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "1 sample(s) exceed the pack shape" in err and "e.g. 17 (1 tiles, 16000000 tokens)" in err, err
    assert "set oversized (--oversized) to 'truncate' or 'own-pack'" in err
    records[17] = {"vit_num": 1, "token_num": 9000, "image_flags": 1}  # long, not corrupt: its own pack
    path.write_text(json.dumps(records))
    assert main(["data", str(path), "--methods", "isf,ours", "--oversized", "own-pack", "--no-progress"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["data", str(path), "--oversized", "drop", "--no-progress"])
    assert "--oversized: invalid choice: 'drop'" in capsys.readouterr().err
