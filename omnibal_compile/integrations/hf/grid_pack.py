"""Real Qwen2-VL samples packed into one row of fixed shapes, as pipelining's fixed buffers need.

A pipeline stage receives tensors of the shapes it was built for, so every pack of a run must have the
same ``pixel_values``, ``image_grid_thw`` and token shapes, whatever its images' sizes. The pack
convention of the grid families (Qwen2-VL):

    tile          one merged patch: ``merge x merge`` rows of ``pixel_values`` and one ``<|image_pad|>``
                  placeholder. An image of grid (t, h, w) is ``t*h*w / merge^2`` tiles; a sample's tiles
                  are its placeholders (what ``lengths --model`` measures and the balancer packs).
    pack shape    (Q_v tiles, Q_t tokens), as for tiled families; the row is ``seq_len`` tokens
                  (Q_t plus room for the filler's placeholders, :class:`~omnibal_compile.data.DataPlan`).
    shapes        ``pixel_values`` (Q_v * merge^2, C * T * P * P), ``image_grid_thw`` (Q_v, 3): one grid row
                  per tile, which no pack can outnumber with images (each has at least one tile),
                  ``input_ids``/``labels``/``position_ids``/``segment_ids`` (1, seq_len).
    filler        the r tiles the pack's images leave free make one image of grid (1, merge, merge * r),
                  zero pixels, whose r placeholders open the padding tail: its own segment, labels -100,
                  its own 3-D positions (:func:`~omnibal_compile.integrations.hf.inputs.hf_pack_inputs`).
    empty images  the grid rows left after the pack's images and the filler are (0, merge, merge): no
                  frames, no patches, no placeholders.

A row of synthetic tiles (``--lengths``, the plan's example) has the same shapes: each tile is an
image of grid (1, merge, merge) (:func:`~omnibal_compile.integrations.hf.inputs.hf_pack_inputs`), so
a plan made from lengths runs on the dataset's packs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.data.packing import PackShape
from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.collate import sample_tokens

__all__ = ["GridPackCollator"]


@dataclass(frozen=True, kw_only=True)
class GridPackCollator:
    """One pack of real grid-family samples (``input_ids``, ``labels``, ``pixel_values`` patches and
    ``image_grid_thw``; none of the last two for a text-only sample) -> one row of the fixed shapes of the
    module's convention, in the reference keys plus ``image_grid_thw`` (``hf_pack_inputs`` adds the rest)."""

    shape: PackShape
    """Q_v tiles (merged patches) and Q_t tokens of a pack."""
    seq_len: int
    """Row length in tokens: Q_t plus room for the filler's placeholders."""
    merge: int
    """The vision config's ``spatial_merge_size``."""
    patch_dim: int
    """Columns of ``pixel_values``: channels x temporal patch x patch x patch."""
    image_token_id: int
    """Id of ``<|image_pad|>``."""
    pad_token_id: int = 0
    """Id of the padding tail's text tokens."""

    @classmethod
    def for_model(cls, model: Any, shape: PackShape, seq_len: int) -> GridPackCollator:
        """The collator of a Hugging Face grid-family model (its vision config, image and padding tokens)."""
        config = model.config
        vision = config.vision_config
        patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        pad = getattr(config.get_text_config(), "pad_token_id", None)
        return cls(shape=shape, seq_len=seq_len, merge=int(vision.spatial_merge_size), patch_dim=patch_dim,
                   image_token_id=int(config.image_token_id), pad_token_id=int(pad or 0))

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise InputError("the collator got an empty pack; the sampler never yields one")
        m2 = self.merge ** 2
        ids, labels, pixels, grids = [], [], [], []
        for i, s in enumerate(samples):
            sid, lab, pix, grid = self._sample(i, s)
            lab = lab.clone()
            lab[0] = IGNORE_INDEX  # in a row it would be predicted from the previous sample's last token
            ids.append(sid)
            labels.append(lab)
            pixels.append(pix)
            grids.append(grid)
        tiles = sum(int(g.prod(-1).sum()) for g in grids) // m2
        tokens = sum(x.numel() for x in ids)
        free, pad = self.shape.tiles - tiles, self.seq_len - tokens
        if free < 0 or tokens > self.shape.tokens or pad < free:
            raise InputError(
                f"pack of {len(samples)} samples has {tiles} tiles (merged patches) and {tokens} tokens, over the "
                f"shape ({self.shape.tiles} tiles, {self.shape.tokens} tokens, row {self.seq_len}); pack with the "
                "shape the collator was built for"
            )
        lengths = [x.numel() for x in ids] + ([pad] if pad else [])
        tail = torch.full((pad,), self.pad_token_id, dtype=torch.long)
        tail[:free] = self.image_token_id  # the filler's placeholders
        ids.append(tail)
        labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
        if free:
            pixels.append(torch.zeros(free * m2, self.patch_dim))
            grids.append(torch.tensor([[1, self.merge, self.merge * free]]))
        grid = torch.cat(grids)
        empty = torch.tensor([[0, self.merge, self.merge]]).expand(self.shape.tiles - grid.shape[0], 3)
        return {
            "pixel_values": torch.cat(pixels).float(),
            "image_grid_thw": torch.cat([grid, empty]).long(),
            "input_ids": torch.cat(ids)[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "segment_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None],
        }

    def _sample(self, i: int, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, given = sample_tokens(i, s)
        labels = torch.where(ids == self.image_token_id, IGNORE_INDEX, ids) if given is None else given
        pix, grid = s.get("pixel_values"), s.get("image_grid_thw")
        if (pix is None) != (grid is None):
            raise InputError(f"sample {i}: give pixel_values and image_grid_thw together")
        if pix is None:
            pix, grid = torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        pix, grid = torch.as_tensor(pix), torch.as_tensor(grid).long().reshape(-1, 3)
        patches = int(grid.prod(-1).sum())
        if pix.dim() != 2 or pix.shape != (patches, self.patch_dim):
            raise InputError(f"sample {i}: pixel_values has shape {tuple(pix.shape)}, but image_grid_thw "
                             f"{grid.tolist()} makes ({patches}, {self.patch_dim}) patches")
        if bool((grid[:, 1:] % self.merge).any()):
            raise InputError(f"sample {i}: image_grid_thw {grid.tolist()} has sides that are not multiples of the "
                             f"merge size {self.merge}")
        placeholders = int((ids == self.image_token_id).sum())
        if placeholders * self.merge ** 2 != patches:
            raise InputError(f"sample {i}: input_ids hold {placeholders} image tokens (id {self.image_token_id}) but "
                             f"its grids {grid.tolist()} make {patches // self.merge ** 2} merged patches")
        return ids, labels, pix, grid
