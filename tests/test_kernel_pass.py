"""Kernel-substitution pass: the reference VLM and a tiny HF Llama keep their loss and gradients.

On CPU, Triton cases run in a child pytest under ``TRITON_INTERPRET=1`` (``test_kernels.py`` says
why); with a GPU they run here on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SMALL_VLM
from test_kernels import CUDA, needs_triton, run_triton_cases_in_child, triton_impl

import omnibal_compile as oc
from omnibal_compile.compile.fuse import KernelReport, substitute_kernels
from omnibal_compile.kernels import ops

BACKENDS = [pytest.param("triton", marks=needs_triton), "eager"]
VLM_SITES = {
    "rms_norm": 2 * SMALL_VLM.llm_layers + 1,
    "layer_norm": 2 * SMALL_VLM.vit_layers + 1,  # two per ViT block, one in the projector
    "swiglu": SMALL_VLM.llm_layers,
    "rope": SMALL_VLM.llm_layers,  # q and k of each layer: one op
    "fused_linear_cross_entropy": 1,
}


def _report(result: oc.OptimizeResult) -> KernelReport:
    assert result.kernels is not None
    return result.kernels


def _code(result: oc.OptimizeResult) -> str:
    return "\n".join(stage.code for stage in result.stages)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_vlm_keeps_loss_and_gradients(vlm, backend):
    model, batch = vlm
    if CUDA and backend == "triton":  # the compiled kernels need CUDA tensors
        model = copy.deepcopy(model).cuda()
        batch = {k: v.cuda() for k, v in batch.items()}
    result = oc.optimize(model, batch, num_stages=3, kernels=backend)
    assert _report(result).counts() == VLM_SITES
    code = _code(result)
    for kernel, count in VLM_SITES.items():
        assert code.count(f"torch.ops.omnibal.{kernel}.default(") == count
    assert f"'{backend}'" in code
    for unfused in ("cross_entropy_loss", "aten.silu", "aten.layer_norm", "aten.neg", "aten.rsqrt"):
        assert unfused not in code
    report = result.check_parity(batch, tolerance=1e-5)
    assert report.ok, str(report)
    assert report.num_params == sum(1 for _ in model.parameters())
    # parameters stay get_attr inputs: each one is owned by exactly one stage, shared not copied
    original = dict(model.named_parameters())
    owned = [
        (name, p) for s, stage in enumerate(result.stages) for name, p in stage.named_parameters()
        if p is original[result.stage_info(s).param_map[name][0]]
    ]
    assert sorted(n for n, _ in owned) == sorted(original)


def test_default_is_no_substitution(vlm):
    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=2)
    assert result.kernels is None
    assert "omnibal" not in _code(result)
    assert "kernels" not in result.timings


def test_pass_returns_a_new_capture_and_leaves_the_given_one_alone(vlm):
    from omnibal_compile.compile.capture import capture

    model, batch = vlm
    captured = capture(model, batch)
    before = captured.graph_module.code
    rewritten, report = substitute_kernels(captured, model, backend="eager")
    assert captured.graph_module.code == before  # the input capture is untouched
    assert "torch.ops.omnibal" not in before and "torch.ops.omnibal" in rewritten.graph_module.code
    assert report.counts() == VLM_SITES
    # the new graph module shares the model's parameters (no copy)
    original = {id(p) for p in model.parameters()}
    assert {id(p) for p in rewritten.graph_module.parameters()} <= original
    assert len(rewritten.graph_module.code) < len(before)


def test_low_precision_llama_within_dtype_tolerance(tiny_llama):
    # the reference VLM keeps fp32 rotary tables, so a bf16 Llama is the low-precision case
    model, batch = tiny_llama
    model = copy.deepcopy(model).to(torch.bfloat16)
    result = oc.optimize(model, batch, num_stages=2, kernels="eager")
    assert _report(result).counts()["rms_norm"] == 2 * model.config.num_hidden_layers + 1
    report = result.check_parity(batch, tolerance=5e-2)
    assert report.ok, str(report)


def test_tiny_llama_norms_and_mlp(tiny_llama):
    model, batch = tiny_llama
    result = oc.optimize(model, batch, num_stages=2, kernels="eager")
    layers = model.config.num_hidden_layers
    # the logits are returned next to the loss, so the loss keeps its unfused form
    assert _report(result).counts() == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers}
    report = result.check_parity(batch, tolerance=1e-5)
    assert report.ok, str(report)


class _OffsetRMSNorm(torch.nn.Module):
    """Gemma-style ``x / rms(x) * (1 + weight)``: named like an RMSNorm but not Llama's maths."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = torch.nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _OffsetRMSNorm(8)
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(self.norm(x)).chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b


def test_lookalike_norm_is_left_alone_and_swiglu_still_matches():
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(3, 8)
    result = oc.optimize(model, (x,), num_stages=1, kernels="eager")
    assert _report(result).counts() == {"swiglu": 1}
    assert result.check_parity((x,), tolerance=1e-5).ok


class _LearnedRotary(torch.nn.Module):
    """The rotary pattern with trainable cos/sin tables: the op (constant tables) must not take it."""

    def __init__(self) -> None:
        super().__init__()
        self.cos = torch.nn.Parameter(torch.randn(1, 1, 5, 8))
        self.sin = torch.nn.Parameter(torch.randn(1, 1, 5, 8))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        def rot(x: torch.Tensor) -> torch.Tensor:
            a, b = x.chunk(2, dim=-1)
            return x * self.cos + torch.cat((-b, a), dim=-1) * self.sin

        return (rot(q) * rot(k)).sum()


def test_rotary_with_trainable_tables_is_left_alone():
    model, q, k = _LearnedRotary(), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    result = oc.optimize(model, (q, k), num_stages=1, kernels="eager")
    assert "rope" not in _report(result).counts()
    assert result.check_parity((q, k), tolerance=1e-5).ok


def test_bad_kernels_argument(vlm):
    model, batch = vlm
    with pytest.raises(oc.InputError, match="kernels must be one of"):
        oc.optimize(model, batch, num_stages=2, kernels="cuda")
    with pytest.raises(oc.InputError, match="capture_method='export'"):
        oc.optimize(_Tiny(), (torch.randn(2, 8),), num_stages=1, kernels="eager", capture_method="fx")


def test_missing_backend_named_by_optimize(vlm, monkeypatch):
    model, batch = vlm
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(ops.MissingBackendError, match=r"pip install 'omnibal-compile\[triton\]'"):
        oc.optimize(model, batch, num_stages=2, kernels="triton")


@pytest.mark.skipif(triton_impl is not None or not ops.triton_available(), reason="runs them itself, or no triton")
def test_triton_cases_in_interpreter():
    run_triton_cases_in_child(__file__)
