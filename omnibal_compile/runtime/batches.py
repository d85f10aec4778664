"""Where a run's batches come from: the model spec, built-in random batches, a user's function, balanced packs of
length statistics."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from omnibal_compile.errors import InputError
from omnibal_compile.models.load import TINY_VLM
from omnibal_compile.runtime.settings import RunConfig, read_plan, with_plan_layout

BatchSource = Callable[[int], Any]


def _import(spec: str, what: str) -> Any:
    from omnibal_compile.models.load import import_from_spec

    return import_from_spec(spec, what)


def _load(config: RunConfig) -> Any:
    from omnibal_compile.models.load import load_model

    return load_model(config.model, config=config.model_config, seed=config.seed, batch=config.batch_size,
                      tiles=config.tiles_per_sample, text=config.text_tokens)


def build_model(config: RunConfig) -> nn.Module:
    """The model, seeded with ``config.seed`` so every rank builds the same weights; with ``config.lora`` its LoRA
    adapters injected and every other parameter frozen (:func:`~omnibal_compile.models.lora.apply_lora`); then its
    ``config.freeze`` parameters frozen (``requires_grad=False``; a pattern matching nothing is an InputError)."""
    from omnibal_compile.models.freeze import freeze_parameters

    model = _load(config).model
    if config.lora is not None:
        from omnibal_compile.models.lora import apply_lora

        model = apply_lora(model, config.lora, seed=config.seed)
    freeze_parameters(model, config.freeze)
    return model


BATCHINGS: tuple[str, ...] = ("balanced", "random")
"""How rows are made from length statistics (``RunConfig.batching``)."""


def batch_source(config: RunConfig, model: nn.Module, dp_rank: int | None = None) -> BatchSource:
    """``step -> batch``: data-parallel rank ``dp_rank``'s rows, or the whole step's (see the module glossary)."""
    config = with_plan_layout(config)
    dp = cast(int, config.dp)  # with_plan_layout fills in dp
    given = [flag for flag, on in (("--batches", config.batches is not None), ("--lengths", bool(config.lengths)),
                                   ("--dataset", config.dataset is not None)) if on]
    if len(given) > 1:
        raise InputError(f"give one source of batches, not {' and '.join(given)}")
    if config.batching not in BATCHINGS:
        raise InputError(f"batching (--batching) must be one of {list(BATCHINGS)}, got {config.batching!r}")
    if dp_rank is not None and not 0 <= dp_rank < dp:
        raise InputError(f"dp rank {dp_rank} is out of range for dp={dp}")
    if config.lengths or config.dataset:
        return packed_source(config, model, dp_rank)
    whole: BatchSource
    if config.batches is not None:
        fn = _import(config.batches, "batch function (--batches)")

        def whole(step: int) -> Any:
            return fn(step, batch_size=config.batch_size, seed=config.seed)
    elif config.model in TINY_VLM:
        from omnibal_compile.models import TinyVLM, make_example_batch

        cfg = cast(TinyVLM, model).config  # build_model makes a TinyVLM for these specs

        def whole(step: int) -> Any:
            return make_example_batch(
                cfg,
                batch=config.batch_size,
                tiles_per_sample=config.tiles_per_sample,
                text_tokens=config.text_tokens,
                seed=config.seed + 1 + step,
            )
    elif config.model.startswith("hf:"):
        from omnibal_compile.models.load import hf_example_batch

        def whole(step: int) -> Any:
            return hf_example_batch(model, batch=config.batch_size, text=config.text_tokens,
                                    seed=config.seed + 1 + step)
    else:
        example = _load(config).example_batch
        if example is None:
            raise InputError(
                f"model {config.model!r} needs data: set data='package.module:fn' (--data), lengths (--lengths), "
                "or return (model, example_batch) from the factory"
            )

        def whole(step: int) -> Any:
            return example
    if dp_rank is None or dp == 1:
        return whole
    return lambda step: _dp_part(whole(step), dp, dp_rank)


class _Steps(torch.utils.data.Dataset):
    """Steps ``first..last-1`` of a batch source, as a dataset a ``DataLoader`` reads in its workers."""

    def __init__(self, source: BatchSource, first: int, last: int) -> None:
        self.source, self.first, self.last = source, first, last

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, k: int) -> Any:
        return self.source(self.first + k)


def step_batches(source: BatchSource, first: int, last: int, *, workers: int = 0) -> Iterator[Any]:
    """The batches of steps ``first..last-1`` in order: made here (``workers=0``), or by a ``DataLoader``'s
    ``workers`` processes two steps ahead each, so a step does not wait on reading and processing images.

    The batches are the same either way: a source is a function of the step alone.
    """
    if workers == 0:
        return (source(step) for step in range(first, last))
    loader = torch.utils.data.DataLoader(_Steps(source, first, last), batch_size=None, shuffle=False,
                                         num_workers=workers, prefetch_factor=2)
    return iter(loader)


def _dp_part(batch: Any, dp: int, dp_rank: int) -> Any:
    """Data-parallel rank ``dp_rank``'s slice of a whole-step batch: the dp_rank-th of ``dp`` equal parts (dim 0)."""
    from torch.utils import _pytree as pytree

    from omnibal_compile.compile.capture import split_batch

    leaves, spec = pytree.tree_flatten(batch)
    return pytree.tree_unflatten(list(split_batch(leaves, dp)[dp_rank]), spec)


def packed_source(config: RunConfig, model: nn.Module, dp_rank: int | None = None) -> BatchSource:
    """Steps of packs from the data balancer, ``batch_size / dp`` per data-parallel rank, one per row.

    Data-parallel rank r draws from its own sampler (``rank=r, world_size=dp``): its row i of step k
    is pack ``j = k * rows + i`` of its sequence, pack ``j % P`` of epoch ``j // P`` (P steps per
    epoch), so each sample is used once per epoch and the dp packs of one (k, i) are one step of
    the packing, of near-equal cost. Deterministic in (seed, step): every rank builds the same
    batches. ``source.packs(step, r)`` gives rank r's sample ids; ``dp_rank=None``: every rank's rows.
    """
    from torch.utils import _pytree as pytree

    from omnibal_compile.data.data_plan import DataOptions, plan_data
    from omnibal_compile.integrations.hf.inputs import stacked_positions
    from omnibal_compile.models.load import hf_data_facts

    config = with_plan_layout(config)  # a direct caller may leave dp open (None), as RunConfig does by default
    dp = cast(int, config.dp)  # with_plan_layout fills in dp
    rows_per_rank = config.batch_size // dp
    if stacked_positions(model) and Path(config.plan).is_file():
        micro = cast(int, read_plan(config).num_microbatches)  # Plan.__post_init__ fills it in
        if micro != rows_per_rank:
            raise InputError(
                f"{type(model).__name__} packs carry position_ids of shape (4, 1, L) per row, which split into "
                f"micro-batches of one row only: set batch_size (--batch-size) to dp x micro-batches "
                f"({dp * micro}), got {config.batch_size}"
            )
    method = "ours" if config.batching == "balanced" else "random"
    facts = hf_data_facts(model)
    dataset = open_dataset(config, facts) if config.dataset else None
    options = DataOptions(dp=dp, samples_per_pack=config.samples_per_pack, seed=config.seed, method=method, **facts)
    if dataset is not None:  # measured by the model's own processor: in its units, nothing to rescale
        options = dataclasses.replace(options, source_tokens_per_tile=None)
    data = plan_data(dataset.lengths(progress=False) if dataset else list(config.lengths), options, model=model)
    if dataset is None:
        data.check_synthetic()  # every sample of the lengths can be made, named here rather than at its step
    if dataset is not None and dataset.skipped and os.environ.get("RANK", "0") == "0":  # said once, not per rank
        from omnibal_compile import progress

        shown = "; ".join(reason for _, reason in dataset.skipped[:5])
        progress.info(f"{config.dataset}: {len(dataset.skipped)} of {len(dataset.records)} records left out "
                      f"(--skip-bad-records): {shown}" + (" ..." if len(dataset.skipped) > 5 else ""))
    samplers = [data.sampler(r) for r in range(dp)]
    per_epoch = len(samplers[0])
    rows = config.batch_size // dp
    _check_epoch_fills_a_step(config, len(data.stats), per_epoch, rows, dp)
    epochs: dict[tuple[int, int], list[list[int]]] = {}

    def pack(r: int, j: int) -> list[int]:
        epoch = j // per_epoch
        if (r, epoch) not in epochs:
            samplers[r].set_epoch(epoch)
            epochs[r, epoch] = list(samplers[r])
        return epochs[r, epoch][j % per_epoch]

    def packs(step: int, r: int) -> list[list[int]]:
        return [pack(r, step * rows + i) for i in range(rows)]

    def source(step: int) -> dict[str, Any]:
        out = []
        for r in range(dp) if dp_rank is None else (dp_rank,):
            for i, ids in enumerate(packs(step, r)):
                j = step * rows + i
                if dataset is not None:
                    row = data.real_batch([dataset[i] for i in ids], where=f"{config.dataset} records {ids}")
                else:
                    g = torch.Generator().manual_seed(config.seed * 1_000_003 + j * dp + r)
                    row = data.synthetic_batch(ids, generator=g)
                out.append(model_inputs(model, row))
        return pytree.tree_map(lambda *rows: torch.cat(rows), *out)  # a mask per layer type is a dict

    source.data_plan = data  # type: ignore[attr-defined]  # for inspection: shape, metrics
    source.packs = packs  # type: ignore[attr-defined]
    kept = dataset.kept if dataset is not None else None
    # the step log's sample ids: dataset record indices (a record left out by --skip-bad-records has none)
    source.sample_ids = (  # type: ignore[attr-defined]
        packs if kept is None else lambda step, r: [[kept[i] for i in ids] for ids in packs(step, r)]
    )
    return source


def _check_epoch_fills_a_step(config: RunConfig, samples: int, per_epoch: int, rows: int, dp: int) -> None:
    """A step's packs are distinct samples: the dataset holds at least one step of packs (each rank's rows)."""
    lengths = config.dataset or ", ".join(config.lengths)
    if config.batching == "balanced" and config.samples_per_pack > samples:
        raise InputError(
            f"samples_per_pack (--samples-per-pack) {config.samples_per_pack:g} is more than the {samples} samples of "
            f"{lengths}: a pack cannot hold that many different samples; lower it (at most "
            f"{max(1, samples * dp // config.batch_size)} gives every row of a step its own samples)"
        )
    if per_epoch < rows:
        raise InputError(
            f"{lengths}: {samples} samples make {per_epoch} pack(s) per dp rank per epoch (samples_per_pack "
            f"{config.samples_per_pack:g}), fewer than the {rows} rows each rank trains per step (batch_size "
            f"{config.batch_size} / dp {dp}): every step would train the same samples several times; lower "
            "--samples-per-pack or --batch-size"
        )


def open_dataset(config: RunConfig, facts: Mapping[str, Any]) -> Any:
    """The run's :class:`~omnibal_compile.integrations.hf.dataset.ConversationDataset`, read by its processor
    (``--processor``, else the folder of an ``hf:`` model: DIR, or its config's folder), checked against the
    model's image token."""
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor
    from omnibal_compile.models.load import model_folder

    folder = config.processor
    if folder is None:
        found = model_folder(config.model)
        if found is None:
            raise InputError(f"dataset (--dataset) needs the processor that reads it: set processor (--processor DIR); "
                             f"model {config.model!r} has no folder to take it from")
        folder = str(found)
    dataset = ConversationDataset(config.dataset, load_processor(folder), image_root=config.image_root,  # type: ignore[arg-type]
                                  skip_bad=config.skip_bad_records)
    if dataset.image_token is not None and "image_token_id" in facts:
        got = int(dataset.tokenizer.convert_tokens_to_ids(dataset.image_token))
        if got != int(facts["image_token_id"]):
            raise InputError(f"processor {folder}: its image token {dataset.image_token!r} has id {got}, but the "
                             f"model's is {facts['image_token_id']}: use the processor saved with this model")
    return dataset


def model_inputs(
    model: nn.Module, row: dict[str, torch.Tensor]
) -> Mapping[str, torch.Tensor | dict[str, torch.Tensor]]:
    """A collated pack -> the inputs ``model`` takes: the one place where a model's packing layout is chosen.

    The packing collator (``data.collate``) lays a pack out for the reference VLM: ``pixel_values``
    (tiles), ``input_ids``, ``labels``, ``position_ids`` restarting per sample, ``segment_ids``. A
    Hugging Face model gets its family's own keys, with the pack's samples kept apart
    (:func:`omnibal_compile.integrations.hf.inputs.hf_pack_inputs`).
    """
    import inspect

    if "segment_ids" in inspect.signature(model.forward).parameters:  # the reference layout
        return row
    from omnibal_compile.integrations.hf.inputs import hf_pack_inputs

    return hf_pack_inputs(model, row)


