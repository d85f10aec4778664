"""Recompute pass: apply the plan's per-block recompute options to a generated stage module.

The plan decides (``Plan.recompute``, one option per block); this pass only applies the decision.

Glossary:
    region      one block of a stage whose recompute option is not ``none``. It becomes one
                submodule, ``recompute_<k>``, of the new stage module,
                which runs it under :func:`~omnibal_compile.compile.recompute_policy.with_recompute`
                (``full`` or ``selective``, as defined in :mod:`~omnibal_compile.compile.recompute_policy`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from torch import fx, nn

from omnibal_compile.compile._subgraph import SubgraphCopy
from omnibal_compile.compile.blocks import BlockGraph
from omnibal_compile.compile.codegen import _META_KEY, stage_info
from omnibal_compile.compile.recompute_policy import with_recompute
from omnibal_compile.errors import PlanError
from omnibal_compile.ir.plan import Plan

__all__ = ["CheckpointedRegion", "apply_recompute"]


class CheckpointedRegion(nn.Module):
    """Runs ``region`` under non-reentrant activation checkpointing, fully or selectively."""

    def __init__(self, region: fx.GraphModule, option: str) -> None:
        super().__init__()
        if option not in ("full", "selective"):
            raise PlanError(f"recompute option {option!r} cannot be applied; use 'full' or 'selective'")
        self.region = region
        self.option = option

    def forward(self, *args: Any) -> Any:
        return with_recompute(self.region, self.option)(*args)


def _regions(blocks: tuple[str, ...], options: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    # One region per recomputed block, never a run of blocks: a checkpoint recomputes its whole region
    # in the backward, so a run of k fully recomputed blocks would hold all k blocks' activations at
    # once (the cost pass and the planner price one block at a time).
    return [(option, [block]) for block, option in zip(blocks, options) if option != "none"]


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _region_graph(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """A graph of ``members`` taking ``inputs`` and returning the tuple of ``outputs``."""
    sub = SubgraphCopy(lambda x: PlanError(f"internal error: recompute region reads '{x.name}', not one of its inputs"))
    for x in inputs:
        sub.input(x, x.meta)
    sub.copy(members)
    sub.graph.output(tuple(sub.env[o] for o in outputs))
    return sub.graph


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
    for i, (_, names) in enumerate(regions):
        for name in names:
            for node_name in index[name].nodes:
                region_of[node_name] = i
    nodes = list(stage.graph.nodes)
    for node in nodes:  # a module call a pass added inside a block (no block names it) joins its neighbours' region
        near = {region_of.get(x.name) for x in (*node.all_input_nodes, *node.users) if x.op != "get_attr"}
        k = near.pop() if len(near) == 1 else None
        if node.name not in region_of and node.op == "call_module" and k is not None:
            region_of[node.name] = k
    members: list[list[fx.Node]] = [[] for _ in regions]
    for node in nodes:
        if node.op not in ("placeholder", "get_attr", "output") and node.name in region_of:
            members[region_of[node.name]].append(node)

    outer = SubgraphCopy(
        lambda x: PlanError(f"internal error: recompute regions of stage {info.index} are not contiguous at '{x.name}'")
    )
    root: dict[str, Any] = {}
    emitted: set[int] = set()
    for node in nodes:
        if node.op == "get_attr" or node in outer.env:
            continue  # created on first use, so parameters used only inside regions stay there
        k = region_of.get(node.name) if node.op not in ("placeholder", "output") else None
        if k is None:
            outer.copy([node])
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
        call = outer.graph.call_module(name, tuple(outer.read(x) for x in inputs))
        for j, o in enumerate(outputs):
            outer.env[o] = outer.graph.call_function(operator.getitem, (call, j))
            outer.env[o].meta.update(o.meta)
    outer.graph.lint()
    # modules too: a pass (tensor parallelism) calls some layers as modules outside the regions
    root.update({str(n.target): _attr(stage, str(n.target)) for n in outer.graph.nodes
                 if n.op in ("get_attr", "call_module") and str(n.target) not in root})
    new = fx.GraphModule(root, outer.graph, class_name=type(stage).__name__)
    owner = {id(t): n for n, t in list(stage.named_parameters()) + list(stage.named_buffers())}
    param_map = {
        name: info.param_map[owner[id(t)]]
        for name, t in list(new.named_parameters()) + list(new.named_buffers())
        if id(t) in owner
    }
    new.meta.update(stage.meta)
    new.meta[_META_KEY] = dataclasses.replace(info, param_map=param_map)
    return new
