"""The training recipe of ``run``: LR schedules, weight-decay groups, global gradient clipping, what a step logs,
and exact resume for every model (parameters without gradients or frozen get no optimizer state)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import test_runtime
import torch

import omnibal_compile as oc
from omnibal_compile.api import compile_for_microbatches
from omnibal_compile.config import OptimizerConfig
from omnibal_compile.errors import InputError
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.recipe import build_optimizer, lr_at, weight_decay_groups
from omnibal_compile.runtime.settings import RunConfig
from omnibal_compile.runtime.train import StepLog, progress_line

EXACT = 1e-6
NORM_TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]
mixed_two_stages_one_rank = test_runtime.mixed_two_stages_one_rank


# -- LR schedules ----------------------------------------------------------------------------------
def test_lr_at_warms_up_linearly_then_holds_or_decays_to_min_lr():
    lr = 1.0
    # warm-up as before: step k < W uses lr * (k + 1) / W, then the schedule starts at lr
    assert [lr_at(k, lr=lr, warmup_steps=4, steps=10) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_at(k, lr=2.0) for k in range(3)] == [2.0, 2.0, 2.0]  # constant, no warm-up
    # linear over the 10 - 2 steps after warm-up, from lr to min_lr
    lin = [lr_at(k, lr=lr, schedule="linear", warmup_steps=2, steps=10, min_lr=0.2) for k in range(10)]
    assert lin[:3] == [0.5, 1.0, 1.0]
    assert lin[6] == pytest.approx(0.2 + 0.8 * (1 - 4 / 8)) and lin[9] == pytest.approx(0.2 + 0.8 / 8)
    assert lr_at(10, lr=lr, schedule="linear", warmup_steps=2, steps=10, min_lr=0.2) == pytest.approx(0.2)
    assert lr_at(99, lr=lr, schedule="linear", steps=10) == 0.0  # past the end: the floor
    # cosine: half-way down at half the decay
    cos = [lr_at(k, lr=lr, schedule="cosine", warmup_steps=0, steps=8, min_lr=0.0) for k in range(8)]
    assert cos[0] == 1.0 and cos[4] == pytest.approx(0.5) and cos[2] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert all(a > b for a, b in zip(cos, cos[1:]))
    with pytest.raises(InputError, match=r"lr_schedule \(--lr-schedule\)"):
        lr_at(0, lr=1.0, schedule="step")


def test_schedule_settings_are_checked_by_name():
    with pytest.raises(InputError, match=r"min_lr \(--min-lr\) is 0.1, above lr \(--lr\) 0.01"):
        OptimizerConfig(lr=0.01, min_lr=0.1)
    with pytest.raises(InputError, match=r"lr_schedule must be one of .*; setting lr_schedule \(--lr-schedule\)"):
        OptimizerConfig(lr_schedule="exp")
    with pytest.raises(InputError, match=r"setting max_grad_norm \(--max-grad-norm\)"):
        OptimizerConfig(max_grad_norm=-1.0)
    with pytest.raises(InputError, match=r"setting weight_decay \(--weight-decay\)"):
        OptimizerConfig(weight_decay=-0.1)


# -- weight decay ----------------------------------------------------------------------------------
def test_weight_decay_skips_biases_norms_and_embeddings_by_name(vlm, tiny_llama):
    model, _ = vlm
    decay, skip = weight_decay_groups(model.named_parameters(), 0.1)
    assert (decay["weight_decay"], skip["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, skipped = {names[id(p)] for p in decay["params"]}, {names[id(p)] for p in skip["params"]}
    assert {"vision.layers.0.attn.qkv.weight", "vision.patch_embed.conv.weight", "llm.layers.0.attn.q_proj.weight",
            "projector.fc1.weight"} <= decayed
    assert {"vision.layers.0.attn.qkv.bias", "vision.layers.0.norm1.weight", "projector.norm.weight",
            "llm.layers.0.input_norm.weight", "llm.embed_tokens.weight", "vision.patch_embed.pos"} <= skipped
    assert decayed.isdisjoint(skipped) and len(decayed | skipped) == len(list(model.parameters()))
    # a tied head is the embedding: not decayed, listed once
    llama, _ = tiny_llama
    decay, skip = weight_decay_groups(llama.named_parameters(remove_duplicate=False), 0.1)
    head = llama.lm_head.weight
    assert head is llama.model.embed_tokens.weight
    assert any(p is head for p in skip["params"]) and not any(p is head for p in decay["params"])
    assert sum(p is head for p in skip["params"]) == 1


# -- gradient clipping and optimizer state in one process ------------------------------------------
def test_clip_grad_norm_is_the_unsplit_models_norm_and_clips_like_torch(one_rank_group, mixed_two_stages_one_rank):
    from omnibal_compile.runtime import build_pipeline

    model, batch, plan = mixed_two_stages_one_rank
    reference = copy.deepcopy(model)
    pipe = build_pipeline(compile_for_microbatches(copy.deepcopy(model), batch, plan), rank=0, world_size=1)
    pipe.step(batch)
    reference(**batch).backward()
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05))
    assert abs(pipe.clip_grad_norm(0.05) - want) <= NORM_TOL * max(1.0, want)
    assert want > 0.05  # so the gradients were scaled
    ref = dict(reference.named_parameters())
    for name, g in pipe.named_grads().items():
        assert g is not None and float((g - ref[name].grad).abs().max()) <= NORM_TOL, name
    assert abs(pipe.clip_grad_norm(None) - 0.05) <= NORM_TOL  # the clipped norm, left as it is


def test_frozen_parameters_get_no_optimizer_state_and_resume_restores_the_rest(
    one_rank_group, mixed_two_stages_one_rank, tmp_path
):
    """Frozen parameters are not in the optimizer; the saved state holds only parameters that had gradients, and a
    fresh pipeline resumed from it has the same state, parameter by parameter."""
    import torch.distributed.checkpoint as dcp

    from omnibal_compile.runtime import build_pipeline
    from omnibal_compile.runtime.checkpoint import load_training_state, save_training_state

    model, batch, plan = mixed_two_stages_one_rank

    def pipeline_and_optimizer() -> tuple[Any, torch.optim.Optimizer]:
        frozen = copy.deepcopy(model)
        for p in frozen.vision.parameters():
            p.requires_grad_(False)
        pipe = build_pipeline(compile_for_microbatches(frozen, batch, plan), rank=0, world_size=1)
        return pipe, build_optimizer(OptimizerConfig(optimizer="adamw", weight_decay=0.1), pipe)

    pipe, opt = pipeline_and_optimizer()
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    vision = {n for n in pipe.state if n.startswith("vision.")}
    assert vision and not any(id(pipe.state[n]) in in_optimizer for n in vision)
    pipe.step(batch)
    opt.step()
    save_training_state(tmp_path, step=1, state=pipe.state, optimizer=opt, trainer={})
    keys = dcp.FileSystemReader(str(tmp_path / "step-000001")).read_metadata().state_dict_metadata
    saved = {k[len("optim."):].rpartition(".")[0] for k in keys if k.startswith("optim.")}
    assert saved and not saved & vision and "llm.embed_tokens.weight" in saved

    again, opt2 = pipeline_and_optimizer()
    folder, meta = load_training_state(tmp_path, state=again.state, optimizer=opt2)
    assert folder.name == "step-000001" and meta["step"] == 1
    assert len(opt2.state) == len(opt.state)
    for name, p in pipe.state.items():
        if id(p) in in_optimizer:
            q = again.state[name]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], opt2.state[q][key]), (name, key)


def test_progress_line_shows_step_loss_lr_grad_norm_throughput_and_eta():
    entry = StepLog(step=2, loss=3.1415926, step_time_s=0.5, lr=2.5e-4, grad_norm=1.23456, tokens=1000,
                    tokens_per_s=2000.0)
    line = progress_line(entry, steps=10, seconds_left=3725)
    assert line.startswith("step 3/10  loss 3.1416  lr 2.500e-04  grad norm 1.235  2,000 tokens/s")
    assert line.endswith("0.500 s/step  ETA 1:02:05")


def test_progress_line_shows_mfu_only_when_known():
    entry = StepLog(step=0, loss=1.0, step_time_s=0.5, tokens_per_s=10.0, mfu=0.4213)
    assert progress_line(entry, steps=1, seconds_left=0).endswith("ETA 0:00:00  MFU 42.1%")
    assert "MFU" not in progress_line(dataclasses.replace(entry, mfu=None), steps=1, seconds_left=0)


def test_peak_flops_comes_from_the_setting_or_a_known_gpu_name():
    from omnibal_compile.costs.devices import H100_80G, spec_for_gpu_name
    from omnibal_compile.runtime.train import peak_flops

    assert spec_for_gpu_name("NVIDIA H100 80GB HBM3") is H100_80G
    assert spec_for_gpu_name("NVIDIA A100-SXM4-40GB").name == "a100-80gb"  # the same bf16 peak
    assert spec_for_gpu_name("NVIDIA GeForce RTX 4090") is None
    cpu = torch.device("cpu")
    assert peak_flops(RunConfig(plan="-"), cpu) is None  # no MFU on a CPU unless told its peak
    assert peak_flops(RunConfig(plan="-", peak_flops=2e12), cpu) == 2e12
    with pytest.raises(InputError, match=r"peak_flops \(--peak-flops\)"):
        RunConfig(plan="-", peak_flops=0.0)


def test_a_pipeline_counts_its_stages_forward_flops_once(one_rank_group, mixed_two_stages_one_rank):
    """Two stages on one rank: their forward FLOPs on one micro-batch are the unsplit model's (the MFU's numerator)."""
    from omnibal_compile.costs._measure import count_flops
    from omnibal_compile.runtime import build_pipeline

    model, batch, plan = mixed_two_stages_one_rank
    pipe = build_pipeline(compile_for_microbatches(copy.deepcopy(model), batch, plan), rank=0, world_size=1)
    rows = len(next(iter(batch.values()))) // plan.num_microbatches
    with torch.no_grad(), count_flops() as counter:
        model(**{k: v[:rows] for k, v in batch.items()})
    assert counter.get_total_flops() > 0
    assert pipe.forward_flops == counter.get_total_flops()


# -- distributed: global gradient norm -------------------------------------------------------------
def _llama_run(tmp_path: Path, tiny_llama: Any, *, stages: int, **kw: Any) -> RunConfig:
    llama, _ = tiny_llama
    config_file = tmp_path / "llama.json"
    llama.config.to_json_file(config_file)  # tied embedding and head: on the first and the last pipeline rank
    spec = f"hf:LlamaForCausalLM:{config_file}"
    probe = RunConfig(plan="-", model=spec, batch_size=1, text_tokens=12)
    model = build_model(probe)
    plan = oc.optimize(model, batch_source(probe, model)(0), num_stages=stages, planner="uniform").plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    return RunConfig(plan=str(tmp_path / "plan.json"), model=spec, text_tokens=12, batch_size=4, num_microbatches=2,
                     schedule="1f1b", **kw)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("stages", "dp", "shard"), [(2, 1, None), (2, 2, "fsdp"), (1, 2, "ddp")],
                         ids=["pp2", "dp2xpp2-fsdp", "dp2-ddp"])
def test_logged_grad_norm_is_the_unsplit_models_and_clipping_trains_like_it(tmp_path, tiny_llama, stages, dp, shard):
    """Each step's logged norm is ``clip_grad_norm_``'s total norm on the unsplit model (the tied weight counted
    once, FSDP shards summed over dp, replicas not), and with the clip on, training follows the unsplit model."""
    config = _llama_run(tmp_path, tiny_llama, stages=stages, dp=dp, dp_shard=shard, steps=3, optimizer="sgd",
                        lr=0.5, max_grad_norm=0.5, log=str(tmp_path / "steps.jsonl"))
    logged = launch(config, timeout_s=400, quiet=True)
    assert [e.step for e in logged] == [0, 1, 2]
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    norms = []
    for step, entry in enumerate(logged):
        opt.zero_grad()
        loss = model(**source(step)).loss
        assert abs(float(loss.detach()) - entry.loss) <= NORM_TOL, (step, float(loss.detach()), entry.loss)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=config.max_grad_norm))
        norms.append((norm, entry.grad_norm))
        assert abs(norm - entry.grad_norm) <= NORM_TOL, (step, norm, entry.grad_norm)
        opt.step()
        assert entry.lr == config.lr and entry.tokens == 4 * 11 and entry.tokens_per_s > 0
    assert any(n > config.max_grad_norm for n, _ in norms)  # the clip did act
    print(f"grad norms (unsplit, pipeline) dp={dp} pp={stages}: {norms}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_logs_mfu_peak_memory_per_rank_and_tensorboard_scalars(tmp_path, tiny_llama):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omnibal_compile.costs._measure import count_flops

    board = tmp_path / "board"
    config = _llama_run(tmp_path, tiny_llama, stages=2, steps=2, optimizer="sgd", lr=0.1, peak_flops=1e9,
                        tensorboard=str(board))
    logged = launch(config, timeout_s=300, quiet=True)
    model = build_model(config)
    batch = batch_source(config, model)(0)
    with torch.no_grad(), count_flops() as counter:  # one micro-batch: 2 of the 4 rows
        model(**{k: v[:2] for k, v in batch.items()})
    for entry in logged:
        assert entry.model_flops == 3 * counter.get_total_flops() * 2  # 2 micro-batches
        assert entry.mfu == pytest.approx(entry.model_flops / (entry.step_time_s * 2 * 1e9), rel=1e-12)
        assert len(entry.rank_memory_bytes) == 2 and min(entry.rank_memory_bytes) > 50 * 2**20  # torch alone
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([e.loss for e in logged], rel=1e-6)
    assert [e.step for e in events.Scalars("train/mfu")] == [0, 1]
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_gib"} <= tags


def test_tensorboard_folder_and_package_are_checked_before_any_rank_starts(tmp_path, monkeypatch):
    import importlib.util

    from omnibal_compile.runtime.launch import _check_outputs

    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=r"--tensorboard .*file is a file, not a folder"):
        _check_outputs(RunConfig(plan="-", tensorboard=str(tmp_path / "file")), 5)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    with pytest.raises(InputError, match=r"--tensorboard needs the tensorboard package: pip install tensorboard"):
        _check_outputs(RunConfig(plan="-", tensorboard=str(tmp_path / "board")), 5)


# -- distributed: exact resume of a Llava with unused parameters -----------------------------------
@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    """A tiny Llava whose last vision layer and post-layernorm get no gradient (``vision_feature_layer=-2``)."""
    tf = pytest.importorskip("transformers")
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=95, vision_feature_layer=-2)
    folder = tmp_path_factory.mktemp("llava")
    tf.LlavaForConditionalGeneration(cfg).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.distributed
def test_llava_resume_is_exact_with_unused_parameters(tmp_path, llava_dir):
    spec = f"hf:LlavaForConditionalGeneration:{llava_dir / 'config.json'}"
    probe = RunConfig(plan="-", model=spec, batch_size=1, text_tokens=8)
    model = build_model(probe)
    micro = batch_source(probe, model)(0)
    model(**micro).loss.backward()
    unused = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert "model.vision_tower.encoder.layers.1.mlp.fc1.weight" in unused, unused
    plan = oc.optimize(model, micro, num_stages=1, planner="uniform").plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model=spec, text_tokens=8, dp=2, batch_size=4,
                       num_microbatches=2, schedule="1f1b", steps=6, optimizer="adamw", lr=2e-3,
                       lr_schedule="cosine", warmup_steps=2, min_lr=1e-4, weight_decay=0.1, max_grad_norm=1.0)
    root = tmp_path / "ckpt"
    # the 6 steps, saving after step 3 too: its step-3 folder is what a run stopped there leaves
    full = launch(dataclasses.replace(config, save=str(root), save_every=3), timeout_s=400, quiet=True)
    rest = launch(dataclasses.replace(config, resume=str(root / "step-000003")), timeout_s=400, quiet=True)
    assert [e.step for e in full] == list(range(6)) and [e.step for e in rest] == [3, 4, 5]
    for a, b in zip(rest, full[3:]):
        assert abs(a.loss - b.loss) <= EXACT, (a, b)
        assert abs(a.lr - b.lr) <= 1e-12 and abs(a.grad_norm - b.grad_norm) <= EXACT, (a, b)
    want = [lr_at(k, lr=2e-3, schedule="cosine", warmup_steps=2, steps=6, min_lr=1e-4) for k in range(6)]
    assert [e.lr for e in full] == pytest.approx(want, rel=1e-9)
    meta = json.loads((root / "step-000003" / "meta.json").read_text())
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]


@pytest.mark.distributed
def test_a_last_stage_holding_only_the_tied_head_trains_like_the_unsplit_model(tmp_path, tiny_llama):
    """The tied head alone on the last stage (its only parameter is the embedding's): its rank's optimizer steps
    the shared weight, whose gradient sums both ranks' parts (issue "Trust at first sight", tied-only stages)."""
    config = _llama_run(tmp_path, tiny_llama, stages=2, steps=2, optimizer="sgd", lr=0.5)
    plan = oc.Plan.from_json((tmp_path / "plan.json").read_text())
    head = plan.block_names.index("lm_head")
    alone = dataclasses.replace(plan, boundaries=(0, head, len(plan.block_names)))
    (tmp_path / "plan.json").write_text(alone.to_json())
    logged = launch(config, timeout_s=300, quiet=True)
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step, entry in enumerate(logged):
        opt.zero_grad()
        loss = model(**source(step)).loss
        assert abs(float(loss.detach()) - entry.loss) <= NORM_TOL, (step, float(loss.detach()), entry.loss)
        loss.backward()
        opt.step()
    assert len(logged) == 2


# -- distributed: exact resume on a real dataset, frozen tower and bf16 ----------------------------
@pytest.fixture(scope="module")
def tiny_llava_vfl2(tmp_path_factory) -> Path:
    """``examples/make_tiny_llava.py``'s model and dataset, the model's features taken from the next-to-last vision
    layer (``vision_feature_layer=-2``: the last layer and the post-layernorm get no gradient)."""
    from conftest import make_tiny_llava

    out = make_tiny_llava(tmp_path_factory.mktemp("tiny-vfl2"))
    config_file = out / "model" / "config.json"
    config = json.loads(config_file.read_text())
    config["vision_feature_layer"] = -2
    config_file.write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"], ids=["frozen-tower", "frozen-tower-bf16"])
def test_resume_on_a_dataset_is_exact_with_a_frozen_tower_and_in_bf16(tmp_path, tiny_llava_vfl2, precision):
    """dp=2 (DDP) on the real records of a dataset (8 records, 4 a step: the resume falls inside the second epoch),
    Llava with ``vision_feature_layer=-2`` and its vision tower frozen: 6 steps in one run vs 3 then ``--resume`` to
    6 log the same steps, losses (<= 1e-6), lrs, grad norms and sample indices of each dp rank."""
    tiny = tiny_llava_vfl2
    spec = f"hf:{tiny / 'model'}"
    config = RunConfig(plan=str(tmp_path / "plan.json"), model=spec, dataset=str(tiny / "train.json"), dp=2,
                       batch_size=4, samples_per_pack=1, num_microbatches=2, schedule="1f1b", steps=6,
                       optimizer="adamw", lr=2e-3, lr_schedule="cosine", warmup_steps=2, min_lr=1e-4,
                       weight_decay=0.1, max_grad_norm=1.0, freeze=("vision_tower",), precision=precision)
    model = build_model(config)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "vision_tower" in n)
    batch = batch_source(config, model)(0)  # both dp ranks' rows, each with the pack's tiles
    tiles = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    micro = {k: v[:1] if k != "pixel_values" else v[:tiles] for k, v in batch.items()}
    plan = oc.optimize(model, micro, num_stages=1, planner="uniform").plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    root = tmp_path / "ckpt"
    # the 6 steps, saving after step 3 too: its step-3 folder is what a run stopped there leaves
    full = launch(dataclasses.replace(config, save=str(root), save_every=3), timeout_s=400, quiet=True)
    rest = launch(dataclasses.replace(config, resume=str(root / "step-000003")), timeout_s=400, quiet=True)
    assert [e.step for e in full] == list(range(6)) and [e.step for e in rest] == [3, 4, 5]
    assert len({e.loss for e in full}) == 6  # it trains: the loss moves step to step
    for a, b in zip(rest, full[3:]):
        assert a.samples == b.samples and len(a.samples) == 2 and all(a.samples), (a.samples, b.samples)
        assert abs(a.loss - b.loss) <= EXACT, (a, b)
        assert abs(a.lr - b.lr) <= 1e-12 and abs(a.grad_norm - b.grad_norm) <= EXACT, (a, b)
    epochs = [sorted(i for e in full[k:k + 2] for rank in e.samples for i in rank) for k in (0, 2, 4)]
    assert epochs == [list(range(8))] * 3  # each 2 steps an epoch: every record once
    want = [lr_at(k, lr=2e-3, schedule="cosine", warmup_steps=2, steps=6, min_lr=1e-4) for k in range(6)]
    assert [e.lr for e in full] == pytest.approx(want, rel=1e-9)
