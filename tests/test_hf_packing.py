"""Packing for Hugging Face models: a packed row gives every sample the losses it has alone.

Tiny models with random weights, built offline from configs: Llama (text only), Llava (fixed
placeholders per image) and Qwen2-VL (placeholders and 3-D rotary positions from each image's
grid), each under ``sdpa`` and ``eager``. Flash-attention's variable-length layout cannot run on
CPU; its kwargs are checked against what transformers derives from the positions, and run through
each model with a reference attention registered in transformers that reads them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.collate import HFPackingCollator, block_causal_mask, hf_lengths

tf = pytest.importorskip("transformers")

VOCAB = 96
IMG = 95  # image placeholder id of the VLMs below


def _text_config(cls=None, **kw):
    cls = cls or tf.LlamaConfig
    return cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, **kw)


def _llama(impl: str):
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_text_config(use_cache=False))
    model.set_attn_implementation(impl)
    return model.eval()


def _llava(impl: str):
    torch.manual_seed(0)
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=_text_config(use_cache=False), image_token_index=IMG,
                         image_seq_length=17, vision_feature_layer=-1, vision_feature_select_strategy="full")
    model = tf.LlavaForConditionalGeneration(cfg)
    model.set_attn_implementation(impl)
    return model.eval()


def _qwen2_vl(impl: str):
    torch.manual_seed(0)
    vc = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 4,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    tc = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "use_cache": False,
          "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}}
    cfg = tf.Qwen2VLConfig(vision_config=vc, text_config=tc, image_token_id=IMG, video_token_id=92,
                           vision_start_token_id=93, vision_end_token_id=94,
                           bos_token_id=0, eos_token_id=1)
    model = tf.Qwen2VLForConditionalGeneration(cfg)
    model.set_attn_implementation(impl)
    return model.eval()


def _text(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, 90, (n,), generator=g)


def _llama_samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": _text(g, n)} for n in (9, 14, 6)]


def _llava_samples() -> list[dict[str, torch.Tensor]]:
    """Processor-style samples: each <image> already expanded to 17 placeholders, except the second sample,
    which carries one placeholder per image (the collator expands it)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for images, before, after, expanded in ((1, 2, 7, True), (2, 1, 5, False), (0, 0, 8, True)):
        ids = [_text(g, before)]
        for _ in range(images):
            ids += [torch.full((17 if expanded else 1,), IMG), _text(g, 2)]
        ids.append(_text(g, after))
        s = {"input_ids": torch.cat(ids)}
        if images:
            s["pixel_values"] = torch.randn(images, 3, 16, 16, generator=g)
        out.append(s)
    return out


def _qwen_samples() -> list[dict[str, torch.Tensor]]:
    """Images of different grids (t, h, w) in patches; merge 2 -> t*h*w/4 placeholders between vision start/end."""
    g = torch.Generator().manual_seed(1)
    out = []
    for grids, after in (([(1, 4, 4)], 6), ([(1, 2, 4), (1, 4, 2)], 4), ([], 7), ([(1, 6, 4)], 3)):
        ids = [_text(g, 2)]
        for t, h, w in grids:
            ids += [torch.tensor([93]), torch.full((t * h * w // 4,), IMG), torch.tensor([94]), _text(g, 1)]
        ids.append(_text(g, after))
        s = {"input_ids": torch.cat(ids)}
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            s["pixel_values"] = torch.randn(patches, 3 * 2 * 4 * 4, generator=g)
            s["image_grid_thw"] = torch.tensor(grids)
        out.append(s)
    return out


FAMILIES = {
    "llama": (_llama, _llama_samples),
    "llava": (_llava, _llava_samples),
    "qwen2_vl": (_qwen2_vl, _qwen_samples),
}


def _alone(collator: HFPackingCollator, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sample run alone, the way a user would call the model: no mask, no positions (the model numbers them)."""
    batch = replace(collator, row_tokens=None)([sample])
    out = {"input_ids": batch["input_ids"]}
    for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        if k in batch:
            out[k] = batch[k]
    return out


def _per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at each position, as the models' own loss shifts it (0 where ignored)."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def _check_packed_equals_alone(model, collator: HFPackingCollator, samples, batch, *, tol: float = 1e-5) -> float:
    """Per-sample losses and logits of the packed row vs each sample alone; returns the worst loss difference."""
    with torch.no_grad():
        out = model(**batch)
        packed_logits = out.logits[0]
        packed_ce = _per_token_ce(packed_logits, batch["labels"][0])
        start, worst, num, den = 0, 0.0, 0.0, 0
        for s in samples:
            alone_in = _alone(collator, s)
            labels = replace(collator, row_tokens=None)([s])["labels"][0]
            alone = model(**alone_in, labels=labels[None])
            n = alone_in["input_ids"].shape[1]
            torch.testing.assert_close(packed_logits[start:start + n], alone.logits[0], atol=tol, rtol=0)
            got = packed_ce[start:start + n - 1]
            ref = _per_token_ce(alone.logits[0], labels)
            valid = int((labels[1:] != IGNORE_INDEX).sum())
            loss = float(got.sum()) / valid
            assert loss == pytest.approx(float(alone.loss), abs=tol)
            worst = max(worst, abs(loss - float(alone.loss)))
            torch.testing.assert_close(got, ref, atol=tol, rtol=0)
            num, den = num + float(ref.sum()), den + valid
            start += n
        # The model's own loss over the packed row is the token-weighted mean of the samples' losses.
        assert float(out.loss) == pytest.approx(num / den, abs=tol)
    return worst


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_row_losses_equal_each_sample_alone(family: str, impl: str) -> None:
    build, make = FAMILIES[family]
    model = build(impl)
    collator = HFPackingCollator.for_model(model)
    assert collator.attn_implementation == impl
    samples = make()
    batch = collator(samples)
    assert batch["attention_mask"].shape == (1, 1, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
    assert batch["attention_mask"].dtype == torch.float32
    _check_packed_equals_alone(model, collator, samples, batch)


@pytest.mark.parametrize("family", ["llama", "llava"])
def test_padded_row_gives_the_same_losses(family: str) -> None:
    build, make = FAMILIES[family]
    model = build("sdpa")
    samples = make()
    tokens = sum(HFPackingCollator.for_model(model).sample_lengths(s)[1] for s in samples)
    collator = HFPackingCollator.for_model(model, row_tokens=tokens + 7)
    batch = collator(samples)
    assert batch["input_ids"].shape == (1, tokens + 7)
    assert torch.all(batch["labels"][0, tokens:] == IGNORE_INDEX)
    assert batch["position_ids"][0, tokens:].tolist() == list(range(7))
    _check_packed_equals_alone(model, collator, samples, batch)
    with pytest.raises(InputError, match="row_tokens"):
        HFPackingCollator.for_model(model, row_tokens=tokens - 1)(samples)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "llava"])
def test_without_the_block_mask_samples_talk_across(family: str, impl: str) -> None:
    """The equality above depends on the mask: a plain causal 4-D mask lets later samples see earlier ones,
    and so does no mask when the model keeps a cache (transformers infers packing from restarting
    position_ids only when there is none)."""
    build, make = FAMILIES[family]
    model = build(impl)
    collator = HFPackingCollator.for_model(model)
    samples = make()
    batch = collator(samples)
    n = batch["input_ids"].shape[1]
    causal = block_causal_mask([n])
    with pytest.raises(AssertionError):
        _check_packed_equals_alone(model, collator, samples, {**batch, "attention_mask": causal})
    no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    with pytest.raises(AssertionError):
        _check_packed_equals_alone(model, collator, samples, {**no_mask, "use_cache": True})
    # How large the cross-talk is: the second sample's logits against the sample alone.
    with torch.no_grad():
        n0 = batch_len = _alone(collator, samples[0])["input_ids"].shape[1]
        n1 = _alone(collator, samples[1])["input_ids"].shape[1]
        packed = model(**{**batch, "attention_mask": causal}).logits[0, batch_len:batch_len + n1]
        alone = model(**_alone(collator, samples[1])).logits[0]
    assert (packed - alone).abs().max() > 1e-2, n0


def test_eager_needs_an_additive_mask_not_a_boolean_one() -> None:
    model = _llama("eager")
    collator = HFPackingCollator.for_model(model)
    samples = _llama_samples()
    batch = collator(samples)
    boolean = batch["attention_mask"] == 0
    with pytest.raises(AssertionError):
        _check_packed_equals_alone(model, collator, samples, {**batch, "attention_mask": boolean})


def test_mask_dtype_follows_the_model() -> None:
    model = _llama("sdpa").to(torch.bfloat16)
    collator = HFPackingCollator.for_model(model)
    mask = collator(_llama_samples())["attention_mask"]
    assert mask.dtype == torch.bfloat16
    assert mask.min() == torch.finfo(torch.bfloat16).min and mask.max() == 0


def test_block_causal_mask_layout() -> None:
    m = block_causal_mask([2, 3])[0, 0]
    allowed = (m == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_llava_placeholders_expand_as_the_processor_does() -> None:
    collator = HFPackingCollator.for_model(_llava("sdpa"))
    assert collator.tokens_per_image == 17  # 16 patches + CLS under the "full" strategy
    s = {"input_ids": torch.tensor([5, IMG, 6, IMG, 7]), "labels": torch.tensor([5, 1, 6, 2, 7]),
         "pixel_values": torch.zeros(2, 3, 16, 16)}
    batch = collator([s])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert ids.tolist() == [5] + [IMG] * 17 + [6] + [IMG] * 17 + [7]
    assert labels.tolist() == [IGNORE_INDEX] + [IGNORE_INDEX] * 17 + [6] + [IGNORE_INDEX] * 17 + [7]
    assert collator.sample_lengths(s) == (2, 37)
    with pytest.raises(InputError, match="3 image tokens .* for 2 images"):
        collator([{"input_ids": torch.tensor([IMG, IMG, IMG]), "pixel_values": s["pixel_values"]}])
    default = HFPackingCollator.for_model(_llava("sdpa").config.__class__(
        vision_config=_llava("sdpa").config.vision_config, text_config=_text_config(), image_token_index=IMG))
    assert default.tokens_per_image == 16  # the "default" strategy drops CLS


def test_labels_are_ignored_at_each_sample_start_and_positions_restart() -> None:
    collator = HFPackingCollator(attn_implementation="sdpa")
    batch = collator(
        [{"input_ids": torch.arange(1, 5)}, {"input_ids": torch.arange(10, 13), "labels": torch.tensor([1, 2, 3])}]
    )
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, 2, 3, 4, IGNORE_INDEX, 2, 3]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask"}


def test_qwen2_vl_positions_match_the_models_own() -> None:
    """Per sample, the 3-D rotary positions equal what the model computes for the sample alone."""
    model = _qwen2_vl("sdpa")
    collator = HFPackingCollator.for_model(model)
    samples = _qwen_samples()
    batch = collator(samples)
    assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
    start = 0
    for s in samples:
        ids = s["input_ids"][None]
        grid = s.get("image_grid_thw")
        ref, _ = model.model.get_rope_index(ids, (ids == IMG).int(), image_grid_thw=grid)
        n = ids.shape[1]
        assert torch.equal(batch["position_ids"][1:, :, start:start + n], ref)
        assert batch["position_ids"][0, 0, start:start + n].tolist() == list(range(n))
        start += n
    assert torch.equal(
        batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flash_layout_gives_each_sample_its_own_losses(family: str) -> None:
    """The flash layout, run through the model with a CPU stand-in for transformers' flash path (same dispatch
    on kwargs and positions, per-segment attention instead of the kernel): every sample gets its own losses.
    Its boundaries equal what transformers derives from the restarting positions."""
    from transformers import AttentionInterface
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    AttentionInterface.register("omnibal_varlen_reference", _flash_reference_attention)
    build, make = FAMILIES[family]
    model = build("sdpa")
    collator = HFPackingCollator.for_model(model, attn_implementation="flash_attention_2")
    samples = make()
    batch = collator(samples)
    assert "attention_mask" not in batch
    text_pos = batch["position_ids"][0] if batch["position_ids"].dim() == 3 else batch["position_ids"]
    (cu, _), (longest, _) = prepare_fa_kwargs_from_position_ids(text_pos)
    lengths = [collator.sample_lengths(s)[1] for s in samples]
    assert cu.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    if family == "llama":  # text-only: the boundaries precomputed, as DataCollatorWithFlattening emits them
        assert batch["cu_seq_lens_q"].dtype == torch.int32
        assert torch.equal(batch["cu_seq_lens_q"], cu) and torch.equal(batch["cu_seq_lens_k"], cu)
        assert batch["max_length_q"] == batch["max_length_k"] == int(longest) == max(lengths)
    else:  # they would reach the vision tower as well
        assert "cu_seq_lens_q" not in batch
    model.set_attn_implementation("omnibal_varlen_reference")
    _FLASH_SEGMENTS.clear()
    _check_packed_equals_alone(model, HFPackingCollator.for_model(build("sdpa")), samples, batch)
    assert len(samples) in _FLASH_SEGMENTS, "no attention layer split the packed row"
    if family == "llava":  # what precomputed boundaries would do to a VLM: image tokens split at text boundaries
        with pytest.raises(ValueError, match="cu_seqlens cover"):
            _check_packed_equals_alone(model, HFPackingCollator.for_model(build("sdpa")), samples,
                                       {**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                                        "max_length_q": int(longest), "max_length_k": int(longest)})


_FLASH_SEGMENTS: list[int] = []


def _flash_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' ``_flash_attention_forward`` dispatch in plain torch: precomputed ``cu_seq_lens_q`` first, then
    boundaries derived from packed ``position_ids`` of a one-row batch, else one segment; attention within each."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    n = query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and _is_packed_sequence(kwargs.get("position_ids"), query.shape[0]):
        (cu, _), _ = prepare_fa_kwargs_from_position_ids(kwargs["position_ids"])
    bounds = [0, n] if cu is None else cu.tolist()
    if cu is not None:
        if bounds[-1] != n:
            raise ValueError(f"cu_seqlens cover {bounds[-1]} tokens, the layer has {n}")
        _FLASH_SEGMENTS.append(len(bounds) - 1)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=causal,
                                           scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def test_errors_name_the_sample_and_the_fix() -> None:
    llava = HFPackingCollator.for_model(_llava("sdpa"))
    with pytest.raises(InputError, match="no 'input_ids'"):
        llava([{"labels": torch.ones(3)}])
    with pytest.raises(InputError, match="sample 1: labels has 2 entries"):
        llava(
            [
                {"input_ids": torch.ones(3, dtype=torch.long)},
                {"input_ids": torch.ones(3, dtype=torch.long), "labels": torch.ones(2)},
            ]
        )
    with pytest.raises(InputError, match="text-only"):
        HFPackingCollator()([{"input_ids": torch.ones(3, dtype=torch.long), "pixel_values": torch.zeros(1, 3, 4, 4)}])
    with pytest.raises(InputError, match="attn_implementation"):
        HFPackingCollator(attn_implementation="flex_attention")
    with pytest.raises(InputError, match="empty pack"):
        llava([])


def test_lengths_for_the_balancer() -> None:
    collator = HFPackingCollator.for_model(_llava("sdpa"))
    stats = hf_lengths(_llava_samples(), collator)
    assert stats.tiles.tolist() == [1, 2, 0]
    assert stats.tokens.tolist() == [collator.sample_lengths(s)[1] for s in _llava_samples()]
    assert stats.tokens[1] == 1 + 2 * (17 + 2) + 5
