"""Tied weights (a head sharing the embedding's weight): the plan's static memory per stage against what the
runtime holds per rank, counted as bytes of parameters, gradients and optimizer states (fp32 AdamW).

The runtime (:mod:`omnibal_compile.runtime.pipeline`) gives every pipeline rank whose stages read the tied
weight a copy of it; their gradients are summed after backward and every holder's optimizer steps its copy
(``build_optimizer`` takes ``pipeline.parameters()``, the copy included), so each holder keeps the weight, its
gradient and its optimizer state. Blocks are costed each with every parameter they read, so each stage that
holds a block reading the weight counts it; a stage (or device) holding several such blocks keeps one copy,
and the cost table's ``shared`` parameters take the extra copies off (``ir.costs.held_once``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import omnibal_compile as oc  # noqa: E402
from omnibal_compile.api import compile_for_microbatches  # noqa: E402
from omnibal_compile.costs.annotate import annotate_costs  # noqa: E402
from omnibal_compile.ir.costs import FP32_ADAM  # noqa: E402
from omnibal_compile.planning.build import uniform  # noqa: E402
from omnibal_compile.planning.problem import problem_from_costs, stage_static, stage_transient  # noqa: E402
from omnibal_compile.sim.simulate import stage_costs  # noqa: E402

TIED = "model.embed_tokens.weight"


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids}


def _planned(model: torch.nn.Module, batch: dict[str, torch.Tensor], stages: int) -> tuple[Any, Any, list[int]]:
    """The uniform plan of ``stages`` stages (2 micro-batches), its cost table in fp32 AdamW (the runtime's default
    precision and the recipe's optimizer) and the static bytes per stage the plan's accounting gives."""
    graph = oc.optimize(model, {k: v[:2] for k, v in batch.items()}, num_stages=1).graph
    plan = dataclasses.replace(uniform(graph, stages), num_microbatches=2)
    costs = annotate_costs(graph, model, device="h100-80gb", precision=FP32_ADAM)
    return plan, costs, [c.static_bytes for c in stage_costs(plan, costs)]


def _held_bytes(pipe: Any, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(all bytes, the tied weight's bytes) of parameters, gradients and optimizer states this rank holds."""
    total = tied = 0
    weight = pipe.state.get(TIED)
    for p in pipe.parameters():
        n = p.numel() * p.element_size()
        n += p.grad.numel() * p.grad.element_size() if p.grad is not None else 0
        n += sum(t.numel() * t.element_size() for t in optimizer.state[p].values()
                 if isinstance(t, torch.Tensor) and t.shape == p.shape)  # AdamW's moments (not its step count)
        total += n
        tied += n if p is weight else 0
    return total, tied


def _one_step(result: Any, rank: int, world: int, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    from omnibal_compile.config import OptimizerConfig
    from omnibal_compile.runtime import build_pipeline
    from omnibal_compile.runtime.recipe import build_optimizer

    pipe = build_pipeline(result, rank=rank, world_size=world)
    optimizer = build_optimizer(OptimizerConfig(optimizer="adamw"), pipe)
    pipe.step(batch)
    optimizer.step()
    return _held_bytes(pipe, optimizer)


def _worker(rank: int, world: int, port: int, out: str, models: dict[str, Any], cases: list[Any]) -> None:
    from test_runtime import _rank_process, _rebuild

    with _rank_process(rank, world, port, out):
        model, batch = _rebuild(*models["llama"])
        (plan,) = cases
        held = _one_step(compile_for_microbatches(model, batch, plan), rank, world, batch)
        torch.save({"held": held}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_holding_the_tied_weight_is_charged_for_it_once(tiny_llama, tmp_path):
    from test_runtime import _spawn

    model = tiny_llama[0]
    batch = _batch()
    plan, _, planned = _planned(model, batch, 2)
    assert plan.boundaries[1] < plan.block_names.index("lm_head")  # embedding on stage 0, head on stage 1
    ranks = _spawn(2, tmp_path, {"llama": (model, batch)}, [plan], worker=_worker)
    weight = model.get_parameter(TIED)
    per_copy = weight.numel() * FP32_ADAM.bytes_per_param
    for rank, found in enumerate(ranks):
        total, tied = found["held"]
        assert tied == per_copy, rank  # both ranks: weight, gradient and AdamW moments of the tied weight
        assert total == planned[rank], (rank, total, planned)


def _local_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: Any) -> tuple[int, int]:
    return _one_step(compile_for_microbatches(model, batch, plan), 0, 1, batch)


def test_one_stage_holding_embedding_and_head_is_charged_for_the_tied_weight_once(tiny_llama, one_rank_group):
    model = tiny_llama[0]
    batch = _batch()
    plan, costs, planned = _planned(model, batch, 1)
    total, tied = _local_step(model, batch, plan)
    assert tied == model.get_parameter(TIED).numel() * FP32_ADAM.bytes_per_param
    assert planned == [total]  # the embedding's and the head's blocks both read it: one copy charged
    # the planners' own accounting (problem.stage_static, less the transient bytes) agrees
    assert [sp.name for sp in costs.shared] == ["lm_head.weight"]
    problem = problem_from_costs(costs, num_stages=1, num_microbatches=2)
    assert stage_static(problem, 0, problem.n) - stage_transient(problem, 0, problem.n) == total
