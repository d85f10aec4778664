"""``run --kernels triton|eager`` (the fused kernels in the stages the ranks build) and ``run --compile``
(each stage module's forward under torch.compile, inductor): their checks before launch, the plan's note of what
its costs were measured with, and their numbers against eager runs.

Gradients of a run are read from a one-step SGD run at lr 1 saved to a checkpoint: ``w0 - w1`` is the step's
gradient. The Triton runs are interpreted (``TRITON_INTERPRET=1``, inherited by the ranks), so they run the real
Triton kernels on CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile import progress
from omnibal_compile.errors import InputError, MissingBackendError, PlanError
from omnibal_compile.kernels import ops
from omnibal_compile.runtime.batches import build_model
from omnibal_compile.runtime.checkpoint import load_into_model
from omnibal_compile.runtime.launch import launch, precheck
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM

KERNEL_TOL = 2e-5
"""fp32 (atol, rtol) of the kernels against their references (tests/test_kernels.py's TOL[float32])."""

TINIEST = dataclasses.replace(SMALL_VLM, vit_layers=1, llm_layers=1)
"""One layer each: inductor compiles every kernel with a C++ compiler and Triton's interpreter
runs every kernel in Python, both slow on a loaded CPU."""


def _plan(tmp_path: Path, model_config: dict, stages: int, **kw) -> Path:
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=stages,
                           planner="uniform", num_microbatches=2, device="cpu", **kw).plan
    path = tmp_path / f"plan{stages}-{kw.get('kernels')}.json"
    path.write_text(plan.to_json())
    return path


def _run_gradients(config: RunConfig, root: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One SGD step at lr 1: its loss and every parameter's gradient (the weights before minus after)."""
    config = dataclasses.replace(config, steps=1, optimizer="sgd", lr=1.0, save=str(root))
    losses = [e.loss for e in launch(config, timeout_s=240, quiet=True)]
    before, after = build_model(config), build_model(config)
    load_into_model(after, root)
    moved = dict(after.named_parameters())
    return losses, {n: (p - moved[n]).detach() for n, p in before.named_parameters()}


def test_a_missing_backend_is_named_before_launch(tmp_path: Path, monkeypatch):
    model_config = dataclasses.asdict(TINIEST)
    with pytest.raises(InputError, match=r"--kernels"):
        RunConfig(plan="-", kernels="cuda")
    with progress.quiet():  # not costed: the checks come before the plan is captured
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=2,
                           planner="uniform", num_microbatches=2).plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, batch_size=4)
    with monkeypatch.context() as m:  # triton not installed: the kernels' own rule, named with the flag
        m.setattr(ops, "triton_available", lambda: False)
        with pytest.raises(MissingBackendError, match=r"--kernels triton: .*triton is not installed.*--kernels eager"):
            precheck(dataclasses.replace(config, kernels="triton"))

    def no_compiler() -> str:
        raise RuntimeError("no working C++ compiler found")

    with monkeypatch.context() as m:  # inductor without a C++ compiler: said before any rank starts
        m.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
        with pytest.raises(InputError, match=r"--compile .*on cpu needs a C\+\+ compiler"):
            precheck(dataclasses.replace(config, compile=True))


@pytest.mark.slow
def test_the_plan_notes_its_fast_paths_and_a_run_with_others_says_so(tmp_path: Path, capsys, monkeypatch):
    model_config = dataclasses.asdict(SMALL_VLM)
    path = _plan(tmp_path, model_config, 2)
    plan = oc.Plan.from_file(path)
    assert (plan.notes["kernels"], plan.notes["compiled"]) == ("none", "no")  # the costs' fast paths
    config = RunConfig(plan=str(path), model_config=model_config, batch_size=4)
    with pytest.raises(PlanError, match=r"made without --kernels, this run trains --kernels eager: .*fuses the LM"):
        precheck(dataclasses.replace(config, kernels="eager"))  # its blocks are not the plan's
    fused = dataclasses.replace(config, plan=str(_plan(tmp_path, model_config, 2, kernels="eager")), kernels="eager")
    assert oc.Plan.from_file(fused.plan).notes["kernels"] == "eager"
    capsys.readouterr()
    precheck(fused)
    assert "measured with kernels" not in capsys.readouterr().err  # the plan's own settings: nothing to say
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    precheck(dataclasses.replace(fused, kernels="triton", compile=True))
    said = capsys.readouterr().err
    assert ("costs were measured with kernels eager, torch.compile no; this run uses --kernels triton, torch.compile "
            "inductor") in said
    assert "--kernels triton on cpu without TRITON_INTERPRET=1 runs the kernels' eager implementations" in said


def test_the_run_flags_are_the_config_fields():
    from omnibal_compile.cli import build_parser

    args = build_parser().parse_args(["run", "--plan", "p.json", "--kernels", "triton", "--compile"])
    assert (args.kernels, args.compile) == ("triton", True)
    from omnibal_compile.config import Config, ModelConfig, RuntimeConfig

    assert "kernels" in ModelConfig.names() and "compile" in RuntimeConfig.names()  # one field each, for plan and run
    assert Config(kernels="eager").section(ModelConfig).kernels == "eager"


@pytest.mark.skipif(not ops.triton_available(), reason="needs triton (interpreted on CPU)")
@pytest.mark.slow
@pytest.mark.distributed
def test_triton_kernels_in_a_pp2_run_match_eager(tmp_path: Path, monkeypatch):
    """2 ranks, pp=2, the reference VLM (one layer per tower): a --kernels triton step (every fused kernel
    interpreted) gives eager's loss and gradients within the kernels' fp32 tolerance, and not bit for bit (the
    kernels ran). Each run has its plan: the kernel pass fuses the LM head into the loss, so their blocks differ
    (the model's numbers do not)."""
    model_config = dataclasses.asdict(TINIEST)
    config = RunConfig(plan=str(_plan(tmp_path, model_config, 2)), model_config=model_config, batch_size=4)
    loss, grads = _run_gradients(config, tmp_path / "eager")
    fused_plan = str(_plan(tmp_path, model_config, 2, kernels="triton"))  # the LM head's block fused into the loss
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused_loss, fused = _run_gradients(dataclasses.replace(config, plan=fused_plan, kernels="triton"),
                                       tmp_path / "triton")
    torch.testing.assert_close(torch.tensor(fused_loss), torch.tensor(loss), atol=KERNEL_TOL, rtol=KERNEL_TOL)
    for name, g in grads.items():
        torch.testing.assert_close(fused[name], g, atol=KERNEL_TOL, rtol=KERNEL_TOL, msg=name)
    assert any(not torch.equal(fused[n], g) for n, g in grads.items())  # the kernels computed them, not eager torch
    print(f"triton-interpret vs eager: loss {abs(fused_loss[0] - loss[0]):.2e}, gradients "
          f"{max(float((fused[n] - g).abs().max()) for n, g in grads.items()):.2e} (max abs differences)")


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_stages_give_eagers_loss(tmp_path: Path):
    """--compile with every block recomputed (checkpoint regions inside the compiled forward): eager's loss within
    1e-5 and its gradients within the kernels' fp32 tolerance."""
    model_config = dataclasses.asdict(TINIEST)
    config = RunConfig(plan=str(_plan(tmp_path, model_config, 1, recompute="full")), model_config=model_config,
                       batch_size=4)
    loss, grads = _run_gradients(config, tmp_path / "eager")
    compiled_loss, compiled = _run_gradients(dataclasses.replace(config, compile=True), tmp_path / "compiled")
    assert abs(compiled_loss[0] - loss[0]) <= 1e-5
    for name, g in grads.items():
        torch.testing.assert_close(compiled[name], g, atol=KERNEL_TOL, rtol=KERNEL_TOL, msg=name)
    assert any(not torch.equal(compiled[n], g) for n, g in grads.items())  # inductor's code ran, not the eager graph
    print(f"compiled vs eager: loss {abs(compiled_loss[0] - loss[0]):.2e}, gradients "
          f"{max(float((compiled[n] - g).abs().max()) for n, g in grads.items()):.2e} (max abs differences)")
