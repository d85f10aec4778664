"""Tiny Hugging Face VLMs of several families, built offline from small configs with random weights.

Each builder returns ``(model, batch)``: a ``*ForConditionalGeneration`` model and a training batch
laid out as the family's processor lays it out (image placeholder tokens expanded to the number of
features the vision tower yields, the family's start/end/break tokens, per-image sizes, token
types, precomputed 3-D rotary positions), built by hand from the config. Labels are -100 on the
image part of each row. Samples in one batch have images of different sizes or counts where the
family allows it (Qwen2-VL, Qwen2.5-VL, Mistral3, Idefics3), so their graphs carry data-dependent sizes.

``FAMILIES`` maps a short name to its builder; ``build(name)`` seeds and builds one. Reuse these in
any test that needs real VLM families (``pytest.importorskip("transformers")`` first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FAMILIES", "build"]

IGNORE = -100
HIDDEN, HEADS, KV_HEADS, MLP, LAYERS, VOCAB = 32, 4, 2, 64, 3, 128


def _tf() -> Any:
    import transformers

    return transformers


def _labels(ids: torch.Tensor, prefix: int) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :prefix] = IGNORE
    return labels


def _text(**extra: Any) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def _rows(parts: list[list[int]], text: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Rows of ``parts[i]`` (each row's image part) followed by random text to one length; returns ids and the
    longest image part."""
    prefix = max(len(p) for p in parts)
    rows = []
    for p in parts:
        filler = torch.randint(0, 100, (prefix + text - len(p),), generator=g)
        rows.append(torch.cat([torch.tensor(p, dtype=torch.long), filler]))
    return torch.stack(rows), prefix


def qwen2_vl(batch: int = 2, *, v25: bool = False) -> tuple[Any, dict[str, Any]]:
    """Qwen2-VL (or Qwen2.5-VL): flattened patches, ``image_grid_thw`` per image, 3-D rotary positions."""
    tf = _tf()
    image, video, start, end = 120, 121, 122, 123
    vision = dict(depth=2, hidden_size=HIDDEN, num_heads=HEADS, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if v25:
        vision.update(intermediate_size=MLP, out_hidden_size=HIDDEN, window_size=16, fullatt_block_indexes=[1])
        cfg_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=HIDDEN)
        cfg_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    cfg = cfg_cls(vision_config=vision, text_config=_text(rope_parameters=rope), image_token_id=image,
                  video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    model = model_cls(cfg)
    g = torch.Generator().manual_seed(1)
    # Images of 16x16 and 16x24 pixels: 4x4 and 4x6 patches of 4 pixels, merged 2x2 into 4 and 6 tokens.
    grids = [(1, 4, 4 + 2 * (i % 2)) for i in range(batch)]
    merge = 2 * 2
    parts = [[start] + [image] * (t * h * w // merge) + [end] for t, h, w in grids]
    ids, prefix = _rows(parts, 12, g)
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    # The processor's token types; the training collator turns them into M-RoPE positions, as here.
    types = (ids == image).int()
    positions, _ = model.model.get_rope_index(ids, image_grid_thw=grid, mm_token_type_ids=types)
    return model, {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions,
                   "labels": _labels(ids, prefix)}


def qwen2_5_vl(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Qwen2.5-VL: Qwen2-VL's layout with a windowed-attention vision tower."""
    return qwen2_vl(batch, v25=True)


def paligemma(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """PaliGemma: 16 image tokens (4x4 SigLIP patches) + BOS + prompt form the prefix (token type 0)."""
    tf = _tf()
    image = 120
    vision = tf.SiglipVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=HEADS,
                                   image_size=16, patch_size=4)
    text = tf.GemmaConfig(**_text(head_dim=8))
    cfg = tf.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=image, vocab_size=VOCAB,
                             projection_dim=HIDDEN, hidden_size=HIDDEN)
    model = tf.PaliGemmaForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    n = (16 // 4) ** 2
    ids, _ = _rows([[image] * n + [2, 7, 8]] * batch, 12, g)  # BOS = 2, a 2-token prompt, then the suffix
    prefix = n + 3
    types = torch.zeros_like(ids)
    types[:, prefix:] = 1
    return model, {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g), "token_type_ids": types,
                   "labels": _labels(ids, prefix)}


def gemma3(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Gemma 3: ``<boi>`` + pooled image tokens + ``<eoi>``, token type 1 on image tokens."""
    tf = _tf()
    image, boi, eoi = 120, 121, 122
    vision = tf.SiglipVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=HEADS,
                                   image_size=16, patch_size=4)
    text = tf.Gemma3TextConfig(**_text(head_dim=8, query_pre_attn_scalar=8, sliding_window=8))
    cfg = tf.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, image_token_index=image,
                          boi_token_index=boi, eoi_token_index=eoi)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids, prefix = _rows([[boi] + [image] * 4 + [eoi]] * batch, 12, g)
    return model, {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
                   "token_type_ids": (ids == image).long(), "labels": _labels(ids, prefix)}


def mistral3(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Mistral 3 (Pixtral vision, dynamic resolution): ``image_sizes`` per image, rows of ``[IMG]`` tokens
    closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``."""
    tf = _tf()
    img, brk, end = 120, 121, 122
    vision = tf.PixtralVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                    num_attention_heads=HEADS, head_dim=8, image_size=32, patch_size=4)
    text = tf.MistralConfig(**_text(head_dim=8))
    cfg = tf.Mistral3Config(vision_config=vision, text_config=text, image_token_index=img, spatial_merge_size=2,
                            vision_feature_layer=-1)
    model = tf.Mistral3ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    sizes = [(16, 16 + 8 * (i % 2)) for i in range(batch)]  # 16x16 and 16x24 pixels
    parts = []
    for h, w in sizes:
        rows, cols = h // 4 // 2, w // 4 // 2  # merged 2x2 patches of 4 pixels
        tokens = ([img] * cols + [brk]) * rows
        tokens[-1] = end
        parts.append(tokens)
    ids, prefix = _rows(parts, 12, g)
    pixels = torch.zeros(batch, 3, max(h for h, _ in sizes), max(w for _, w in sizes))
    for i, (h, w) in enumerate(sizes):  # the processor pads every image to the batch's largest
        pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=g)
    return model, {"input_ids": ids, "pixel_values": pixels, "image_sizes": torch.tensor(sizes),
                   "labels": _labels(ids, prefix)}


def internvl(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """InternVL (the Hugging Face port): ``<img>`` + 4 context tokens per tile (pixel shuffle 0.5) + ``</img>``."""
    tf = _tf()
    ctx, start, end = 120, 121, 122
    vision = tf.InternVLVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                     num_attention_heads=HEADS, image_size=16, patch_size=4)
    text = tf.Qwen2Config(**_text())
    cfg = tf.InternVLConfig(vision_config=vision, text_config=text, image_token_id=ctx, image_seq_length=4,
                            downsample_ratio=0.5)
    model = tf.InternVLForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids, prefix = _rows([[start] + [ctx] * 4 + [end]] * batch, 12, g)
    return model, {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
                   "labels": _labels(ids, prefix)}


def idefics3(batch: int = 2, *, smolvlm: bool = False) -> tuple[Any, dict[str, Any]]:
    """Idefics3 (or SmolVLM): padded image slots per row, real images found from the pixels, 4 tokens per image
    between ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``."""
    tf = _tf()
    image, around, glob = 120, 121, 122
    vision = dict(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=HEADS,
                  image_size=16, patch_size=4)
    text = tf.LlamaConfig(**_text())
    if smolvlm:
        cfg = tf.SmolVLMConfig(vision_config=vision, text_config=text, image_token_id=image, scale_factor=2)
        model = tf.SmolVLMForConditionalGeneration(cfg)
    else:
        cfg = tf.Idefics3Config(vision_config=vision, text_config=text, image_token_id=image, scale_factor=2)
        model = tf.Idefics3ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    per_image = (16 // 4) ** 2 // 2**2
    # Row i holds 1 + (i % 2) images; the processor pads rows to the batch's largest count with zero images.
    counts = [1 + i % 2 for i in range(batch)]
    parts = [([around, glob] + [image] * per_image) * n + [around] for n in counts]
    ids, prefix = _rows(parts, 12, g)
    slots = max(counts)
    pixels = torch.zeros(batch, slots, 3, 16, 16)
    mask = torch.zeros(batch, slots, 16, 16, dtype=torch.long)
    for i, n in enumerate(counts):
        pixels[i, :n] = torch.randn(n, 3, 16, 16, generator=g)
        mask[i, :n] = 1
    return model, {"input_ids": ids, "pixel_values": pixels, "pixel_attention_mask": mask, "labels": _labels(ids, prefix)}


def smolvlm(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """SmolVLM: Idefics3's layout."""
    return idefics3(batch, smolvlm=True)


FAMILIES: dict[str, Callable[..., tuple[Any, dict[str, Any]]]] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_5_vl,
    "paligemma": paligemma,
    "gemma3": gemma3,
    "mistral3": mistral3,
    "internvl": internvl,
    "idefics3": idefics3,
}
"""Families tested (SmolVLM shares Idefics3's code). LLaVA-NeXT is left out: its any-resolution tiling compares
aspect ratios of the image sizes, and torch 2.13 cannot turn that guard into a runtime assert
(``TraceError`` in ``insert_deferred_runtime_asserts``), so it cannot be captured yet."""


def build(name: str, batch: int = 2, *, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """Family ``name`` with weights seeded by ``seed``, in eval mode (no dropout). ``use_cache`` is left at the
    family's default (on): capture turns it off."""
    torch.manual_seed(seed)
    model, inputs = FAMILIES[name](batch)
    model.eval()
    return model, inputs
