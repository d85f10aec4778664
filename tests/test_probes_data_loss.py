"""Trust at first sight, "Data lost": each case below lost a user's data (checkpoints, logs, datasets) on the code
before these tests; now it is an error before any work, or the behaviour a user expects.

Runs are tiny (one stage, one rank, a few steps); the tests that start ranks are marked ``distributed``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import omnibal_compile as oc
from omnibal_compile.cli import main
from omnibal_compile.errors import InputError, LaunchError
from omnibal_compile.runtime.batches import build_model
from omnibal_compile.runtime.checkpoint import checkpoint_meta, latest_checkpoint
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM

TESTS = Path(__file__).resolve().parent


def _no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import omnibal_compile.runtime.processes as processes_mod

    def no_process(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(processes_mod.subprocess, "Popen", no_process)


def _ranks_see_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """One stage on one rank, built-in batches of 2 rows in 2 micro-batches, SGD."""
    from omnibal_compile.models import make_example_batch

    fields = dataclasses.asdict(SMALL_VLM)
    model = build_model(RunConfig(plan="-", model_config=fields))
    batch = make_example_batch(SMALL_VLM, batch=2, tiles_per_sample=1, text_tokens=12)
    plan_path = tmp_path_factory.mktemp("probe-plan") / "plan.json"
    plan_path.write_text(oc.optimize(model, batch, num_stages=1, planner="uniform").plan.to_json())
    return RunConfig(plan=str(plan_path), model_config=fields, batch_size=2, tiles_per_sample=1, text_tokens=12,
                     steps=3, optimizer="sgd", lr=0.05, schedule="1f1b", num_microbatches=2)


# -- a non-finite loss -------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_nan_loss_stops_the_run_at_its_step_and_keeps_the_good_checkpoints(tiny, tmp_path, monkeypatch):
    # The batches of step 3 on are NaN images: the run used to train to the end, exit 0, and prune step-2 and
    # step-3 (finite) in favour of two checkpoints of NaN weights.
    _ranks_see_tests(monkeypatch)
    root = tmp_path / "ckpt"
    config = dataclasses.replace(tiny, batches="probe_batches:nan_from_step_3", steps=6, save=str(root),
                                 save_every=1, log=str(tmp_path / "steps.jsonl"))
    with pytest.raises(LaunchError, match=r"step 3: the loss is nan \(--lr 0.05\)"):
        launch(config, timeout_s=240, quiet=True)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000002", "step-000003"]
    meta = checkpoint_meta(root / "step-000003")
    assert meta["step"] == 3 and isinstance(meta["loss"], float) and meta["loss"] == meta["loss"]  # finite
    assert latest_checkpoint(root).name == "step-000003"
    assert not (root / ".lock").exists()  # released by the failed run


# -- --log, user folders in the checkpoint root, --resume ---------------------------------------------------------
@pytest.fixture(scope="module")
def two_runs(tiny, tmp_path_factory):
    """A run of 3 steps saving every step into a root that holds the user's ``step-1`` folder, then a resumed run
    to step 5 with the same --log, after the user put a ``step-7`` folder there."""
    tmp = tmp_path_factory.mktemp("two-runs")
    root, log = tmp / "ckpt", tmp / "steps.jsonl"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "notes.txt").write_text("the user's own notes")
    first = dataclasses.replace(tiny, save=str(root), save_every=1, log=str(log))
    first_logs = launch(first, timeout_s=240, quiet=True)
    (root / "step-7").mkdir()
    (root / "step-7" / "results.csv").write_text("a,b\n")
    second = dataclasses.replace(first, resume=str(root), steps=5, save_every=0)
    second_logs = launch(second, timeout_s=240, quiet=True)
    return root, log, first_logs, second_logs


@pytest.mark.distributed
def test_log_is_appended_to_and_a_resumed_run_continues_it(two_runs):
    _, log, first_logs, second_logs = two_runs
    assert [e.step for e in first_logs] == [0, 1, 2]
    assert [e.step for e in second_logs] == [3, 4]  # launch returns this run's lines only
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3, 4]


@pytest.mark.distributed
def test_pruning_removes_only_step_folders_the_program_wrote(two_runs):
    root, *_ = two_runs
    assert (root / "step-1" / "notes.txt").read_text() == "the user's own notes"
    assert (root / "step-7" / "results.csv").is_file()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-0")) == ["step-000003", "step-000005"]


@pytest.mark.distributed
def test_a_user_folder_named_like_a_later_step_does_not_block_resume(two_runs):
    root, _, _, second_logs = two_runs
    assert second_logs[0].step == 3  # resumed from step-000003, not refused for step-7 (no meta.json)
    assert latest_checkpoint(root).name == "step-000005"


def test_pruning_never_removes_the_newest_checkpoint_with_a_finite_loss(tmp_path):
    from omnibal_compile.runtime.checkpoint import CHECKPOINT_FORMAT, _prune

    for step, loss in ((1, 2.5), (2, 2.0), (3, float("nan")), (4, float("inf"))):  # NaN from step 3 on
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "written_by": "omnibal_compile",
                                                      "step": step, "loss": loss}))
    (tmp_path / "step-1").mkdir()  # the user's
    (tmp_path / "step-000000").mkdir()  # not ours either: no meta.json
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000", "step-000002", "step-000003", "step-000004",
                                                         "step-1"]


def test_a_step_folder_of_the_user_in_the_way_of_a_save_is_refused_before_training(tiny, tmp_path, monkeypatch):
    _no_process(monkeypatch)
    root = tmp_path / "ckpt"
    (root / "step-000003").mkdir(parents=True)
    with pytest.raises(InputError, match=r"step-000003 exists and was not written by --save"):
        launch(dataclasses.replace(tiny, save=str(root)))


# -- --save that cannot be written ------------------------------------------------------------------------------
def test_save_to_a_file_or_a_read_only_folder_is_refused_before_training(tiny, tmp_path, monkeypatch):
    _no_process(monkeypatch)
    a_file = tmp_path / "model.pt"
    a_file.write_text("the user's weights")
    with pytest.raises(InputError, match=rf"--save {a_file} is a file, not a folder"):
        launch(dataclasses.replace(tiny, save=str(a_file)))
    assert a_file.read_text() == "the user's weights"
    with pytest.raises(InputError, match=r"--save .*model.pt/ckpt: cannot create the folder"):
        launch(dataclasses.replace(tiny, save=str(a_file / "ckpt")))

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the folder is read-only for everybody else
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != read_only and real(p, mode, **k))
    try:
        with pytest.raises(InputError, match=rf"--save {read_only}: the folder is not writable"):
            launch(dataclasses.replace(tiny, save=str(read_only)))
    finally:
        read_only.chmod(0o755)


# -- two runs saving into one folder ------------------------------------------------------------------------------
def test_a_second_run_saving_into_a_locked_folder_is_refused_with_the_other_pid(tiny, tmp_path, monkeypatch, capsys):
    import socket

    root = tmp_path / "ckpt"
    root.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another run, alive
    _no_process(monkeypatch)
    try:
        (root / ".lock").write_text(f"{other.pid} {socket.gethostname()}\n")
        with pytest.raises(InputError, match=rf"in use by another run \(pid {other.pid} on"):
            launch(dataclasses.replace(tiny, save=str(root)))
        assert (root / ".lock").read_text().split()[0] == str(other.pid)  # the other run's lock stays
    finally:
        other.kill()
        other.wait()
    # the other run has ended without removing its lock: the next run takes it over, with a note
    with pytest.raises(AssertionError, match="a process was started"):
        launch(dataclasses.replace(tiny, save=str(root)))
    assert f"was left by process {other.pid}, which has ended; taking it over" in capsys.readouterr().err
    assert not (root / ".lock").exists()  # and releases it at the end


# -- the lengths command's outputs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from test_dataset_lengths import _tokenizer

    return _tokenizer(tmp_path_factory.mktemp("tok") / "plain", template=None)


def test_lengths_outputs_never_overwrite_the_dataset(tmp_path, tokenizer, capsys):
    qa = [{"from": "human", "value": "What is in the picture ?"}, {"from": "gpt", "value": "A red bar ."}]
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"conversations": qa}, {"conversations": qa}]))
    before = data.read_text()
    base = ["lengths", str(data), "--tokenizer", str(tokenizer), "--no-progress"]
    assert main([*base, "--out", str(data)]) == 2
    assert "--out" in capsys.readouterr().err and data.read_text() == before
    same_data = str(tmp_path / "." / "data.json")
    assert main([*base, "--out", str(tmp_path / "lengths.json"), "--skipped-out", same_data]) == 2
    assert "is the dataset DATA itself" in capsys.readouterr().err and data.read_text() == before
    assert not (tmp_path / "lengths.json").exists()  # refused before the work
    assert main([*base, "--out", str(tmp_path / "l.json"), "--skipped-out", str(tmp_path / "l.json")]) == 2
    assert "is also --out" in capsys.readouterr().err


def test_a_full_disk_while_writing_lengths_leaves_the_old_file(tmp_path):
    # The file size limit (RLIMIT_FSIZE) stands in for a full disk: writes past 4 KiB fail (EFBIG).
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"vit_num": 1, "token_num": 300, "image_flags": 1}]))
    before = old.read_text()
    script = textwrap.dedent(f"""
        import resource, signal
        import numpy as np
        from omnibal_compile.data.lengths import LengthStats, save_lengths
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        stats = LengthStats.from_arrays(np.ones(2000, int), np.full(2000, 300))
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_lengths(stats, {str(old)!r})
        except OSError as e:
            print("failed:", e.strerror)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert "failed: File too large" in done.stdout, done.stdout + done.stderr
    assert old.read_text() == before  # not 4 KiB of a longer file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # no temporary file left behind
