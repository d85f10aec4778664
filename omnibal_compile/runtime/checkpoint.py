"""Checkpoints on ``torch.distributed.checkpoint`` (DCP) from which training continues exactly.

Glossary:
    root            the folder given to ``--save`` / ``--resume``; it holds one folder per saved step.
    step folder     ``root/step-<K>``: the state after K training steps. It is written as
                    ``root/.partial-step-<K>`` and renamed by rank 0 only after every rank has
                    finished writing (a barrier), so a kill at any moment leaves the previous step
                    folder complete; partial folders are never read and are removed by the next save.
    model state     every parameter and persistent buffer under the original model's names. FSDP2 and
                    tensor-parallel shards are DTensors and DCP stores their full logical tensors, so a
                    checkpoint loads into another (dp, pp, tp) layout (DCP reshards; optimizer moments
                    are DTensors sharded as their parameters) and into the unsplit model.
    optimizer state per parameter (its first original name) the optimizer's tensors (AdamW:
                    ``step``, ``exp_avg``, ``exp_avg_sq``), for exactly the parameters that have
                    any: those the optimizer has updated. A parameter that never got a gradient
                    (unused, as LLaVA's last vision layer with ``vision_feature_layer=-2``) or is
                    frozen has none, and a resumed run makes state for the saved ones only, so it
                    holds what the uninterrupted run holds. Hyper-parameters go to the trainer
                    state; the learning rate is a function of the step (``recipe.lr_at``).
    trainer state   ``meta.json``: step, layout, the run settings the data order depends on (the
                    batches of step k are a function of the seed, the data settings and k, so the
                    step is the sampler position and the LR schedule's); ``rng-rank<r>.pt``: each
                    rank's RNG state (restored when the layout is the same).
    complete        a step folder with ``meta.json`` (written last), DCP's ``.metadata`` and every
                    data file the metadata points into, each as long as the metadata says.
    ours            a step folder whose ``meta.json`` says ``"written_by": "omnibal_compile"``. Only
                    those are pruned (the ``keep`` newest stay, and the newest whose last loss was
                    finite is never removed) or overwritten; a folder of the user's named ``step-1``
                    is left alone, and one without ``meta.json`` is skipped when the newest
                    checkpoint of a root is looked for.
    lock            ``root/.lock`` holds the pid (and host) of the run saving into ``root``
                    (:func:`lock_checkpoint_root`); a second run saving there is refused at start,
                    a lock left by a dead process is taken over with a note.
    trusted read    DCP reads ``.metadata`` with plain ``pickle.load`` and a bytes item with
                    ``torch.load(weights_only=False)``: either runs whatever code the file names. Here
                    ``.metadata`` is unpickled admitting only DCP's own metadata classes, torch sizes,
                    dtypes and layouts, and must describe what this program writes (tensors only, data
                    files inside the step folder) before DCP reads anything; DCP's own loads get the
                    same reader. Tensors and the RNG files are read with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import socket
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from omnibal_compile import progress
from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile._utils.validate import open_regular_file
from omnibal_compile.errors import InputError, TrainingError

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_meta",
    "find_checkpoint",
    "latest_checkpoint",
    "lock_checkpoint_root",
    "load_into_model",
    "load_training_state",
    "read_dcp_metadata",
    "save_training_state",
]

CHECKPOINT_FORMAT = 2
"""Version of the step-folder layout (1 was one ``rank<r>.pt`` per rank, weights only)."""

_STEP = re.compile(r"^step-(\d+)$")
_META = "meta.json"
_WRITER = "omnibal_compile"  # meta.json's "written_by": the step folder is ours (pruned, overwritten)
_LOCK = ".lock"
_DCP_METADATA = ".metadata"  # DCP's name for it
_UNTRUSTED = "it is not a checkpoint this program wrote; resume only checkpoints you trust"

# What DCP's metadata pickles hold (besides containers and strings, which need no class): DCP's own
# metadata classes, torch sizes, dtypes and layouts, and the path the checkpoint was saved to.
_PATHS = (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath)
_ADMITTED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in (
        dcp_md.Metadata, dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata, dcp_md.ChunkStorageMetadata,
        dcp_md.TensorProperties, dcp_md.StorageMeta, dcp_md.MetadataIndex, dcp_md._MEM_FORMAT_ENCODING,
        dcp_fs._StorageInfo, torch.Size, torch.serialization._get_layout, *_PATHS)},
    **{("pathlib", c.__name__): c for c in _PATHS},  # as Python < 3.13 names them
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


class _RefusedClass(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the classes of :data:`_ADMITTED` (a pickle runs code only through the classes it names)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[module, name]
        except KeyError:
            raise _RefusedClass(f"{module}.{name}") from None


def _metadata_problem(md: Any) -> str | None:
    """What in unpickled DCP metadata this program never writes, or None."""
    if type(md) is not dcp_md.Metadata:
        return f"holds a {type(md).__name__}, not DCP metadata"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        return "lacks DCP's item and storage tables"
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, dcp_md.BytesStorageMetadata):
            # DCP would read it with torch.load(weights_only=False): arbitrary code
            return f"stores item {key!r} as a pickled Python object, which this program never writes"
        if not isinstance(key, str) or not isinstance(item, dcp_md.TensorStorageMetadata):
            return f"has item {key!r} of type {type(item).__name__}, not a tensor"
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            return f"has a storage entry of type {type(info).__name__}"
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            return f"points into {name!r}, not a data file of the step folder"
        if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
            return f"has a storage entry in {name} with offset {info.offset!r} and length {info.length!r}"
        descriptors = info.transform_descriptors
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            return f"has storage transforms {descriptors!r}, not names"
    return None


def read_dcp_metadata(path: Path) -> dcp_md.Metadata:
    """The DCP metadata file ``path``, unpickled admitting only DCP's metadata classes (no code runs)
    and checked to describe a checkpoint this program writes; raises :class:`InputError` otherwise."""
    where = f"checkpoint {path.parent}: {path.name}"
    try:
        with open_regular_file(path) as f:
            metadata = _MetadataUnpickler(f).load()
    except _RefusedClass as e:
        raise InputError(f"{where}: refused to unpickle class {e}; {_UNTRUSTED}") from None
    except OSError as e:
        raise InputError(f"{where}: DCP metadata is missing or unreadable ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - a broken pickle raises many types; all mean the same here
        raise InputError(f"{where} is not DCP metadata ({type(e).__name__}: {e}); {_UNTRUSTED}") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise InputError(f"{where} {problem}; {_UNTRUSTED}")
    return metadata


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader, reading its metadata with :func:`read_dcp_metadata` instead of ``pickle.load``."""

    refused: InputError | None = None
    """The first refusal (DCP buries what its reader raises in its own exceptions)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        rank = kwargs.get("rank")  # DCP falls back to a rank's own metadata file when the global one fails
        name = _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}"
        try:
            metadata = read_dcp_metadata(Path(self.path) / name)
        except InputError as e:
            self.refused = self.refused or e
            raise
        if metadata.storage_meta is None:  # as DCP's own read_metadata does
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def _dcp_load(state_dict: dict[str, Any], folder: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` from ``folder`` through :class:`_CheckedReader`; its refusal is raised as it is."""
    reader = _CheckedReader(str(folder))
    try:
        dcp.load(state_dict, storage_reader=reader, no_dist=no_dist)
    except BaseException:  # DCP's CheckpointException is a BaseException
        if reader.refused is not None:
            raise reader.refused from None
        raise


def _read_rng(path: Path) -> torch.Tensor:
    """The CPU RNG state a rank saved to ``path``; raises :class:`InputError` when it is anything else."""
    try:
        with open_regular_file(path) as f:
            state = torch.load(f, weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"checkpoint {path.parent}: {path.name} is not an RNG state ({first}); {_UNTRUSTED}") from None
    cpu = state.get("cpu") if isinstance(state, dict) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise InputError(f"checkpoint {path.parent}: {path.name} is not an RNG state; {_UNTRUSTED}")
    return cpu


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def _read_meta(folder: Path) -> dict[str, Any] | None:
    """``folder/meta.json`` as a dict, or None when it is missing or not a JSON object."""
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_ours(folder: str | Path) -> bool:
    """Whether ``folder`` is a step folder this program wrote (its meta.json says so)."""
    meta = _read_meta(Path(folder))
    return meta is not None and meta.get("written_by") == _WRITER and meta.get("format") == CHECKPOINT_FORMAT


def _finite_loss(meta: Mapping[str, Any] | None) -> bool:
    loss = None if meta is None else meta.get("loss")
    return isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)


def _prune(root: Path, keep: int) -> list[Path]:
    """Remove the step folders of ``root`` this program wrote beyond the ``keep`` newest, never the newest
    whose last loss was finite; folders not ours are never touched. Returns the removed folders."""
    if keep <= 0:
        return []
    ours = [(step, folder, _read_meta(folder)) for step, folder in _step_folders(root) if is_ours(folder)]
    kept = {folder for _, folder, _ in ours[-keep:]}
    finite = [folder for _, folder, meta in ours if _finite_loss(meta)]
    if finite:
        kept.add(finite[-1])
    removed = [folder for _, folder, _ in ours if folder not in kept]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The trainer state of a complete step folder; raises :class:`InputError` saying what is missing."""
    folder = Path(path)
    meta_path = folder / _META
    if not meta_path.is_file():
        raise InputError(
            f"checkpoint {folder} is incomplete (no {_META}): it was not finished; resume from an earlier step"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"checkpoint {folder}: {_META} is corrupt ({e})") from None
    if not isinstance(meta, dict):
        raise InputError(f"checkpoint {folder}: {meta_path} holds a {type(meta).__name__}, not a JSON object")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise InputError(
            f"checkpoint {folder} has format {meta.get('format')!r}; this version reads format {CHECKPOINT_FORMAT}"
        )
    _check_meta(meta, meta_path)
    metadata = read_dcp_metadata(folder / _DCP_METADATA)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = folder / name
        have = f.stat().st_size if f.is_file() else -1
        if have < size:
            what = "is missing" if have < 0 else f"has {have:,} bytes of {size:,}"
            raise InputError(f"checkpoint {folder} is truncated: data file {name} {what}; resume from an earlier step")
    for rng in sorted(folder.glob("rng-rank*.pt")):
        _read_rng(rng)  # refused here, before any rank starts, rather than in a rank
    return meta


def _is_count(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


def _check_meta(meta: Mapping[str, Any], path: Path) -> None:
    """The trainer state's values are of the kinds this program writes; an InputError names the file and key."""
    def bad(key: str, what: str) -> InputError:
        return InputError(f"checkpoint {path}: {key!r} must be {what}, got {meta.get(key)!r}; {_UNTRUSTED}")

    if not _is_count(meta.get("step"), 0):
        raise bad("step", "a whole number of steps >= 0")
    if "world_size" in meta and not _is_count(meta["world_size"], 1):
        raise bad("world_size", "a whole number >= 1")
    layout = meta.get("layout", {})
    if not isinstance(layout, dict) or not all(_is_count(layout.get(k, 1), 1) for k in ("dp", "pp", "tp")):
        raise bad("layout", "an object of dp, pp and tp, whole numbers >= 1")
    for key, kind in (("data", dict), ("scheduler", dict), ("param_groups", list), ("settings", dict)):
        if key in meta and not isinstance(meta[key], kind):
            raise bad(key, f"a JSON {'object' if kind is dict else 'list'}")
    if not all(isinstance(g, dict) for g in meta.get("param_groups", [])):
        raise bad("param_groups", "a list of JSON objects")
    scheduler = meta.get("scheduler", {})
    if "last_epoch" in scheduler and scheduler["last_epoch"] != meta["step"]:
        raise bad("step", f"the scheduler's position ({scheduler['last_epoch']!r})")
    loss = meta.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        raise bad("loss", "a number or null")


def find_checkpoint(root: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest step folder under ``root`` (or ``root`` itself when it is a step folder), checked
    complete, and its trainer state."""
    folder = Path(root)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file, not a folder"
        raise InputError(
            f"checkpoint {folder} {what}: give the folder written by --save, or one of its step-<K> folders"
        )
    if not ((folder / _META).is_file() or _STEP.match(folder.name)):
        steps = _step_folders(folder)
        if not steps:
            raise InputError(f"no checkpoint under {folder}: expected step-<K> folders written by --save")
        # a step folder without meta.json is not one of ours (ours appear complete, by a rename): skipped
        with_meta = [p for _, p in steps if (p / _META).is_file()]
        if not with_meta:
            names = ", ".join(p.name for _, p in steps[-3:])
            raise InputError(f"no complete checkpoint under {folder}: its step folders ({names}) have no {_META} "
                             "(incomplete, or not written by --save)")
        folder = with_meta[-1]
    return folder, checkpoint_meta(folder)


def latest_checkpoint(root: str | Path) -> Path:
    """The newest complete step folder under ``root`` (see :func:`find_checkpoint`)."""
    return find_checkpoint(root)[0]


def _optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """Optimizer tensors keyed by parameter name (the same objects: DCP loads into them in place)."""
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                out[names[id(p)]] = dict(optimizer.state[p])
    return out


def _init_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: set[str]) -> None:
    """Create the state tensors of the parameters whose state is ``saved`` (by name), for DCP to load into:
    a step with zero gradients for them alone (the others get none) and zero learning rate."""
    if optimizer.state:
        return
    lrs = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and names[id(p)] in saved:
                p.grad = torch.zeros_like(p)
        lrs.append(group["lr"])
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _saved_optimizer_names(folder: Path) -> set[str]:
    """Names of the parameters with optimizer state in a step folder (DCP keys ``optim.<name>.<state>``)."""
    metadata = read_dcp_metadata(folder / _DCP_METADATA)
    return {k[len("optim."):].rpartition(".")[0] for k in metadata.state_dict_metadata if k.startswith("optim.")}


def _param_names(state: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """Tensor -> its first original name (tied parameters have several)."""
    names: dict[int, str] = {}
    for name in sorted(state):
        names.setdefault(id(state[name]), name)
    return names


def save_training_state(
    root: str | Path,
    *,
    step: int,
    state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    trainer: Mapping[str, Any],
    keep: int = 2,
) -> Path:
    """Collectively write ``root/step-<step>`` (every rank calls it); returns the step folder.

    ``state`` maps original names to this rank's parameters and buffers (DTensors under FSDP2);
    ``trainer`` is JSON data saved as the trainer state (layout, data settings, LR scheduler).
    Older step folders of ours beyond the ``keep`` newest are removed after the new one is in place,
    except the newest whose ``trainer["loss"]`` was finite (:func:`_prune`).
    """
    rank = dist.get_rank()
    root = Path(root)
    final, partial = root / f"step-{step:06d}", root / f".partial-step-{step:06d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(".partial-step-*"):
            shutil.rmtree(old, ignore_errors=True)  # left by a save that was killed
    dist.barrier()
    names = _param_names(state)
    try:
        dcp.save({"model": dict(state), "optim": _optimizer_state(optimizer, names)}, checkpoint_id=str(partial))
        torch.save({"cpu": torch.get_rng_state()}, partial / f"rng-rank{rank}.pt")
    except (OSError, RuntimeError, dcp.api.CheckpointException) as e:  # DCP's gathers every rank's errors
        need = sum(t.numel() * t.element_size() for t in state.values())
        raise _save_failure(e, root, step, need) from None
    dist.barrier()  # every rank's part is on disk before the folder counts as complete
    if rank == 0:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        meta = {"format": CHECKPOINT_FORMAT, "written_by": _WRITER, "step": step,
                "world_size": dist.get_world_size(), "param_groups": hyper, **trainer}
        atomic_write_text(partial / _META, json.dumps(meta, indent=2, default=str))
        if final.exists():
            if not is_ours(final):  # launch's precheck refuses this before training; torchrun users meet it here
                raise InputError(f"{final} exists and was not written by --save; it is left as it is: "
                                 "move it, or save elsewhere")
            shutil.rmtree(final)
        partial.rename(final)  # atomic: the step folder appears complete or not at all
        _prune(root, keep)
    dist.barrier()
    return final


def _save_failure(exc: BaseException, root: Path, step: int, need: int) -> TrainingError:
    """What a failed save says: the ranks and their first error, in plain words for a full disk (an ``ENOSPC``, or
    less room left than this rank's weights: torch's writer reports a full disk as "unexpected pos")."""
    failures = getattr(exc, "failures", None)
    errors = {r: e for r, (e, _) in failures.items()} if isinstance(failures, dict) else {dist.get_rank(): exc}
    first = next(iter(errors.values()))
    text = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}".strip()
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors.values()) or (
        free is not None and free < need)
    what = "no space left on device" if full else f"on rank{'s' if len(errors) > 1 else ''} " + ", ".join(
        str(r) for r in sorted(errors))
    fix = "free space there" if full else "check the folder"
    return TrainingError(f"saving the checkpoint of step {step} in {root} failed: {what} ({text}); the earlier "
                         f"checkpoints there are kept: {fix}, or give --save another folder")


def load_training_state(
    path: str | Path, *, state: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]]:
    """Collectively load the newest step folder of ``path`` (see :func:`find_checkpoint`) into this
    rank's tensors and optimizer, in place; returns the step folder and its trainer state.

    Works across layouts: each rank reads the names it holds, DCP reshards. RNG states are restored
    only when the world size is the one that saved.
    """
    folder, meta = find_checkpoint(path)
    names = _param_names(state)
    _init_optimizer_state(optimizer, names, _saved_optimizer_names(folder))
    # DCP loads into the given tensors (DTensor shards included), so the parameters and the
    # optimizer's own state tensors are filled where they are.
    _dcp_load({"model": dict(state), "optim": _optimizer_state(optimizer, names)}, folder)
    for group, saved in zip(optimizer.param_groups, meta.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k in group and not isinstance(group[k], torch.Tensor)})
    if meta.get("world_size") == dist.get_world_size():
        rng = folder / f"rng-rank{dist.get_rank()}.pt"
        if rng.is_file():
            torch.set_rng_state(_read_rng(rng))
    return folder, meta


def load_into_model(model: nn.Module, path: str | Path) -> int:
    """Load a checkpoint's weights into the unsplit ``model`` (no process group needed); returns its step."""
    folder, meta = find_checkpoint(path)
    state = model.state_dict()
    check_fits(folder, model)
    with warnings.catch_warnings():  # DCP warns that it runs in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load({"model": state}, folder, no_dist=True)
    model.load_state_dict(state)
    return int(meta["step"])


def check_fits(folder: Path, model: nn.Module) -> None:
    """Refuse, before any tensor is read, a step folder whose model tensors are not ``model``'s: names missing
    or unexpected, or the same name with another shape (a config edited since the save)."""
    state = model.state_dict()
    entries = read_dcp_metadata(folder / _DCP_METADATA).state_dict_metadata.items()
    saved = {k[len("model."):]: tuple(getattr(v, "size", ())) for k, v in entries if k.startswith("model.")}
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    shapes = [f"{n} {list(saved[n])} saved, {list(state[n].shape)} now" for n in sorted(set(state) & set(saved))
              if saved[n] != tuple(state[n].shape)]
    if missing or unexpected or shapes:
        parts = [f"{what} {names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                 for what, names in (("missing", missing), ("unexpected", unexpected), ("other shapes:", shapes))
                 if names]
        raise InputError(f"checkpoint {folder} does not fit {type(model).__name__}: {'; '.join(parts)}; was it saved "
                         "from this model, with this config?")


def _saved_model_names(folder: Path) -> list[str]:
    metadata = read_dcp_metadata(folder / _DCP_METADATA)
    return [k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def lock_checkpoint_root(root: str | Path) -> Iterator[Path]:
    """Hold ``root/.lock`` (created with O_EXCL, holding this pid and host) while the body runs.

    A lock held by a live process is an :class:`InputError` naming its pid; one left by a process of
    this host that is no longer alive is taken over, with a note. The lock is removed at the end.
    """
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / _LOCK
    me = f"{os.getpid()} {socket.gethostname()}"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = lock.read_text(errors="replace").split() if lock.is_file() else []
            pid = int(held[0]) if held and held[0].isdigit() else None
            host = held[1] if len(held) > 1 else None
            if pid is not None and host == socket.gethostname() and not _pid_alive(pid):
                progress.info(f"note: {lock} was left by process {pid}, which has ended; taking it over")
                lock.unlink(missing_ok=True)
                continue
            who = f"pid {pid}" + (f" on {host}" if host else "") if pid is not None else "an unknown process"
            raise InputError(
                f"checkpoint folder {folder} is in use by another run ({who}, lock file {lock}): two runs saving "
                "into one folder would delete each other's checkpoints; wait for it to end or give --save another "
                f"folder (if no run is using it, delete {lock})"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        break
    else:
        raise InputError(f"could not take the lock {lock}; another run is starting there")
    try:
        yield lock
    finally:
        with contextlib.suppress(OSError):
            if lock.read_text().strip() == me:
                lock.unlink()
