"""Pack a group of samples into one row of a Hugging Face model's own inputs, without cross-talk.

A packed row holds several samples one after the other. Every sample must see only itself, as
if it ran alone; how the model is told depends on its attention implementation:

    sdpa, eager   a 4-D additive ``attention_mask`` of shape (1, 1, L, L) in the model's dtype:
                  0 where a query may attend a key (same sample, not in the future), the dtype's
                  minimum elsewhere. A float mask, because ``eager`` adds the mask to the scores
                  (a boolean mask would add 0 and 1 there); ``sdpa`` accepts the same mask.
                  Hugging Face models pass a 4-D mask through unchanged.
    flash         no mask: ``position_ids`` restarting at 0 per sample, from which transformers'
                  flash path derives the variable-length boundaries ``cu_seqlens`` (int32
                  ``[0, t_0, t_0 + t_1, ..., L]``) of a one-row batch. Text-only models also get
                  them precomputed, as ``transformers.DataCollatorWithFlattening`` emits them:
                  ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k`` (the
                  longest segment). Vision models do not: their forward hands these kwargs to the
                  vision tower too, whose attention would then split image tokens at text
                  boundaries; positions reach only the language model.

Glossary:
    sample        a dict with ``input_ids`` (1-D, or (1, T)), optional ``labels`` (same length;
                  default: ``input_ids`` with image tokens ignored) and the family's image
                  tensors: ``pixel_values`` with one row per image (Llava-like families), or
                  ``pixel_values`` patches plus ``image_grid_thw`` (Qwen2-VL-like families).
    placeholders  image token ids in ``input_ids`` that the model replaces with image features.
                  A sample may carry them expanded (as the family's processor emits them) or
                  one per image; the collator then expands each as the processor would.
    segment       one sample's span of the row; a padding tail (``row_tokens``) is a segment of
                  its own that attends only within itself.
    labels        IGNORE_INDEX at each sample's first token (the model would otherwise learn to
                  predict it from the previous sample's last token), on placeholders and padding.
    position_ids  restart at 0 for every sample; Qwen2-VL-like families get their 3-D rotary
                  positions per sample (temporal, height, width over each image's grid) with the
                  text positions as a first row, shape (4, 1, L), the layout the model reads for
                  packed rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.errors import InputError

__all__ = [
    "HFPackingCollator",
    "MASK_ATTENTION",
    "VARLEN_ATTENTION",
    "hf_lengths",
    "mrope_positions",
    "segment_allows",
    "segment_mask",
    "block_ids",
    "sample_tokens",
]

MASK_ATTENTION: tuple[str, ...] = ("sdpa", "eager")
"""Attention implementations that get a 4-D additive block-causal mask."""
VARLEN_ATTENTION: tuple[str, ...] = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
"""Attention implementations that get flash-attention's variable-length kwargs (also any name with 'flash')."""


def is_varlen(attn_implementation: str) -> bool:
    return attn_implementation in VARLEN_ATTENTION or "flash" in attn_implementation


@dataclass(frozen=True, kw_only=True)
class _Sample:
    ids: torch.Tensor
    labels: torch.Tensor
    images: dict[str, torch.Tensor]
    grids: torch.Tensor | None
    """(n_images, 3) grids of a grid family, else None."""


@dataclass(frozen=True, kw_only=True)
class HFPackingCollator:
    """``collate_fn`` turning one pack (a list of samples) into one row of a Hugging Face model's inputs.

    Build it with :meth:`for_model` (reads the family's facts from ``model.config``) or give the
    facts yourself. The batch it returns goes to the model as ``model(**batch)``.
    """

    attn_implementation: str = "sdpa"
    """The model's ``config._attn_implementation``: ``sdpa``/``eager`` (4-D mask) or a flash one (variable-length
    kwargs)."""
    image_token_id: int | None = None
    """Id of the image placeholder token; None for a text-only model."""
    tokens_per_image: int | None = None
    """Placeholders per ``pixel_values`` row (Llava: patches, plus CLS under the ``full`` strategy)."""
    spatial_merge_size: int | None = None
    """Grid families (Qwen2-VL): an image of grid (t, h, w) has t*h*w / merge^2 placeholders and 3-D positions."""
    mask_dtype: torch.dtype = torch.float32
    """Dtype of the 4-D mask: the model's compute dtype (its minimum marks a forbidden pair)."""
    row_tokens: int | None = None
    """Pad every row to this many tokens (a fixed shape); None: the row is exactly the pack's tokens."""
    pad_token_id: int = 0
    """Id of padding tokens."""

    def __post_init__(self) -> None:
        if self.attn_implementation not in MASK_ATTENTION and not is_varlen(self.attn_implementation):
            raise InputError(
                f"packing supports attn_implementation {list(MASK_ATTENTION + VARLEN_ATTENTION)}, got "
                f"{self.attn_implementation!r}; build the model with one of them"
            )
        if self.image_token_id is not None and (self.tokens_per_image is None) == (self.spatial_merge_size is None):
            raise InputError("an image model needs exactly one of tokens_per_image (Llava-like) or spatial_merge_size "
                             "(Qwen2-VL-like)")
        if self.mask_dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise InputError(f"mask_dtype must be the model's floating dtype, got {self.mask_dtype}")

    @classmethod
    def for_model(cls, model: Any, **overrides: Any) -> HFPackingCollator:
        """The collator for a Hugging Face model (or its config): attention implementation, dtype and image facts."""
        config = getattr(model, "config", model)
        facts: dict[str, Any] = {
            "attn_implementation": getattr(config, "_attn_implementation", None) or "sdpa",
            "mask_dtype": getattr(model, "dtype", None) if isinstance(getattr(model, "dtype", None), torch.dtype)
            else torch.float32,
        }
        facts.update(_image_facts(config))
        pad = getattr(getattr(config, "text_config", config), "pad_token_id", None)
        if pad is not None:
            facts["pad_token_id"] = int(pad)
        facts.update(overrides)
        return cls(**facts)

    @property
    def varlen(self) -> bool:
        """Whether rows carry flash-attention's variable-length kwargs instead of a mask."""
        return is_varlen(self.attn_implementation)

    def sample_lengths(self, sample: Mapping[str, Any]) -> tuple[int, int]:
        """(images, tokens) of a sample as packed: tokens counted after placeholder expansion.

        Images are ``pixel_values`` rows (Llava-like: tiles) or grids (Qwen2-VL-like).
        """
        s = self._parse(0, sample)
        n = s.grids.shape[0] if s.grids is not None else (s.images["pixel_values"].shape[0] if s.images else 0)
        return int(n), int(s.ids.numel())

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise InputError("the collator got an empty pack; the sampler never yields one")
        parts = [self._parse(i, s) for i, s in enumerate(samples)]
        tokens = sum(p.ids.numel() for p in parts)
        row = tokens if self.row_tokens is None else self.row_tokens
        if row < tokens:
            raise InputError(f"pack of {len(parts)} samples has {tokens} tokens, over row_tokens={row}; "
                             "pack with a shape that fits the row, or raise row_tokens")
        lengths = [p.ids.numel() for p in parts] + ([row - tokens] if row > tokens else [])
        ids = [p.ids for p in parts]
        labels = []
        for p in parts:
            lab = p.labels.clone()
            lab[0] = IGNORE_INDEX
            labels.append(lab)
        if row > tokens:
            ids.append(torch.full((row - tokens,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((row - tokens,), IGNORE_INDEX, dtype=torch.long))
        text_pos = torch.cat([torch.arange(n) for n in lengths])
        batch: dict[str, Any] = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None]}
        if self.spatial_merge_size is not None:
            rope = [self._rope_positions(p) for p in parts]
            if row > tokens:
                rope.append(torch.arange(row - tokens).expand(3, -1))
            batch["position_ids"] = torch.cat([text_pos[None], torch.cat(rope, dim=1)])[:, None]  # (4, 1, L)
            batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).int()  # as the processor emits
        else:
            batch["position_ids"] = text_pos[None]
        if self.varlen and self.image_token_id is None:
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        elif not self.varlen:
            batch["attention_mask"] = block_causal_mask(lengths, dtype=self.mask_dtype)
        for key in parts[0].images:  # a pack without images has no image keys, as the processor's output
            present = [p.images[key] for p in parts if p.images[key].shape[0]]
            if present:
                batch[key] = torch.cat(present)
        return batch

    def _parse(self, i: int, s: Mapping[str, Any]) -> _Sample:
        ids, labels = sample_tokens(i, s)
        if self.image_token_id is None:
            if s.get("pixel_values") is not None:
                raise InputError(f"sample {i} has pixel_values but the collator is for a text-only model; build it "
                                 "with HFPackingCollator.for_model(model) for the vision model")
            return _Sample(ids=ids, labels=ids.clone() if labels is None else labels, images={}, grids=None)
        images, per_image = self._images(i, s)
        ids, labels = self._expand(i, ids, labels, per_image)
        if labels is None:
            labels = torch.where(ids == self.image_token_id, IGNORE_INDEX, ids)
        return _Sample(ids=ids, labels=labels, images=images, grids=images.get("image_grid_thw"))

    def _images(self, i: int, s: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The sample's image tensors and the placeholder count of each image."""
        pix = s.get("pixel_values")
        if self.spatial_merge_size is not None:
            grid = s.get("image_grid_thw")
            if pix is None or grid is None:
                if pix is not None or grid is not None:
                    raise InputError(f"sample {i}: give pixel_values and image_grid_thw together")
                return {"pixel_values": torch.zeros(0), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}, []
            pix, grid = torch.as_tensor(pix), torch.as_tensor(grid).long().reshape(-1, 3)
            patches = int(grid.prod(-1).sum())
            if pix.shape[0] != patches:
                raise InputError(f"sample {i}: pixel_values has {pix.shape[0]} patch rows but image_grid_thw "
                                 f"{grid.tolist()} makes {patches}")
            m2 = self.spatial_merge_size ** 2
            return {"pixel_values": pix, "image_grid_thw": grid}, [int(g) // m2 for g in grid.prod(-1)]
        if pix is None:
            return {"pixel_values": torch.zeros(0)}, []
        pix = torch.as_tensor(pix)
        if pix.dim() == 3:  # a single image without its batch dimension
            pix = pix[None]
        return {"pixel_values": pix}, [int(self.tokens_per_image)] * pix.shape[0]  # type: ignore[arg-type]

    def _expand(self, i: int, ids: torch.Tensor, labels: torch.Tensor | None, per_image: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Check the placeholders, expanding one-per-image placeholders as the family's processor does."""
        is_img = ids.eq(cast(int, self.image_token_id))  # called for an image model only (image_token_id set)
        n = int(is_img.sum())
        if n == sum(per_image):
            return ids, labels
        if n != len(per_image):
            raise InputError(
                f"sample {i}: input_ids hold {n} image tokens (id {self.image_token_id}) for {len(per_image)} images; "
                f"expected {sum(per_image)} (expanded, {per_image} per image) or {len(per_image)} (one per image)"
            )
        repeats = torch.ones_like(ids)
        repeats[is_img] = torch.tensor(per_image, dtype=torch.long)
        ids = torch.repeat_interleave(ids, repeats)
        if labels is not None:
            labels = torch.where(is_img, IGNORE_INDEX, labels)
            labels = torch.repeat_interleave(labels, repeats)
        return ids, labels

    def _rope_positions(self, s: _Sample) -> torch.Tensor:
        assert s.grids is not None and self.spatial_merge_size is not None and self.image_token_id is not None
        return mrope_positions(s.ids, s.grids, image_token_id=self.image_token_id, merge=self.spatial_merge_size)


def mrope_positions(ids: torch.Tensor, grids: torch.Tensor, *, image_token_id: int, merge: int) -> torch.Tensor:
    """Qwen2-VL's 3-D rotary positions (3, T) of one sample run alone: text advances all three by one, an image
    (the next row of ``grids``, (t, h, w) patches) spans its merged grid from the current position and then
    advances it by max(h, w) / merge."""
    out = torch.zeros(3, ids.numel(), dtype=torch.long)
    is_img = (ids == image_token_id).tolist()
    rows = iter(grids.tolist())
    j, cur = 0, 0
    while j < len(is_img):
        if not is_img[j]:
            out[:, j] = cur
            j, cur = j + 1, cur + 1
            continue
        t, h, w = next(rows)
        h, w = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        span = t * h * w
        out[:, j:j + span] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        j, cur = j + span, cur + max(h, w)
    return out


def block_causal_mask(lengths: Sequence[int], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, 1, L, L) additive mask: 0 where query and key are in the same segment and the key is not later, else min."""
    return segment_mask(
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))[None], dtype=dtype
    )


def segment_allows(segment_ids: torch.Tensor, b: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, *,
                   blocks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Whether query ``q`` of row ``b`` may attend key ``kv``: the one rule of a pack's attention, read by the 4-D
    mask (:func:`segment_mask`, on index grids) and by flex attention's ``mask_mod``
    (:mod:`~omnibal_compile.integrations.hf.flex`, on scalar indices).

    Query and key share a segment of the (B, L) ``segment_ids`` and the key is not later; ``blocks``: (B, L) ids of
    bidirectional blocks (image tokens, a prefix), -1 outside any: within a segment, a query also sees every key of
    its own block, later ones included (Gemma 3's images, PaliGemma's prefix). ``window``: a sliding window, keys
    closer than ``window`` positions only.
    """
    def at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:  # t[b, i]; the ATen op, not flex's traced getitem
        return torch.ops.aten.index.Tensor(t, [b, i])  # (which does not trace under torch.export for Llava)

    near = kv <= q
    if blocks is not None:
        near = near | ((at(blocks, q) == at(blocks, kv)) & (at(blocks, q) >= 0))
    if window is not None:
        near = near & (kv > q - window)
    return (at(segment_ids, q) == at(segment_ids, kv)) & near


def segment_mask(segment_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32, blocks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
    """(B, 1, L, L) additive mask of (B, L) segment ids: 0 where :func:`segment_allows` lets the query attend the
    key (same segment, not later, the bidirectional ``blocks`` and the sliding ``window``), the dtype's minimum
    elsewhere (what ``sdpa`` and ``eager`` need: see the module doc)."""
    n, device = segment_ids.shape[-1], segment_ids.device
    b = torch.arange(segment_ids.shape[0], device=device)[:, None, None]
    q, kv = torch.arange(n, device=device)[None, :, None], torch.arange(n, device=device)[None, None, :]
    allowed = segment_allows(segment_ids, b, q, kv, blocks=blocks, window=window)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def sample_tokens(i: int, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample ``i``'s ``input_ids`` and ``labels`` (None when it has none) as 1-D long tensors; InputErrors name it
    when the ids are missing or empty or the labels are of another length."""
    if "input_ids" not in s:
        raise InputError(f"sample {i} of the pack has no 'input_ids'")
    ids = torch.as_tensor(s["input_ids"]).long().reshape(-1)
    if ids.numel() < 1:
        raise InputError(f"sample {i}: input_ids is empty")
    labels = s.get("labels")
    labels = None if labels is None else torch.as_tensor(labels).long().reshape(-1)
    if labels is not None and labels.numel() != ids.numel():
        raise InputError(f"sample {i}: labels has {labels.numel()} entries but input_ids {ids.numel()}")
    return ids, labels


def block_ids(segment_ids: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """(B, L) ids of the contiguous runs of ``inside`` tokens that do not cross a segment boundary, -1 elsewhere."""
    prev_inside = torch.roll(inside, 1, dims=-1)
    prev_segment = torch.roll(segment_ids, 1, dims=-1)
    starts = inside & (~prev_inside | (prev_segment != segment_ids))
    starts[..., 0] = inside[..., 0]
    return torch.where(inside, torch.cumsum(starts.long(), dim=-1) - 1, -1)


def _image_facts(config: Any) -> dict[str, Any]:
    """Image placeholder facts of a Hugging Face config, read the way the family's processor counts them."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return {}
    model_type = getattr(config, "model_type", "")
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise InputError(f"{model_type} config has a vision_config but no image_token_id; pass image_token_id=")
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        return {"image_token_id": int(token), "spatial_merge_size": int(vision.spatial_merge_size)}
    if model_type == "llava":
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        full = getattr(config, "vision_feature_select_strategy", "default") == "full"
        return {"image_token_id": int(token), "tokens_per_image": patches + (1 if full else 0)}
    raise InputError(
        f"packing does not know how {model_type!r} expands image placeholders; pass image_token_id= and "
        "tokens_per_image= (placeholders per pixel_values row) or spatial_merge_size= (grid families)"
    )


def hf_lengths(
    dataset: Sequence[Mapping[str, Any]], collator: HFPackingCollator, *, source: str = "dataset"
) -> LengthStats:
    """Per-sample (images, tokens) of a dataset as the collator packs them, for the balancer."""
    tiles, tokens = [], []
    for k in range(len(dataset)):
        v, t = collator.sample_lengths(dataset[k])
        tiles.append(v)
        tokens.append(t)
    return LengthStats.from_arrays(tiles, tokens, source=source)
