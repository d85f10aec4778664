"""Packs in each Hugging Face family's own layout (models/hf_inputs.hf_pack_inputs): every sample of a packed
row gets the logits it gets run alone, with the model building its own mask (bidirectional image/prefix
attention, sliding windows, 3-D rotary positions)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from hf_families import build  # noqa: E402

from omnibal_compile.data.collate import PackingCollator, synthetic_sample  # noqa: E402
from omnibal_compile.data.packing import PackShape  # noqa: E402
from omnibal_compile.integrations.hf.collate import block_ids, segment_mask  # noqa: E402
from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_pack_inputs  # noqa: E402

TOL = 1e-5
SAMPLES = [(1, 14), (2, 9), (1, 7)]
"""(tiles, text tokens) of the packed samples."""


def _collate(facts, samples, *, tiles, tokens, g):
    made = [synthetic_sample(t, t * facts["tokens_per_tile"] + n, tokens_per_tile=facts["tokens_per_tile"],
                             image_token_id=facts["image_token_id"], vocab_size=facts["image_token_id"],
                             image_shape=facts["image_shape"], generator=g) for t, n in samples]
    collator = PackingCollator(shape=PackShape(tiles=tiles, tokens=tokens), tokens_per_tile=facts["tokens_per_tile"],
                               image_token_id=facts["image_token_id"], image_shape=facts["image_shape"])
    return made, collator


@pytest.mark.parametrize("family", ["gemma3", "paligemma", "qwen2_vl", "mistral3", "idefics3", "internvl"])
def test_each_sample_of_a_pack_sees_what_it_sees_alone(family):
    model, _ = build(family)
    if family == "gemma3":  # its projector starts at zero: every image token would get the same features, and
        with torch.no_grad():  # attention over identical values cannot tell a bidirectional block from a causal one
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    facts = hf_data_facts(model)
    tpt = facts["tokens_per_tile"]
    g = torch.Generator().manual_seed(3)
    lengths = [(t, t * tpt + n) for t, n in SAMPLES]
    # room for one dummy tile and padding: the tail segment must not disturb the samples either
    made, collator = _collate(facts, SAMPLES, tiles=sum(t for t, _ in lengths) + 1,
                              tokens=sum(n for _, n in lengths) + 3, g=g)
    packed = hf_pack_inputs(model, collator(made))
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
    start = 0
    for (tiles, tokens), sample in zip(lengths, made):
        alone_collator = PackingCollator(
            shape=PackShape(tiles=tiles, tokens=tokens),
            tokens_per_tile=tpt,
            seq_len=tokens,
            image_token_id=facts["image_token_id"],
            image_shape=facts["image_shape"],
        )
        alone = hf_pack_inputs(model, alone_collator([sample]))
        # the model's own masking and positions: no mask, no positions given
        alone = {k: v for k, v in alone.items() if k not in ("labels", "attention_mask", "position_ids")}
        with torch.no_grad():
            want = model(**alone).logits[0]
        diff = float((logits[start:start + tokens] - want).abs().max())
        assert diff <= TOL, (family, start, diff)
        start += tokens


def test_gemma3_pack_mask_is_bidirectional_within_each_image_and_windowed():
    model, _ = build("gemma3")
    facts = hf_data_facts(model)
    made, collator = _collate(facts, [(1, 5), (1, 5)], tiles=2, tokens=2 * (facts["tokens_per_tile"] + 5), g=None)
    masks = hf_pack_inputs(model, collator(made))["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    full = masks["full_attention"][0, 0] == 0
    assert bool(full[0, facts["tokens_per_tile"] - 1])  # the first image token sees the image's last one
    second = facts["tokens_per_tile"] + 5
    assert not bool(full[second, 0])  # but nothing of the sample before it
    window = model.config.text_config.sliding_window
    sliding = masks["sliding_attention"][0, 0] == 0
    assert bool(full[second - 1, 0]) and not bool(sliding[second - 1, second - 1 - window])


def test_block_ids_do_not_cross_segments():
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    inside = torch.tensor([[True, True, False, True, True, False]])
    assert block_ids(seg, inside).tolist() == [[0, 0, -1, 1, 1, -1]]
    adjacent = torch.tensor([[False, True, True, True, True, False]])  # a run over the boundary is two blocks
    assert block_ids(seg, adjacent).tolist() == [[-1, 0, 0, 1, 1, -1]]
    mask = segment_mask(seg, blocks=block_ids(seg, inside))[0, 0] == 0
    assert bool(mask[0, 1]) and not bool(mask[2, 3])


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("strategy", ["full", "default"])
def test_a_llava_tile_is_its_towers_tokens_with_or_without_a_class_token(tower, strategy):
    """A Llava's image placeholders: the tower's patches, CLIP's class token (SigLIP has none), less the first token
    under "default"; the example batch runs (a miscount is the model's "Image features and image tokens do not
    match")."""
    import transformers as tf

    from omnibal_compile.integrations.hf.inputs import hf_example_batch

    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "image_size": 32, "patch_size": 8}
    vision = tf.CLIPVisionConfig(**size, projection_dim=32) if tower == "clip" else tf.SiglipVisionConfig(**size)
    text = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2)
    model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=127, vision_feature_layer=-1,
        vision_feature_select_strategy=strategy))
    assert hf_data_facts(model)["tokens_per_tile"] == 16 + (tower == "clip") - (strategy == "default")
    with torch.no_grad():
        assert torch.isfinite(model(**hf_example_batch(model, batch=1, text=4, seed=0)).loss)
