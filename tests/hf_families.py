"""Tiny Hugging Face VLMs of several families, built offline from small configs with random weights.

Each builder returns ``(model, batch)``: a ``*ForConditionalGeneration`` model and a training batch
laid out as the family's processor lays it out (image placeholder tokens expanded to the number of
features the vision tower yields, the family's start/end/break tokens, per-image sizes, token
types, precomputed 3-D rotary positions), built from the config by the package's
``omnibal_compile.integrations.hf.inputs.hf_example_batch`` (the one definition of each family's layout).
Labels are -100 on the image part of each row. Samples in one batch have images of different sizes
or counts where the family allows it (Qwen2-VL, Qwen2.5-VL, Mistral3, Idefics3), so their graphs
carry data-dependent sizes.

``FAMILIES`` maps a short name to its builder; ``build(name)`` seeds and builds one. Reuse these in
any test that needs real VLM families (``pytest.importorskip("transformers")`` first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnibal_compile.integrations.hf.inputs import hf_example_batch

__all__ = ["FAMILIES", "KWARG_FAMILIES", "build"]

HIDDEN, HEADS, KV_HEADS, MLP, LAYERS, VOCAB = 32, 4, 2, 64, 3, 128
TEXT = 12
"""Text tokens per row after the image part."""


def _tf() -> Any:
    import transformers

    return transformers


def _text(layers: int = LAYERS, **extra: Any) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def _with_batch(model: Any, batch: int) -> tuple[Any, dict[str, Any]]:
    """The model and the package's processor-style batch for it (``omnibal_compile.integrations.hf.inputs``)."""
    return model, hf_example_batch(model, batch=batch, text=TEXT, seed=1)


def qwen2_vl(batch: int = 2, *, v25: bool = False) -> tuple[Any, dict[str, Any]]:
    """Qwen2-VL (or Qwen2.5-VL): flattened patches, ``image_grid_thw`` per image, 3-D rotary positions."""
    tf = _tf()
    vision = dict(depth=2, hidden_size=HIDDEN, num_heads=HEADS, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if v25:
        vision.update(intermediate_size=MLP, out_hidden_size=HIDDEN, window_size=16, fullatt_block_indexes=[1])
        cfg_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=HIDDEN)
        cfg_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    cfg = cfg_cls(vision_config=vision, text_config=_text(rope_parameters=rope), image_token_id=120,
                  video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    # Images of 16x16 and 16x24 pixels: 4x4 and 4x6 patches of 4 pixels, merged 2x2 into 4 and 6 tokens.
    return _with_batch(model_cls(cfg), batch)


def qwen2_5_vl(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Qwen2.5-VL: Qwen2-VL's layout with a windowed-attention vision tower."""
    return qwen2_vl(batch, v25=True)


def _siglip() -> Any:
    return _tf().SiglipVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                    num_attention_heads=HEADS, image_size=16, patch_size=4)


def paligemma(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """PaliGemma: 16 image tokens (4x4 SigLIP patches) + BOS + prompt form the prefix (token type 0)."""
    tf = _tf()
    cfg = tf.PaliGemmaConfig(vision_config=_siglip(), text_config=tf.GemmaConfig(**_text(head_dim=8)),
                             image_token_index=120, vocab_size=VOCAB, projection_dim=HIDDEN, hidden_size=HIDDEN)
    return _with_batch(tf.PaliGemmaForConditionalGeneration(cfg), batch)


def gemma3(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Gemma 3: ``<boi>`` + pooled image tokens + ``<eoi>``, token type 1 on image tokens."""
    tf = _tf()
    text = tf.Gemma3TextConfig(**_text(head_dim=8, query_pre_attn_scalar=8, sliding_window=8))
    cfg = tf.Gemma3Config(vision_config=_siglip(), text_config=text, mm_tokens_per_image=4, image_token_index=120,
                          boi_token_index=121, eoi_token_index=122)
    return _with_batch(tf.Gemma3ForConditionalGeneration(cfg), batch)


def mistral3(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Mistral 3 (Pixtral vision, dynamic resolution): ``image_sizes`` per image (16x16 and 16x24 pixels), rows of
    ``[IMG]`` tokens closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``."""
    tf = _tf()
    vision = tf.PixtralVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                    num_attention_heads=HEADS, head_dim=8, image_size=32, patch_size=4)
    cfg = tf.Mistral3Config(vision_config=vision, text_config=tf.MistralConfig(**_text(head_dim=8)),
                            image_token_index=120, spatial_merge_size=2, vision_feature_layer=-1)
    return _with_batch(tf.Mistral3ForConditionalGeneration(cfg), batch)


def internvl(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """InternVL (the Hugging Face port): ``<img>`` + 4 context tokens per tile (pixel shuffle 0.5) + ``</img>``."""
    tf = _tf()
    vision = tf.InternVLVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                     num_attention_heads=HEADS, image_size=16, patch_size=4)
    cfg = tf.InternVLConfig(vision_config=vision, text_config=tf.Qwen2Config(**_text()), image_token_id=120,
                            image_seq_length=4, downsample_ratio=0.5)
    return _with_batch(tf.InternVLForConditionalGeneration(cfg), batch)


def idefics3(batch: int = 2, *, smolvlm: bool = False, layers: int = LAYERS) -> tuple[Any, dict[str, Any]]:
    """Idefics3 (or SmolVLM): padded image slots per row (1 or 2 images), real images found from the pixels, 4
    tokens per image between ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``."""
    tf = _tf()
    vision = dict(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=HEADS,
                  image_size=16, patch_size=4)
    text = tf.LlamaConfig(**_text(layers))
    if smolvlm:
        model = tf.SmolVLMForConditionalGeneration(
            tf.SmolVLMConfig(vision_config=vision, text_config=text, image_token_id=120, scale_factor=2))
    else:
        model = tf.Idefics3ForConditionalGeneration(
            tf.Idefics3Config(vision_config=vision, text_config=text, image_token_id=120, scale_factor=2))
    return _with_batch(model, batch)


def smolvlm(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """SmolVLM: Idefics3's layout (2 LLM layers)."""
    return idefics3(batch, smolvlm=True, layers=2)


def llava(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Llava: CLIP vision, 17 image tokens per tile (16 patches and CLS, ``"full"`` strategy), 2 LLM layers."""
    tf = _tf()
    vision = tf.CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2,
                                 num_attention_heads=HEADS, image_size=16, patch_size=4, projection_dim=HIDDEN)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=tf.LlamaConfig(**_text(2)), image_token_index=120,
                         vision_feature_layer=-1, vision_feature_select_strategy="full")
    return _with_batch(tf.LlavaForConditionalGeneration(cfg), batch)


def aya_vision(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Aya Vision: SigLIP tiles of 4x4 patches pixel-shuffled 2x2 into 4 image tokens, a Cohere 2 LLM of 2 layers
    (one sliding-window, one full)."""
    tf = _tf()
    text = tf.Cohere2Config(**_text(2, sliding_window=8))
    cfg = tf.AyaVisionConfig(vision_config=_siglip(), text_config=text, image_token_index=120, downsample_factor=2,
                             vision_feature_layer=-1)
    return _with_batch(tf.AyaVisionForConditionalGeneration(cfg), batch)


def mllama(batch: int = 2) -> tuple[Any, dict[str, Any]]:
    """Mllama (Llama 3.2 Vision): one ``<|image|>`` token per row, images of 1 or 2 tiles of 16x16 pixels read by a
    cross-attention layer (the second of 2 LLM layers); a 2-layer local + 1-layer global vision encoder."""
    tf = _tf()
    vision = tf.MllamaVisionConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_global_layers=1,
                                   attention_heads=HEADS, intermediate_size=MLP, vision_output_dim=2 * HIDDEN,
                                   image_size=16, patch_size=4, max_num_tiles=2, intermediate_layers_indices=[0],
                                   supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = tf.MllamaTextConfig(**_text(2, cross_attention_layers=[1]))
    return _with_batch(tf.MllamaForConditionalGeneration(tf.MllamaConfig(vision_config=vision, text_config=text,
                                                                        image_token_index=120)), batch)


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


KWARG_FAMILIES: dict[str, Callable[..., tuple[Any, dict[str, Any]]]] = {
    "llava": llava,
    "aya_vision": aya_vision,
    "mllama": mllama,
    "smolvlm": smolvlm,
}
"""More families, of 2 LLM layers, checked only for a 2-stage split with ``use_cache=False`` among the inputs
(tests/test_hf_families.py)."""


def build(name: str, batch: int = 2, *, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """Family ``name`` with weights seeded by ``seed``, in eval mode (no dropout). ``use_cache`` is left at the
    family's default (on): capture turns it off."""
    torch.manual_seed(seed)
    model, inputs = {**FAMILIES, **KWARG_FAMILIES}[name](batch)
    model.eval()
    return model, inputs
