"""Write a tiny "pretrained" Llava and a LLaVA-format dataset with real images, to try the training path offline.

    python examples/make_tiny_llava.py OUT

OUT/model: a LlavaForConditionalGeneration saved with ``save_pretrained`` (config + safetensors), its
processor (a word-level tokenizer with a chat template, a CLIP image processor of 16x16 pixels);
OUT/train.json and OUT/eval.json: conversation records with PNG and JPEG images of 200x150 to 1600x900
pixels in OUT/images, multi-turn and text-only ones among them. Needs transformers and pillow. Stands
in for your own model folder and dataset; nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", ".", "Describe", "it", "Hello", "Hi", "and",
         "blue", "box", "Thanks", "Sure", "a", "green", "square", "small", "big"]
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<image>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make(out: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                           bos_token="<s>", eos_token="</s>", additional_special_tokens=SPECIALS[4:])
    images = tf.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                  vision_feature_select_strategy="full", num_additional_image_tokens=1,
                                  chat_template=TEMPLATE, image_token="<image>")
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                            image_seq_length=17, vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(config).save_pretrained(out / "model")
    processor.save_pretrained(out / "model")
    write_dataset(out)


def write_dataset(out: Path) -> None:
    """OUT/images (PNG and JPEG files of varied sizes), OUT/train.json and OUT/eval.json (see the module doc)."""
    from PIL import Image

    (out / "images").mkdir(parents=True, exist_ok=True)
    pictures = {"red.png": (200, 150, (200, 30, 30)), "blue.jpg": (1600, 900, (20, 20, 220)),
                "green.png": (300, 500, (20, 200, 20)), "small.jpg": (240, 240, (240, 240, 20))}
    for name, (w, h, color) in pictures.items():
        Image.new("RGB", (w, h), color).save(out / "images" / name, format="PNG" if name.endswith("png") else "JPEG")

    def ask(image: str | list[str] | None, question: str, answer: str) -> dict[str, object]:
        record: dict[str, object] = {"conversations": [{"from": "human", "value": question},
                                                      {"from": "gpt", "value": answer}]}
        if image is not None:
            record["image"] = image
        return record

    train = [
        ask("images/red.png", "<image>\nWhat is in the picture ?", "A red bar ."),
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi"},
                           {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "Sure"}]},
        {"image": ["images/blue.jpg", "images/green.png"],
         "messages": [{"role": "system", "content": "Describe it"},
                      {"role": "user", "content": "What is in the picture ?"},
                      {"role": "assistant", "content": "A blue box and a green square ."}]},
        ask("images/green.png", "Describe it <image>", "A green square"),
        ask("images/small.jpg", "<image>\nWhat is in the picture ?", "A small square ."),
        ask(None, "Describe a red bar", "A red bar is a small red box ."),
        ask("images/blue.jpg", "<image> Describe it", "A big blue box ."),
        ask("images/red.png", "What is in the picture ? <image>", "A red bar and a small box ."),
    ]
    held_out = [ask("images/small.jpg", "<image>\nDescribe it", "A small square ."),
                ask(None, "Hello", "Hi"), ask("images/blue.jpg", "What is in the picture ? <image>", "A blue box .")]
    (out / "train.json").write_text(json.dumps(train, indent=1))
    (out / "eval.json").write_text(json.dumps(held_out, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/model (a tiny Llava and its processor), train.json, eval.json and images/")
