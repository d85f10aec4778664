"""Write a tiny "pretrained" Qwen2-VL and a LLaVA-format dataset with real images, to try the training path offline.

    python examples/make_tiny_qwen2vl.py OUT

OUT/model: a Qwen2VLForConditionalGeneration saved with ``save_pretrained`` (config + safetensors), a word-level
tokenizer with Qwen's special tokens and a Qwen-style chat template, and Qwen2-VL's image processor (the
Pillow one: no torchvision needed) with small ``min_pixels``/``max_pixels``, so that an image gives 4 to 16
merged patches; OUT/train.json and OUT/eval.json: the records of ``examples/make_tiny_llava.py`` (PNG and JPEG
images of 200x150 to 1600x900 pixels in OUT/images, multi-turn and text-only ones among them). Needs
transformers and pillow. Stands in for your own model folder and dataset; nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", ".", "Describe", "it", "Hello", "Hi", "and",
         "blue", "box", "Thanks", "Sure", "a", "green", "square", "small", "big", "system", "user", "assistant",
         "You", "are", "helpful"]
SPECIALS = ["<|endoftext|>", "[UNK]", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a "
            "helpful assistant .<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2-VL's template for string contents: a default system turn, each turn between <|im_start|> and <|im_end|>."""


def make(out: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_tiny_llava import write_dataset

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>",
                                           eos_token="<|im_end|>", additional_special_tokens=SPECIALS[2:])
    tokenizer.chat_template = TEMPLATE
    # patch 4, merge 2: a merged patch is 8x8 pixels; 256..1024 pixels give 4..16 merged patches per image
    images = tf.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                         size={"shortest_edge": 256, "longest_edge": 1024})
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "in_channels": 3,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    text = {"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
            "pad_token_id": vocab["<|endoftext|>"], "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"]}
    config = tf.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=vocab["<|image_pad|>"],
                              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.Qwen2VLForConditionalGeneration(config).save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    images.save_pretrained(out / "model")
    write_dataset(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/model (a tiny Qwen2-VL, its tokenizer and image processor), train.json, eval.json "
          "and images/")
