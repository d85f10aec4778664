"""Stage checkpoints keyed by the original model's names, so they load back into the unsplit model.

Glossary:
    rank file   ``rank<r>.pt`` in the checkpoint folder: ``{original name: tensor}`` for every
                parameter and persistent buffer that rank's stages hold. A tied parameter is
                written under each of its names, by every rank that holds it.
    meta file   ``meta.json``: world size, step and the plan the stages were made from.
    data parallel  the ``dp`` replicas hold the same values: whole tensors are gathered (FSDP shards)
                and data-parallel rank 0 writes; ``world_size`` counts pipeline ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from omnibal_compile.errors import InputError
from omnibal_compile.runtime.pipeline import RankPipeline

__all__ = ["load_checkpoint", "load_into_model", "load_into_pipeline", "save_checkpoint"]


def save_checkpoint(pipeline: RankPipeline, directory: str | Path, *, step: int) -> Path:
    """Write this rank's tensors under their original names; rank 0 also writes ``meta.json``.

    Every rank calls it (a collective over ``dp``); data-parallel rank 0 writes.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{pipeline.rank}.pt"
    state = {name: t.cpu().clone() for name, t in pipeline.full_state().items()}
    if pipeline.dp_rank != 0:
        return path
    torch.save(state, path)
    if pipeline.rank == 0:
        meta = {"world_size": pipeline.world_size, "step": step, "plan": pipeline.plan.to_dict()}
        (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return path


def load_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Merge every rank file of a checkpoint into one state dict with the original model's names."""
    folder = Path(directory)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise InputError(f"{folder} is not a pipeline checkpoint (no meta.json); pass the folder given to --save")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    merged: dict[str, torch.Tensor] = {}
    for r in range(int(meta["world_size"])):
        path = folder / f"rank{r}.pt"
        if not path.exists():
            raise InputError(f"checkpoint {folder} is missing {path.name}; every rank must have saved")
        for name, t in torch.load(path, map_location="cpu", weights_only=True).items():
            if name in merged and not torch.equal(merged[name], t):
                raise InputError(f"checkpoint {folder}: ranks disagree on tied tensor '{name}'")
            merged[name] = t
    return merged


def load_into_model(model: nn.Module, directory: str | Path) -> None:
    """Load a pipeline checkpoint into the unsplit ``model`` (every name must match)."""
    state = load_checkpoint(directory)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise InputError(
            f"checkpoint {directory} does not fit {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; was it saved from a pipeline of this model?"
        )
    model.load_state_dict(state)


def load_into_pipeline(pipeline: RankPipeline, directory: str | Path) -> None:
    """Copy a checkpoint's values into this rank's parameters and buffers (resume training)."""
    state = load_checkpoint(directory)
    missing = sorted(set(pipeline.state) - set(state))
    if missing:
        raise InputError(f"checkpoint {directory} lacks {missing[:5]} held by rank {pipeline.rank}")
    with torch.no_grad():
        for name, t in pipeline.state.items():
            value = state[name].to(t.device)
            if isinstance(t, DTensor):  # this rank's shard of the whole tensor, cut locally
                value = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(value)
