"""Training batches for Hugging Face models, built from the config as each family's processor lays them out.

One builder per family (dispatched on ``config.model_type``) returns a dict of the model's keyword
inputs: image placeholder tokens expanded to the number of features the vision tower yields, the
family's per-image tensors (grids, sizes, token types, padded image slots), 3-D rotary positions
where the family precomputes them, and labels -100 on each row's image part. Rows carry images of
different sizes or counts where the family allows it (Qwen2-VL, Qwen2.5-VL, Mistral 3, Idefics3),
as real batches do.

Glossary:
    tiled family   images are fixed-size tiles, ``pixel_values`` of shape (tiles, C, H, W), and every
                   tile has the same number of placeholders (Llava, InternVL, PaliGemma, Gemma 3,
                   Aya Vision):
                   :func:`hf_data_facts` reads those facts, which the data balancer packs with.
    stand-in ids   tokens a processor wraps images with (``<img>``/``</img>``, Pixtral's
                   ``[IMG_BREAK]``/``[IMG_END]``, Idefics3's ``<fake_token_around_image>``) live in the
                   tokenizer, not in the config; the ids after the image token stand in for them
                   (the model reads them as ordinary text).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.errors import InputError

__all__ = ["HF_FAMILIES", "GRID_FAMILIES", "hf_example_batch", "hf_data_facts", "hf_family", "hf_pack_inputs",
           "pack_flex_mask", "pack_mask", "stacked_positions"]

Batch = dict[str, torch.Tensor]


def _config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "get_text_config"):
        raise InputError(f"{type(model).__name__} has no Hugging Face config (model.config)")
    return cfg


def _image_token(cfg: Any) -> int:
    token = getattr(cfg, "image_token_id", None)
    return int(cfg.image_token_index if token is None else token)


def _pair(value: Any) -> int:
    return int(value if isinstance(value, int) else value[0])


def _stand_ins(cfg: Any, n: int) -> list[int]:
    """``n`` ids after the image token (wrapping within the vocabulary) for the tokenizer-only wrapper tokens."""
    vocab, image = int(cfg.get_text_config().vocab_size), _image_token(cfg)
    return [(image + 1 + k) % vocab for k in range(n)]


def _rows(parts: list[list[int]], text: int, specials: set[int], vocab: int, g: torch.Generator
          ) -> tuple[torch.Tensor, int]:
    """Rows of ``parts[i]`` (each row's image part) then random text (no special id) to one length; returns the
    ids and the longest image part."""
    allowed = torch.tensor([i for i in range(vocab) if i not in specials] or [0])
    prefix = max(len(p) for p in parts)
    rows = []
    for p in parts:
        filler = allowed[torch.randint(0, allowed.numel(), (prefix + text - len(p),), generator=g)]
        rows.append(torch.cat([torch.tensor(p, dtype=torch.long), filler]))
    return torch.stack(rows), prefix


def _labels(ids: torch.Tensor, prefix: int) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :prefix] = IGNORE_INDEX
    return labels


def qwen2_vl(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """Qwen2-VL / Qwen2.5-VL: flattened patches, ``image_grid_thw`` per image, 3-D rotary positions.

    Row i holds one image of (2, 2 + i % 2) merged tokens per side: grid (1, 2m, 2m) or (1, 2m, 3m) patches.
    """
    cfg, vision = _config(model), _config(model).vision_config
    image, start, end = _image_token(cfg), int(cfg.vision_start_token_id), int(cfg.vision_end_token_id)
    m, p, t = int(vision.spatial_merge_size), int(vision.patch_size), int(vision.temporal_patch_size)
    grids = [(1, 2 * m, (2 + i % 2) * m) for i in range(batch)]
    parts = [[start] + [image] * (gt * gh * gw // m**2) + [end] for gt, gh, gw in grids]
    specials = {image, start, end, int(getattr(cfg, "video_token_id", image) or image)}
    ids, prefix = _rows(parts, text, specials, int(cfg.get_text_config().vocab_size), g)
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), int(vision.in_channels) * t * p * p, generator=g)
    # The processor's token types; the training collator turns them into M-RoPE positions, as here.
    # model.model: the Hugging Face inner model, an attribute nn.Module's __getattr__ types as Tensor | Module
    positions, _ = model.model.get_rope_index(  # type: ignore[union-attr, operator]
        ids, image_grid_thw=grid, mm_token_type_ids=(ids == image).int()
    )
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions,
            "labels": _labels(ids, prefix)}


def paligemma(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """PaliGemma: the image's tokens, BOS and a 2-token prompt form the prefix (token type 0), then the suffix."""
    cfg = _config(model)
    image, facts = _image_token(cfg), hf_data_facts(model)
    bos = int(cfg.get_text_config().bos_token_id or 0)
    vocab = int(cfg.get_text_config().vocab_size)
    prompt = _stand_ins(cfg, 2)
    ids, _ = _rows([[image] * facts["tokens_per_tile"] + [bos, *prompt]] * batch, text, {image, bos}, vocab, g)
    prefix = facts["tokens_per_tile"] + 3
    types = torch.zeros_like(ids)
    types[:, prefix:] = 1
    return {"input_ids": ids, "pixel_values": torch.randn(batch, *facts["image_shape"], generator=g),
            "token_type_ids": types, "labels": _labels(ids, prefix)}


def gemma3(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """Gemma 3: ``<boi>`` + the image's pooled tokens + ``<eoi>``, token type 1 on image tokens."""
    cfg = _config(model)
    image, boi, eoi, facts = _image_token(cfg), int(cfg.boi_token_index), int(cfg.eoi_token_index), hf_data_facts(model)
    vocab = int(cfg.get_text_config().vocab_size)
    ids, prefix = _rows([[boi] + [image] * facts["tokens_per_tile"] + [eoi]] * batch, text, {image, boi, eoi}, vocab, g)
    return {"input_ids": ids, "pixel_values": torch.randn(batch, *facts["image_shape"], generator=g),
            "token_type_ids": (ids == image).long(), "labels": _labels(ids, prefix)}


def mistral3(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """Mistral 3 (Pixtral vision, dynamic resolution): ``image_sizes`` per image, rows of ``[IMG]`` tokens closed
    by ``[IMG_BREAK]``, the last by ``[IMG_END]`` (stand-in ids); every image padded to the batch's largest.

    Row i holds an image of 2 x (2 + i % 2) merged patches.
    """
    cfg = _config(model)
    vision = cfg.vision_config
    image, (brk, end) = _image_token(cfg), _stand_ins(cfg, 2)
    side = _pair(vision.patch_size) * int(cfg.spatial_merge_size)
    sizes = [(2 * side, (2 + i % 2) * side) for i in range(batch)]
    parts = []
    for h, w in sizes:
        tokens = ([image] * (w // side) + [brk]) * (h // side)
        tokens[-1] = end
        parts.append(tokens)
    ids, prefix = _rows(parts, text, {image, brk, end}, int(cfg.get_text_config().vocab_size), g)
    channels = int(getattr(vision, "num_channels", 3))
    pixels = torch.zeros(batch, channels, max(h for h, _ in sizes), max(w for _, w in sizes))
    for i, (h, w) in enumerate(sizes):
        pixels[i, :, :h, :w] = torch.randn(channels, h, w, generator=g)
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_sizes": torch.tensor(sizes),
        "labels": _labels(ids, prefix),
    }


def internvl(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """InternVL (the Hugging Face port): ``<img>`` + the tile's context tokens + ``</img>`` (stand-in ids)."""
    cfg = _config(model)
    image, (start, end), facts = _image_token(cfg), _stand_ins(cfg, 2), hf_data_facts(model)
    vocab = int(cfg.get_text_config().vocab_size)
    ids, prefix = _rows(
        [[start] + [image] * facts["tokens_per_tile"] + [end]] * batch, text, {image, start, end}, vocab, g
    )
    return {"input_ids": ids, "pixel_values": torch.randn(batch, *facts["image_shape"], generator=g),
            "labels": _labels(ids, prefix)}


def idefics3_tokens_per_image(cfg: Any) -> int:
    """Placeholders of one Idefics3/SmolVLM image: its patches, pixel-shuffled by ``scale_factor`` per side."""
    vision = cfg.vision_config
    return (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(cfg.scale_factor) ** 2


def idefics3(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """Idefics3 / SmolVLM: image slots per row padded to the batch's largest count with zero images (the model
    finds the real ones from the pixels), each image's tokens between ``<fake_token_around_image><global-img>``
    and ``<fake_token_around_image>`` (stand-in ids). Row i holds 1 + i % 2 images."""
    cfg = _config(model)
    vision = cfg.vision_config
    image, (around, glob) = _image_token(cfg), _stand_ins(cfg, 2)
    per_image = idefics3_tokens_per_image(cfg)
    counts = [1 + i % 2 for i in range(batch)]
    parts = [([around, glob] + [image] * per_image) * n + [around] for n in counts]
    ids, prefix = _rows(parts, text, {image, around, glob}, int(cfg.get_text_config().vocab_size), g)
    size, channels = int(vision.image_size), int(getattr(vision, "num_channels", 3))
    pixels = torch.zeros(batch, max(counts), channels, size, size)
    mask = torch.zeros(batch, max(counts), size, size, dtype=torch.long)
    for i, n in enumerate(counts):
        pixels[i, :n] = torch.randn(n, channels, size, size, generator=g)
        mask[i, :n] = 1
    return {"input_ids": ids, "pixel_values": pixels, "pixel_attention_mask": mask, "labels": _labels(ids, prefix)}


def mllama(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """Mllama (Llama 3.2 Vision): one ``<|image|>`` token per row, read by the cross-attention layers; row i holds an
    image of 1 + i % 2 tiles side by side (aspect ratio 1x1 or 1x2), padded to ``max_num_tiles`` with zero tiles,
    with ``aspect_ratio_ids`` (1 + the ratio's index in ``supported_aspect_ratios``), ``aspect_ratio_mask`` and a
    ``cross_attention_mask`` that lets every token from the image token on see the image's real tiles."""
    cfg = _config(model)
    vision = cfg.vision_config
    image, vocab = _image_token(cfg), int(cfg.get_text_config().vocab_size)
    ratios = [list(r) for r in vision.supported_aspect_ratios]
    most = int(vision.max_num_tiles)
    tiles = [min(1 + i % 2, most) if [1, 2] in ratios else 1 for i in range(batch)]
    ids, prefix = _rows([[image]] * batch, text, {image}, vocab, g)
    size, channels = int(vision.image_size), int(getattr(vision, "num_channels", 3))
    pixels = torch.zeros(batch, 1, most, channels, size, size)
    ratio_mask = torch.zeros(batch, 1, most, dtype=torch.long)
    cross = torch.zeros(batch, ids.shape[1], 1, most, dtype=torch.long)
    for i, n in enumerate(tiles):
        pixels[i, 0, :n] = torch.randn(n, channels, size, size, generator=g)
        ratio_mask[i, 0, :n] = 1
        cross[i, :, 0, :n] = 1  # the image token is first: every token sees it
    ratio_ids = torch.tensor([[ratios.index([1, n]) + 1] for n in tiles])
    return {"input_ids": ids, "pixel_values": pixels, "aspect_ratio_ids": ratio_ids, "aspect_ratio_mask": ratio_mask,
            "cross_attention_mask": cross, "labels": _labels(ids, prefix)}


HF_FAMILIES: dict[str, Callable[..., Batch]] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_vl,
    "paligemma": paligemma,
    "gemma3": gemma3,
    "mistral3": mistral3,
    "internvl": internvl,
    "idefics3": idefics3,
    "smolvlm": idefics3,
    "mllama": mllama,
}
"""``config.model_type`` -> the family's batch builder ``(model, *, batch, text, g) -> batch``. Other models with
fixed-size tiles (Llava...) and text-only models use the generic builder of :func:`hf_example_batch`."""


def hf_family(model: nn.Module) -> str:
    """How :func:`hf_example_batch` lays out ``model``'s batch: a family of :data:`HF_FAMILIES`, ``"tiled"`` or
    ``"text"``; raises InputError for a vision model of a family it does not know."""
    cfg = _config(model)
    kind = str(getattr(cfg, "model_type", ""))
    if kind in HF_FAMILIES:
        return kind
    if hf_data_facts(model):
        return "tiled"
    if getattr(cfg, "vision_config", None) is None:
        return "text"
    raise InputError(
        f"cannot build example inputs for a {type(model).__name__} ({kind!r}): its images are not fixed-size tiles "
        f"and its family is not one of {sorted(HF_FAMILIES)}; pass example_inputs= (one batch as its processor emits "
        "it)"
    )


def hf_data_facts(model: nn.Module) -> dict[str, Any]:
    """What the data balancer packs a Hugging Face VLM's images as: fixed-size tiles, with their placeholders per
    tile, the image placeholder id, the tile's (channels, height, width) and the vocabulary. Empty for a text-only
    model or a vision model whose layout is unknown.

    Tiled families (Llava, InternVL, PaliGemma, Gemma 3) take their tile from the vision config (a Llava tile: the
    tower's patches, plus CLIP's class token, less the first token under ``vision_feature_select_strategy``
    "default"); the others
    count a tile as the family's images are counted (see :func:`hf_pack_inputs`, which lays a pack out):

    - Qwen2-VL, Qwen2.5-VL: one merged patch (merge x merge patches, ``merge * patch`` pixels a side) and its
      one ``<|image_pad|>`` placeholder: an image of grid (t, h, w) is t*h*w / merge^2 tiles (the pack
      convention of :mod:`~omnibal_compile.integrations.hf.grid_pack`);
    - Mistral 3: a square image of r x r merged patches, r = image_size // (patch x merge), with its r
      ``[IMG_BREAK]``/``[IMG_END]`` tokens counted as placeholders (r x (r + 1));
    - Idefics3, SmolVLM: one image slot, its patches pixel-shuffled by ``scale_factor`` per side;
    - Aya Vision: a tiled family whose tile's patches are pixel-shuffled by ``downsample_factor`` per side;
    - Mllama: none (empty): its images take no placeholders but are read by cross-attention layers.
    """
    cfg = getattr(model, "config", None)
    vision = getattr(cfg, "vision_config", None)
    image_token = getattr(cfg, "image_token_id", getattr(cfg, "image_token_index", None))
    if cfg is None or vision is None or image_token is None:
        return {}
    kind = str(getattr(cfg, "model_type", ""))
    channels = int(getattr(vision, "num_channels", getattr(vision, "in_channels", 3)))
    vocab = int(cfg.get_text_config().vocab_size)
    if kind in GRID_FAMILIES:
        side = int(vision.spatial_merge_size) * int(vision.patch_size)
        return {"tokens_per_tile": 1, "image_token_id": int(image_token), "image_shape": (channels, side, side),
                "vocab_size": vocab}
    if not hasattr(vision, "image_size") or kind == "mllama":  # Mllama's images are read by cross-attention
        return {}
    size, patch = _pair(vision.image_size), _pair(vision.patch_size)
    if kind == "mistral3":
        unit = patch * int(cfg.spatial_merge_size)
        r = size // unit
        return {"tokens_per_tile": r * (r + 1), "image_token_id": int(image_token),
                "image_shape": (channels, r * unit, r * unit), "vocab_size": vocab}
    tokens = getattr(cfg, "mm_tokens_per_image", None) or getattr(cfg, "image_seq_length", None)  # Gemma 3, PaliGemma
    if kind in ("idefics3", "smolvlm"):
        tokens = idefics3_tokens_per_image(cfg)
    elif kind == "aya_vision":  # the tile's patches (less the first under "default"), pixel-shuffled per side
        kept = (size // patch) ** 2 - (1 if getattr(cfg, "vision_feature_select_strategy", "full") == "default" else 0)
        tokens = (math.isqrt(kept) // int(cfg.downsample_factor)) ** 2
    elif tokens is None or type(model).__name__.startswith("Llava"):  # Llava's image_seq_length is informational
        # a Llava's: the tower's patches and its class token (CLIP's; SigLIP's towers have none), less the first
        # under the "default" strategy; a config without a strategy: the patches
        strategy = getattr(cfg, "vision_feature_select_strategy", None)
        cls = 0 if "siglip" in str(getattr(vision, "model_type", "")) else 1
        tokens = (size // patch) ** 2 + (0 if strategy is None else cls - (1 if strategy == "default" else 0))
    return {"tokens_per_tile": int(tokens), "image_token_id": int(image_token), "image_shape": (channels, size, size),
            "vocab_size": vocab}


GRID_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
"""Families whose images are flattened patches with ``image_grid_thw`` and 3-D rotary positions."""


def stacked_positions(model: nn.Module) -> bool:
    """Whether a pack's ``position_ids`` for ``model`` are (4, 1, L) per row, stacked along dim 0 (Qwen2-VL's
    text row plus 3-D rotary rows), so that a step splits into micro-batches of one row each only."""
    return str(getattr(getattr(model, "config", None), "model_type", "")) in GRID_FAMILIES


def hf_pack_inputs(model: nn.Module, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
    """One collated pack in the reference layout (``data.collate``: tiles, placeholders ``tokens_per_tile`` per
    tile as :func:`hf_data_facts` counts them, ``position_ids`` restarting per sample, ``segment_ids``) -> the
    inputs a Hugging Face model takes, with the pack's samples kept apart.

    Keys the model's ``forward`` does not name are dropped; under ``sdpa``/``eager`` the row gets the 4-D
    block-causal ``attention_mask`` of its segments (flash attention reads the restarting ``position_ids``).
    Per family, as its processor lays images out:

    - Qwen2-VL, Qwen2.5-VL: a row that carries ``image_grid_thw`` (real images,
      :class:`~omnibal_compile.integrations.hf.grid_pack.GridPackCollator`) keeps its patches and grids; in
      a row of tiles (one merged patch each) each run of a sample's tiles becomes an image of grid
      (1, merge, merge x run), its flattened patches in the image processor's order (each tile repeated over
      the temporal patch), the grid rows padded to one per tile with empty images (0, merge, merge), as
      ``GridPackCollator`` lays them out (Qwen2.5-VL, captured for the example's grids: one image of grid
      (1, merge, merge) per tile). Both get
      ``mm_token_type_ids`` and ``position_ids`` of shape (4, 1, L): the text positions, then each
      sample's 3-D rotary positions as if it ran alone;
    - Mistral 3: ``image_sizes`` per tile, the last placeholder of each row of merged patches turned into
      ``[IMG_BREAK]``, the tile's last into ``[IMG_END]`` (stand-in ids);
    - Idefics3, SmolVLM: ``pixel_values`` of shape (1, tiles, C, H, W) with ``pixel_attention_mask``; a dummy
      tile (all zeros, which the model would take for an empty slot) gets pixels of 1 so that every tile's
      placeholders get features;
    - Gemma 3: ``token_type_ids`` 1 on image tokens; PaliGemma: 0 on image tokens (the prefix), 1 elsewhere;
      both get their bidirectional blocks in the mask (:func:`_pack_mask`).

    The mask: a 4-D additive one under ``sdpa``/``eager`` (:func:`pack_mask`), flex block masks under
    ``flex_attention`` (:func:`pack_flex_mask`), none under a flash implementation (restarting positions).
    """
    import inspect

    from omnibal_compile.integrations.hf.collate import block_ids, is_varlen, mrope_positions

    cfg = getattr(model, "config", None)
    kind = str(getattr(cfg, "model_type", ""))
    params = inspect.signature(model.forward).parameters
    out: dict[str, torch.Tensor | dict[str, torch.Tensor]] = {k: v for k, v in row.items() if k in params}
    impl = str(getattr(cfg, "_attn_implementation", None) or "sdpa")
    if "segment_ids" in row and "attention_mask" in params and not is_varlen(impl):
        out["attention_mask"] = _pack_mask(model, row)
    if cfg is None or getattr(cfg, "vision_config", None) is None or "pixel_values" not in row:
        return out
    ids, pixels, image = row["input_ids"], row["pixel_values"], _image_token(cfg)
    n_tiles, channels, side = pixels.shape[0], pixels.shape[1], pixels.shape[-1]
    if kind in GRID_FAMILIES:
        vision = cfg.vision_config
        m = int(vision.spatial_merge_size)
        if "image_grid_thw" in row:  # real images, already the image processor's patches
            grid = row["image_grid_thw"].long()
        else:  # each run of a sample's tiles is one image of grid (1, m, m * run), the grid rows padded with empty ones
            p, t = int(vision.patch_size), int(vision.temporal_patch_size)
            x = pixels[:, None].expand(n_tiles, t, channels, side, side)
            x = x.reshape(n_tiles, t, channels, 1, m, p, 1, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            out["pixel_values"] = x.reshape(n_tiles * m * m, channels * t * p * p)
            runs = block_ids(row["segment_ids"], ids == image)
            # Qwen2.5-VL's captured tower keeps the example's grids (integrations/hf/grids.py): one image per tile,
            # the same grids in every pack
            run_tiles = [1] * n_tiles if kind == "qwen2_5_vl" else torch.bincount(runs[runs >= 0]).tolist()
            grid = torch.tensor([[1, m, m * r] for r in run_tiles] + [[0, m, m]] * (n_tiles - len(run_tiles)),
                                dtype=torch.long).reshape(-1, 3)
        out["image_grid_thw"] = grid
        if "mm_token_type_ids" in params:
            out["mm_token_type_ids"] = (ids == image).int()
        seg = row["segment_ids"][0]
        images = grid[grid.prod(-1) > 0]  # the empty images that pad the grid rows have no placeholders
        per_image = (images.prod(-1) // m**2).tolist()
        rope, used = [], 0
        for k in range(int(seg.max()) + 1):
            part = ids[0][seg == k]
            placeholders, n = int((part == image).sum()), 0
            while placeholders > 0:  # the segment's images: the next ones in order, as many as its placeholders
                placeholders -= per_image[used + n]
                n += 1
            rope.append(mrope_positions(part, images[used:used + n], image_token_id=image, merge=m))
            used += n
        out["position_ids"] = torch.cat([row["position_ids"], torch.cat(rope, dim=1)])[:, None]
    elif kind == "mistral3":
        r = int(side) // (_pair(cfg.vision_config.patch_size) * int(cfg.spatial_merge_size))
        brk, end = _stand_ins(cfg, 2)
        ids = ids.clone()
        where = (ids[0] == image).nonzero().flatten().reshape(n_tiles, r, r + 1)
        ids[0, where[:, :, -1].flatten()] = brk
        ids[0, where[:, -1, -1]] = end
        out["input_ids"] = ids
        out["image_sizes"] = torch.tensor([[side, side]] * n_tiles, dtype=torch.long)
    elif kind in ("idefics3", "smolvlm"):
        empty = (pixels == 0).flatten(1).all(1)
        out["pixel_values"] = torch.where(empty[:, None, None, None], torch.ones_like(pixels), pixels)[None]
        out["pixel_attention_mask"] = torch.ones(1, n_tiles, side, side, dtype=torch.long)
    elif kind == "gemma3":
        out["token_type_ids"] = (ids == image).long()
    elif kind == "paligemma":
        out["token_type_ids"] = (ids != image).long()
    return out


def _pack_mask(model: nn.Module, row: dict[str, torch.Tensor]) -> Any:
    """The attention mask of a pack: :func:`pack_mask` of its segments and tokens, or :func:`pack_flex_mask` under
    ``flex_attention``."""
    from omnibal_compile.integrations.hf.flex import is_flex

    cfg = getattr(model, "config", None)
    make = pack_flex_mask if is_flex(str(getattr(cfg, "_attn_implementation", None) or "")) else pack_mask
    return make(model, row["segment_ids"], row.get("input_ids"))


def _mask_rules(model: nn.Module, seg: torch.Tensor, input_ids: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, int | None]:
    """(bidirectional block ids, sliding window) of a pack's attention: Gemma 3's images (each run of image
    tokens), PaliGemma's prefix (the sample's image tokens), or None; the language model's window where it has
    sliding-window layers (``layer_types``), else None."""
    from omnibal_compile.integrations.hf.collate import block_ids

    cfg = getattr(model, "config", None)
    kind = str(getattr(cfg, "model_type", ""))
    blocks = None
    if kind in ("gemma3", "paligemma") and input_ids is not None:
        blocks = block_ids(seg, input_ids == _image_token(cfg))
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else None
    window = getattr(text, "sliding_window", None)
    if window is None or "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return blocks, None
    return blocks, int(window)


def pack_mask(model: nn.Module, seg: torch.Tensor, input_ids: torch.Tensor | None
              ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D additive mask of a pack of (B, L) segment ids ``seg``: each sample sees itself as the model would
    mask it alone.

    Causal within each sample, plus the family's bidirectional blocks: Gemma 3's images (each run of image
    tokens), PaliGemma's prefix (the sample's image tokens). A language model with sliding-window layers
    (``layer_types``) gets one mask per layer type, ``{"full_attention": ..., "sliding_attention": ...}``, as its
    forward takes them. Captured graphs make the same mask again of the positions
    (:mod:`omnibal_compile.integrations.hf.masks`).
    """
    from omnibal_compile.integrations.hf.collate import segment_mask

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    blocks, window = _mask_rules(model, seg, input_ids)
    full = segment_mask(seg, dtype=dtype, blocks=blocks)
    if window is None:
        return full
    return {"full_attention": full, "sliding_attention": segment_mask(seg, dtype=dtype, blocks=blocks, window=window)}


def pack_flex_mask(model: nn.Module, seg: torch.Tensor, input_ids: torch.Tensor | None) -> Any:
    """:func:`pack_mask`'s rules as flex block masks (:func:`~omnibal_compile.integrations.hf.flex.pack_block_mask`):
    one, or one per layer type; raises InputError for a family that cannot take them
    (:func:`~omnibal_compile.integrations.hf.flex.check_flex_family`)."""
    from omnibal_compile.integrations.hf.flex import check_flex_family, pack_block_mask

    check_flex_family(model)
    blocks, window = _mask_rules(model, seg, input_ids)
    full = pack_block_mask(seg, blocks=blocks)
    if window is None:
        return full
    return {"full_attention": full, "sliding_attention": pack_block_mask(seg, blocks=blocks, window=window)}


def hf_example_batch(model: nn.Module, *, batch: int, text: int, seed: int) -> Batch:
    """A training batch for a Hugging Face model from its config: ``batch`` rows of the family's image part
    (:data:`HF_FAMILIES`; one tile per row, placeholders first, for other tiled VLMs) and ``text`` random
    text tokens; labels -100 on the image part. Raises InputError for a VLM of an unknown layout."""
    g = torch.Generator().manual_seed(seed)
    family = hf_family(model)
    if family in HF_FAMILIES:
        return HF_FAMILIES[family](model, batch=batch, text=text, g=g)
    if family == "text":
        # model.config: a Hugging Face config, an attribute nn.Module's __getattr__ types as Tensor | Module
        vocab = int(model.config.get_text_config().vocab_size)  # type: ignore[union-attr, operator]
        ids = torch.randint(0, vocab, (batch, text), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    facts = hf_data_facts(model)
    n_image, image_token = facts["tokens_per_tile"], facts["image_token_id"]
    high = min(facts["vocab_size"], image_token) if image_token > 0 else facts["vocab_size"]
    ids = torch.randint(0, max(1, high), (batch, n_image + text), generator=g)
    ids[:, :n_image] = image_token
    labels = ids.clone()
    labels[:, :n_image] = IGNORE_INDEX
    pixels = torch.randn(batch, *facts["image_shape"], generator=g)
    return {"pixel_values": pixels, "input_ids": ids, "labels": labels}
