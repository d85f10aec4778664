"""The worked example of the Hugging Face section runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    """The docs' python block that trains with BalancedTrainer (docs/guides/hugging-face.md)."""
    page = ROOT / "docs" / "guides" / "hugging-face.md"
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        if "BalancedTrainer(" in block:
            return block
    raise AssertionError(f"no python block with BalancedTrainer( in {page}")


def test_trainer_example_runs_as_written(capsys) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    exec(compile(_example(), "hf-example", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "torch.Size([1, 1, 37, 37])" in out  # the shape the text after the block quotes
    losses = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\[\d+\.\d+, \d+\.\d+\]", losses), losses
