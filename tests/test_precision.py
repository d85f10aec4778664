"""--precision: bf16 and fp16 compute under autocast inside each stage's forward (fp32 weights, fp32 tensors
between stages), fp16 with a dynamic loss scale agreed by every rank, and a run
whose compute dtype differs from its plan's costs says so. The
20-step bf16-vs-fp32 figures are bench/precision_cpu.py's."""

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
