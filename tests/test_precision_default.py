"""--precision's auto default (bf16 on cuda, fp32 on cpu; one rule, config.precision_for), TF32 on CUDA runs only,
`plan` costing parameters and activations in the precision the run uses, and the note of a run whose precision
differs from its plan's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from omnibal_compile.cli import main
from omnibal_compile.config import Config, precision_for
from omnibal_compile.costs.devices import get_device
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.runtime.precision import enable_tf32
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM


def test_auto_precision_is_bf16_on_a_gpu_and_fp32_on_cpu_and_a_given_one_wins():
    assert precision_for(None, "cuda") == precision_for(None, "cuda:3") == precision_for(None, " CUDA ") == "bf16"
    assert precision_for(None, "h200") == precision_for(None, get_device("a100-80gb")) == "bf16"  # roofline targets
    assert precision_for(None, "cpu") == precision_for(None, None) == "fp32"
    assert precision_for("fp32", "cuda") == "fp32" and precision_for("bf16", "cpu") == "bf16"
    assert precision_for("fp16", "cuda") == "fp16"
    # a run resolves it where it is read (RunConfig.run_precision): the setting itself stays auto
    assert RunConfig(plan="p.json").run_precision == "fp32"
    assert RunConfig(plan="p.json", device="cuda").run_precision == "bf16"
    assert RunConfig(plan="p.json", device="cuda", precision="fp32").run_precision == "fp32"
    assert RunConfig.from_json(RunConfig(plan="p.json", device="cuda").to_json()).run_precision == "bf16"
    # a copy with another device resolves auto for that device (a stored resolution would keep cpu's fp32)
    cpu = RunConfig(plan="p.json")
    assert cpu.precision is None and dataclasses.replace(cpu, device="cuda").run_precision == "bf16"
    assert dataclasses.replace(RunConfig(plan="p.json", precision="fp16"), device="cuda").run_precision == "fp16"
    assert Config().precision is None  # the setting stays auto; what costs it is resolved by optimize()


def test_tf32_is_switched_on_for_cuda_devices_only(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert enable_tf32("cpu") is False and enable_tf32(torch.device("cpu")) is False
    assert calls == [] and torch.backends.cudnn.allow_tf32 is False
    assert enable_tf32("cuda:1") is True  # a device string is enough: no GPU needed to decide
    assert calls == ["high"] and torch.backends.cudnn.allow_tf32 is True


def _plan(tmp_path: Path, name: str, *flags: str) -> tuple[Plan, CostTable]:
    out = tmp_path / name
    code = main(["plan", "tinyvlm", "--model-config", json.dumps(dataclasses.asdict(SMALL_VLM)), "--num-stages", "2",
                 "--planner", "uniform", "--microbatch-size", "2", "--no-pictures", "--out", str(out), *flags])
    assert code == 0
    return Plan.from_file(out / "plan.json"), CostTable.from_json((out / "costs.json").read_text())


@pytest.mark.slow
def test_plan_costs_parameters_and_activations_in_the_runs_precision(tmp_path: Path, capsys):
    """`plan --precision bf16` on cpu measures the activations of a bf16 model (as the run captures it), not of the
    fp32 model it built; the parameters in compute cost 2 + 2 bytes instead of 4 + 4; the plan records both."""
    fp32_plan, fp32 = _plan(tmp_path, "auto")  # cpu, no --precision: auto is fp32, as the cpu run
    bf16_plan, bf16 = _plan(tmp_path, "bf16", "--precision", "bf16")
    assert fp32_plan.notes["precision"] == "fp32" and fp32_plan.notes["compute dtype"] == "float32"
    assert bf16_plan.notes["precision"] == "bf16" and bf16_plan.notes["compute dtype"] == "bfloat16"
    assert fp32.activation_dtype == "float32" and bf16.activation_dtype == "bfloat16"
    assert "activations in bfloat16" in capsys.readouterr().out
    p16, p32 = bf16.precision, fp32.precision
    assert (p16.weight_bytes + p16.grad_bytes) * 2 == p32.weight_bytes + p32.grad_bytes
    assert p16.master_bytes == 4 and p32.master_bytes == 0
    saved = [sum(b.activation_bytes["none"] for b in t.blocks) for t in (fp32, bf16)]
    sent = [sum(t.cut_bytes) for t in (fp32, bf16)]
    # about half: integer ids, fp32 upcasts inside the norms and the fp32 loss keep their bytes
    assert 0.4 <= saved[1] / saved[0] <= 0.75, saved
    assert 0.4 <= sent[1] / sent[0] <= 0.75, sent
    # the note of a run whose precision differs: this bf16 plan, a cpu run (auto: fp32)
    config = RunConfig(plan=str(tmp_path / "bf16" / "plan.json"), model_config=dataclasses.asdict(SMALL_VLM),
                       batch_size=4)
    from omnibal_compile.runtime.launch import precheck

    capsys.readouterr()
    precheck(config)
    said = capsys.readouterr().err
    assert "costs were measured in bfloat16, this run computes in float32 (--precision fp32)" in said
    assert "the plan costed the parameters of --precision bf16" in said
    precheck(dataclasses.replace(config, precision="bf16"))
    said = capsys.readouterr().err
    assert "measured in" not in said and "costed the parameters" not in said  # the plan's precision: nothing to say


@pytest.mark.slow
def test_optimize_costs_auto_precision_for_the_device_it_costs_on():
    """A roofline GPU target: bf16; a layout search that profiles here (no device given, on cpu): fp32, as the cpu
    run; a Precision given as the input is costed as given."""
    import omnibal_compile as oc
    from omnibal_compile import progress
    from omnibal_compile.ir.costs import FP32_ADAM
    from omnibal_compile.models import TinyVLM

    with progress.quiet():
        target = oc.optimize(TinyVLM(SMALL_VLM), num_stages=2, device="h200", planner="uniform")
        searched = oc.optimize(TinyVLM(SMALL_VLM), devices=2, planner="dp")
        given = oc.optimize(TinyVLM(SMALL_VLM), num_stages=2, device="cpu", planner="uniform", precision=FP32_ADAM)
    assert target.plan.notes["precision"] == "bf16" and target.costs.precision.compute_dtype == "bfloat16"
    assert searched.plan.notes["precision"] == "fp32" and searched.costs.precision == FP32_ADAM
    assert given.costs.precision == FP32_ADAM and "precision" not in given.plan.notes
