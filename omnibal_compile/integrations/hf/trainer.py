"""Balanced packs in ``transformers.Trainer``: the data balance without pipelining (data parallel only).

``BalancedTrainer`` is a ``transformers.Trainer`` whose training batches are balanced packs: at
every step each data-parallel rank gets one pack of samples (a :class:`BalancedBatchSampler` over
our balanced packing, for ``args.world_size`` ranks, seeded with ``args.seed``), which the data
collator (an :class:`~omnibal_compile.integrations.hf.collate.HFPackingCollator`) turns into one row.
Everything else (optimizer, schedule, DDP, logging, checkpoints) is the Trainer's.

transformers and accelerate are imported on first use of ``BalancedTrainer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from omnibal_compile.config import DEFAULT_SAMPLES_PER_PACK
from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.lengths import LengthStats, load_lengths
from omnibal_compile.data.packing import Packing, PackShape
from omnibal_compile.data.sampler import BalancedBatchSampler
from omnibal_compile.errors import InputError, MissingBackendError
from omnibal_compile.integrations.hf.collate import HFPackingCollator, hf_lengths

__all__ = ["BalancedTrainer", "balanced_sampler"]  # noqa: F822 (BalancedTrainer is made on first access)


def balanced_sampler(
    lengths: LengthStats,
    *,
    rank: int,
    world_size: int,
    samples_per_pack: float = DEFAULT_SAMPLES_PER_PACK,
    shape: PackShape | None = None,
    oversized: str = "error",
    seed: int = 0,
) -> BalancedBatchSampler:
    """The batch sampler of data-parallel ``rank``: our balanced packing of ``lengths``, recomputed each epoch."""

    def packer(s: int) -> Packing:
        return balance_pack(lengths, dp=world_size, samples_per_pack=samples_per_pack, capacity=shape, seed=s,
                            oversized=oversized)

    # What the packs depend on, so a saved sampler state is refused by a sampler that would differ.
    settings = {"lengths_digest": lengths.digest, "method": "ours", "samples_per_pack": samples_per_pack,
                "oversized": oversized, "shape": None if shape is None else [shape.tiles, shape.tokens]}
    return BalancedBatchSampler(packer, num_samples=len(lengths), rank=rank, world_size=world_size, seed=seed,
                                settings=settings)


def _trainer_class() -> type:
    try:
        import transformers
        from torch.utils.data import DataLoader, Dataset
    except ImportError:
        raise MissingBackendError("BalancedTrainer needs transformers and accelerate: "
                                  "pip install 'omnibal-compile[hf]'") from None

    class BalancedTrainer(transformers.Trainer):
        """A ``transformers.Trainer`` that trains on balanced packs, one pack per rank per step.

        Takes the Trainer's arguments plus ``lengths`` (per-sample lengths of ``train_dataset``,
        a :class:`LengthStats` or anything ``load_lengths`` reads; default: measured from the
        dataset with the collator), ``samples_per_pack``, ``shape`` (a fixed pack shape, or None
        for the largest pack) and ``oversized`` (``error``, ``truncate``, ``own-pack``).
        ``per_device_train_batch_size`` is not used: a batch is one pack.
        """

        def __init__(self, *args: Any, lengths: Any = None, samples_per_pack: float = DEFAULT_SAMPLES_PER_PACK,
                     shape: PackShape | None = None, oversized: str = "error", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.train_dataset is None:
                raise InputError("BalancedTrainer needs train_dataset= (the samples the packs index)")
            # The packs are lists of sample indices: train_dataset is a map-style dataset with a length, as documented
            dataset = cast(Sequence[Mapping[str, Any]], self.train_dataset)
            if lengths is None:
                if not isinstance(self.data_collator, HFPackingCollator):
                    raise InputError(
                        "give BalancedTrainer lengths=, or data_collator=HFPackingCollator.for_model(model) "
                        "to measure them from the dataset"
                    )
                lengths = hf_lengths(dataset, self.data_collator, source="train_dataset")
            self.lengths = lengths if isinstance(lengths, LengthStats) else load_lengths(lengths)
            if len(self.lengths) != len(dataset):
                raise InputError(
                    f"lengths has {len(self.lengths)} samples but train_dataset {len(dataset)}; "
                    "give one (tiles, tokens) per sample of the dataset, in its order"
                )
            self.samples_per_pack, self.shape, self.oversized = samples_per_pack, shape, oversized

        def balanced_sampler(self) -> BalancedBatchSampler:
            """This rank's sampler (``args.process_index`` of ``args.world_size``)."""
            return balanced_sampler(self.lengths, rank=self.args.process_index, world_size=self.args.world_size,
                                    samples_per_pack=self.samples_per_pack, shape=self.shape,
                                    oversized=self.oversized, seed=self.args.seed)

        def get_train_dataloader(self) -> DataLoader:
            sampler = self.balanced_sampler()
            dataset = cast(Dataset, self.train_dataset)  # __init__ refuses None
            loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=self.data_collator,
                                num_workers=self.args.dataloader_num_workers,
                                pin_memory=self.args.dataloader_pin_memory,
                                persistent_workers=self.args.dataloader_persistent_workers and
                                self.args.dataloader_num_workers > 0)
            loader = self.accelerator.prepare(loader)
            # The sampler already yields this rank's packs; the shard wrapper accelerate adds under DDP
            # would keep only every world_size-th of them. Make it a passthrough, as the Trainer does for
            # its own rank-aware sampler.
            shard = getattr(loader, "batch_sampler", None)
            if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
                shard.num_processes, shard.process_index = 1, 0
            if len(loader) != len(sampler):
                raise InputError(
                    f"the prepared loader has {len(loader)} batches for the sampler's {len(sampler)} packs; "
                    "this accelerate version shards batch samplers differently"
                )
            return loader

    return BalancedTrainer


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    global _CLASS
    if name == "BalancedTrainer":
        if _CLASS is None:
            _CLASS = _trainer_class()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
