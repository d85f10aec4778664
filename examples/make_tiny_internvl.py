"""Write a tiny "pretrained" InternVL and a LLaVA-format dataset with real images, to try the training path offline.

    python examples/make_tiny_internvl.py OUT

OUT/model: an InternVLForConditionalGeneration (the Hugging Face port) saved with ``save_pretrained`` (config +
safetensors), a word-level tokenizer with InternVL's image tokens (``<img>``, ``</img>``, ``<IMG_CONTEXT>``, named as
InternVL's tokenizer names them) and a Qwen-style chat template, GotOcr2's image processor (the Pillow one: no
torchvision needed) cutting images into tiles of 16x16 pixels (1 to 6 tiles plus a thumbnail), and a
``processor_config.json`` with InternVL's ``image_seq_length`` (4 tokens per tile: 16 patches of 4 pixels, pixel
shuffle 0.5); OUT/train.json and OUT/eval.json: the records of ``examples/make_tiny_llava.py`` (PNG and JPEG images
of 200x150 to 1600x900 pixels in OUT/images, multi-turn and text-only ones among them). Needs transformers and
pillow. Stands in for your own model folder and dataset; nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", ".", "Describe", "it", "Hello", "Hi", "and",
         "blue", "box", "Thanks", "Sure", "a", "green", "square", "small", "big", "system", "user", "assistant",
         "You", "are", "helpful"]
SPECIALS = ["<|endoftext|>", "[UNK]", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}
"""The tokenizer's named image tokens, which InternVLProcessor reads (``tokenizer.start_image_token`` ...)."""
TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a "
            "helpful assistant .<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""InternVL's (Qwen-style) template for string contents: a default system turn, each turn between <|im_start|> and
<|im_end|>; an image is its ``<IMG_CONTEXT>``, which the processor expands to ``<img>`` + its tiles' tokens +
``</img>``."""
TILE, PATCH, MAX_TILES = 16, 4, 6
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // 4
"""Image tokens per tile: the tile's patches after InternVL's pixel shuffle (downsample ratio 0.5)."""


def make(out: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_tiny_llava import write_dataset

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)  # never split, as in InternVL's tokenizer
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>",
                                           eos_token="<|im_end|>", extra_special_tokens=IMAGE_TOKENS)
    tokenizer.chat_template = TEMPLATE
    # crop_to_patches: InternVL's dynamic tiling, as InternVLProcessor asks its image processor for it
    images = tf.GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                         max_patches=MAX_TILES)
    vision = tf.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=TILE, patch_size=PATCH)
    text = tf.Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|endoftext|>"],
                          eos_token_id=vocab["<|im_end|>"])
    config = tf.InternVLConfig(vision_config=vision, text_config=text, image_token_id=vocab["<IMG_CONTEXT>"],
                               image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.InternVLForConditionalGeneration(config).save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    images.save_pretrained(out / "model")
    # What InternVLProcessor.save_pretrained writes (it cannot be built here: its video processor needs torchvision)
    (out / "model" / "processor_config.json").write_text(json.dumps(
        {"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE}, indent=1))
    write_dataset(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/model (a tiny InternVL, its tokenizer, image processor and processor config), "
          "train.json, eval.json and images/")
