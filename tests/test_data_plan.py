"""The data pass: optimize(lengths=...) fixes the micro-batch shape and carries sampler and collator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMALL_VLM
from torch.utils.data import DataLoader

import omnibal_compile as oc
from omnibal_compile.data import MODEL_KEYS, DataOptions, PackShape, plan_data, synthetic_sample
from omnibal_compile.data.lengths import bundled_length_files
from omnibal_compile.errors import InputError
from omnibal_compile.models import TinyVLM


def _lengths(n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tiles = rng.integers(0, 3, n)
    return tiles, tiles * SMALL_VLM.tokens_per_tile + rng.integers(2, 12, n)


def test_optimize_with_lengths_plans_on_the_balanced_shape_and_feeds_it() -> None:
    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    tiles, tokens = _lengths()
    opts = DataOptions(dp=2, samples_per_pack=3, source_tokens_per_tile=None)
    result = oc.optimize(model, lengths=(tiles, tokens), data=opts, num_stages=2)
    plan = result.data
    assert plan is not None and "data" in result.timings
    assert result.captured.flatten_inputs(**plan.example_batch())[1].shape == (1, plan.seq_len)
    # Feed rank 1's first two steps through the stages: the fixed shape runs and matches the model.
    dataset = [
        synthetic_sample(
            int(v),
            int(t),
            tokens_per_tile=SMALL_VLM.tokens_per_tile,
            image_token_id=SMALL_VLM.image_token_id,
            vocab_size=SMALL_VLM.vocab_size,
            image_shape=(3, SMALL_VLM.image_size, SMALL_VLM.image_size),
            generator=torch.Generator().manual_seed(i),
        )
        for i, (v, t) in enumerate(zip(tiles, tokens))
    ]
    loader = DataLoader(dataset, batch_sampler=plan.sampler(rank=1), collate_fn=plan.collator)
    for _step, batch in zip(range(2), loader):
        inputs = {k: batch[k] for k in MODEL_KEYS}
        assert inputs["pixel_values"].shape[0] == plan.shape.tiles
        assert inputs["input_ids"].shape == (1, plan.seq_len)
        torch.testing.assert_close(result.run(**inputs), model(**inputs))
    assert oc.OptimizeResult.__dataclass_fields__["data"].default is None  # results without lengths


def test_optimize_data_errors_are_named() -> None:
    model = TinyVLM(SMALL_VLM)
    with pytest.raises(InputError, match="needs lengths"):
        oc.optimize(model, num_stages=2, data=DataOptions())
    with pytest.raises(InputError, match="cannot build example inputs"):  # a model with no way to build them
        oc.optimize(torch.nn.Sequential(torch.nn.Linear(2, 2)), num_stages=1)
    with pytest.raises(InputError, match="tokens_per_tile"):
        plan_data(_lengths(), DataOptions(source_tokens_per_tile=None), model=torch.nn.Linear(2, 2))
    with pytest.raises(InputError, match="method"):
        DataOptions(method="greedy")


def test_isf_method_plan_runs_on_synthetic_lengths() -> None:
    tiles, tokens = _lengths(400)
    plan = plan_data((tiles, tokens), DataOptions(dp=4, samples_per_pack=4, method="isf", source_tokens_per_tile=None),
                     model=TinyVLM(SMALL_VLM))
    assert 4 <= plan.metrics.samples_per_pack <= 5
    sampler = plan.sampler(rank=0)
    assert sum(len(b) for b in sampler) > 0


def test_shared_statistics_scaled_to_the_tiny_model() -> None:
    plan = plan_data(bundled_length_files(), DataOptions(dp=8, samples_per_pack=4), model=TinyVLM(SMALL_VLM))
    assert plan.stats.tokens.max() < 1_832  # scaled from 256 to 4 tokens per tile
    assert plan.metrics.dist_vision <= 0.01 and plan.metrics.dist_language <= 0.02
    batch = plan.example_batch()
    assert batch["input_ids"].shape == (1, plan.seq_len) and batch["pixel_values"].shape[0] == plan.shape.tiles


@pytest.mark.parametrize("oversized", ["truncate", "own-pack"])
def test_every_epoch_fits_the_planned_row(oversized: str) -> None:
    tiles, tokens = _lengths(300)
    tiles[5], tokens[5] = 9, 9 * SMALL_VLM.tokens_per_tile + 5  # over the shape below
    model = TinyVLM(SMALL_VLM)
    probe = plan_data((tiles, tokens), DataOptions(dp=4, samples_per_pack=4, source_tokens_per_tile=None), model=model)
    shape = PackShape(tiles=probe.shape.tiles - 1, tokens=probe.shape.tokens)
    plan = plan_data((tiles, tokens), DataOptions(dp=4, samples_per_pack=4, source_tokens_per_tile=None, shape=shape,
                                                  oversized=oversized), model=model)
    tpt = SMALL_VLM.tokens_per_tile
    assert plan.seq_len < shape.tokens + shape.tiles * tpt  # tighter than the always-safe bound
    assert plan.metrics.oversized >= 1
    sampler = plan.sampler(rank=0)
    for epoch in range(3):
        packing = sampler.packing(epoch)
        packing.check_exactly_once(300)
        v = np.minimum(tiles, shape.tiles) if oversized == "truncate" else tiles
        t = np.minimum(tokens, shape.tokens) if oversized == "truncate" else tokens
        pv, pt = packing.pack_sums(v), packing.pack_sums(t)
        lone = np.diff(packing.offsets) == 1
        normal = ~(lone & np.isin(packing.order[packing.offsets[:-1]], packing.oversized))
        assert (pv[normal] <= shape.tiles).all() and (pt[normal] <= shape.tokens).all()
        assert (pt[normal] + (shape.tiles - pv[normal]) * tpt <= plan.seq_len).all()
