"""Pack a group of samples into one fixed-shape row that the reference VLM consumes.

Layout of the row (length ``seq_len``), for samples s_0..s_{k-1} with tiles v_i and tokens t_i:

    [ s_0 tokens | s_1 tokens | ... | s_{k-1} tokens | dummy-tile placeholders | pad tokens ]
      segment 0    segment 1          segment k-1      ----- segment k (padding) ----------

Glossary:
    dummy tiles   zero images appended so the vision encoder always sees Q_v tiles; a model that
                  splices tile features into placeholder tokens (TinyVLM, InternVL) needs
                  ``tokens_per_tile`` placeholder slots for each, so they sit in the padding
                  segment with label -100 and attend only within it.
    seq_len       the row length: Q_t plus room for the dummy tiles' placeholders. The default
                  ``Q_t + Q_v * tokens_per_tile`` always suffices.
    position_ids  restart at 0 for every sample (and for the padding segment), so rotary
                  embeddings match the sample run alone.
    segment_ids   which sample each token belongs to; attention never crosses segments.
    cu_seqlens    int32 segment boundaries ``[0, t_0, t_0 + t_1, ..., seq_len]`` (flash-attention's
                  variable-length convention), padding segment included.
    labels        the sample's labels, except -100 at each sample's first token (in a row it would
                  be predicted from the previous sample) and on the padding segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.data.packing import PackShape
from omnibal_compile.errors import InputError

__all__ = ["PackingCollator", "MODEL_KEYS", "synthetic_sample"]

MODEL_KEYS: tuple[str, ...] = ("pixel_values", "input_ids", "labels", "position_ids", "segment_ids")
"""The keys of a collated batch that ``TinyVLM.forward`` takes (``cu_seqlens`` is extra)."""


@dataclass(frozen=True, kw_only=True)
class PackingCollator:
    """``collate_fn`` turning one pack (a list of samples) into a fixed-shape batch of one row."""

    shape: PackShape
    """Q_v tiles and Q_t tokens of a pack."""
    tokens_per_tile: int
    """Placeholder tokens each tile has in ``input_ids``."""
    image_token_id: int
    """Id of the image placeholder token."""
    image_shape: tuple[int, int, int]
    """(channels, height, width) of a tile, for dummy tiles."""
    seq_len: int | None = None
    """Row length; default ``Q_t + Q_v * tokens_per_tile`` (room for every dummy tile's placeholders)."""
    pad_token_id: int = 0
    """Id of padding tokens."""
    oversized: str = "error"
    """A sample over the shape: ``error``, ``truncate`` (cut to fit), ``own-pack`` (a lone sample may exceed it)."""

    @property
    def row_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.shape.tokens + self.shape.tiles * self.tokens_per_tile

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise InputError("the collator got an empty pack; the sampler never yields one")
        parts = [self._sample(i, s) for i, s in enumerate(samples)]
        q_v, row = self.shape.tiles, self.row_len
        tiles = sum(p[0].shape[0] for p in parts)
        tokens = sum(p[1].numel() for p in parts)
        over = tiles > q_v or tokens > self.shape.tokens
        if over and self.oversized == "own-pack" and len(parts) == 1:
            q_v, row = tiles, tokens  # a pack of its own: its own shape, no padding
        elif over:
            raise InputError(
                f"pack of {len(parts)} samples has {tiles} tiles and {tokens} tokens, over the shape "
                f"({self.shape.tiles} tiles, {self.shape.tokens} tokens); pack with the same shape as the collator"
            )
        n_dummy = q_v - tiles
        pad_len = row - tokens
        if pad_len < n_dummy * self.tokens_per_tile:
            raise InputError(
                f"seq_len {row} leaves {pad_len} tokens after the pack's {tokens}, too few for {n_dummy} dummy tiles x "
                f"{self.tokens_per_tile} placeholders; leave seq_len at its default"
            )
        c, h, w = self.image_shape
        pix = [p[0] for p in parts] + [torch.zeros(n_dummy, c, h, w)]
        pad_ids = torch.full((pad_len,), self.pad_token_id, dtype=torch.long)
        pad_ids[: n_dummy * self.tokens_per_tile] = self.image_token_id
        ids = [p[1] for p in parts] + [pad_ids]
        labels = []
        for _, _sid, lab in parts:
            lab = lab.clone()
            lab[0] = IGNORE_INDEX
            labels.append(lab)
        labels.append(torch.full((pad_len,), IGNORE_INDEX, dtype=torch.long))
        lengths = [p[1].numel() for p in parts] + ([pad_len] if pad_len else [])
        position_ids = torch.cat([torch.arange(n) for n in lengths])
        segment_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        return {
            "pixel_values": torch.cat(pix).float(),
            "input_ids": torch.cat(ids).unsqueeze(0),
            "labels": torch.cat(labels).unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "segment_ids": segment_ids.unsqueeze(0),
            "cu_seqlens": cu,
        }

    def _sample(self, i: int, s: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "input_ids" not in s:
            raise InputError(f"sample {i} of the pack has no 'input_ids'")
        ids = torch.as_tensor(s["input_ids"]).long().reshape(-1)
        c, h, w = self.image_shape
        pix = s.get("pixel_values")
        pix = torch.zeros(0, c, h, w) if pix is None else torch.as_tensor(pix)
        if pix.dim() != 4 or tuple(pix.shape[1:]) != (c, h, w):
            raise InputError(f"sample {i}: pixel_values has shape {tuple(pix.shape)}, expected [tiles, {c}, {h}, {w}]")
        labels = s.get("labels")
        if labels is None:
            labels = torch.where(ids == self.image_token_id, IGNORE_INDEX, ids)
        labels = torch.as_tensor(labels).long().reshape(-1)
        if labels.numel() != ids.numel():
            raise InputError(f"sample {i}: labels has {labels.numel()} entries but input_ids {ids.numel()}")
        n_img = int((ids == self.image_token_id).sum())
        if n_img != pix.shape[0] * self.tokens_per_tile:
            raise InputError(
                f"sample {i}: input_ids hold {n_img} image tokens but it has {pix.shape[0]} tiles x "
                f"{self.tokens_per_tile} tokens per tile"
            )
        if ids.numel() < 1:
            raise InputError(f"sample {i}: input_ids is empty")
        if self.oversized == "truncate" and (pix.shape[0] > self.shape.tiles or ids.numel() > self.shape.tokens):
            pix, ids, labels = self._truncate(pix, ids, labels)
        return pix, ids, labels

    def _truncate(self, pix: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keep the first Q_v tiles and Q_t tokens, dropping the placeholders of every cut tile."""
        tpt = self.tokens_per_tile
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        img_pos = torch.nonzero(ids == self.image_token_id).flatten()
        keep[img_pos[self.shape.tiles * tpt:]] = False  # placeholders of tiles beyond Q_v
        keep &= torch.cumsum(keep.long(), 0) <= self.shape.tokens  # then the first Q_t tokens
        kept_img = img_pos[keep[img_pos]]
        partial = kept_img.numel() % tpt  # a tile cut through its placeholders is dropped whole
        if partial:
            keep[kept_img[-partial:]] = False
        n_tiles = (kept_img.numel() - partial) // tpt
        return pix[:n_tiles], ids[keep], labels[keep]


def synthetic_sample(tiles: int, tokens: int, *, tokens_per_tile: int, image_token_id: int, vocab_size: int,
                     image_shape: tuple[int, int, int], generator: torch.Generator | None = None
                     ) -> dict[str, torch.Tensor]:
    """A random sample of the given lengths: its tiles' placeholders first, then text.

    Labels are -100 on image tokens, as in LLaVA/InternVL training.
    """
    n_img = tiles * tokens_per_tile
    if tokens < n_img + 1:
        raise InputError(f"a sample with {tiles} tiles needs more than {n_img} tokens, got {tokens}")
    text = torch.randint(0, vocab_size, (tokens - n_img,), generator=generator)
    text[text == image_token_id] = (image_token_id + 1) % vocab_size
    ids = torch.cat([torch.full((n_img,), image_token_id, dtype=torch.long), text])
    labels = torch.where(ids == image_token_id, IGNORE_INDEX, ids)
    return {"pixel_values": torch.randn(tiles, *image_shape, generator=generator), "input_ids": ids, "labels": labels}
