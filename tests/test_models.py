import pytest
import torch

from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from tests.conftest import SMALL_VLM


def test_default_config_makes_llm_layers_costlier_than_vit_layers():
    m = TinyVLM()
    vit = sum(p.numel() for p in m.vision.layers[0].parameters())
    llm = sum(p.numel() for p in m.llm.layers[0].parameters())
    assert llm >= 3 * vit


def test_loss_ignores_image_tokens_and_is_finite(vlm):
    model, batch = vlm
    loss = model(**batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    logits = model(batch["pixel_values"], batch["input_ids"])
    assert logits.shape == (*batch["input_ids"].shape, SMALL_VLM.vocab_size)


def test_image_features_reach_the_llm(vlm):
    model, batch = vlm
    a = model(**batch)
    b = model(batch["pixel_values"] + 1.0, batch["input_ids"], batch["labels"])
    assert not torch.allclose(a, b)


def test_variable_number_of_tiles():
    torch.manual_seed(0)
    m = TinyVLM(SMALL_VLM)
    for tiles in (0, 1, 3):
        batch = make_example_batch(SMALL_VLM, batch=1, tiles_per_sample=tiles, text_tokens=8)
        assert torch.isfinite(m(**batch))


def test_wrong_image_token_count_is_a_clear_error(vlm):
    model, batch = vlm
    with pytest.raises(ValueError, match="image tokens"):
        model(batch["pixel_values"][:1], batch["input_ids"], batch["labels"])


def test_segment_ids_isolate_packed_samples(vlm):
    model, _ = vlm
    cfg = SMALL_VLM
    a = make_example_batch(cfg, batch=1, tiles_per_sample=0, text_tokens=6, seed=1)
    b = make_example_batch(cfg, batch=1, tiles_per_sample=0, text_tokens=6, seed=2)
    empty = torch.zeros(0, 3, cfg.image_size, cfg.image_size)
    ids = torch.cat([a["input_ids"], b["input_ids"]], 1)
    pos = torch.cat([torch.arange(6), torch.arange(6)]).unsqueeze(0)
    seg = torch.tensor([[0] * 6 + [1] * 6])
    packed = model(empty, ids, None, pos, seg)
    alone = model(empty, b["input_ids"])
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(image_size=30), "multiple of patch_size"),
        (dict(llm_heads=4, llm_kv_heads=3), "llm_kv_heads"),
        (dict(image_token_id=999), "image_token_id"),
    ],
)
def test_bad_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        TinyVLMConfig(**kw)
