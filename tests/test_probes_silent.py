"""Trust at first sight, "Wrong without a word": each case below trained on, or trained something else than asked,
without saying so on the code before these tests; now it is an error naming the input (before any rank starts
where it can be), or it applies with a note.

The resume cases share one checkpoint of a tiny run (one stage, one rank, balanced packs, AdamW).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_probes_data_loss import _no_process
from test_runtime_data import _config

from omnibal_compile.errors import InputError, LaunchError
from omnibal_compile.runtime.checkpoint import checkpoint_meta, latest_checkpoint
from omnibal_compile.runtime.launch import launch


@pytest.fixture(scope="module")
def saved(tmp_path_factory, lengths_file):
    """A 2-step AdamW run on balanced packs of a copy of the lengths file (the tests edit it), saved."""
    tmp = tmp_path_factory.mktemp("silent")
    lengths = tmp / "lengths.json"
    shutil.copy(lengths_file, lengths)
    config = _config(tmp, str(lengths), stages=1, dp=1, batch_size=4, num_microbatches=2, schedule="1f1b",
                     steps=2, optimizer="adamw", lr=2e-3, save=str(tmp / "ckpt"))
    launch(config, timeout_s=240, quiet=True)
    return config


def _resumed(config: Any, **changes: Any) -> Any:
    return dataclasses.replace(config, resume=config.save, save=None, steps=4, **changes)


@pytest.mark.distributed
def test_a_huge_lr_stops_the_run_at_the_first_non_finite_loss(tmp_path, lengths_file):
    config = _config(tmp_path, lengths_file, stages=1, dp=1, batch_size=2, num_microbatches=2, schedule="1f1b",
                     steps=4, optimizer="sgd", lr=1e30)
    with pytest.raises(LaunchError, match=r"step \d: the (loss is|weights it made are) (nan|inf) \(--lr 1e\+30\)"):
        launch(config, timeout_s=240, quiet=True)


@pytest.mark.distributed
def test_a_changed_lr_on_resume_applies_with_a_note(saved, tmp_path, capsys):
    resumed = dataclasses.replace(_resumed(saved, lr=0.01), save=str(tmp_path / "ckpt"), steps=3)
    launch(resumed, timeout_s=240, quiet=True)
    assert "with --lr 0.01 instead of the saved run's 0.002; it applies from step 2 on" in capsys.readouterr().err
    meta = checkpoint_meta(latest_checkpoint(tmp_path / "ckpt"))
    assert {g["lr"] for g in meta["param_groups"]} == {0.01}  # it trained with 0.01, not the saved 0.002
    assert set(meta["scheduler"]["base_lrs"]) == {0.01} and meta["settings"]["lr"] == 0.01


@pytest.mark.distributed
def test_another_optimizer_on_resume_is_refused(saved, monkeypatch):
    _no_process(monkeypatch)
    with pytest.raises(InputError, match=r"holds adamw optimizer state; --optimizer sgd would drop it.*"
                                         r"resume with --optimizer adamw"):
        launch(_resumed(saved, optimizer="sgd"))


@pytest.mark.distributed
def test_another_dp_on_resume_of_a_lengths_run_is_refused(saved, monkeypatch):
    # dp 1 -> 2 used to be accepted: in epoch 0 some samples were then never seen and others twice
    _no_process(monkeypatch)
    with pytest.raises(InputError, match=r"trained with dp 1 on balanced packs; with --dp 2 .* resume with --dp 1"):
        launch(_resumed(saved, dp=2))


@pytest.mark.distributed
def test_a_lengths_file_edited_in_place_is_refused_on_resume(saved, monkeypatch):
    _no_process(monkeypatch)
    path = Path(saved.lengths[0])
    original = path.read_text()
    records = json.loads(original)
    records[0]["token_num"] += 1
    path.write_text(json.dumps(records))  # the same path, other content
    try:
        with pytest.raises(InputError, match=rf"data file {path} has changed since checkpoint .* was saved"):
            launch(_resumed(saved))
    finally:
        path.write_text(original)


@pytest.mark.distributed
@pytest.mark.parametrize("step", [-3, 5.5, "2", True])
def test_meta_json_values_are_checked_and_name_the_file(saved, tmp_path, monkeypatch, step):
    _no_process(monkeypatch)
    folder = tmp_path / "edited" / "step-000002"
    shutil.copytree(latest_checkpoint(saved.save), folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "step": step}))
    with pytest.raises(InputError, match=rf"checkpoint {folder / 'meta.json'}: 'step' must be a whole number"):
        checkpoint_meta(folder)
    with pytest.raises(InputError, match=r"meta.json: 'step' must be a whole number of steps >= 0"):
        launch(dataclasses.replace(_resumed(saved), resume=str(folder.parent), steps=13))


@pytest.mark.distributed
def test_a_meta_step_that_is_not_the_schedules_position_is_refused(saved, tmp_path):
    folder = tmp_path / "edited" / "step-000002"
    shutil.copytree(latest_checkpoint(saved.save), folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "step": 1}))
    with pytest.raises(InputError, match=r"'step' must be the scheduler's position \(2\)"):
        checkpoint_meta(folder)


def test_samples_per_pack_above_the_dataset_is_refused_before_training(tmp_path, lengths_file, monkeypatch):
    _no_process(monkeypatch)
    config = _config(tmp_path, lengths_file, stages=1, dp=1, batch_size=8, num_microbatches=2, schedule="1f1b",
                     steps=2, samples_per_pack=100)
    with pytest.raises(InputError, match=r"samples_per_pack \(--samples-per-pack\) 100 is more than the 40 samples"):
        launch(config)
    config = dataclasses.replace(config, samples_per_pack=20)  # 2 packs an epoch, 8 rows a step
    with pytest.raises(InputError, match=r"40 samples make 2 pack\(s\) per dp rank per epoch .* fewer than the 8 rows"):
        launch(config)
