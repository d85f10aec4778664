"""Recompute pass: apply the plan's per-block recompute options to a generated stage module.

The plan decides (``Plan.recompute``, one option per block); this pass only applies the decision.

Glossary:
    region      a maximal run of consecutive blocks of one stage sharing one recompute option other
                than ``none``. It becomes one submodule, ``recompute_<k>``, of the new stage module.
    full        the region runs under ``torch.utils.checkpoint`` (non-reentrant): only its inputs
                are kept for backward, and the whole region runs again before its backward.
    selective   the same, under a selective-checkpoint policy (:func:`selective_policy`): outputs
                of matmuls, convolutions and attention are kept, every other op (norms,
                activations, elementwise) is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from omnibal_compile.errors import PlanError
from omnibal_compile.passes.blocks import BlockGraph
from omnibal_compile.passes.codegen import _META_KEY, stage_info
from omnibal_compile.plan import Plan

__all__ = ["SAVED_OPS", "CheckpointedRegion", "apply_recompute", "selective_policy"]


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


SAVED_OPS: frozenset[Any] = _packets(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_mm",
)
"""ATen ops whose outputs selective recomputation keeps (the expensive ones); the rest is recomputed."""


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedRegion(nn.Module):
    """Runs ``region`` under non-reentrant activation checkpointing, fully or selectively."""

    def __init__(self, region: fx.GraphModule, option: str) -> None:
        super().__init__()
        if option not in ("full", "selective"):
            raise PlanError(f"recompute option {option!r} cannot be applied; use 'full' or 'selective'")
        self.region = region
        self.option = option

    def forward(self, *args: Any) -> Any:
        context_fn: Callable[[], Any] | None = None
        if self.option == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        if context_fn is None:
            return checkpoint(self.region, *args, use_reentrant=False)
        return checkpoint(self.region, *args, use_reentrant=False, context_fn=context_fn)


def _regions(blocks: tuple[str, ...], options: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    regions: list[tuple[str, list[str]]] = []
    prev = "none"
    for block, option in zip(blocks, options):
        if option != "none":
            if option == prev:
                regions[-1][1].append(block)
            else:
                regions.append((option, [block]))
        prev = option
    return regions


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _region_graph(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """A graph of ``members`` taking ``inputs`` and returning the tuple of ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta.update(x.meta)

    def lookup(x: fx.Node) -> fx.Node:
        if x not in env:  # every outside value is an input, so anything else read is a parameter
            env[x] = graph.get_attr(x.target)  # type: ignore[arg-type]
            env[x].meta.update(x.meta)
        return env[x]

    for n in members:
        env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(env[o] for o in outputs))
    return graph


def apply_recompute(stage: fx.GraphModule, graph: BlockGraph, plan: Plan) -> fx.GraphModule:
    """A new stage module in which each planned region runs under activation checkpointing.

    ``stage`` is a module made by codegen from ``graph`` and ``plan``; it is not modified, and the
    new module shares its parameters. Returns ``stage`` itself when none of its blocks recompute.
    """
    info = stage_info(stage)
    options = tuple(plan.block_recompute[plan.block_names.index(b)] for b in info.blocks)
    regions = _regions(info.blocks, options)
    if not regions:
        return stage
    index = {b.name: b for b in graph.blocks}
    region_of: dict[str, int] = {}
    for k, (_, names) in enumerate(regions):
        for name in names:
            for node_name in index[name].nodes:
                region_of[node_name] = k
    nodes = list(stage.graph.nodes)
    members: list[list[fx.Node]] = [[] for _ in regions]
    for node in nodes:
        if node.op not in ("placeholder", "get_attr", "output") and node.name in region_of:
            members[region_of[node.name]].append(node)

    outer = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    emitted: set[int] = set()

    def outer_lookup(x: fx.Node) -> fx.Node:
        if x not in env:
            if x.op != "get_attr":
                raise PlanError(f"internal error: recompute regions of stage {info.index} are not contiguous at '{x.name}'")
            env[x] = outer.get_attr(x.target)  # type: ignore[arg-type]
            env[x].meta.update(x.meta)
            root[x.target] = _attr(stage, x.target)  # type: ignore[index,arg-type]
        return env[x]

    for node in nodes:
        if node.op == "get_attr" or node in env:
            continue  # created on first use, so parameters used only inside regions stay there
        k = region_of.get(node.name) if node.op not in ("placeholder", "output") else None
        if k is None:
            env[node] = outer.node_copy(node, outer_lookup)
            continue
        if k in emitted:
            continue
        emitted.add(k)
        option = regions[k][0]
        inside = set(members[k])
        inputs: list[fx.Node] = []
        for n in members[k]:
            for x in n.all_input_nodes:
                if x not in inside and x.op != "get_attr" and x not in inputs:
                    inputs.append(x)
        outputs = [n for n in members[k] if any(u not in inside for u in n.users)]
        region = _region_graph(members[k], inputs, outputs)
        name = f"recompute_{k}"
        root[name] = CheckpointedRegion(fx.GraphModule(stage, region, class_name=f"Region{k}"), option)
        call = outer.call_module(name, tuple(outer_lookup(x) for x in inputs))
        for j, o in enumerate(outputs):
            env[o] = outer.call_function(operator.getitem, (call, j))
            env[o].meta.update(o.meta)
    outer.lint()
    new = fx.GraphModule(root, outer, class_name=type(stage).__name__)
    owner = {id(t): n for n, t in list(stage.named_parameters()) + list(stage.named_buffers())}
    param_map = {
        name: info.param_map[owner[id(t)]]
        for name, t in list(new.named_parameters()) + list(new.named_buffers())
        if id(t) in owner
    }
    new.meta.update(stage.meta)
    new.meta[_META_KEY] = dataclasses.replace(info, param_map=param_map)
    return new
