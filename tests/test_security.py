"""Inputs that come from elsewhere run no code and block nothing: checkpoints given to --resume, model
factory specs run in a folder with stray files, dataset image paths that are FIFOs, devices or outside
the image root.

Each probe plants a payload that creates a marker file when it runs (a pickle's ``__reduce__`` calling
``os.system``, a ``pulp.py`` or ``torch.py`` in the working folder) and checks the marker is absent.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from omnibal_compile.errors import InputError
from omnibal_compile.runtime import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent


class Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``: unpickling it runs that command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _finishes(fn: Callable[[], Any], *, fifos: tuple[Path, ...] = (), seconds: float = 30.0) -> Any:
    """``fn()``'s result (or its exception, raised), failing instead of hanging when it blocks on one of ``fifos``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # a writer that opens and closes releases a reader blocked in open()
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"still running after {seconds:.0f} s: blocked on {[str(f) for f in fifos]}")
    if "error" in out:
        raise out["error"]
    return out["value"]


# -- checkpoints -----------------------------------------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


@pytest.fixture(scope="module")
def saved(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A step folder written by the project's own save, and the weights in it."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    root = tmp_path_factory.mktemp("ckpt")
    folder = ckpt.save_training_state(root, step=1, state=model.state_dict(keep_vars=True), optimizer=optimizer,
                                      trainer={})
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture()
def copy(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    """A copy of the saved step folder, to tamper with."""
    import shutil

    return Path(shutil.copytree(saved[0], tmp_path / saved[0].name))


def _trusted_metadata(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())  # the test's own file: trusted


def test_a_checkpoint_this_program_wrote_still_loads(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, weights = saved
    assert ckpt.checkpoint_meta(folder)["step"] == 1
    model = _model()
    nn.init.zeros_(model[0].weight)
    assert ckpt.load_into_model(model, folder) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    again = _model()
    nn.init.zeros_(again[0].weight)
    optimizer = torch.optim.AdamW(again.parameters(), lr=0.1)
    ckpt.load_training_state(folder, state=again.state_dict(keep_vars=True), optimizer=optimizer)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())
    assert all("exp_avg" in s for s in optimizer.state.values())


def test_crafted_metadata_is_refused_without_running_it(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (copy / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InputError, match=rf"{copy.name}: \.metadata: refused to unpickle class posix\.system; "
                                         "it is not a checkpoint this program wrote"):
        ckpt.checkpoint_meta(copy)
    with pytest.raises(InputError, match="refused to unpickle"):
        ckpt.load_into_model(_model(), copy)
    assert not marker.exists()


def test_dcps_own_reads_are_checked_too(copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        one_rank_group: None) -> None:
    """A ``.metadata`` swapped in after the checks: DCP's own reads of it refuse it as well."""
    marker = tmp_path / "pwned"
    found = ckpt.find_checkpoint(copy)
    (copy / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    monkeypatch.setattr(ckpt, "find_checkpoint", lambda path: found)
    with pytest.raises(InputError, match="refused to unpickle class posix.system"):
        ckpt.load_into_model(_model(), copy)
    model = _model()
    with pytest.raises(InputError, match="refused to unpickle class posix.system"):
        ckpt.load_training_state(copy, state=model.state_dict(keep_vars=True),
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    assert not marker.exists()


def test_a_pickled_object_item_is_refused_before_dcp_unpickles_it(copy: Path, tmp_path: Path) -> None:
    """Metadata of DCP's own classes only, one item stored as bytes: DCP would ``torch.load`` those bytes
    with ``weights_only=False``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    (copy / "payload.distcp").write_bytes(buf.getvalue())
    md = _trusted_metadata(copy)
    md.state_dict_metadata["model.0.weight"] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "model.0.weight"}
    md.storage_data[MetadataIndex("model.0.weight")] = _StorageInfo("payload.distcp", 0, len(buf.getvalue()))
    (copy / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(InputError, match="stores item 'model.0.weight' as a pickled Python object, which this "
                                         "program never writes"):
        ckpt.load_into_model(_model(), copy)
    assert not marker.exists()


def test_metadata_pointing_outside_the_step_folder_is_refused(copy: Path, tmp_path: Path) -> None:
    md = _trusted_metadata(copy)
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes((copy / "__0_0.distcp").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (copy / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(InputError, match=r"points into '\.\./elsewhere\.distcp', not a data file of the step folder"):
        ckpt.checkpoint_meta(copy)


def test_a_crafted_rng_file_is_refused_before_any_rank_starts(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save(Payload(marker), copy / "rng-rank0.pt")
    with pytest.raises(InputError, match=r"rng-rank0\.pt is not an RNG state .*resume only checkpoints you trust"):
        ckpt.checkpoint_meta(copy)
    assert not marker.exists()


def test_a_metadata_fifo_is_refused_instead_of_waited_on(copy: Path) -> None:
    (copy / ".metadata").unlink()
    os.mkfifo(copy / ".metadata")
    with pytest.raises(InputError, match=r"\.metadata: DCP metadata is missing or unreadable .*FIFO"):
        _finishes(lambda: ckpt.checkpoint_meta(copy), fifos=(copy / ".metadata",))


# -- model factory specs ---------------------------------------------------------------------------------------------
FACTORY = """
from torch import nn


def build():
    return nn.Linear(2, 2)
"""


def _plant(folder: Path, name: str, marker: Path) -> None:
    """A module ``name`` in ``folder`` that creates ``marker`` when imported (and is no use otherwise)."""
    (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh Python that, like the installed script, does not itself put ``cwd`` on ``sys.path``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_module_planted_in_the_working_folder_does_not_shadow_a_package(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "my_models.py").write_text(FACTORY)
    _plant(tmp_path, "pulp", marker)
    done = _python("""
        from omnibal_compile.models.load import load_model
        print(type(load_model("my_models:build").model).__name__)
        import pulp  # as the planner does
        print(pulp.__file__)
    """, tmp_path)
    assert not marker.exists(), done.stderr
    assert done.returncode == 0, done.stderr
    model, pulp_file = done.stdout.split()
    assert model == "Linear" and Path(pulp_file).parent.parent != tmp_path


def test_a_factory_from_a_named_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omnibal_compile.models.load import load_model

    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_for_factory_test.py").write_text("WIDTH = 3\n")
    (code / "factory_file_test.py").write_text("from helper_for_factory_test import WIDTH\nfrom torch import nn\n\n\n"
                                               "def build():\n    return nn.Linear(WIDTH, 1)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("factory_file_test", "helper_for_factory_test"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    model = load_model("../code/factory_file_test.py:build").model
    assert isinstance(model, nn.Linear) and model.in_features == 3
    assert sys.path[-1] == str(code)  # beside the file, searched after the installed packages
    with pytest.raises(InputError, match=r"\.\./code/missing\.py is not a file"):
        load_model("../code/missing.py:build")
    with pytest.raises(InputError, match=r"no module 'no_such_module' among the installed packages or in the current "
                                         r"folder .*package\.module:function.*path/to/file\.py:function"):
        load_model("no_such_module:build")


def test_rank_processes_do_not_put_the_working_folder_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            lengths_file: str) -> None:
    """``python -m`` puts the working folder first on ``sys.path``: a ``torch.py`` there would run in the
    agent and in every rank. The ranks start as ``launch`` starts them, running a module that imports torch."""
    from test_runtime_data import _config

    import omnibal_compile.runtime.processes as processes_mod
    from omnibal_compile.runtime.launch import launch

    config = _config(tmp_path, lengths_file, stages=1, steps=1, log=str(tmp_path / "steps.jsonl"))
    real_run_ranks = processes_mod.run_ranks

    def ranks_import_torch(argv: list[str], **kw: Any) -> None:
        module_at = argv.index("-m") + 1
        real_run_ranks([*argv[:module_at], "omnibal_compile.runtime.checkpoint"], **kw)
        (tmp_path / "steps.jsonl").touch()

    monkeypatch.setattr(processes_mod, "run_ranks", ranks_import_torch)
    marker = tmp_path / "pwned"
    _plant(tmp_path, "torch", marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert launch(config, timeout_s=120, quiet=True) == []
    assert not marker.exists()


# -- dataset paths -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("PIL")
    pytest.importorskip("transformers")
    from test_dataset_lengths import _tokenizer

    return _tokenizer(tmp_path_factory.mktemp("tok") / "plain", template=None)


def _records(tmp_path: Path, images: list[str]) -> Path:
    import json

    from test_dataset_lengths import QA, _image

    _image(tmp_path / "images/ok.png", 600, 400)
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"image": "images/ok.png", "conversations": QA}]
                               + [{"image": p, "conversations": QA} for p in images]))
    return data


def test_lengths_finishes_promptly_when_an_image_is_a_fifo(tmp_path: Path, tokenizer: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from omnibal_compile.cli import main

    data = _records(tmp_path, ["images/fifo.png"])
    fifo = tmp_path / "images/fifo.png"
    os.mkfifo(fifo)
    skipped = tmp_path / "skipped.jsonl"
    argv = ["lengths", str(data), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "lengths.json"),
            "--skipped-out", str(skipped), "--workers", "1", "--no-progress"]
    assert _finishes(lambda: main(argv), fifos=(fifo,)) == 0
    import json

    (left_out,) = [json.loads(line) for line in skipped.read_text().splitlines()]
    assert left_out["record"] == 1 and left_out["reason"].startswith("a FIFO (named pipe), not a regular file")
    capsys.readouterr()
    assert _finishes(lambda: main([*argv, "--on-error", "fail"]), fifos=(fifo,)) == 2
    assert "fifo.png: a FIFO (named pipe), not a regular file" in capsys.readouterr().err


def test_device_and_proc_files_are_not_read_as_images(tmp_path: Path, tokenizer: Path) -> None:
    from omnibal_compile.data.dataset_lengths import dataset_lengths

    data = _records(tmp_path, ["/dev/zero", "/proc/self/status"])
    r = _finishes(lambda: dataset_lengths(data, tokenizer=tokenizer))
    assert r.record_ids.tolist() == [0]
    assert [s.reason for s in r.skipped] == ["a character device, not a regular file; only regular files are read",
                                             "empty file (0 bytes)"]


def test_images_can_be_confined_to_the_image_root(tmp_path: Path, tokenizer: Path) -> None:
    from test_dataset_lengths import _image

    from omnibal_compile.data.dataset_lengths import dataset_lengths

    root = tmp_path / "root"
    outside = tmp_path / "outside.png"
    _image(outside, 448, 448)
    data = _records(root, ["../outside.png", str(outside), "images/link.png"])
    (root / "images/link.png").symlink_to(outside)
    assert dataset_lengths(data, tokenizer=tokenizer).record_ids.tolist() == [0, 1, 2, 3]
    r = dataset_lengths(data, tokenizer=tokenizer, confine_to_root=True)
    assert r.record_ids.tolist() == [0]
    assert {s.reason for s in r.skipped} == {f"resolves to {outside.resolve()}, outside {root.resolve()}"}
