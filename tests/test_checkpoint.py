"""Checkpoints on DCP: exact resume, atomic saves, other layouts, clear errors before any rank starts.

Runs are dp=2 x pp=1 (FSDP2) on balanced packs with AdamW and a warm-up schedule, so the model,
the optimizer state, the LR schedule and the data position all have to come back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_data import _config

from omnibal_compile.errors import InputError, LaunchError
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.checkpoint import checkpoint_meta, latest_checkpoint, load_into_model
from omnibal_compile.runtime.launch import launch

TESTS = Path(__file__).resolve().parent
STEPS = 6
EXACT = 1e-6


def _base(tmp_path: Path, lengths_file: str, **kw: Any):
    return _config(tmp_path, lengths_file, stages=1, dp=2, batch_size=4, num_microbatches=2, schedule="1f1b",
                   steps=STEPS, optimizer="adamw", lr=2e-3, warmup_steps=3, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, lengths_file):
    tmp = tmp_path_factory.mktemp("full")
    config = _base(tmp, lengths_file, save=str(tmp / "ckpt"))
    return config, launch(config, timeout_s=300, quiet=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_kill_in_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path, lengths_file, uninterrupted,
                                                                          monkeypatch):
    _, full = uninterrupted
    assert [e.step for e in full] == list(range(STEPS))
    root = tmp_path / "ckpt"
    config = _base(tmp_path, lengths_file, save=str(root), save_every=1)
    # rank 1 dies inside the save after step 4 (tests/fault_worker.py plants it)
    with monkeypatch.context() as planted:
        planted.setenv("_OMNIBAL_TEST_KILL_IN_SAVE", "1:4")
        planted.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
        with pytest.raises(LaunchError):
            launch(config, timeout_s=300, quiet=True, _worker="fault_worker")
    names = sorted(p.name for p in root.iterdir())
    assert names == [".partial-step-000004", "step-000002", "step-000003"], names  # keep=2; step 4 never completed
    assert latest_checkpoint(root).name == "step-000003"
    assert checkpoint_meta(root / "step-000003")["step"] == 3

    resumed = launch(dataclasses.replace(config, resume=str(root), save_every=0), timeout_s=300, quiet=True)
    assert [e.step for e in resumed] == [3, 4, 5]  # --steps counts all steps
    for a, b in zip(resumed, full[3:]):
        assert abs(a.loss - b.loss) <= EXACT, (a, b)
    assert not (root / ".partial-step-000004").exists()  # cleared by the next save
    # the resumed run's final weights are the uninterrupted run's
    ref, got = build_model(config), build_model(dataclasses.replace(config, seed=7))
    assert load_into_model(ref, Path(uninterrupted[0].save)) == STEPS
    assert load_into_model(got, root) == STEPS
    for (n, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert float((a - b).abs().max()) <= EXACT, n


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_loads_into_another_layout_and_the_unsplit_model(tmp_path, lengths_file, uninterrupted):
    config, full = uninterrupted
    ckpt = Path(config.save)
    # the unsplit model, loaded from the dp=2 x pp=1 checkpoint, computes the loss a pipeline computes next
    model = build_model(dataclasses.replace(config, seed=11))
    assert load_into_model(model, ckpt) == STEPS
    # dp=2 x pp=2 resumes from it (DCP reshards the FSDP shards of one stage into those of two); another dp is
    # refused with --lengths (each dp rank's sampler holds its share of the epoch: tests/test_probes_silent.py)
    plan2 = _config(tmp_path, lengths_file, stages=2).plan
    moved = dataclasses.replace(config, plan=plan2, resume=str(ckpt), steps=STEPS + 1, save=None)
    logged = launch(moved, timeout_s=300, quiet=True)
    assert [e.step for e in logged] == [STEPS]
    with torch.no_grad():
        expected = float(model(**batch_source(moved, model)(STEPS)))
    assert abs(logged[0].loss - expected) <= 1e-5


def test_resume_checks_fail_before_any_process_starts(tmp_path, lengths_file, uninterrupted, monkeypatch):
    import shutil

    import omnibal_compile.runtime.processes as processes_mod  # where rank processes start

    def no_process(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(processes_mod.subprocess, "Popen", no_process)
    config, _ = uninterrupted
    step = latest_checkpoint(config.save)
    with pytest.raises(InputError, match="at step 6 and --steps is 6: nothing left to run"):
        launch(dataclasses.replace(config, resume=config.save, save=None))
    with pytest.raises(InputError, match=r"other data settings.*seed: saved 0, now 1"):
        launch(dataclasses.replace(config, resume=config.save, steps=8, seed=1, save=None))
    with pytest.raises(InputError, match="no checkpoint under"):
        launch(dataclasses.replace(config, resume=str(tmp_path), steps=8, save=None))
    with pytest.raises(InputError, match="--save-every needs --save"):
        launch(dataclasses.replace(config, save=None, save_every=2))

    broken = tmp_path / "broken" / step.name
    shutil.copytree(step, broken)
    data = sorted(broken.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:10])  # a truncated data file
    with pytest.raises(InputError, match=rf"truncated: data file {data.name} has 10 bytes of"):
        launch(dataclasses.replace(config, resume=str(broken.parent), steps=8, save=None))
    (broken / "meta.json").unlink()  # meta.json is written last: its absence means unfinished
    with pytest.raises(InputError, match="incomplete"):
        launch(dataclasses.replace(config, resume=str(broken), steps=8, save=None))
    (broken / "meta.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(InputError, match="format 1"):
        checkpoint_meta(broken)


def test_a_save_onto_a_full_disk_says_so_and_keeps_the_earlier_checkpoint(one_rank_group, tmp_path, monkeypatch):
    """DCP reports a failed write as ``CheckpointException ranks:dict_keys([0])`` and a traceback; the run says
    what happened (no space left), where, and that the earlier checkpoints are kept."""
    import contextlib
    import errno
    import io

    from torch.distributed.checkpoint import filesystem as dcp_fs

    from omnibal_compile.errors import TrainingError
    from omnibal_compile.runtime.checkpoint import save_training_state

    model = torch.nn.Linear(4, 4)
    state = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = save_training_state(tmp_path, step=1, state=state, optimizer=optimizer, trainer={"loss": 1.0})

    class Full:
        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(io.BytesIO(), name)

    @contextlib.contextmanager
    def full_stream(self: Any, path: Any, mode: str) -> Any:
        yield Full()

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", full_stream)
    with pytest.raises(TrainingError) as info:
        save_training_state(tmp_path, step=2, state=state, optimizer=optimizer, trainer={"loss": 1.0})
    message = str(info.value)
    assert message.startswith(f"saving the checkpoint of step 2 in {tmp_path} failed: no space left on device "
                              "(OSError: [Errno 28] No space left on device); the earlier checkpoints there are "
                              "kept"), message
    assert "CheckpointException" not in message
    # torch's zip writer turns a full disk into "unexpected pos": the free space tells
    Full.write = lambda self, data: (_ for _ in ()).throw(RuntimeError("unexpected pos 704 vs 598"))  # type: ignore
    from omnibal_compile.runtime import checkpoint

    usage = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(p)._replace(free=10))
    with pytest.raises(TrainingError, match=r"step 3 .* failed: no space left on device \(RuntimeError: unexpected"):
        save_training_state(tmp_path, step=3, state=state, optimizer=optimizer, trainer={"loss": 1.0})
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)  # room enough: another failure, named as it is
    with pytest.raises(TrainingError, match=r"step 3 .* failed: on rank 0 \(RuntimeError: unexpected pos"):
        save_training_state(tmp_path, step=3, state=state, optimizer=optimizer, trainer={"loss": 1.0})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first  # the partial folders never became step folders
