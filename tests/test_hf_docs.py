"""The worked example of the Hugging Face section runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    """The python block that trains with BalancedTrainer, from the section's own file or, once merged, the README."""
    for name in ("docs_hf_packing.md", "README.md"):
        path = ROOT / name
        if path.exists():
            for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
                if "BalancedTrainer(" in block:
                    return block
    raise AssertionError("no python block with BalancedTrainer( in docs_hf_packing.md or README.md")


def test_trainer_example_runs_as_written(capsys) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    exec(compile(_example(), "hf-example", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "torch.Size([1, 1, 37, 37])" in out  # the shape the text after the block quotes
    losses = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\[\d+\.\d+, \d+\.\d+\]", losses), losses
