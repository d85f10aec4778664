"""Shared tiny models and batches. Hugging Face fixtures skip cleanly without transformers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

warnings.filterwarnings("ignore")

SMALL_VLM = TinyVLMConfig(
    image_size=16, patch_size=4, vit_hidden=32, vit_layers=2, vit_heads=2, vit_mlp=64,
    llm_hidden=32, llm_layers=3, llm_heads=4, llm_kv_heads=2, llm_mlp=64, vocab_size=64, image_token_id=63,
)


@pytest.fixture(scope="session")
def vlm() -> tuple[TinyVLM, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    return model, make_example_batch(SMALL_VLM, batch=2, tiles_per_sample=1, text_tokens=12)


def _hf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_llama():
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="session")
def tiny_llava():
    tf = _hf()
    torch.manual_seed(0)
    vc = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        projection_dim=32,
    )
    tc = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    cfg = tf.LlavaConfig(
        vision_config=vc, text_config=tc, image_token_index=95, image_seq_length=17, vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    model = tf.LlavaForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (2, 24), generator=g)
    ids[:, :17] = 95  # 16 patches + CLS ("full" strategy keeps it)
    labels = ids.clone()
    labels[:, :17] = -100
    return model, {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "input_ids": ids, "labels": labels}


@pytest.fixture(scope="session")
def lengths_file(tmp_path_factory):
    # OmniBal's format in InternVL units (256 tokens per tile); scaled to the small model on load.
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(40):
        tiles = int(torch.randint(1, 4, (1,), generator=g))
        records.append({"vit_num": tiles, "token_num": tiles * 256 + int(torch.randint(64, 700, (1,), generator=g)),
                        "image_flags": tiles})
    path = tmp_path_factory.mktemp("lengths") / "lengths.json"
    path.write_text(json.dumps(records))
    return str(path)
