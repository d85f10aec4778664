"""Training batches for Hugging Face models, built from the config as each family's processor lays them out.

One builder per family (dispatched on ``config.model_type``) returns a dict of the model's keyword
inputs: image placeholder tokens expanded to the number of features the vision tower yields, the
family's per-image tensors (grids, sizes, token types, padded image slots), 3-D rotary positions
where the family precomputes them, and labels -100 on each row's image part. Rows carry images of
different sizes or counts where the family allows it (Qwen2-VL, Qwen2.5-VL, Mistral 3, Idefics3),
as real batches do.

Glossary:
    tiled family   images are fixed-size tiles, ``pixel_values`` of shape (tiles, C, H, W), and every
                   tile has the same number of placeholders (Llava, InternVL, PaliGemma, Gemma 3):
                   :func:`hf_data_facts` reads those facts, which the data balancer packs with.
    stand-in ids   tokens a processor wraps images with (``<img>``/``</img>``, Pixtral's
                   ``[IMG_BREAK]``/``[IMG_END]``, Idefics3's ``<fake_token_around_image>``) live in the
                   tokenizer, not in the config; the ids after the image token stand in for them
                   (the model reads them as ordinary text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from omnibal_compile.errors import InputError
from omnibal_compile.labels import IGNORE_INDEX

__all__ = ["HF_FAMILIES", "hf_example_batch", "hf_data_facts", "hf_family"]

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
    positions, _ = model.model.get_rope_index(ids, image_grid_thw=grid, mm_token_type_ids=(ids == image).int())
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
    return {"input_ids": ids, "pixel_values": pixels, "image_sizes": torch.tensor(sizes), "labels": _labels(ids, prefix)}


def internvl(model: nn.Module, *, batch: int, text: int, g: torch.Generator) -> Batch:
    """InternVL (the Hugging Face port): ``<img>`` + the tile's context tokens + ``</img>`` (stand-in ids)."""
    cfg = _config(model)
    image, (start, end), facts = _image_token(cfg), _stand_ins(cfg, 2), hf_data_facts(model)
    vocab = int(cfg.get_text_config().vocab_size)
    ids, prefix = _rows([[start] + [image] * facts["tokens_per_tile"] + [end]] * batch, text, {image, start, end}, vocab, g)
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


HF_FAMILIES: dict[str, Callable[..., Batch]] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_vl,
    "paligemma": paligemma,
    "gemma3": gemma3,
    "mistral3": mistral3,
    "internvl": internvl,
    "idefics3": idefics3,
    "smolvlm": idefics3,
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
        f"and its family is not one of {sorted(HF_FAMILIES)}; pass example_inputs= (one batch as its processor emits it)"
    )


def hf_data_facts(model: nn.Module) -> dict[str, Any]:
    """Tokens per tile, image placeholder id, tile shape and vocabulary of a Hugging Face VLM whose images are
    fixed-size tiles (``pixel_values`` of shape ``(tiles, channels, size, size)``: Llava, InternVL, ...).

    Empty for a text-only model. Families that lay images out otherwise (Qwen2-VL's patches with
    ``image_grid_thw``, Mistral3's ``image_sizes``) need their own packing collator.
    """
    cfg = getattr(model, "config", None)
    vision = getattr(cfg, "vision_config", None)
    image_token = getattr(cfg, "image_token_id", getattr(cfg, "image_token_index", None))
    if cfg is None or vision is None or image_token is None or not hasattr(vision, "image_size"):
        return {}
    size, patch = _pair(vision.image_size), _pair(vision.patch_size)
    tokens = getattr(cfg, "mm_tokens_per_image", None) or getattr(cfg, "image_seq_length", None)  # Gemma 3, PaliGemma
    if tokens is None or type(model).__name__.startswith("Llava"):  # Llava's image_seq_length is informational
        tokens = (size // patch) ** 2 + (1 if getattr(cfg, "vision_feature_select_strategy", "default") == "full" else 0)
    return {
        "tokens_per_tile": int(tokens),
        "image_token_id": int(image_token),
        "image_shape": (int(getattr(vision, "num_channels", 3)), size, size),
        "vocab_size": int(cfg.get_text_config().vocab_size),
    }


def hf_example_batch(model: nn.Module, *, batch: int, text: int, seed: int) -> Batch:
    """A training batch for a Hugging Face model from its config: ``batch`` rows of the family's image part
    (:data:`HF_FAMILIES`; one tile per row, placeholders first, for other tiled VLMs) and ``text`` random
    text tokens; labels -100 on the image part. Raises InputError for a VLM of an unknown layout."""
    g = torch.Generator().manual_seed(seed)
    family = hf_family(model)
    if family in HF_FAMILIES:
        return HF_FAMILIES[family](model, batch=batch, text=text, g=g)
    if family == "text":
        vocab = int(model.config.get_text_config().vocab_size)  # type: ignore[union-attr]
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
