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

from omnibal_compile.config import DEFAULT_STEPS
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

    With ``config.epochs`` the run trains ``epochs x P`` packs per rank: the rows of the last step past them are
    empty rows (a pack whose labels are all -100: no loss, no gradient, no sample ids in the step log).
    """
    config = with_plan_layout(config)  # a direct caller may leave dp open (None), as RunConfig does by default
    data, dataset = _data_plan(config, model)
    samplers = [data.sampler(r) for r in range(cast(int, config.dp))]
    _check_epoch_fills_a_step(config, len(data.stats), len(samplers[0]), config.batch_size // cast(int, config.dp),
                              cast(int, config.dp))
    limit = config.epochs * len(samplers[0]) if config.epochs is not None else None
    return _pack_source(config, model, data, dataset, samplers, dp_rank, limit=limit)


def _data_plan(config: RunConfig, model: nn.Module, *, eval_of: Any = None) -> tuple[Any, Any]:
    """The balanced packing of the run's data (its ``DataPlan``) and its dataset (None with lengths); ``eval_of``:
    the training ``DataPlan`` whose pack shape and row length the packs of ``config.eval_data`` keep."""
    from omnibal_compile.data.data_plan import DataOptions, plan_data
    from omnibal_compile.integrations.hf.inputs import stacked_positions
    from omnibal_compile.models.load import hf_data_facts

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
    path = config.eval_data if eval_of is not None else config.dataset  # None: the training lengths files
    dataset = open_dataset(config, facts, path) if config.dataset else None
    options = DataOptions(dp=dp, samples_per_pack=config.samples_per_pack, seed=config.seed, method=method,
                          oversized=config.oversized, **facts)
    if dataset is not None:  # measured by the model's own processor: in its units, nothing to rescale
        options = dataclasses.replace(options, source_tokens_per_tile=None)
    if eval_of is not None:
        options = dataclasses.replace(options, shape=eval_of.shape, row_tokens=eval_of.seq_len)
    lengths = dataset.lengths(progress=False) if dataset else [config.eval_data] if eval_of else list(config.lengths)
    try:
        data = plan_data(lengths, options, model=model, model_spec=config.model)
    except InputError as e:
        if eval_of is None:
            raise
        raise InputError(f"eval_data (--eval-data) {config.eval_data}: {e} (eval packs keep the training packs' "
                         "shape and row: leave such samples out of the eval set)") from None
    if dataset is None:
        data.check_synthetic()  # every sample of the lengths can be made, named here rather than at its step
    elif stacked_positions(model):  # Qwen2-VL: real samples are patches and grids, not tiles
        from omnibal_compile.integrations.hf.grid_pack import GridPackCollator

        if config.oversized != "error":  # a cut image or a pack of its own would change the pipeline's shapes
            raise InputError(f"oversized (--oversized) {config.oversized!r}: {type(model).__name__} packs of a "
                             "dataset keep every image whole in one fixed shape; leave it at 'error' (the pack shape "
                             "is derived from the samples, so none is over it)")

        data = dataclasses.replace(data, real_collator=GridPackCollator.for_model(model, data.shape, data.seq_len))
    left = len(data.stats) % dp if method == "random" else 0
    if left and os.environ.get("RANK", "0") == "0":  # random rows: dp ranks take equal shares of each epoch
        from omnibal_compile import progress

        progress.info(f"note: {path or ', '.join(config.lengths)}: --batching random leaves {left} of its "
                      f"{len(data.stats)} samples out of each epoch (a multiple of --dp {dp} is used)")
    if dataset is not None and dataset.skipped and os.environ.get("RANK", "0") == "0":  # said once, not per rank
        from omnibal_compile import progress

        shown = "; ".join(reason for _, reason in dataset.skipped[:5])
        progress.info(f"{path}: {len(dataset.skipped)} of {len(dataset.records)} records left out "
                      f"(--skip-bad-records): {shown}" + (" ..." if len(dataset.skipped) > 5 else ""))
    return data, dataset


def _pack_source(config: RunConfig, model: nn.Module, data: Any, dataset: Any, samplers: list[Any],
                 dp_rank: int | None, *, limit: int | None) -> BatchSource:
    """``step -> batch`` of ``data``'s packs (see :func:`packed_source`); rows past pack ``limit`` of a rank's
    sequence are empty rows."""
    from torch.utils import _pytree as pytree

    from omnibal_compile._utils.labels import IGNORE_INDEX

    dp = cast(int, config.dp)
    per_epoch = len(samplers[0])
    rows = config.batch_size // dp
    epochs: dict[tuple[int, int], list[list[int]]] = {}

    def pack(r: int, j: int) -> list[int]:
        epoch = j // per_epoch
        if (r, epoch) not in epochs:
            samplers[r].set_epoch(epoch)
            epochs[r, epoch] = list(samplers[r])
        return epochs[r, epoch][j % per_epoch]

    def packs(step: int, r: int) -> list[list[int]]:
        return [pack(r, step * rows + i) for i in range(rows)]

    def trained(step: int, r: int) -> list[list[int]]:  # the sample ids each row trains on (none: an empty row)
        return [ids if limit is None or step * rows + i < limit else [] for i, ids in enumerate(packs(step, r))]

    def source(step: int) -> dict[str, Any]:
        out = []
        for r in range(dp) if dp_rank is None else (dp_rank,):
            for i, ids in enumerate(packs(step, r)):
                j = step * rows + i
                if dataset is not None:
                    row = data.real_batch([dataset[i] for i in ids], where=f"{dataset.path} records {ids}")
                else:
                    g = torch.Generator().manual_seed(config.seed * 1_000_003 + j * dp + r)
                    row = data.synthetic_batch(ids, generator=g)
                if limit is not None and j >= limit:  # past the last epoch: a row of the planned shape, no loss
                    row = {**row, "labels": torch.full_like(row["labels"], IGNORE_INDEX)}
                out.append(model_inputs(model, row))
        return pytree.tree_map(lambda *rows: torch.cat(rows), *out)  # a mask per layer type is a dict

    source.data_plan = data  # type: ignore[attr-defined]  # for inspection: shape, metrics
    source.packs = packs  # type: ignore[attr-defined]
    source.packs_per_epoch = per_epoch  # type: ignore[attr-defined]
    kept = dataset.kept if dataset is not None else None
    # the step log's sample ids: dataset record indices (a record left out by --skip-bad-records has none)
    source.sample_ids = (  # type: ignore[attr-defined]
        trained if kept is None else lambda step, r: [[kept[i] for i in ids] for ids in trained(step, r)]
    )
    return source


def run_steps(config: RunConfig, source: BatchSource) -> int:
    """The run's steps in all: ``steps``; with ``epochs``, as many as hold ``epochs`` x each rank's packs per epoch
    (the last one padded with empty rows); neither: ``DEFAULT_STEPS``."""
    if config.epochs is None:
        return config.steps if config.steps is not None else DEFAULT_STEPS
    per_epoch = getattr(source, "packs_per_epoch", None)
    if per_epoch is None:
        raise InputError("epochs (--epochs) counts passes over the data: give --dataset FILE or --lengths FILE, "
                         "or give --steps N instead")
    rows = config.batch_size // cast(int, with_plan_layout(config).dp)
    return -(-config.epochs * int(per_epoch) // rows)


def eval_source(config: RunConfig, model: nn.Module, train: BatchSource, dp_rank: int | None = None
                ) -> tuple[BatchSource, int]:
    """``config.eval_data``'s batches in the training plan's pack shape and row length, and how many steps hold it
    (every pack once over the dp ranks; the last step padded with empty rows)."""
    config = with_plan_layout(config)
    if config.eval_data is None:
        raise InputError("eval_data (--eval-data) is not set")
    if not (config.dataset or config.lengths):
        raise InputError("eval_data (--eval-data) is a held-out set in the training data's format: the run needs "
                         "--dataset FILE or --lengths FILE too (built-in and --batches data have no held-out set)")
    data, dataset = _data_plan(config, model, eval_of=train.data_plan)  # type: ignore[attr-defined]
    samplers = [data.sampler(r) for r in range(cast(int, config.dp))]
    per_epoch = len(samplers[0])
    rows = config.batch_size // cast(int, config.dp)
    source = _pack_source(config, model, data, dataset, samplers, dp_rank, limit=per_epoch)
    return source, -(-per_epoch // rows)


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


def open_dataset(config: RunConfig, facts: Mapping[str, Any], path: str | None = None) -> Any:
    """The run's :class:`~omnibal_compile.integrations.hf.dataset.ConversationDataset` (:func:`conversation_dataset`
    of ``path``, default ``--dataset``: its eval set is another file)."""
    dataset, _ = conversation_dataset(path or config.dataset, model=config.model,  # type: ignore[arg-type]
                                      processor=config.processor, image_root=config.image_root,
                                      skip_bad=config.skip_bad_records, facts=facts)
    return dataset


def conversation_dataset(data: str | os.PathLike[str], *, model: str, processor: str | None, image_root: str | None,
                         skip_bad: bool, facts: Mapping[str, Any]) -> tuple[Any, str]:
    """(``data`` as a :class:`~omnibal_compile.integrations.hf.dataset.ConversationDataset` read by its processor
    (``processor``, else the folder of an ``hf:`` model spec ``model``: DIR, or its config's folder), checked against
    the model's image token (``facts["image_token_id"]``, :func:`~omnibal_compile.models.load.hf_data_facts`); the
    processor's folder)."""
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, TileTokenProcessor, load_processor
    from omnibal_compile.models.load import model_folder

    folder = processor
    if folder is None:
        found = model_folder(model)
        if found is None:
            raise InputError(f"dataset {data} needs the processor that reads it: set processor (--processor DIR); "
                             f"model {model!r} has no folder to take it from")
        folder = str(found)
    dataset = ConversationDataset(data, load_processor(folder), image_root=image_root, skip_bad=skip_bad)
    if dataset.image_token is not None and "image_token_id" in facts:
        got = int(dataset.tokenizer.convert_tokens_to_ids(dataset.image_token))
        if got != int(facts["image_token_id"]):
            raise InputError(f"processor {folder}: its image token {dataset.image_token!r} has id {got}, but the "
                             f"model's is {facts['image_token_id']}: use the processor saved with this model")
    per_tile = dataset.processor.image_seq_length if isinstance(dataset.processor, TileTokenProcessor) else None
    if per_tile is not None and "tokens_per_tile" in facts and per_tile != int(facts["tokens_per_tile"]):
        raise InputError(f"processor {folder}: its image_seq_length is {per_tile} image tokens per tile, but the "
                         f"model's config says {facts['tokens_per_tile']} (image_seq_length): use the processor saved "
                         "with this model, or make the two agree")
    return dataset, folder


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


