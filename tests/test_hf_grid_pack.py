"""Qwen2-VL packs of real images in one fixed layout (integrations/hf/grid_pack.py): every pack has the same shapes
whatever its images, the free tiles make a filler image in the padding tail, and each sample of a pack gets the
loss it has alone (the filler, the empty images and the padding add nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from test_hf_packing import IMG, _qwen2_vl, _qwen_samples  # noqa: E402

from omnibal_compile.data.collate import PackingCollator, synthetic_sample  # noqa: E402
from omnibal_compile.data.packing import PackShape  # noqa: E402
from omnibal_compile.errors import InputError  # noqa: E402
from omnibal_compile.integrations.hf.grid_pack import GridPackCollator  # noqa: E402
from omnibal_compile.integrations.hf.grids import grid_free_capture  # noqa: E402
from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_pack_inputs  # noqa: E402

SHAPE = PackShape(tiles=12, tokens=48)
ROW = 56
"""Q_v tiles (merged patches), Q_t tokens and the row: room for every pack of the samples below."""


def _collator() -> GridPackCollator:
    return GridPackCollator(shape=SHAPE, seq_len=ROW, merge=2, patch_dim=3 * 2 * 4 * 4, image_token_id=IMG,
                            pad_token_id=0)


def _tiles(sample) -> int:
    return int(sample["image_grid_thw"].prod(-1).sum()) // 4 if "image_grid_thw" in sample else 0


def test_packs_of_other_images_have_the_same_shapes_with_a_filler_image_in_the_tail():
    samples = _qwen_samples()  # tiles 4, 4, 0, 6
    collate = _collator()
    rows = [collate(pack) for pack in ([samples[0], samples[1]], [samples[2]], [samples[3], samples[2]])]
    shapes = {k: tuple(v.shape) for k, v in rows[0].items()}
    assert shapes == {"pixel_values": (12 * 4, 96), "image_grid_thw": (12, 3), "input_ids": (1, ROW),
                      "labels": (1, ROW), "position_ids": (1, ROW), "segment_ids": (1, ROW)}
    assert all({k: tuple(v.shape) for k, v in r.items()} == shapes for r in rows[1:])
    # pack 0: its three images, the filler of the 12 - 8 free tiles, empty images for the grid rows left
    assert rows[0]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 4, 2], [1, 2, 8]] + [[0, 2, 2]] * 8
    assert rows[1]["image_grid_thw"].tolist() == [[1, 2, 24]] + [[0, 2, 2]] * 11  # text only: the filler is all
    assert torch.equal(rows[0]["pixel_values"][:32], torch.cat([samples[0]["pixel_values"],
                                                                samples[1]["pixel_values"]]))
    assert not rows[0]["pixel_values"][32:].any()  # the filler's pixels are zeros
    ids, labels, seg = rows[0]["input_ids"][0], rows[0]["labels"][0], rows[0]["segment_ids"][0]
    tail, used = seg == 2, samples[0]["input_ids"].numel() + samples[1]["input_ids"].numel()
    assert int(tail.sum()) == ROW - used and bool((ids[tail][:4] == IMG).all())
    assert not bool((ids[tail][4:] == IMG).any())
    assert bool((labels[tail] == -100).all()) and int((ids == IMG).sum()) == SHAPE.tiles  # one placeholder a tile
    assert rows[0]["position_ids"][0, used] == 0  # the tail restarts its positions
    with pytest.raises(InputError, match=r"pack of 3 samples has 14 tiles \(merged patches\).*over the shape"):
        collate([samples[0], samples[1], samples[3]])
    with pytest.raises(InputError, match="input_ids hold 3 image tokens"):
        collate([{**samples[0], "input_ids": samples[0]["input_ids"][4:]}])


def test_a_row_of_synthetic_tiles_has_the_shapes_of_a_row_of_real_images():
    """The plan's example (tiles from lengths) and the run's packs (real images) must fit the same stages."""
    model = _qwen2_vl("sdpa")
    facts = hf_data_facts(model)
    assert facts["tokens_per_tile"] == 1 and facts["image_shape"] == (3, 8, 8)  # a tile is one merged patch
    g = torch.Generator().manual_seed(0)
    made = [synthetic_sample(t, n, tokens_per_tile=1, image_token_id=IMG, vocab_size=90, image_shape=(3, 8, 8),
                             generator=g) for t, n in ((4, 13), (6, 15))]
    synthetic = hf_pack_inputs(model, PackingCollator(shape=SHAPE, tokens_per_tile=1, image_token_id=IMG,
                                                      image_shape=(3, 8, 8), seq_len=ROW)(made))
    real = hf_pack_inputs(model, _collator()(_qwen_samples()[:2]))
    assert {k: v.shape for k, v in synthetic.items()} == {k: v.shape for k, v in real.items()}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_each_sample_of_a_pack_gets_its_loss_alone_and_the_filler_adds_nothing(impl):
    model = _qwen2_vl(impl)
    samples = _qwen_samples()
    for s in samples:
        s["labels"] = torch.where(s["input_ids"] == IMG, -100, s["input_ids"])
    packs = ([samples[0], samples[1]], [samples[3], samples[2]])
    for pack in packs:
        row = hf_pack_inputs(model, _collator()(pack))
        with torch.no_grad(), grid_free_capture(model):  # as the captured stages run it: empty images allowed
            packed = model(**row)
        start, total, count = 0, 0.0, 0
        for s in pack:
            alone = {k: v[None] if k in ("input_ids", "labels") else v for k, v in s.items()}
            alone["mm_token_type_ids"] = (alone["input_ids"] == IMG).int()
            with torch.no_grad():
                out = model(**alone)  # the model's own positions and masking
            n = s["input_ids"].numel()
            assert float((packed.logits[0, start:start + n] - out.logits[0]).abs().max()) <= 1e-5
            weight = int((s["labels"][1:] != -100).sum())
            total, count, start = total + float(out.loss) * weight, count + weight, start + n
        assert abs(float(packed.loss) - total / count) <= 1e-5, (float(packed.loss), total / count)
