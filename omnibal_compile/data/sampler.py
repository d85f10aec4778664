"""A data-parallel, deterministic, resumable batch sampler over balanced packs.

Glossary:
    packer      a function ``seed -> Packing`` (ours or ISF) run once per epoch with a seed mixed
                from (seed, epoch), so every rank computes the same packing without talking.
    batch       what the sampler yields: the sample ids of this rank's pack for one step.
    position    (epoch, step): the next step to yield. ``state_dict`` saves it; a fresh sampler
                given it continues the same sequence. It advances to the next epoch when an epoch
                has been yielded in full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from omnibal_compile.data.packing import Packing
from omnibal_compile.errors import InputError

__all__ = ["BalancedBatchSampler", "epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 32-bit seed for (seed, epoch); neighbouring epochs get unrelated shuffles."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields, for one data-parallel rank, the sample ids of its pack at every step of an epoch.

    Every sample appears exactly once per epoch across the ``world_size`` ranks; the sequence
    depends only on (``seed``, epoch). Use it as ``DataLoader(dataset, batch_sampler=sampler,
    collate_fn=collator)``. ``state_dict`` counts the batches this sampler has yielded; with
    ``num_workers > 0`` the loader prefetches, so save the count of batches you consumed
    instead (``{"epoch": e, "step": s}`` in ``load_state_dict``).
    """

    def __init__(self, packer: Callable[[int], Packing], *, num_samples: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise InputError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.packer = packer
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
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
        self.epoch, self.step = int(epoch), 0

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
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "world_size": self.world_size,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "world_size", "num_samples"):
            if key in state and state[key] != getattr(self, key):
                raise InputError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}; "
                    "resume with the same seed, data-parallel size and dataset"
                )
        for key in ("epoch", "step"):
            if key not in state or not isinstance(state[key], (int, np.integer)) or state[key] < 0:
                raise InputError(f"sampler state needs a non-negative integer '{key}', got {state.get(key)!r}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
