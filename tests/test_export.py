"""Weights in and out: ``--model hf:DIR`` loads a saved model's weights; ``--export-hf DIR`` and ``omnibal-compile
export`` write the trained model as a Hugging Face folder that ``from_pretrained`` loads, equal to the trained one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

tf = pytest.importorskip("transformers")

from omnibal_compile.errors import InputError  # noqa: E402
from omnibal_compile.models.load import load_model, model_folder  # noqa: E402

WORDS = ["What", "is", "in", "the", "picture", "?", "A", "red", "bar", "."]
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>", "<image>"]
VOCAB = 96  # the tiny Llava's; the tokenizer uses its first ids
IMAGE_TOKEN = 95


def _llava() -> torch.nn.Module:
    """A tiny Llava (sizes of conftest's ``tiny_llava``), seeded, its last vision layer's norm never used."""
    torch.manual_seed(7)
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN, image_seq_length=17,
                         vision_feature_layer=-1, vision_feature_select_strategy="full")
    return tf.LlavaForConditionalGeneration(cfg)


def _processor(folder: Path) -> None:
    """A word-level tokenizer and a CLIP image processor saved as the model's LlavaProcessor."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    vocab["<image>"] = IMAGE_TOKEN
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                      eos_token="</s>", additional_special_tokens=["<image>"])
    images = tf.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    tf.LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=4, vision_feature_select_strategy="full",
                      num_additional_image_tokens=1, image_token="<image>").save_pretrained(str(folder))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llava saved by save_pretrained with its processor, and its weights."""
    folder = tmp_path_factory.mktemp("pretrained") / "llava"
    model = _llava()
    model.save_pretrained(str(folder))
    _processor(folder)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sample(n: int = 2, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (n, 24), generator=g)
    ids[:, :17] = IMAGE_TOKEN  # 16 patches + CLS ("full" strategy keeps it)
    labels = ids.clone()
    labels[:, :17] = -100
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g), "input_ids": ids, "labels": labels}


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# -- hf:DIR -----------------------------------------------------------------------------------------
def test_hf_dir_loads_the_saved_weights_not_random_ones(pretrained, tmp_path):
    folder, weights = pretrained
    for spec in (f"hf:{folder}", f"hf:LlavaForConditionalGeneration:{folder}"):
        loaded = load_model(spec, seed=123)  # another seed: only a random init would depend on it
        assert type(loaded.model).__name__ == "LlavaForConditionalGeneration" == loaded.name
        assert loaded.model.training  # trains as a config-built model does (from_pretrained leaves eval)
        assert next(loaded.model.parameters()).dtype == torch.float32
        _assert_state_equal(loaded.model.state_dict(), weights)
        assert loaded.example_batch is not None and "pixel_values" in loaded.example_batch
    random = load_model(f"hf:LlavaForConditionalGeneration:{folder / 'config.json'}", seed=123).model.state_dict()
    assert not torch.equal(random["lm_head.weight"], weights["lm_head.weight"])  # the config alone: random
    # sharded: model.safetensors.index.json and its shards
    sharded = tmp_path / "sharded"
    _llava().save_pretrained(str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    _assert_state_equal(load_model(f"hf:{sharded}").model.state_dict(), weights)
    # on meta: from the config alone, no weights read
    meta = load_model(f"hf:{folder}", meta=True).model
    assert next(meta.parameters()).device.type == "meta"


def test_hf_dir_refusals_and_model_folder(pretrained, tmp_path):
    folder, _ = pretrained
    assert model_folder(f"hf:{folder}") == folder
    assert model_folder(f"hf:LlavaForConditionalGeneration:{folder}") == folder
    assert model_folder(f"hf:LlavaForConditionalGeneration:{folder / 'config.json'}") == folder
    assert model_folder("tinyvlm") is None and model_folder("pkg.mod:make") is None
    no_weights = tmp_path / "config-only"
    _llava().config.save_pretrained(str(no_weights))  # no 'architectures': the Auto classes' for 'llava'
    with pytest.raises(InputError, match="holds no weights .*hf:LlavaForConditionalGeneration:"):
        load_model(f"hf:{no_weights}")
    with pytest.raises(InputError, match="is not a folder"):
        load_model(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(InputError, match="no model class 'NoSuchModel'"):
        load_model(f"hf:NoSuchModel:{folder}")
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    with pytest.raises(InputError, match="names no class"):
        load_model(f"hf:{unnamed}")


def test_a_dataset_run_takes_the_processor_from_the_hf_dir(pretrained):
    from omnibal_compile.runtime.batches import open_dataset
    from omnibal_compile.runtime.settings import RunConfig

    folder, _ = pretrained
    config = RunConfig(plan="-", model=f"hf:{folder}", dataset="nowhere.jsonl")
    with pytest.raises(InputError, match="nowhere.jsonl"):  # the processor was found and loaded: the data is next
        open_dataset(config, {"image_token_id": IMAGE_TOKEN})


# -- export from a checkpoint (one rank in this process) --------------------------------------------
@pytest.fixture(scope="module")
def trained_checkpoint(one_rank_group, pretrained, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A step folder written by the project's save from a model loaded with hf:DIR and trained one AdamW step."""
    from omnibal_compile.runtime.checkpoint import save_training_state

    folder, _ = pretrained
    spec = f"hf:{folder}"
    model = load_model(spec).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**_sample()).loss.backward()
    opt.step()
    root = tmp_path_factory.mktemp("ckpt")
    step = save_training_state(root, step=1, state=model.state_dict(keep_vars=True), optimizer=opt,
                               trainer={"data": {"model": spec, "model_config": {}, "seed": 0, "processor": None}})
    return step, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_export_writes_a_folder_from_pretrained_loads_equal_to_the_checkpoint(trained_checkpoint, pretrained,
                                                                             tmp_path):
    from omnibal_compile.runtime.export import EXPORT_MARKER, export_hf

    step, weights = trained_checkpoint
    folder, _ = pretrained
    out = tmp_path / "hf-out"
    rng = torch.get_rng_state()
    assert export_hf(step.parent, out) == out  # the root: its newest step
    assert torch.equal(torch.get_rng_state(), rng)  # a rank exporting mid-run trains on as without
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", EXPORT_MARKER, "tokenizer.json", "tokenizer_config.json",
            "processor_config.json"} <= names
    assert not any(n.startswith(".") for n in {p.name for p in tmp_path.iterdir()})  # no partial left
    record = json.loads((out / EXPORT_MARKER).read_text())
    assert record["step"] == 1 and record["model"] == f"hf:{folder}"
    exported = tf.LlavaForConditionalGeneration.from_pretrained(str(out), local_files_only=True)
    _assert_state_equal(exported.state_dict(), weights)
    processor = tf.AutoProcessor.from_pretrained(str(out), local_files_only=True)
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    # hf:OUT is a model spec like any saved folder: training can continue from the export
    _assert_state_equal(load_model(f"hf:{out}").model.state_dict(), weights)
    # again into the same folder: the earlier export is replaced
    other = tmp_path / "proc"
    other.mkdir()
    (other / "chat_template.jinja").write_text("{{ messages }}")
    export_hf(step, out, processor=other)
    assert (out / "chat_template.jinja").is_file() and not (out / "tokenizer.json").exists()


def test_export_refuses_a_folder_that_is_not_an_earlier_export(trained_checkpoint, tmp_path):
    from omnibal_compile.runtime.export import export_hf

    step, _ = trained_checkpoint
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not an export of ours"):
        export_hf(step, mine)
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        export_hf(step, tmp_path / "file")
    with pytest.raises(InputError, match="has no save_pretrained"):
        export_hf(step, tmp_path / "tiny", model="tinyvlm")


# -- a 2-rank pipeline run with --save and --export-hf ----------------------------------------------
@pytest.mark.distributed
def test_a_pipeline_run_exports_the_trained_model(pretrained, tmp_path, monkeypatch, capfd):
    """pp=2, 2 AdamW steps from hf:DIR: the export loads with from_pretrained; every trained parameter differs from
    the pretrained one and an unused one is equal; the export's logits equal those of the trained checkpoint loaded
    into the unsplit model (1e-5, fp32); ``omnibal-compile export`` writes the same folder."""
    import omnibal_compile as oc
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.batches import batch_source
    from omnibal_compile.runtime.checkpoint import load_into_model
    from omnibal_compile.runtime.settings import RunConfig

    folder, weights = pretrained
    monkeypatch.chdir(tmp_path)
    spec = f"hf:{folder}"
    model = load_model(spec).model
    batch = batch_source(RunConfig(plan="-", model=spec, batch_size=2), model)(0)
    (tmp_path / "plan.json").write_text(oc.optimize(model, batch, num_stages=2, planner="uniform").plan.to_json())
    assert main(["run", "--plan", "plan.json", "--model", spec, "--batch-size", "2", "--num-microbatches", "2",
                 "--steps", "2", "--save-every", "1", "--lr", "1e-2", "--save", "ckpt", "--export-hf", "out",
                 "--timeout", "300"]) == 0
    assert capfd.readouterr().out.count("[omnibal run] exported: out") == 2  # at each save: steps 1 and 2
    exported = tf.LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert json.loads((tmp_path / "out" / "omnibal-export.json").read_text())["step"] == 2  # the last save's
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    trained = load_model(spec).model
    assert load_into_model(trained, tmp_path / "ckpt") == 2
    _assert_state_equal(exported.state_dict(), trained.state_dict())
    # which parameters training touches: those with a gradient (the vision tower's post-layernorm has none)
    probe = load_model(spec).model
    probe(**batch).loss.backward()
    got = dict(exported.named_parameters())
    untouched = [n for n, p in probe.named_parameters() if p.grad is None]
    assert untouched and all("post_layernorm" in n for n in untouched)
    for name, p in probe.named_parameters():
        same = torch.equal(got[name], weights[name])
        assert same == (p.grad is None), name
    exported.eval()
    trained.eval()
    sample = _sample(seed=11)
    with torch.no_grad():
        want, have = trained(**sample).logits, exported(**sample).logits
    assert torch.allclose(have, want, atol=1e-5, rtol=0), float((have - want).abs().max())
    # the export command from the saved checkpoint: the same folder
    assert main(["export", "ckpt", "again"]) == 0
    again = tf.LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "again"), local_files_only=True)
    _assert_state_equal(again.state_dict(), exported.state_dict())
    assert {p.name for p in (tmp_path / "again").iterdir()} == {p.name for p in (tmp_path / "out").iterdir()}
    assert (tmp_path / "again" / "config.json").read_text() == (tmp_path / "out" / "config.json").read_text()


def test_run_refuses_export_without_save_or_into_a_foreign_folder(pretrained, tmp_path, monkeypatch):
    import omnibal_compile as oc
    from omnibal_compile.runtime.launch import precheck
    from omnibal_compile.runtime.settings import RunConfig

    folder, _ = pretrained
    monkeypatch.chdir(tmp_path)
    spec = f"hf:{folder}"
    model = load_model(spec).model
    batch = load_model(spec, batch=2).example_batch
    (tmp_path / "plan.json").write_text(oc.optimize(model, batch, num_stages=2, planner="uniform").plan.to_json())
    base = {"plan": "plan.json", "model": spec, "batch_size": 2, "num_microbatches": 2}
    with pytest.raises(InputError, match="--export-hf needs --save"):
        precheck(RunConfig(**base, export_hf="out"))
    with pytest.raises(InputError, match="is also --save"):
        precheck(RunConfig(**base, save="ckpt", export_hf="ckpt"))
    (tmp_path / "mine").mkdir()
    with pytest.raises(InputError, match="--export-hf mine exists and is not an export of ours"):
        precheck(RunConfig(**base, save="ckpt", export_hf="mine"))
    with pytest.raises(InputError, match="has no save_pretrained"):
        precheck(RunConfig(plan="plan.json", save="ckpt", export_hf="out"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tp2_run_exports_the_folder_a_tp1_run_exports(pretrained, tmp_path, monkeypatch):
    """One SGD step (Adam would turn the rounding noise of exactly-zero gradients, such as a key bias's, into whole
    steps) from hf:DIR on one stage, at tp=2 (2 ranks: DCP saves the DTensor shards, the export reads the
    whole tensors) and at tp=1 (1 rank): the two folders hold the same files and weights (1e-6, fp32)."""
    import omnibal_compile as oc
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.batches import batch_source
    from omnibal_compile.runtime.settings import RunConfig

    folder, weights = pretrained
    monkeypatch.chdir(tmp_path)
    spec = f"hf:{folder}"
    model = load_model(spec).model
    batch = batch_source(RunConfig(plan="-", model=spec, batch_size=2), model)(0)
    (tmp_path / "plan.json").write_text(oc.optimize(model, batch, num_stages=1, planner="uniform").plan.to_json())
    args = ["run", "--plan", "plan.json", "--model", spec, "--batch-size", "2", "--num-microbatches", "2",
            "--steps", "1", "--optimizer", "sgd", "--lr", "0.5", "--timeout", "300"]
    for tp in (2, 1):
        assert main([*args, "--tp", str(tp), "--save", f"ckpt{tp}", "--export-hf", f"out{tp}"]) == 0
    out = {tp: tf.LlavaForConditionalGeneration.from_pretrained(str(tmp_path / f"out{tp}"), local_files_only=True)
           for tp in (1, 2)}
    assert {p.name for p in (tmp_path / "out2").iterdir()} == {p.name for p in (tmp_path / "out1").iterdir()}
    assert (tmp_path / "out2" / "config.json").read_text() == (tmp_path / "out1" / "config.json").read_text()
    got, want = out[2].state_dict(), out[1].state_dict()
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert float((got[name] - want[name]).abs().max()) <= 1e-6, name
    moved = [n for n in want if not torch.equal(want[n], weights[n])]
    assert "language_model.layers.0.self_attn.q_proj.weight" in " ".join(moved)  # a sharded layer was trained
