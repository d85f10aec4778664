"""The packing collator: fixed shape, masking, positions; packed losses equal one-by-one losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL_VLM
from contracts import assert_frozen_keyword_only

from omnibal_compile.data import MODEL_KEYS, PackingCollator, PackShape, synthetic_sample
from omnibal_compile.errors import InputError
from omnibal_compile.models import TinyVLM

TPT = SMALL_VLM.tokens_per_tile
IMG = SMALL_VLM.image_token_id
SHAPE3 = (SMALL_VLM.channels, SMALL_VLM.image_size, SMALL_VLM.image_size)


def _collator(tiles: int = 5, tokens: int = 60, **kw: object) -> PackingCollator:
    return PackingCollator(shape=PackShape(tiles=tiles, tokens=tokens), tokens_per_tile=TPT, image_token_id=IMG,
                           image_shape=SHAPE3, **kw)  # type: ignore[arg-type]


def _sample(tiles: int, tokens: int, seed: int) -> dict[str, torch.Tensor]:
    return synthetic_sample(tiles, tokens, tokens_per_tile=TPT, image_token_id=IMG, vocab_size=SMALL_VLM.vocab_size,
                            image_shape=SHAPE3, generator=torch.Generator().manual_seed(seed))


def _per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at each position (0 where the target is ignored), as TinyVLM computes it."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("lengths", [[(1, 9), (2, 14), (0, 7)], [(2, 20)], [(1, 5), (1, 6), (1, 7), (1, 8)]])
def test_packed_per_sample_losses_equal_one_by_one(lengths: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM).eval()
    samples = [_sample(v, t, seed=i) for i, (v, t) in enumerate(lengths)]
    batch = _collator()(samples)
    with torch.no_grad():
        packed_logits = model(**{k: batch[k] for k in MODEL_KEYS if k != "labels"})[0]
        packed_ce = _per_token_ce(packed_logits, batch["labels"][0])
        cu = batch["cu_seqlens"].tolist()
        total_num, total_den = 0.0, 0
        for i, s in enumerate(samples):
            alone = model(s["pixel_values"], s["input_ids"][None])[0]
            ref = _per_token_ce(alone, s["labels"])
            start, end = cu[i], cu[i + 1]
            # Position j of the sample predicts token j + 1 of the same sample; the last one predicts
            # the next sample's first token, whose label the collator masks.
            got = packed_ce[start:end - 1]
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
            assert batch["labels"][0, start] == -100
            total_num += float(ref.sum())
            total_den += int((s["labels"][1:] != -100).sum())
        # The model's own packed loss is the token-weighted mean of the samples' losses.
        loss = model(**{k: batch[k] for k in MODEL_KEYS})
        assert float(loss) == pytest.approx(total_num / total_den, rel=1e-5)


def test_fixed_shape_positions_segments_and_cu_seqlens() -> None:
    c = _collator(tiles=5, tokens=60)
    batch = c([_sample(1, 9, 0), _sample(2, 14, 1)])
    row = 60 + 5 * TPT
    assert batch["pixel_values"].shape == (5, *SHAPE3)
    assert torch.all(batch["pixel_values"][3:] == 0)  # two dummy tiles
    for k in ("input_ids", "labels", "position_ids", "segment_ids"):
        assert batch[k].shape == (1, row)
    assert batch["cu_seqlens"].tolist() == [0, 9, 23, row]
    assert batch["cu_seqlens"].dtype == torch.int32
    pos = batch["position_ids"][0].tolist()
    assert pos[:9] == list(range(9)) and pos[9:23] == list(range(14)) and pos[23] == 0
    seg = batch["segment_ids"][0].tolist()
    assert seg[:9] == [0] * 9 and seg[9:23] == [1] * 14 and set(seg[23:]) == {2}
    ids = batch["input_ids"][0]
    assert int((ids == IMG).sum()) == 5 * TPT  # dummy tiles have placeholders
    assert torch.all(ids[23:23 + 2 * TPT] == IMG) and torch.all(ids[23 + 2 * TPT:] == 0)
    assert torch.all(batch["labels"][0, 23:] == -100)


def test_truncate_cuts_tiles_and_tokens_consistently() -> None:
    over_in_tiles = _collator(tiles=4, tokens=60, oversized="truncate")([_sample(5, 30, 0)])  # tokens fit
    assert over_in_tiles["pixel_values"].shape[0] == 4 and (over_in_tiles["input_ids"] == IMG).sum() == 4 * TPT
    c = _collator(tiles=2, tokens=20, oversized="truncate")
    big = _sample(3, 3 * TPT + 30, 0)  # 3 tiles, 42 tokens: over both limits
    batch = c([big])
    ids = batch["input_ids"][0]
    assert int((ids[:20] == IMG).sum()) == 2 * TPT
    assert batch["cu_seqlens"].tolist()[:2] == [0, 20]
    assert torch.equal(batch["pixel_values"][:2], big["pixel_values"][:2])
    TinyVLM(SMALL_VLM)(**{k: batch[k] for k in MODEL_KEYS})  # consistent image tokens: runs
    cut = _collator(tiles=3, tokens=3 * TPT - 2, oversized="truncate")([_sample(3, 3 * TPT + 4, 1)])
    # The first 10 tokens cut the third tile's placeholders: that tile is dropped whole.
    assert cut["cu_seqlens"].tolist()[:2] == [0, 2 * TPT]
    assert torch.all(cut["pixel_values"][2] == 0)
    TinyVLM(SMALL_VLM)(**{k: cut[k] for k in MODEL_KEYS})


def test_own_pack_sample_gets_its_own_shape_and_errors_are_named() -> None:
    own = _collator(tiles=2, tokens=20, oversized="own-pack")([_sample(3, 40, 0)])
    assert own["pixel_values"].shape[0] == 3 and own["input_ids"].shape == (1, 40)
    with pytest.raises(InputError, match="over the shape"):
        _collator(tiles=2, tokens=20)([_sample(3, 40, 0)])
    # over in tiles alone, or in tokens alone, is over; exactly at the shape is not
    for tiles, tokens in ((3, 20), (2, 21 + 2 * TPT)):
        with pytest.raises(InputError, match=f"has {tiles} tiles and .* over the shape"):
            _collator(tiles=2, tokens=20 + 2 * TPT)([_sample(tiles, tokens, 0)])
    assert _collator(tiles=2, tokens=20 + 2 * TPT)([_sample(2, 20 + 2 * TPT, 0)])["pixel_values"].shape[0] == 2
    assert_frozen_keyword_only(_collator())
    bad = _sample(1, 9, 0)
    bad["pixel_values"] = bad["pixel_values"].repeat(2, 1, 1, 1)
    with pytest.raises(InputError, match="sample 1: input_ids hold 4 image tokens but it has 2 tiles"):
        _collator()([_sample(1, 9, 1), bad])
    with pytest.raises(InputError, match="dummy tiles"):
        _collator(seq_len=9 + 5 * TPT - 1)([_sample(0, 9, 1)])


def test_each_samples_fields_are_checked_and_labels_default_to_the_text() -> None:
    c = _collator()
    s = _sample(1, 9, 0)
    del s["labels"]
    out = c([s])
    ids, labels = out["input_ids"][0, :9], out["labels"][0, :9]
    assert torch.equal(labels, torch.where(ids == IMG, -100, ids))  # image placeholders are never targets
    assert (labels == -100).sum() == TPT and (labels != -100).sum() == 9 - TPT
    for bad, message in (
        ({"pixel_values": torch.zeros(SHAPE3)}, r"sample 0: pixel_values has shape \(3, 16, 16\)"),
        ({"pixel_values": torch.zeros(1, 1, 16, 16)}, r"pixel_values has shape \(1, 1, 16, 16\), expected"),
        ({"labels": torch.zeros(8, dtype=torch.long)}, "labels has 8 entries but input_ids 9"),
    ):
        with pytest.raises(InputError, match=message):
            c([{**_sample(1, 9, 0), **bad}])
    with pytest.raises(InputError, match="sample 0: input_ids is empty"):
        c([{"input_ids": torch.zeros(0, dtype=torch.long)}])
    text_only = c([{"input_ids": torch.arange(5)}])  # no pixel_values: a text-only sample
    assert text_only["input_ids"][0, :5].tolist() == [0, 1, 2, 3, 4]
    assert c([{"input_ids": torch.tensor([7])}])["input_ids"][0, 0] == 7  # one token is a sample


def test_synthetic_samples_by_hand() -> None:
    s = synthetic_sample(2, 2 * TPT + 1, tokens_per_tile=TPT, image_token_id=5, vocab_size=6, image_shape=SHAPE3,
                         generator=torch.Generator().manual_seed(0))
    ids = s["input_ids"]
    assert ids.tolist()[: 2 * TPT] == [5] * (2 * TPT) and ids[-1] != 5  # placeholders first, then text
    assert s["labels"].tolist() == [-100] * (2 * TPT) + [int(ids[-1])] and s["pixel_values"].shape == (2, *SHAPE3)
    # text is drawn from the whole vocabulary but never holds the image token
    many = synthetic_sample(0, 400, tokens_per_tile=TPT, image_token_id=3, vocab_size=6, image_shape=SHAPE3,
                            generator=torch.Generator().manual_seed(1))["input_ids"]
    assert set(many.tolist()) == {0, 1, 2, 4, 5}
    with pytest.raises(InputError, match=f"a sample with 2 tiles needs more than {2 * TPT} tokens, got {2 * TPT}"):
        synthetic_sample(2, 2 * TPT, tokens_per_tile=TPT, image_token_id=5, vocab_size=6, image_shape=SHAPE3)
