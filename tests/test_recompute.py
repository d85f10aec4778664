"""Recompute policy and pass: one saved-op set for costs and runtime, parity, what backward reruns."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import omnibal_compile as oc
from omnibal_compile import Plan, PlanError
from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.compile.codegen import generate_stages, run_stages, stage_info
from omnibal_compile.compile.recompute import CheckpointedRegion, apply_recompute
from omnibal_compile.compile.recompute_policy import SAVED_OPS, op_class, selective_policy, with_recompute
from omnibal_compile.costs._measure import kept_bytes
from omnibal_compile.costs.annotate import annotate_costs, block_inputs, block_modules, charged_inputs
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, running_peak

TOL = 1e-5


class _OpCounter(TorchDispatchMode):
    """Records every ATen op overload that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[torch._ops.OpOverload] = []

    @property
    def ops(self) -> list[str]:
        return [f.overloadpacket.__name__ for f in self.funcs]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


# -- one policy ------------------------------------------------------------------------------------


def test_policy_saves_exactly_the_ops_that_are_not_memory_class(vlm):
    for packet in SAVED_OPS:
        for overload in packet.overloads():
            func = getattr(packet, overload)
            assert op_class(func) != "memory", func
            assert selective_policy(None, func) == CheckpointPolicy.MUST_SAVE, func
    model, batch = vlm
    with torch.enable_grad(), _OpCounter() as seen:
        model(**batch)
    for func in set(seen.funcs):
        saved = selective_policy(None, func) == CheckpointPolicy.MUST_SAVE
        assert saved == (op_class(func) != "memory"), func
    # the reference forward exercises all three classes (matmuls, a convolution, CPU flash attention)
    assert {op_class(f) for f in seen.funcs} == {"matmul", "attention", "memory"}
    assert {"addmm", "mm", "convolution", "_scaled_dot_product_flash_attention_for_cpu"} <= {
        p.__name__ for p in SAVED_OPS
    }


def test_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="unknown recompute option 'some'"):
        with_recompute(torch.relu, "some")
    with pytest.raises(PlanError, match="'none' cannot be applied"):
        CheckpointedRegion(torch.fx.symbolic_trace(torch.nn.ReLU()), "none")


# -- the cost pass predicts what the runtime keeps --------------------------------------------------


@pytest.fixture(scope="module", params=["vlm", "tiny_llava"])
def costed(request):
    model, batch = request.getfixturevalue(request.param)
    graph = build_blocks(capture(model, batch), model)
    return model, graph, annotate_costs(graph, model, device="cpu", warmup=0, repeats=1)


@pytest.mark.parametrize("option", RECOMPUTE_OPTIONS)
def test_predicted_activation_bytes_are_what_the_runtime_keeps(costed, option):
    """Per block: the cost pass's bytes == the bytes kept by the block's stage after the recompute pass."""
    model, graph, table = costed
    n = graph.num_blocks
    plan = Plan(block_names=graph.names, boundaries=tuple(range(n + 1)), recompute=(option,) * n)
    # Stages that receive the values stages would rebuild (masks), as the cost pass's block modules do: a stage
    # holds one rebuilt copy per micro-batch whichever of its blocks read it, which no block is charged.
    stages = [apply_recompute(s, graph, plan) for s in generate_stages(graph.sending_all(), plan, model)]
    inputs = block_inputs(graph, block_modules(graph, model))
    kept, predicted = {}, {}
    for k, stage in enumerate(stages):
        assert ("recompute_0" in dict(stage.named_children())) == (option != "none")
        charged = charged_inputs(graph, k, stage_info(stage).input_names)
        kept[graph.names[k]] = kept_bytes(stage, inputs[k], charged)
        predicted[graph.names[k]] = table.blocks[k].activation_bytes[option]
    assert kept == predicted
    if option != "none":  # recomputation keeps less somewhere, so the comparison is not vacuous
        assert sum(kept.values()) < sum(b.activation_bytes["none"] for b in table.blocks)


# -- the pass keeps parity and reruns what the option says -------------------------------------------


@pytest.fixture(scope="module")
def vlm_result2(vlm):
    model, batch = vlm
    return oc.optimize(model, batch, num_stages=2, planner="parameters")


@pytest.mark.parametrize("option", ["none", "full", "selective"])
def test_recompute_pass_keeps_parity_and_reruns_what_it_should(vlm, vlm_result2, option):
    model, batch = vlm
    result = vlm_result2
    plan = dataclasses.replace(result.plan, recompute=(option,) * result.plan.num_blocks)
    stages = [apply_recompute(s, result.graph, plan) for s in generate_stages(result.graph, plan, model)]
    params = list(model.parameters())
    ref = model(**batch)
    ref_grads = torch.autograd.grad(ref, params)
    (loss,) = run_stages(stages, result.flatten_inputs(**batch))
    with _OpCounter() as counter:
        grads = torch.autograd.grad(loss, params)
    assert float((loss - ref).detach().abs()) <= TOL
    assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) <= TOL
    # what runs during backward: full reruns matmuls and activations, selective only activations
    matmuls = counter.ops.count("addmm") + counter.ops.count("mm")
    children = {n for s in stages for n, _ in s.named_children()}
    if option == "none":
        assert "gelu" not in counter.ops and "silu" not in counter.ops
        assert not any(n.startswith("recompute_") for n in children)
        assert matmuls == _backward_matmuls(model, batch)
    else:
        assert "gelu" in counter.ops and "silu" in counter.ops
        assert "recompute_0" in children
        info = oc.stage_info(stages[1])  # the parameter map follows the new module's names
        assert set(info.param_map) == {n for n, _ in stages[1].named_parameters()} | {
            n for n, _ in stages[1].named_buffers()
        }
    if option == "full":
        assert matmuls > _backward_matmuls(model, batch)
    if option == "selective":
        assert matmuls == _backward_matmuls(model, batch)


def _backward_matmuls(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    loss = model(**batch)
    with _OpCounter() as counter:
        torch.autograd.grad(loss, list(model.parameters()))
    return counter.ops.count("addmm") + counter.ops.count("mm")


def test_each_recomputed_block_is_its_own_checkpoint(vlm, vlm_result2):
    """A run of fully recomputed blocks must not be one checkpoint: its backward would rebuild every
    block's activations at once, while the planner prices one block at a time."""
    from omnibal_compile.costs._measure import PeakLiveStorages

    model, batch = vlm
    result = vlm_result2
    peaks = {}
    for option in ("none", "full"):
        plan = dataclasses.replace(result.plan, recompute=(option,) * result.plan.num_blocks)
        stages = [apply_recompute(s, result.graph, plan) for s in generate_stages(result.graph, plan, model)]
        regions = sum(1 for s in stages for n, _ in s.named_children() if n.startswith("recompute_"))
        assert regions == (plan.num_blocks if option == "full" else 0)
        inputs = result.flatten_inputs(**batch)
        for p in model.parameters():  # gradients exist, as after a first micro-batch: not part of the peak
            p.grad = torch.zeros_like(p)
        with PeakLiveStorages() as live:
            (loss,) = run_stages(stages, inputs)
            loss.backward()
            del loss
        model.zero_grad(set_to_none=True)
        peaks[option] = live.peak_bytes
    assert peaks["full"] < 0.6 * peaks["none"], peaks


@pytest.mark.parametrize("option", RECOMPUTE_OPTIONS)
def test_predicted_memory_bounds_the_measured_peak(option):
    """Kept activations plus the largest block workspace (the planners' bound): at least the peak live
    bytes of one micro-batch's forward and backward through the recompute pass's stage, and within 20%
    of it; the predicted peak (``running_peak``) within 8% of it and never above the bound."""
    from omnibal_compile.costs._measure import PeakLiveStorages
    from omnibal_compile.models import TinyVLM, make_example_batch

    torch.manual_seed(0)
    model, batch = TinyVLM(), make_example_batch(batch=2, tiles_per_sample=2, text_tokens=48)
    result = oc.optimize(model, batch, num_stages=1, device="cpu", num_microbatches=1, schedule="gpipe")
    plan = dataclasses.replace(result.plan, recompute=(option,) * result.plan.num_blocks)
    stages = [apply_recompute(s, result.graph, plan) for s in generate_stages(result.graph, plan, model)]
    for p in model.parameters():  # gradients exist (static bytes count them)
        p.grad = torch.zeros_like(p)
    inputs = result.flatten_inputs(**batch)
    with PeakLiveStorages() as live:
        (loss,) = run_stages(stages, inputs)
        loss.backward()
        del loss
    blocks = result.costs.blocks
    predicted = sum(b.activation_bytes[option] for b in blocks) + max(b.workspace_bytes for b in blocks)
    assert live.peak_bytes <= predicted <= 1.2 * live.peak_bytes, (live.peak_bytes, predicted)
    # the predicted peak: the running micro-batch holds what the blocks before the running one keep
    peak = running_peak([b.activation_bytes[option] for b in blocks], [b.peak_bytes[option] for b in blocks])
    assert peak <= predicted and abs(peak / live.peak_bytes - 1) <= 0.08, (live.peak_bytes, peak)


def test_recompute_pass_keeps_node_metadata(vlm, vlm_result2):
    """The values a region returns keep the shapes and dtypes the captured graph recorded ("val"), so
    passes after this one (and readers of the stage graph) see the same metadata as without it."""
    model, _ = vlm
    result = vlm_result2
    plan = dataclasses.replace(result.plan, recompute=("full",) * result.plan.num_blocks)
    for stage in generate_stages(result.graph, plan, model):
        before = {n.name: n.meta.get("val") for n in stage.graph.nodes}
        after = apply_recompute(stage, result.graph, plan)
        reads = [
            n
            for n in after.graph.nodes
            if n.op == "call_function" and n.args and getattr(n.args[0], "op", "") == "call_module"
        ]
        assert reads
        for n in reads:
            region = after.get_submodule(n.args[0].target).region
            out = next(o for o in region.graph.nodes if o.op == "output").args[0][n.args[1]]
            want = before[out.name]
            assert isinstance(want, torch.Tensor) and isinstance(n.meta.get("val"), torch.Tensor), n.name
            assert (n.meta["val"].shape, n.meta["val"].dtype) == (want.shape, want.dtype), n.name
        from omnibal_compile.compile.codegen import stage_info

        a, b = stage_info(after), stage_info(stage)  # still a generated stage, with the same interface
        assert (a.index, a.num_stages, a.blocks, a.input_names, a.output_names) == (
            b.index, b.num_stages, b.blocks, b.input_names, b.output_names)
        # parameters used only inside a region live there: the outer graph reads no attribute it does not use
        assert all(n.users for n in after.graph.nodes if n.op == "get_attr"), after.graph
