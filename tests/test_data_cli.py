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
