"""--precision: bf16 and fp16 compute with 16-bit parameters (the model captured in 16 bits, FSDP2 / replicate
gathering them from fp32 masters), fp16 with a dynamic loss scale agreed by every rank, and a run whose compute
dtype differs from its plan's costs says so. The 20-step bf16-vs-fp32 losses and the parameter + gradient bytes
are bench/precision_memory.py's."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile import progress
from omnibal_compile.config import Config
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BF16_ADAM, FP32_ADAM, precision_named
from omnibal_compile.models import TinyVLM
from omnibal_compile.runtime.batches import build_model
from omnibal_compile.runtime.launch import launch, precheck
from omnibal_compile.runtime.precision import (
    ComputeParams,
    LossScaler,
    cast_for_capture,
    compile_in_precision,
    compute_dtype,
)
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM


def _one_rank(precision: str, steps: int = 1) -> dict:
    """TinyVLM on a (dp=1, pp=1) mesh in ``precision``: losses, and what the stages computed with (step 0)."""
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.models import make_example_batch
    from omnibal_compile.runtime import build_pipeline

    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    batch = make_example_batch(SMALL_VLM, batch=4, tiles_per_sample=1, text_tokens=12)
    with progress.quiet():
        plan = oc.optimize(model, num_stages=1, planner="uniform", num_microbatches=2).plan
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result, masters = compile_in_precision(model, batch, plan, precision)
    pipe = build_pipeline(result, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp")),
                          precision=precision, masters=masters)
    state = {n: t.detach() for n, t in pipe.full_state().items() if n in before}
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    losses, seen = [], None
    for k in range(steps):
        recorder = ComputeParams(pipe.modules)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(batch))
        recorder.close()
        if k == 0:
            seen = {"compute": recorder.dtypes(), "bytes": recorder.param_bytes + recorder.grad_bytes,
                    "masters": {p.dtype for p in pipe.parameters()},
                    "master grads": {p.grad.dtype for p in pipe.parameters() if p.grad is not None},
                    "exact masters": all(torch.equal(state[n], before[n]) for n in state)}
        optimizer.step()
    return {"losses": losses, **(seen or {})}


@pytest.mark.slow
def test_bf16_computes_with_bf16_parameters_over_fp32_masters_on_one_rank(one_rank_group):
    """dp=1: FSDP2 over the 1-rank dp mesh gathers bf16 weights for the stage (parameters and gradients in compute:
    bf16, half of fp32's bytes), the optimizer holds the fp32 masters, equal to the model's fp32 weights before the
    capture cast, with fp32 gradients; the losses stay within 2% of fp32's."""
    fp32, bf16 = _one_rank("fp32"), _one_rank("bf16")
    assert fp32["compute"] == fp32["masters"] == fp32["master grads"] == {torch.float32}
    assert bf16["compute"] == {torch.bfloat16}
    assert bf16["masters"] == bf16["master grads"] == {torch.float32} and bf16["exact masters"]
    assert bf16["bytes"] * 2 == fp32["bytes"]
    assert bf16["losses"] != fp32["losses"]  # computed in bf16 indeed
    assert max(abs(a - b) / a for a, b in zip(fp32["losses"], bf16["losses"])) <= 0.02


def test_16_bit_runs_need_a_model_captured_in_16_bits_and_a_mesh(one_rank_group):
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.models import make_example_batch
    from omnibal_compile.runtime import build_pipeline

    model = TinyVLM(SMALL_VLM)
    batch = make_example_batch(SMALL_VLM, batch=2, tiles_per_sample=1, text_tokens=12)
    with progress.quiet():
        plan = oc.optimize(model, num_stages=1, planner="uniform", num_microbatches=2).plan
    result = compile_for_microbatches(model, batch, plan)
    with pytest.raises(InputError, match=r"captured with float32 parameters; capture it in bfloat16"):
        build_pipeline(result, rank=0, world_size=1, precision="bf16")
    cast_for_capture(model, torch.bfloat16)  # the parameters the check reads (a graph of fp32 casts still)
    with pytest.raises(InputError, match="give build_pipeline a mesh"):
        build_pipeline(result, rank=0, world_size=1, precision="bf16")


def test_16_bit_refuses_two_stages_on_one_rank_sharing_a_tied_weight(one_rank_group, tiny_llama):
    """A 1-rank interleaved pipeline of a Llama whose embedding and head are one parameter: FSDP2 wraps each stage
    on its own, so 16 bits are refused, naming the way out."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.planning.build import uniform
    from omnibal_compile.runtime import build_pipeline

    model, batch = copy.deepcopy(tiny_llama[0]), {k: v[:1] for k, v in tiny_llama[1].items()}
    with progress.quiet():
        graph = oc.optimize(model, batch, num_stages=1).graph
    plan = dataclasses.replace(uniform(graph, 2), schedule="interleaved", num_microbatches=2, virtual_stages=2)
    masters = cast_for_capture(model, torch.bfloat16)
    result = compile_for_microbatches(model, {k: v.repeat(2, 1) for k, v in batch.items()}, plan)
    with pytest.raises(InputError, match=r"share a parameter \(tied weights\); --precision bf16 keeps fp32 masters"):
        build_pipeline(result, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp")), precision="bf16",
                       masters=masters)


def test_the_plan_costs_the_precision_given(tmp_path: Path, capsys):
    assert compute_dtype("fp16") is torch.float16
    with pytest.raises(InputError, match=r"setting precision \(--precision\)"):
        Config(precision="int8")
    assert compute_dtype("bf16") is torch.bfloat16 and compute_dtype(None) is compute_dtype("fp32") is None
    assert precision_named("fp32") == FP32_ADAM and precision_named("bf16") == BF16_ADAM
    model_config = dataclasses.asdict(SMALL_VLM)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=2,
                           planner="uniform", device="cpu", precision="fp32").plan
    assert plan.notes["compute dtype"] == "float32"
    (tmp_path / "plan.json").write_text(plan.to_json())
    bf16 = dataclasses.replace(plan, notes={**plan.notes, "precision": "bf16"})  # as `plan --precision bf16` notes
    (tmp_path / "bf16.json").write_text(bf16.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, batch_size=4)
    capsys.readouterr()
    precheck(config)
    assert "measured in" not in capsys.readouterr().err  # fp32 run, fp32 costs: nothing to say
    assert plan.notes["precision"] == "fp32"  # the setting its parameter bytes were costed in
    precheck(dataclasses.replace(config, precision="bf16"))
    said = capsys.readouterr().err
    assert "costs were measured in float32, this run computes in bfloat16" in said
    assert ("the plan costed the parameters of --precision fp32 (4-byte weights and gradients in compute), this run "
            "holds those of --precision bf16 (2-byte weights and gradients in compute over a 4-byte master copy)"
            in said)
    precheck(dataclasses.replace(config, plan=str(tmp_path / "bf16.json")))  # a bf16 plan, an fp32 run
    said = capsys.readouterr().err
    assert "parameters of --precision bf16 (2-byte" in said and "those of --precision fp32 (4-byte" in said
    assert "measured in" not in said  # profiled on CPU: activations in the model's float32, as the run's


def _losses(tmp_path: Path, stages: int, dp: int, precision: str, steps: int, tp: int = 1) -> list[float]:
    model_config = dataclasses.asdict(SMALL_VLM)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=stages,
                           planner="uniform", num_microbatches=2).plan
    path = tmp_path / f"plan{stages}.json"
    path.write_text(plan.to_json())
    config = RunConfig(plan=str(path), model_config=model_config, steps=steps, batch_size=4 * dp, lr=1e-3, dp=dp,
                       dp_shard="fsdp", precision=precision, tp=tp)
    return [e.loss for e in launch(config, timeout_s=240, quiet=True)]


@pytest.mark.distributed
@pytest.mark.parametrize("stages,dp,tp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["pp2", "dp2-fsdp", "tp2"])
def test_bf16_losses_stay_within_2_percent_of_fp32(tmp_path: Path, stages: int, dp: int, tp: int):
    fp32 = _losses(tmp_path, stages, dp, "fp32", 4, tp)
    bf16 = _losses(tmp_path, stages, dp, "bf16", 4, tp)
    assert bf16 != fp32  # computed in bf16 indeed
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) <= 0.02


def _mesh_worker(rank: int, world: int, port: int, out: str, models: dict, cases: list) -> None:
    """One of 2 ranks: every case (name, (dp, pp) (tp: the rest), dp_shard, precision) trains TinyVLM for its steps
    from the same weights and batches; saves the losses and what the stages computed with in the first step."""
    from test_runtime import _rank_process
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.ir.costs import DataParallel
    from omnibal_compile.runtime import build_pipeline
    from omnibal_compile.runtime.batches import _dp_part

    with _rank_process(rank, world, port, out):
        found = {}
        for name, (dp, pp), shard, precision, plan, steps in cases:
            cls, config, weights, batch = models["vlm"]
            model = cls(config)
            model.load_state_dict(weights)
            mesh = init_device_mesh("cpu", (dp, pp, world // (dp * pp)), mesh_dim_names=("dp", "pp", "tp"))
            part = _dp_part(batch, dp, mesh["dp"].get_local_rank())
            result, masters = compile_in_precision(model, part, plan, precision)
            pipe = build_pipeline(result, mesh=mesh,
                                  precision=precision, masters=masters,
                                  data_parallel=DataParallel(size=dp, shard=shard))
            optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
            losses, seen = [], {}
            for k in range(steps):
                recorder = ComputeParams(pipe.modules)
                optimizer.zero_grad(set_to_none=True)
                losses.append(pipe.step(part))
                recorder.close()
                if k == 0:
                    seen = {"compute": recorder.dtypes(), "bytes": recorder.param_bytes + recorder.grad_bytes,
                            "masters": {p.dtype for p in pipe.parameters()},
                            "master grads": {p.grad.dtype for p in pipe.parameters() if p.grad is not None}}
                optimizer.step()
            found[name] = {"losses": losses, **seen}
        torch.save(found, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_pp2_and_dp2_compute_with_bf16_parameters_over_fp32_masters(tmp_path: Path):
    """2 ranks, 10 steps each of the same data: pp=2 (FSDP2 on the 1-rank dp meshes, bf16 activations sent between
    the stages), dp=2 FSDP2, dp=2 DDP (replicate) and tp=2 (FSDP2 on the 1-rank dp mesh over the tp shards). In
    bf16 every rank computes with bf16 parameters and
    gradients, half of fp32's bytes, while the optimizer steps fp32 masters with fp32 gradients; the losses stay
    within 2% of fp32's."""
    from test_runtime import _spawn, _vlm_batch

    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    batch = _vlm_batch()
    half = {k: v[:2] for k, v in batch.items()}  # dp=2: each rank's part
    plans = {}
    for pp, example in ((2, batch), (1, half)):
        with progress.quiet():
            plans[pp] = oc.optimize(model, {k: v[:1] for k, v in example.items()}, num_stages=pp, planner="uniform",
                                    num_microbatches=2).plan
    layouts = {"pp2": ((1, 2), "fsdp"), "dp2-fsdp": ((2, 1), "fsdp"), "dp2-ddp": ((2, 1), "ddp"),
               "tp2": ((1, 1), "fsdp")}
    cases = [(f"{name}-{precision}", mesh, shard, precision, plans[mesh[1]], 10)
             for name, (mesh, shard) in layouts.items() for precision in ("fp32", "bf16")
             if (name, precision) != ("dp2-ddp", "fp32")]  # fp32 DDP computes as fp32 FSDP: its baseline
    ranks = _spawn(2, tmp_path, {"vlm": (model, batch)}, cases, worker=_mesh_worker)
    for name, baseline in (("pp2", "pp2"), ("dp2-fsdp", "dp2-fsdp"), ("dp2-ddp", "dp2-fsdp"), ("tp2", "tp2")):
        for rank, found in enumerate(ranks):
            fp32, bf16 = found[f"{baseline}-fp32"], found[f"{name}-bf16"]
            assert fp32["compute"] == fp32["masters"] == {torch.float32}, (name, rank)
            assert bf16["compute"] == {torch.bfloat16}, (name, rank)
            assert bf16["masters"] == bf16["master grads"] == {torch.float32}, (name, rank)
            assert bf16["bytes"] * 2 == fp32["bytes"] > 0, (name, rank)
        fp32, bf16 = ranks[-1][f"{baseline}-fp32"]["losses"], ranks[-1][f"{name}-bf16"]["losses"]  # the last stage's
        assert bf16 != fp32, name
        assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) <= 0.02, (name, fp32, bf16)


def test_the_loss_scaler_unscales_skips_on_inf_halves_and_grows_after_good_steps(one_rank_group):
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert not scaler.unscale([p], torch.device("cpu"))
    assert p.grad.tolist() == [1.0, 2.0, 3.0]  # divided by the scale
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0 and scaler.good_steps == 0  # grown after 2 good steps
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale([p], torch.device("cpu"))
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    again = LossScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == {"scale": 8.0, "good_steps": 0}
    with pytest.raises(InputError, match="loss scaler"):
        LossScaler(backoff_factor=1.5)


@pytest.mark.distributed
def test_fp16_trains_logs_its_scale_and_resumes_it(tmp_path: Path):
    model_config = dataclasses.asdict(SMALL_VLM)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=2,
                           planner="uniform", num_microbatches=2).plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, steps=3, batch_size=4, lr=1e-3,
                       precision="fp16")
    whole = launch(config, timeout_s=240, quiet=True)
    assert [e.loss_scale for e in whole] == [2.0**16] * 3 and not any(e.skipped for e in whole)
    launch(dataclasses.replace(config, steps=2, save=str(tmp_path / "ck")), timeout_s=240, quiet=True)
    rest = launch(dataclasses.replace(config, resume=str(tmp_path / "ck")), timeout_s=240, quiet=True)
    assert [e.loss for e in rest] == [whole[2].loss] and rest[0].loss_scale == 2.0**16


# -- fp16: one rank's inf skips the step everywhere; a resumed run keeps the changed scale --------------------------
TESTS = Path(__file__).resolve().parent
EXACT = 1e-6


def _fp16_pp2(tmp_path: Path, **kw) -> RunConfig:
    model_config = dataclasses.asdict(SMALL_VLM)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=2,
                           planner="uniform", num_microbatches=2).plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    return RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, batch_size=4, lr=1e-3,
                     optimizer="adamw", precision="fp16", **kw)


def _launch_planted(config: RunConfig, monkeypatch, *, inf_grad: str | None, scaler_log: Path | None = None):
    """``launch`` with tests/fault_worker.py: an inf in one rank's gradients (``rank:step``), each rank's scaler
    updates logged to ``scaler_log``."""
    with monkeypatch.context() as planted:
        planted.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
        for name, value in (("_OMNIBAL_TEST_INF_GRAD", inf_grad), ("_OMNIBAL_TEST_SCALER_LOG", scaler_log)):
            if value is None:
                planted.delenv(name, raising=False)
            else:
                planted.setenv(name, str(value))
        return launch(config, timeout_s=240, quiet=True, _worker="fault_worker")


@pytest.mark.slow
@pytest.mark.distributed
def test_fp16_an_inf_in_one_ranks_gradients_skips_the_step_and_halves_the_scale_on_every_rank(tmp_path, monkeypatch):
    """pp=2: rank 0 alone gets an inf gradient in step 1; the flag is all-reduced, so rank 1 (whose own gradients are
    finite, and which logs) skips the optimizer step too, both ranks' parameters stay as they were, both scales halve,
    and the next step trains again at the halved scale."""
    updates = tmp_path / "scaler"
    updates.mkdir()
    logged = _launch_planted(_fp16_pp2(tmp_path, steps=3), monkeypatch, inf_grad="0:1", scaler_log=updates)
    assert [e.skipped for e in logged] == [False, True, False]
    assert [e.loss_scale for e in logged] == [2.0**16, 2.0**16, 2.0**15]
    assert math.isfinite(logged[1].loss) and not math.isfinite(logged[1].grad_norm)  # the loss was fine, not the grads
    for rank in (0, 1):
        steps = [json.loads(line) for line in (updates / f"scaler-rank{rank}.jsonl").read_text().splitlines()]
        assert [s["skipped"] for s in steps] == [False, True, False], rank
        assert [s["scale"] for s in steps] == [2.0**16, 2.0**15, 2.0**15], rank
        params = [s["params"] for s in steps]
        assert params[1] == params[0] != params[2], rank  # step 1 left this rank's parameters alone, step 2 moved them


@pytest.mark.slow
@pytest.mark.distributed
def test_fp16_a_run_resumed_after_its_scale_halved_continues_at_that_scale_exactly(tmp_path, monkeypatch):
    """The loss scale is fixed at 2**16 until 2000 good steps in a row, so a forced skip (an inf in rank 1's gradients
    in step 1) changes it: 4 steps saving after step 2 vs --resume from that step-2 checkpoint give the same
    steps 2 and 3 (losses <= 1e-6, grad norms, lrs) at the halved scale."""
    root = tmp_path / "ckpt"
    config = _fp16_pp2(tmp_path, steps=4, warmup_steps=2, lr_schedule="cosine", max_grad_norm=1.0)
    whole = _launch_planted(dataclasses.replace(config, save=str(root), save_every=2), monkeypatch, inf_grad="1:1")
    assert [e.skipped for e in whole] == [False, True, False, False]
    assert [e.loss_scale for e in whole] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    meta = json.loads((root / "step-000002" / "meta.json").read_text())
    assert meta["loss_scale"] == {"scale": 2.0**15, "good_steps": 0}
    rest = launch(dataclasses.replace(config, resume=str(root / "step-000002")), timeout_s=240, quiet=True)
    assert [e.step for e in rest] == [2, 3] and [e.loss_scale for e in rest] == [2.0**15] * 2
    for a, b in zip(rest, whole[2:]):
        assert not a.skipped and abs(a.loss - b.loss) <= EXACT, (a, b)
        assert a.lr == b.lr and abs(a.grad_norm - b.grad_norm) <= EXACT, (a, b)
