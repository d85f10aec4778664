"""Raw or misleading errors of issue "Trust at first sight", each as a test that failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from omnibal_compile.errors import InputError
from omnibal_compile.runtime import checkpoint as ckpt


def _model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))


@pytest.fixture(scope="module")
def saved(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp_path_factory.mktemp("ckpt")
    return ckpt.save_training_state(root, step=1, state=model.state_dict(keep_vars=True), optimizer=optimizer,
                                    trainer={})


def test_a_model_with_other_shapes_is_named_before_any_tensor_is_read(saved: Path) -> None:
    """A config edited since the save (a wider layer): the names and shapes that differ, not a bare
    CheckpointException from DCP (in every rank, for a resumed run: launch's precheck calls the same check)."""
    wider = _model(width=6)
    with pytest.raises(InputError, match=r"does not fit Sequential: other shapes: \['0.bias \[4\] saved, \[6\] now', "
                                         r"'0.weight \[4, 3\] saved, \[6, 3\] now', '2.weight \[2, 4\] saved, \[2, 6\] "
                                         r"now'\]; was it saved from this model"):
        ckpt.load_into_model(wider, saved)
    with pytest.raises(InputError, match=r"missing \['3.bias', '3.weight'\]"):
        ckpt.check_fits(saved, nn.Sequential(*_model(), nn.Linear(2, 2)))
    ckpt.check_fits(saved, _model())  # the same model fits


@pytest.mark.parametrize("where", ["a-file", "a-file/plan"])
def test_plan_out_that_cannot_be_a_folder_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """``--out`` a file, or under one: a sentence naming --out before the model is built (it was an OSError
    traceback from mkdir)."""
    from omnibal_compile import cli
    from omnibal_compile.models import load

    (tmp_path / "a-file").write_text("mine")
    monkeypatch.chdir(tmp_path)

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before --out was checked")

    monkeypatch.setattr(load, "load_model", no_model)
    assert cli.main(["plan", "--out", where]) == 2
    err = capsys.readouterr().err
    assert f"--out {where}" in err and "Traceback" not in err
    assert (tmp_path / "a-file").read_text() == "mine"
