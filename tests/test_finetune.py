"""The documented fine-tune path end to end on 4 ranks: ``lengths --model`` -> ``plan`` -> ``run`` (dp=2 x pp=2) on a
pretrained tiny Llava folder and a LLaVA-format dataset of real images, checked against the unsplit model on each
sample alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llava

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
@pytest.mark.distributed
def test_lengths_plan_run_on_dp2_x_pp2_trains_the_pretrained_model_on_the_real_samples(tiny, tmp_path, monkeypatch):
    from transformers import LlavaForConditionalGeneration

    from omnibal_compile.cli import main
    from omnibal_compile.integrations.hf.dataset import ConversationDataset, load_processor

    monkeypatch.chdir(tmp_path)
    model_spec = f"hf:{tiny / 'model'}"
    assert main(["lengths", str(tiny / "train.json"), "--model", model_spec, "--out", "lengths.jsonl"]) == 0
    assert main(["plan", model_spec, "--lengths", "lengths.jsonl", "--num-stages", "2", "--dp", "2",
                 "--no-pictures", "--out", "plan"]) == 0
    assert main(["run", "--plan", "plan/plan.json", "--model", model_spec, "--dataset", str(tiny / "train.json"),
                 "--dp", "2", "--batch-size", "4", "--samples-per-pack", "2", "--num-microbatches", "2", "--steps", "1",
                 "--optimizer", "sgd",
                 "--log", "steps.jsonl", "--timeout", "400"]) == 0
    (step,) = [json.loads(line) for line in Path("steps.jsonl").read_text().splitlines()]
    ids = [i for rank in step["samples"] for i in rank]
    assert len(step["samples"]) == 2 and len(ids) == len(set(ids)) > 2  # both dp ranks, distinct records

    # each sample alone through the pretrained model (its processor's tensors, its own labels), token-weighted
    dataset = ConversationDataset(tiny / "train.json", load_processor(tiny / "model"))
    model = LlavaForConditionalGeneration.from_pretrained(tiny / "model", dtype=torch.float32)
    total = count = 0.0
    with torch.no_grad():
        for i in ids:
            sample = dataset[i]
            inputs = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]}
            if "pixel_values" in sample:
                inputs["pixel_values"] = sample["pixel_values"]
            n = int((sample["labels"][1:] != -100).sum())
            total += float(model(**inputs).loss) * n
            count += n
    assert count > 0 and abs(step["loss"] - total / count) <= 1e-5, (step["loss"], total / count)
