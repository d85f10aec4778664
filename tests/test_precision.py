"""--precision: bf16 and fp16 compute under autocast inside each stage's forward (fp32 weights, fp32 tensors
between stages), fp16 with a dynamic loss scale agreed by every rank, and a run
whose compute dtype differs from its plan's costs says so. The
20-step bf16-vs-fp32 figures are bench/precision_cpu.py's."""

from __future__ import annotations

import dataclasses
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
from omnibal_compile.runtime.precision import LossScaler, PrecisionStage, compute_dtype
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM


def test_a_bf16_stage_computes_in_bf16_and_hands_on_fp32():
    model = TinyVLM(SMALL_VLM)
    with progress.quiet():
        result = oc.optimize(model, num_stages=2, planner="uniform")
    values = plain = result.captured.example_flat_inputs
    for stage in result.stages:
        plain = stage(*plain)
        values = PrecisionStage(stage, "cpu", torch.bfloat16)(*values)
        assert [v.dtype for v in values if v.is_floating_point()] == [torch.float32] * sum(
            v.is_floating_point() for v in values)
    loss16, loss32 = float(values[0].detach()), float(plain[0].detach())
    assert loss16 != loss32 and abs(loss16 - loss32) / loss32 < 0.02  # computed in bf16, close to fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


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
    config = RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, batch_size=4)
    capsys.readouterr()
    precheck(config)
    assert "measured in" not in capsys.readouterr().err  # fp32 run, fp32 costs: nothing to say
    precheck(dataclasses.replace(config, precision="bf16"))
    assert "costs were measured in float32, this run computes in bfloat16" in capsys.readouterr().err


def _losses(tmp_path: Path, stages: int, dp: int, precision: str, steps: int) -> list[float]:
    model_config = dataclasses.asdict(SMALL_VLM)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=stages,
                           planner="uniform", num_microbatches=2).plan
    path = tmp_path / f"plan{stages}.json"
    path.write_text(plan.to_json())
    config = RunConfig(plan=str(path), model_config=model_config, steps=steps, batch_size=4 * dp, lr=1e-3, dp=dp,
                       dp_shard="fsdp", precision=precision)
    return [e.loss for e in launch(config, timeout_s=240, quiet=True)]


@pytest.mark.distributed
@pytest.mark.parametrize("stages,dp", [(2, 1), (1, 2)], ids=["pp2", "dp2-fsdp"])
def test_bf16_losses_stay_within_2_percent_of_fp32(tmp_path: Path, stages: int, dp: int):
    fp32 = _losses(tmp_path, stages, dp, "fp32", 4)
    bf16 = _losses(tmp_path, stages, dp, "bf16", 4)
    assert bf16 != fp32  # computed in bf16 indeed
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) <= 0.02


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
