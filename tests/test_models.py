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


# -- model specs (omnibal_compile.models.load): one contract for `plan` and `run` -----------------------
FACTORY = '''
import torch
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

CFG = TinyVLMConfig(image_size=16, patch_size=4, vit_hidden=16, vit_layers=1, vit_heads=2, vit_mlp=32, llm_hidden=16,
                    llm_layers=2, llm_heads=2, llm_kv_heads=1, llm_mlp=32, vocab_size=32, image_token_id=31)

def model_only(width=16):
    return TinyVLM(CFG)

def with_batch():
    return TinyVLM(CFG), make_example_batch(CFG, batch=2, tiles_per_sample=1, text_tokens=8)

def hf_only():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(cfg)

def not_a_model():
    return 3
'''


@pytest.fixture()
def factory_dir(tmp_path, monkeypatch):
    """A factory module in the current directory, which is not on sys.path (as for the installed script)."""
    import sys

    (tmp_path / "my_factories.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_factories", raising=False)
    return tmp_path


def test_a_factory_may_return_a_model_or_a_model_and_its_batch(factory_dir):
    from omnibal_compile.models.load import load_model

    loaded = load_model("my_factories:with_batch")
    assert isinstance(loaded.model, TinyVLM) and set(loaded.example_batch) == {"pixel_values", "input_ids", "labels"}
    loaded = load_model("my_factories:model_only", config={"width": 16})
    assert isinstance(loaded.model, TinyVLM) and loaded.example_batch is None  # no config to build one from


def test_a_hugging_face_model_from_a_factory_gets_an_example_batch(factory_dir):
    pytest.importorskip("transformers")
    from omnibal_compile.models.load import load_model

    loaded = load_model("my_factories:hf_only", batch=3, text=10)
    assert loaded.example_batch["input_ids"].shape == (3, 10)


def test_model_specs_that_cannot_work_say_what_to_write(factory_dir):
    from omnibal_compile.errors import InputError
    from omnibal_compile.models.load import load_model

    with pytest.raises(InputError, match=r"returned int; it must return an nn.Module or \(model, example_batch\)"):
        load_model("my_factories:not_a_model")
    with pytest.raises(InputError, match="cannot load model factory 'no_such_module:build'"):
        load_model("no_such_module:build")
    with pytest.raises(InputError, match="hf:ClassName:config.json"):
        load_model("hf:LlamaForCausalLM")
    with pytest.raises(InputError, match="is not tiny-vlm"):
        load_model("llama")


def test_plan_and_run_take_the_same_factory(factory_dir):
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.settings import RunConfig

    assert main(["plan", "my_factories:with_batch", "--num-stages", "2", "--num-microbatches", "2", "--device", "cpu",
                 "--no-pictures", "--out", "out"]) == 0
    config = RunConfig(plan="out/plan.json", model="my_factories:with_batch", batch_size=2)
    model = build_model(config)
    batch = batch_source(config, model)(0)  # the factory's batch, every step
    assert batch["input_ids"].shape == (2, 12) and torch.isfinite(model(**batch))
    assert main(["plan", "my_factories:model_only", "--num-stages", "2", "--no-pictures", "--out", "out2"]) == 2
