"""A data-parallel, deterministic, resumable batch sampler over balanced packs.

Glossary:
    packer      a function ``seed -> Packing`` (ours or ISF) run once per epoch with a seed mixed
                from (seed, epoch), so every rank computes the same packing without talking.
    batch       what the sampler yields: the sample ids of this rank's pack for one step.
    position    (epoch, step): the next step to yield. ``state_dict`` saves it with what the
                sequence depends on; a fresh sampler given it continues the same sequence, or
                refuses it when it would not. It advances to the next epoch when an epoch has been
                yielded in full (never from a loaded step: one beyond the epoch is an error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from omnibal_compile._utils.validate import check_int, check_seed
from omnibal_compile.data.packing import Packing
from omnibal_compile.errors import InputError

__all__ = ["BalancedBatchSampler", "epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 32-bit seed for (seed, epoch); neighbouring epochs get unrelated shuffles."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields, for one data-parallel rank, the sample ids of its pack at every step of an epoch.

    Every sample appears exactly once per epoch across the ``world_size`` ranks; the sequence
    depends only on (``seed``, epoch) and what the packer packs. Use it as ``DataLoader(dataset,
    batch_sampler=sampler, collate_fn=collator)``. ``state_dict`` counts the batches this sampler
    has yielded; with ``num_workers > 0`` the loader prefetches, so save ``state_dict()`` with its
    ``"step"`` replaced by the count of batches you consumed.

    ``settings`` (JSON data: samples per pack, pack shape, a digest of the lengths, ...) describe
    what the packer depends on; :meth:`DataPlan.sampler` fills them. The state carries them, the
    seed, the data-parallel size, the dataset size and a digest of the epoch's packing, and
    :meth:`load_state_dict` refuses a state that does not match, naming what differs.
    """

    def __init__(self, packer: Callable[[int], Packing], *, num_samples: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, settings: Mapping[str, Any] | None = None) -> None:
        self.world_size = check_int(world_size, "world_size", min=1)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise InputError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size}")
        self.packer = packer
        self.num_samples = check_int(num_samples, "num_samples", min=1)
        self.rank = int(rank)
        self.seed = check_seed(seed)
        self.settings = dict(settings or {})
        self.epoch = 0
        self.step = 0
        self._cache: tuple[int, Packing] | None = None

    def packing(self, epoch: int | None = None) -> Packing:
        """The packing of ``epoch`` (default: the current one), computed once and cached."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is None or self._cache[0] != epoch:
            packing = self.packer(epoch_seed(self.seed, epoch))
            if packing.dp != self.world_size:
                raise InputError(f"the packer made steps of {packing.dp} ranks but world_size={self.world_size}")
            self._cache = (epoch, packing)
        return self._cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step."""
        self.epoch, self.step = check_int(epoch, "epoch", min=0), 0

    def __len__(self) -> int:
        return self.packing().num_steps

    def __iter__(self) -> Iterator[list[int]]:
        packing = self.packing()
        steps = packing.steps[:, self.rank]
        while self.step < packing.num_steps:
            pack = packing.pack(int(steps[self.step]))
            self.step += 1
            yield pack.tolist()
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position and everything the sequence depends on (JSON data)."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "world_size": self.world_size,
                "num_samples": self.num_samples, "settings": dict(self.settings),
                "packing": self.packing().digest()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`); refused, naming what differs, unless it was
        saved by a sampler with the same sequence."""
        if not isinstance(state, Mapping):
            raise InputError(f"sampler state must be a dict from state_dict(), got {type(state).__name__}")
        for key in ("epoch", "step"):
            if key not in state:
                raise InputError(f"sampler state needs a non-negative integer '{key}', got nothing")
            check_int(state[key], f"sampler state '{key}'", min=0)
        ours = {"seed": self.seed, "world_size": self.world_size, "num_samples": self.num_samples}
        saved_settings = state.get("settings")
        if isinstance(saved_settings, Mapping):
            ours.update({k: v for k, v in self.settings.items()})
            state = {**state, **saved_settings}
        differ = [f"{k}={state[k]!r} but this sampler has {k}={v!r}" for k, v in ours.items()
                  if k in state and _plain(state[k]) != _plain(v)]
        if differ:
            raise InputError(
                f"sampler state has {'; and '.join(differ)}. A state only resumes the sampler it was saved from: "
                "resume with the same seed, data-parallel size, dataset and packing settings, or start afresh "
                "with set_epoch()"
            )
        missing = [k for k in ("seed", "world_size", "num_samples", "settings", "packing") if k not in state]
        missing += [k for k in self.settings if k not in state]
        if missing:
            raise InputError(
                f"sampler state lacks {missing}: it was not saved by this version's state_dict(), so what it resumes "
                "cannot be checked; save it again with state_dict(), or start afresh with set_epoch()"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        packing = self.packing(epoch)
        if step > packing.num_steps:
            raise InputError(
                f"sampler state step {step} is beyond epoch {epoch}'s {packing.num_steps} steps; a state from "
                "state_dict() never is: was it edited, or saved with other data?"
            )
        if state["packing"] != packing.digest():
            raise InputError(
                f"the packs of epoch {epoch} differ from those the state was saved with (packing digest "
                f"{state['packing']} vs {packing.digest()}): the lengths or the packer changed; resume with the "
                "same data and packing settings, or start afresh with set_epoch()"
            )
        self.epoch, self.step = epoch, step


def _plain(value: Any) -> Any:
    """Tuples as lists (a state read back from JSON has lists), for comparing settings."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
