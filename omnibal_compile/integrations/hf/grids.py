"""Capture-time stand-ins that make Qwen2-VL's vision tower take any per-image grids of the same total shapes.

Hugging Face's Qwen2-VL reads ``image_grid_thw`` with ``.tolist()`` in three places: the vision tower's rotary
positions (``get_vision_position_ids`` loops over the grids), its attention (the non-flash path splits q/k/v per
frame by ``lengths.tolist()``) and ``get_image_features`` (splits the merged features per image). A graph
exported through them holds the example's grids: another pack with the same tensor shapes but other grids fails
its assertions or computes something else. While :func:`grid_free_capture` is entered, those three are replaced,
on the model's own instances, by code whose sizes depend only on input shapes; on exit the model is as it was.
Videos (``pixel_values_videos``, ``video_grid_thw``) go through the same tower and are replaced alike. The
features per image that the model returns (``image_outputs.pooler_output``) have sizes that follow the grids:
the model returns stand-ins there, which capture returns as None (the loss and logits are whole).

Glossary:
    N             patches in the pack: ``pixel_values.shape[0]`` (= sum of t*h*w over the grids).
    segment       the patches one attention sees: one frame (h*w patches) of one image, as Hugging Face's
                  ``get_vision_cu_seqlens`` cuts them for Qwen2-VL; ``cu_seqlens`` here has N+1 entries, the
                  boundaries of the real segments followed by empty ones (their count is data, N bounds it).
    merge order   the order of patches within a frame: blocks of merge x merge patches, row-major over blocks
                  (``get_vision_position_ids``: hpos reshaped (h/m, m, w/m, m), transposed (1, 2), flattened).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnibal_compile import progress

__all__ = ["grid_free_capture", "patch_positions", "segment_ids"]

_TOLD: set[str] = set()


def segment_ids(grid_thw: torch.Tensor, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch: its segment (frame) index over the pack, and its index within its frame (merge order).

    Sizes depend only on ``num_patches`` and ``grid_thw.shape[0]``, never on the grids' values.
    """
    grid = grid_thw.long()
    t, hw = grid[:, 0], grid[:, 1] * grid[:, 2]
    n = grid.shape[0]
    image = torch.repeat_interleave(torch.arange(n, device=grid.device), t * hw, output_size=num_patches)
    first_patch = F.pad((t * hw).cumsum(0), (1, 0))[:-1]
    first_frame = F.pad(t.cumsum(0), (1, 0))[:-1]
    local = torch.arange(num_patches, device=grid.device) - first_patch[image]
    frame_hw = hw[image]
    return first_frame[image] + local // frame_hw, local % frame_hw


def patch_positions(grid_thw: torch.Tensor, merge: int, num_patches: int) -> torch.Tensor:
    """The (h, w) rotary position of each patch, ``[num_patches, 2]``, as ``get_vision_position_ids`` lays them out."""
    grid = grid_thw.long()
    image = torch.repeat_interleave(
        torch.arange(grid.shape[0], device=grid.device), grid.prod(-1), output_size=num_patches
    )
    _, q = segment_ids(grid, num_patches)
    blocks_per_row = grid[:, 2][image] // merge
    block, within = q // (merge * merge), q % (merge * merge)
    hpos = (block // blocks_per_row) * merge + within // merge
    wpos = (block % blocks_per_row) * merge + within % merge
    return torch.stack([hpos, wpos], dim=-1)


def _cu_seqlens(segment: torch.Tensor) -> torch.Tensor:
    """N+1 boundaries: the real segments' then empty ones (see the glossary)."""
    n = segment.shape[0]
    return torch.searchsorted(segment, torch.arange(n + 1, device=segment.device)).to(torch.int32)


def _vision_forward(self: Any, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
    """``Qwen2VisionTransformerPretrainedModel.forward`` with positions and segments computed from shapes."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    for k in ("return_dict", "output_attentions", "output_hidden_states"):
        kwargs.pop(k, None)
    n = hidden_states.shape[0]
    position_ids = kwargs.pop("position_ids", None)
    if position_ids is None:
        position_ids = patch_positions(grid_thw, int(self.spatial_merge_size), n)
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    if cu_seqlens is None:
        cu_seqlens = _cu_seqlens(segment_ids(grid_thw, n)[0])
    kwargs.pop("max_seqlen", None)
    hidden_states = self.patch_embed(hidden_states)
    position_embeddings = self.rotary_pos_emb(hidden_states, position_ids)
    for blk in self.blocks:
        hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens, max_seqlen=n,
                            position_embeddings=position_embeddings, **kwargs)
    return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=self.merger(hidden_states))


def _attention_forward(self: Any, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       max_seqlen: int | None = None, **kwargs: Any) -> torch.Tensor:
    """``VisionAttention.forward``: one SDPA over the pack with a block-diagonal mask instead of a loop per frame."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    assert position_embeddings is not None, "Qwen2-VL's vision blocks always pass position_embeddings"
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    positions = torch.arange(n, device=hidden_states.device)
    segment = torch.searchsorted(cu_seqlens[1:].contiguous(), positions.to(cu_seqlens.dtype), right=True)
    mask = segment[:, None] == segment[None, :]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, N, head_dim]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0, scale=self.scaling
    )
    return self.proj(out[0].transpose(0, 1).reshape(n, -1))


def _features(modality: str) -> Any:
    """``Qwen2VLModel.get_{image,video}_features`` without the split per image: the model concatenates them back."""
    other = "video_" if modality == "image" else "image_"

    def get_features(self: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None,
                     **kwargs: Any) -> Any:
        kwargs = {k.removeprefix(f"{modality}_"): v for k, v in kwargs.items() if not k.startswith(other)}
        out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=grid_thw, **kwargs)
        out.pooler_output = (out.pooler_output,)
        return out

    return get_features


def _stand_in_outputs(forward: Any, returned_none: set[str]) -> Any:
    """``Qwen2VLModel.forward`` whose ``image_outputs``/``video_outputs`` hold one stand-in per image: the model
    returns the features split per image, sizes that follow the grids; capture returns those outputs as None."""

    def stand_in_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        for key in ("image", "video"):
            features: Any = getattr(out, f"{key}_outputs", None)
            grid = kwargs.get(f"{key}_grid_thw")
            pooled = getattr(features, "pooler_output", None)
            if grid is not None and isinstance(pooled, tuple) and len(pooled) == 1:
                features.pooler_output = tuple(pooled[0].new_zeros(0) for _ in range(grid.shape[0]))
                returned_none.add(f"{key}_outputs.pooler_output[")
        return out

    return stand_in_forward


def _model_types(model: nn.Module) -> set[str]:
    return {str(getattr(getattr(m, "config", None), "model_type", "")) for m in model.modules()}


@contextlib.contextmanager
def grid_free_capture(model: nn.Module) -> Iterator[set[str]]:
    """Within: a Qwen2-VL model's vision tower computes with shapes only (see the module docstring).

    Yields the output paths (prefixes, ``image_outputs.pooler_output[``) whose values stand in for the per-image
    features the model returns, which no shape-static graph can: the caller returns them as None.

    Other models are left alone, and so is Qwen2.5-VL: its window attention reorders patches by
    ``get_vision_window_index``, so its graph stays specialised to the example's grids (said once).
    """
    kinds = _model_types(model)
    if "qwen2_5_vl" in kinds and type(model).__name__ not in _TOLD:
        _TOLD.add(type(model).__name__)
        progress.info(
            f"{type(model).__name__}: its vision tower's window attention is captured for the example's image "
            "grids; batches must have the same grids (t, h, w) per image, in the same order, as the example."
        )
    returned_none: set[str] = set()
    if "qwen2_vl" not in kinds:
        yield returned_none
        return
    from transformers.models.qwen2_vl import modeling_qwen2_vl as q

    stand_ins: list[tuple[nn.Module, str, Any]] = []
    for m in model.modules():
        if type(m) is q.Qwen2VisionTransformerPretrainedModel:
            stand_ins.append((m, "forward", _vision_forward))
        elif type(m) is q.VisionAttention and not m.config._attn_implementation.startswith("flash"):
            stand_ins.append((m, "forward", _attention_forward))  # flash: the kernel takes cu_seqlens as a tensor
        elif type(m) is q.Qwen2VLModel:
            stand_ins += [(m, f"get_{k}_features", _features(k)) for k in ("image", "video")]
            stand_ins.append((m, "forward", _stand_in_outputs(type(m).forward, returned_none)))
    try:
        for m, attr, fn in stand_ins:  # on the instances: the class, and every other model of it, stay as they are
            setattr(m, attr, types.MethodType(fn, m))
        yield returned_none
    finally:
        for m, attr, _ in stand_ins:
            if attr in vars(m):
                delattr(m, attr)
