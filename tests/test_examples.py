"""optimize(model) without example inputs: the batch is synthesized from the model, printed and kept."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import omnibal_compile as oc
from omnibal_compile.errors import InputError
from omnibal_compile.models import TinyVLM
from omnibal_compile.models.examples import describe_batch, example_inputs_for
from tests.conftest import SMALL_VLM

sys.path.insert(0, str(Path(__file__).parent))


def _check(result, capsys, source: str) -> None:
    printed = capsys.readouterr().err  # progress.info: stderr
    assert result.example is not None and result.example.synthesized
    assert source in result.example.source
    assert result.example.summary() in printed  # what it assumed was printed...
    assert result.example.summary() in result.summary()  # ...and is in the plan summary
    report = result.check_parity(tolerance=1e-6)
    assert report.ok, report


def test_bare_optimize_on_the_reference_vlm(capsys):
    result = oc.optimize(TinyVLM(SMALL_VLM))
    _check(result, capsys, "reference VLM's example")
    names = [n for n, _, _ in result.example.inputs]
    assert names == ["pixel_values", "input_ids", "labels"]
    assert result.layout is not None  # no num_stages: the layout search chose


def test_reference_vlm_on_two_devices_pinned_to_two_stages(capsys):
    result = oc.optimize(TinyVLM(SMALL_VLM), devices=2, num_stages=2)
    assert result.plan.num_stages == 2 and len(result.stages) == 2
    _check(result, capsys, "reference VLM's example")


@pytest.mark.parametrize("family", ["llava", "llama", "qwen2_vl", "internvl", "mistral3", "idefics3"])
def test_hugging_face_models_get_their_family_batch(family, tiny_llava, tiny_llama, capsys):
    pytest.importorskip("transformers")
    from hf_families import build

    model = {"llava": lambda: tiny_llava[0], "llama": lambda: tiny_llama[0]}.get(family, lambda: build(family)[0])()
    result = oc.optimize(model, num_stages=2)
    assert result.plan.num_stages == 2
    _check(result, capsys, f"built from the {type(model).__name__} config")
    batch = result.example.batch
    cfg = model.config
    if family == "llama":
        assert set(batch) == {"input_ids", "labels"} and "text only" in result.example.source
        return
    image = cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index
    n_image = int((batch["input_ids"] == image).sum())
    if family == "qwen2_vl":  # the processor's count: t * h * w / merge^2 per image
        merge = cfg.vision_config.spatial_merge_size
        assert n_image == int(batch["image_grid_thw"].prod(-1).sum()) // merge**2
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    elif family == "idefics3":
        assert n_image == int(batch["pixel_attention_mask"].amax((-1, -2)).sum()) * 4  # 4 tokens per real image
    elif family == "mistral3":
        merged = batch["image_sizes"] // (cfg.vision_config.patch_size * cfg.spatial_merge_size)
        assert n_image == int(merged.prod(-1).sum())
    else:  # one tile per row
        per_tile = {"llava": 16 + 1, "internvl": cfg.image_seq_length}[family]  # Llava "full": patches + CLS
        assert n_image == batch["pixel_values"].shape[0] * per_tile
    assert bool((batch["labels"][batch["input_ids"] == image] == -100).all())


@pytest.mark.parametrize("family", ["llava", "llama", "qwen2_vl"])
def test_bare_optimize_on_hugging_face_models(family, tiny_llava, tiny_llama, capsys):
    """``optimize(model)`` and nothing else: the batch from the config, the layout from the search."""
    pytest.importorskip("transformers")
    from hf_families import build

    model = {"llava": lambda: tiny_llava[0], "llama": lambda: tiny_llama[0]}.get(family, lambda: build(family)[0])()
    result = oc.optimize(model)
    assert result.layout is not None  # no num_stages: the layout search chose
    _check(result, capsys, f"built from the {type(model).__name__} config")


def test_bare_optimize_on_a_hugging_face_llama(tiny_llama, capsys):
    result = oc.optimize(tiny_llama[0], devices=2, num_stages=2)
    _check(result, capsys, "text only")


def test_a_model_may_give_its_own_example():
    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).sum()

        def example_inputs(self):
            return (torch.randn(3, 4),)

    result = oc.optimize(Own(), num_stages=2)
    assert result.example.source == "Own.example_inputs()" and result.example.inputs == (("0", (3, 4), "float32"),)
    assert result.check_parity().ok


def test_given_examples_are_recorded_not_synthesized(capsys):
    from omnibal_compile.models import make_example_batch

    result = oc.optimize(TinyVLM(SMALL_VLM), make_example_batch(SMALL_VLM), num_stages=2)
    assert not result.example.synthesized and "Example inputs" not in capsys.readouterr().err


def test_a_model_without_any_way_to_build_inputs_says_what_to_pass():
    with pytest.raises(InputError, match=r"cannot build example inputs for a Sequential.*example_inputs=.*lengths="):
        oc.optimize(nn.Sequential(nn.Linear(2, 2)), num_stages=1)


def test_description_names_nested_inputs():
    desc = describe_batch(((torch.zeros(2, 3),), {"mask": torch.ones(2, dtype=torch.bool), "n": 3}), source="x",
                          synthesized=False)
    assert desc.inputs == (("0.0", (2, 3), "float32"), ("1.mask", (2,), "bool"), ("1.n", (), "int"))
    assert "0.0" in desc.summary() and "2x3" in desc.summary()


def test_example_rows_and_text_are_honoured(tiny_llava):
    ex = example_inputs_for(tiny_llava[0], batch=3, text=5)
    assert ex.batch["input_ids"].shape == (3, 17 + 5) and ex.batch["pixel_values"].shape[0] == 3
