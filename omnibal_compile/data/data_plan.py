"""The data pass of ``optimize``: length statistics -> micro-batch shape, sampler and collator.

Glossary:
    model units   statistics are balanced in the model's own tiles and tokens (:func:`model_lengths`):
                  a file whose header says ``units: model`` is taken as is when its model_type and
                  image token are the model's (else an error); a file in InternVL units (a header
                  ``units: internvl``, or no header: ``source_tokens_per_tile``, 256 for the shared
                  statistics) is scaled (:func:`~omnibal_compile.data.lengths.scale_lengths`) to the
                  model's own tokens per tile, except that a file measured with InternVL's tiling
                  is refused for a Hugging Face model of another family, whose processor sees
                  other images and tokens, and for an InternVL model whose tiles are not the file's
                  ``tile_size``.
    DataPlan      what the pass decides: the fixed pack shape, the balance it reached, and
                  factories for the per-rank sampler and the collator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from omnibal_compile._utils.validate import check_int, check_int_list, check_number, check_seed
from omnibal_compile.config import DEFAULT_SAMPLES_PER_PACK
from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.collate import MODEL_KEYS, PackingCollator, synthetic_sample
from omnibal_compile.data.isf import isf_pack, isf_search
from omnibal_compile.data.lengths import INTERNVL_TOKENS_PER_TILE, LengthStats, load_lengths, scale_lengths
from omnibal_compile.data.metrics import BalanceMetrics, CostFn, balance_metrics
from omnibal_compile.data.packing import OVERSIZED_POLICIES, Packing, PackShape, packing_from_groups, refuse_unpackable
from omnibal_compile.data.sampler import BalancedBatchSampler, epoch_seed
from omnibal_compile.errors import InputError

__all__ = ["DataOptions", "DataPlan", "plan_data", "model_lengths", "INTERNVL_MODEL_TYPES"]

INTERNVL_MODEL_TYPES: tuple[str, ...] = ("internvl", "internvl_chat")
"""Hugging Face model_types that tile images as InternVL does (a file in InternVL units converts to them)."""


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How to balance the data (all optional; model facts default to ``model.config``)."""

    dp: int = 1
    """Data-parallel ranks per step."""
    samples_per_pack: float = DEFAULT_SAMPLES_PER_PACK
    """Target mean samples per pack (micro-batch)."""
    method: str = "ours"
    """``ours`` (balanced packing), ``isf`` (OmniBal's ISF with its parameter search) or ``random`` (the
    baseline: one random sample per pack, padded to the largest sample's shape; steps drop the
    ``len % dp`` samples left over)."""
    shape: PackShape | None = None
    """Fix the pack shape (Q_v, Q_t) in model units instead of deriving it."""
    row_tokens: int | None = None
    """With ``shape``: fix the collated row length too (an eval set in the training batches' row); None: derived."""
    source_tokens_per_tile: int | None = INTERNVL_TOKENS_PER_TILE
    """Tokens per tile the statistics were measured with; None if already in model units."""
    oversized: str = "error"
    """Samples over a fixed shape: ``error``, ``truncate`` or ``own-pack``."""
    seed: int = 0
    """Seed of packing and step order (mixed with the epoch)."""
    cost: CostFn | None = None
    """Pack cost ``(tiles, tokens, attention_pairs) -> cost`` deciding which packs share a step."""
    tokens_per_tile: int | None = None
    """Model's image tokens per tile (default: ``model.config.tokens_per_tile``)."""
    image_token_id: int | None = None
    """Model's image placeholder id (default: ``model.config.image_token_id``)."""
    model_type: str | None = None
    """Model's Hugging Face family, checked against a length file's header (default: ``model.config.model_type``)."""
    image_shape: tuple[int, int, int] | None = None
    """(channels, height, width) of a tile (default: from ``model.config``)."""
    vocab_size: int | None = None
    """For the synthetic example batch (default: ``model.config.vocab_size``)."""

    def __post_init__(self) -> None:
        if self.method not in ("ours", "isf", "random"):
            raise InputError(f"DataOptions.method must be 'ours', 'isf' or 'random', got {self.method!r}")
        if self.oversized not in OVERSIZED_POLICIES:
            raise InputError(f"DataOptions.oversized must be one of {list(OVERSIZED_POLICIES)}, got {self.oversized!r}")
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("dp", check_int(self.dp, "DataOptions.dp", min=1))
        put("samples_per_pack", check_number(self.samples_per_pack, "DataOptions.samples_per_pack", min=1))
        put("seed", check_seed(self.seed, "DataOptions.seed"))
        lows = {"row_tokens": 1, "source_tokens_per_tile": 1, "tokens_per_tile": 1, "image_token_id": 0,
                "vocab_size": 1}
        for name, low in lows.items():
            if getattr(self, name) is not None:
                put(name, check_int(getattr(self, name), f"DataOptions.{name}", min=low))
        if self.model_type is not None and (not isinstance(self.model_type, str) or not self.model_type):
            raise InputError(f"DataOptions.model_type must be a Hugging Face model_type such as 'llava', "
                             f"got {self.model_type!r}")
        if self.image_shape is not None:
            shape = check_int_list(self.image_shape, "DataOptions.image_shape", min=1)
            if len(shape) != 3:
                raise InputError(f"DataOptions.image_shape must be (channels, height, width), got {self.image_shape!r}")
            put("image_shape", shape)
        if self.shape is not None and not isinstance(self.shape, PackShape):
            raise InputError(f"DataOptions.shape must be a PackShape(tiles=..., tokens=...), got {self.shape!r}")
        if self.cost is not None and not callable(self.cost):
            raise InputError(
                f"DataOptions.cost must be a callable (tiles, tokens, attention_pairs) -> cost, got {self.cost!r}"
            )

    def describe(self) -> dict[str, Any]:
        """The options the packs depend on, as JSON data (what a sampler state is checked against)."""
        cost = None
        if self.cost is not None:
            named = getattr(self.cost, "__qualname__", type(self.cost).__qualname__)
            cost = repr(self.cost) if dataclasses.is_dataclass(self.cost) else named
        return {"method": self.method, "samples_per_pack": self.samples_per_pack, "oversized": self.oversized,
                "source_tokens_per_tile": self.source_tokens_per_tile, "cost": cost,
                "shape": None if self.shape is None else [self.shape.tiles, self.shape.tokens]}


@dataclass(frozen=True, kw_only=True)
class DataPlan:
    """The balanced micro-batch shape plus a configured sampler and collator."""

    stats: LengthStats = field(repr=False)
    """Statistics in model units (what was balanced)."""
    options: DataOptions = field(repr=False)
    """The options used."""
    shape: PackShape
    """Fixed pack shape (Q_v tiles, Q_t tokens), model units."""
    seq_len: int
    """Row length of a collated batch (Q_t plus room for dummy-tile placeholders)."""
    metrics: BalanceMetrics
    """Balance of epoch 0."""
    collator: PackingCollator = field(repr=False)
    """``collate_fn`` for the DataLoader."""
    packer: Callable[[int], Packing] = field(repr=False)
    """``seed -> Packing`` that the sampler runs once per epoch."""
    first_packing: Packing = field(repr=False)
    """The packing of epoch 0 (what ``metrics`` measured)."""
    real_collator: Callable[[Sequence[Mapping[str, Any]]], dict[str, torch.Tensor]] | None = field(
        default=None, repr=False)
    """Collates real samples to a row of the same shapes as ``collator``'s, for a family whose samples are not
    tiles (Qwen2-VL's patches and grids: ``integrations.hf.grid_pack``); None: ``collator`` takes them."""

    def sampler(self, rank: int = 0) -> BalancedBatchSampler:
        """The batch sampler of data-parallel ``rank``; its state names everything its sequence depends on."""
        settings = {"lengths_digest": self.stats.digest, **self.options.describe(),
                    "pack_shape": [self.shape.tiles, self.shape.tokens], "row_tokens": self.seq_len}
        return BalancedBatchSampler(self.packer, num_samples=len(self.stats), rank=rank, world_size=self.options.dp,
                                    seed=self.options.seed, settings=settings)

    def example_batch(self, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """One collated micro-batch of the planned shape (random content), for capture and profiling."""
        packing = self.first_packing
        return self.synthetic_batch(
            packing.pack(int(packing.steps[0, 0])), generator=torch.Generator().manual_seed(seed)
        )

    def check_synthetic(self) -> None:
        """Refuse, naming the file and the sample, statistics whose samples cannot be made as synthetic ones: each
        needs its tiles' image tokens plus at least one text token (in the model's units, after any conversion)."""
        tpt = self.collator.tokens_per_tile
        need = self.stats.tiles * tpt + 1
        bad = np.flatnonzero(self.stats.tokens < need)
        if bad.size:
            i = int(bad[0])
            dummy = int(self.stats.tiles[i] - self.stats.image_flags[i])
            why = (f"{dummy} of its tiles are dummy ones (image_flags), whose image tokens the file does not count"
                   if dummy else "the file's tokens are not in the units assumed")
            raise InputError(
                f"{self.stats.source}: sample {i} has {int(self.stats.tiles[i])} tiles and {int(self.stats.tokens[i])} "
                f"tokens, fewer than its {int(need[i]) - 1} image tokens plus one text token "
                f"({bad.size} of {len(self.stats)} samples are so): {why}; measure the lengths without dummy tiles "
                "in the model's own units, or train on the dataset itself (--dataset)"
            )

    def synthetic_batch(
        self, pack: Sequence[int] | np.ndarray, *, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """The samples of ``pack`` with their real lengths and random contents, collated to one fixed-shape row."""
        c = self.collator
        samples = [
            synthetic_sample(
                int(self.stats.tiles[i]),
                int(self.stats.tokens[i]),
                tokens_per_tile=c.tokens_per_tile,
                image_token_id=c.image_token_id,
                vocab_size=int(self.options.vocab_size or c.image_token_id + 1),
                image_shape=c.image_shape,
                generator=generator,
            )
            for i in pack
        ]
        batch = c(samples)
        return {k: batch[k] for k in MODEL_KEYS}

    def real_batch(self, samples: Sequence[Mapping[str, torch.Tensor]], *, where: str) -> dict[str, torch.Tensor]:
        """Real samples (``input_ids``, ``labels``, ``pixel_values``) of one pack collated to one fixed-shape row;
        ``where`` names them in errors."""
        try:
            batch = (self.real_collator or self.collator)(samples)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        return batch if self.real_collator is not None else {k: batch[k] for k in MODEL_KEYS}

    def summary(self) -> str:
        m = self.metrics
        return (
            f"data: {len(self.stats)} samples, {self.options.method} packs of ({self.shape.tiles} tiles, "
            f"{self.shape.tokens} tokens), row {self.seq_len}, {m.samples_per_pack:.2f} samples/pack, "
            f"{m.num_steps} steps x {self.options.dp} ranks; Pad {m.pad_ratio:.4f}, Dist vision {m.dist_vision:.4f} "
            f"language {m.dist_language:.4f}, oversized {m.oversized}"
        )


def _model_fact(options: DataOptions, model: Any, name: str) -> Any:
    value = getattr(options, name)
    if value is not None:
        return value
    cfg = getattr(model, "config", None)
    if name == "image_shape" and cfg is not None and all(hasattr(cfg, a) for a in ("channels", "image_size")):
        return (int(cfg.channels), int(cfg.image_size), int(cfg.image_size))
    if cfg is not None and hasattr(cfg, name):
        return getattr(cfg, name)
    raise InputError(f"the data pass needs the model's {name}; pass DataOptions({name}=...)")


def _model_type(options: DataOptions, model: Any) -> str | None:
    if options.model_type is not None:
        return options.model_type
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) and kind else None


def _tile_side(options: DataOptions, model: Any) -> int | None:
    """The model's tile side in pixels, None when neither the options nor its config say."""
    try:
        return int(tuple(_model_fact(options, model, "image_shape"))[-1])
    except InputError:
        return None


def model_lengths(lengths: Any, options: DataOptions | None = None, *, model: Any = None,
                  model_spec: str | None = None) -> LengthStats:
    """``lengths`` in the model's units (module glossary: model units); a file in another model's units, or in
    InternVL units for a Hugging Face model of another family, is an InputError naming the command that measures it
    for this model (``model_spec``: how the model is named there; default ``hf:DIR``)."""
    o = options or DataOptions()
    tpt = int(_model_fact(o, model, "tokens_per_tile"))
    image_token_id = int(_model_fact(o, model, "image_token_id"))
    kind = _model_type(o, model)
    stats = load_lengths(lengths)
    h = stats.header
    data = h.info.get("dataset") if h is not None else None
    out = stats.source if " + " not in stats.source else "FILE"
    measure = f"omnibal-compile lengths {data if isinstance(data, str) else 'DATA'} --model {model_spec or 'hf:DIR'} " \
              f"--out {out}"
    named = kind or (type(model).__name__ if model is not None else "the model given by DataOptions")
    if h is not None and h.units == "model":
        if h.model_type != kind or h.image_token_id != image_token_id:
            by = h.info.get("processor")
            raise InputError(
                f"{stats.source}: its lengths are in {h.describe()}{f', measured by processor {by}' if by else ''}, "
                f"but the model is {named} (image token {image_token_id}): another model's processor gives other "
                f"tokens; measure them for this model: {measure}"
            )
        return stats
    if h is not None and kind is not None and kind not in INTERNVL_MODEL_TYPES:
        raise InputError(
            f"{stats.source}: its lengths are in {h.describe()}, InternVL's tiling, which does not convert to what a "
            f"{kind} model's processor makes of the images; measure them with this model's processor: {measure}"
        )
    tile, side = h.info.get("tile_size") if h is not None else None, _tile_side(o, model)
    if h is not None and kind in INTERNVL_MODEL_TYPES and isinstance(tile, int) and side is not None and tile != side:
        raise InputError(
            f"{stats.source}: its lengths are in {h.describe()} of {tile}-pixel tiles, but the {kind} model's tiles "
            f"are {side} pixels, which tile its images otherwise; measure them again with --tile-size {side} (with "
            f"its processor's --max-tiles, and --image-marker-tokens 2 for <img> and </img>), or in the model's own "
            f"units: {measure}"
        )
    source = h.tokens_per_tile if h is not None else o.source_tokens_per_tile
    if source is not None and source != tpt:
        stats = scale_lengths(stats, tokens_per_tile=tpt, source_tokens_per_tile=source)
    return stats


def plan_data(lengths: Any, options: DataOptions | None = None, *, model: Any = None,
              model_spec: str | None = None) -> DataPlan:
    """Balance ``lengths`` (in the model's units, :func:`model_lengths`) for ``options.dp`` ranks; facts about the
    model come from ``options`` or ``model.config``; ``model_spec`` names the model in the command an error
    suggests."""
    o = options or DataOptions()
    tpt = int(_model_fact(o, model, "tokens_per_tile"))
    image_token_id = int(_model_fact(o, model, "image_token_id"))
    image_shape = tuple(int(x) for x in _model_fact(o, model, "image_shape"))
    if o.vocab_size is None and model is not None and hasattr(getattr(model, "config", None), "vocab_size"):
        o = replace(o, vocab_size=int(model.config.vocab_size))
    stats = model_lengths(lengths, o, model=model, model_spec=model_spec)
    first = epoch_seed(o.seed, 0)
    if o.method == "random":
        if o.shape is None:
            refuse_unpackable(stats)  # the shape is the largest sample
        if len(stats) < o.dp:
            raise InputError(f"{len(stats)} samples cannot fill {o.dp} data-parallel ranks; use fewer ranks")
        fixed = o.shape or PackShape(tiles=int(stats.tiles.max()), tokens=int(stats.tokens.max()))
        row = None  # the collator's always-sufficient row

        def packer(seed: int) -> Packing:
            used = len(stats) - len(stats) % o.dp
            order = np.random.default_rng(seed).permutation(len(stats))[:used]
            return packing_from_groups(order, np.ones(used, np.int64), dp=o.dp, capacity=None, layout="padded",
                                       oversized=np.zeros(0, np.int64), policy="error", method="random", seed=seed,
                                       in_order=True)
    elif o.method == "isf":
        # The reference's constants in InternVL units (start at 4096 = 16 tiles' tokens, margin 128
        # = half a tile, lengths binned to 256 = one tile), carried over to model units.
        margin = max(tpt // 2, 1)
        shape = o.shape
        if shape is None:
            shape = isf_search(stats, dp=o.dp, samples_per_pack=o.samples_per_pack, seed=first, start_tokens=16 * tpt,
                               token_margin=margin, length_bin=tpt, oversized=o.oversized).capacity
        fixed = shape

        def packer(seed: int) -> Packing:
            return isf_pack(stats, dp=o.dp, capacity=fixed, seed=seed, oversized=o.oversized,
                            token_thresh=fixed.tokens - margin)
        row = None  # ISF packs vary in tiles: keep the collator's always-sufficient row
    elif o.shape is not None and o.row_tokens is not None:  # both given (an eval set in the training row)
        fixed, row = o.shape, o.row_tokens
    else:
        draft = balance_pack(stats, dp=o.dp, samples_per_pack=o.samples_per_pack, seed=first, cost=o.cost,
                             capacity=o.shape, oversized=o.oversized)
        planned = o.shape or draft.capacity
        assert planned is not None
        fixed = planned
        # Our packs are near-full in tiles, so few dummy tiles need placeholders: size the row for
        # epoch 0's worst pack and hold every later epoch's packs to it.
        own = np.zeros(draft.num_packs, bool)
        if o.oversized == "own-pack":  # a lone oversized sample is collated to its own shape
            own = (np.diff(draft.offsets) == 1) & np.isin(draft.order[draft.offsets[:-1]], draft.oversized)
        # Truncation cuts samples to the shape, so size the row from clipped lengths.
        tiles = draft.pack_sums(np.minimum(stats.tiles, fixed.tiles))[~own]
        tokens = draft.pack_sums(np.minimum(stats.tokens, fixed.tokens))[~own]
        row = int(max(fixed.tokens, (tokens + (fixed.tiles - tiles) * tpt).max(initial=0)))

    if o.method == "ours":

        def packer(seed: int) -> Packing:
            return balance_pack(stats, dp=o.dp, samples_per_pack=o.samples_per_pack, capacity=fixed, seed=seed,
                                cost=o.cost, oversized=o.oversized, row_tokens=row, dummy_tile_tokens=tpt)

    packing = packer(first)
    metrics = balance_metrics(stats, packing, cost=o.cost)
    collator = PackingCollator(shape=fixed, tokens_per_tile=tpt, image_token_id=image_token_id, seq_len=row,
                               image_shape=image_shape, oversized=o.oversized)  # type: ignore[arg-type]
    return DataPlan(stats=stats, options=o, shape=fixed, seq_len=collator.row_len, metrics=metrics,
                    collator=collator, packer=packer, first_packing=packing)
