"""Block signatures: one hash per block's structure and input shapes, so identical layers are costed once.

Every layer of a stack is the same computation on inputs of the same shapes, so its FLOPs, bytes
and times are the same; measuring each again only adds noise (identical CPU layers once measured
2.9 to 7.3 ms backward in one run). :func:`block_signature` is the one rule for "same block": the
cost pass profiles one block per signature and gives the others its figures
(:attr:`BlockCost.profiled_as` says which), and any other costing path (the roofline on the meta
device) can key its work on it too.

What it hashes (names never enter, so ``layers.0`` and ``layers.1`` agree):
    nodes       the block module's graph in order: each node's op, its target (the ATen op or
                function; a submodule's class), and its arguments, with references to earlier
                nodes replaced by their position, inputs by the order in which the computation
                first reads them (so the order of a block's inputs does not matter), and
                constants by their ``repr``; the outputs it computes (inputs it only passes on,
                such as masks travelling to later layers, cost nothing and are left out);
    attributes  for each ``get_attr`` (parameters and buffers): shape, dtype and whether it
                requires grad, never its values;
    inputs      each input the computation reads: shape, dtype, device type and ``requires_grad``
                (tensors), or its ``repr`` (other values).
Two blocks with equal signatures run the same ops on the same shapes; different parameter values
(or different data in the inputs) do not change a signature, which is the point.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["block_signature"]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _describe_value(v: Any) -> tuple[Any, ...] | str:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), v.device.type, bool(v.requires_grad))
    return repr(v)


def block_signature(gm: fx.GraphModule, inputs: Sequence[Any]) -> str:
    """Hex digest (16 characters) of ``gm``'s computation and the shapes of the inputs it reads.

    ``gm``: a block as a standalone module (:func:`omnibal_compile.costs.annotate.block_modules`);
    ``inputs``: its example inputs, in placeholder order (real, fake or meta tensors alike).
    See the module docstring for what is hashed.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"the block has {len(placeholders)} inputs but {len(inputs)} example values were given")
    given = dict(zip(placeholders, inputs))
    position: dict[fx.Node, tuple[str, int]] = {}
    read: list[Any] = []  # the inputs, in the order the computation first reads them

    def ref(x: fx.Node) -> tuple[str, int]:
        if x not in position:  # a placeholder read for the first time
            position[x] = ("in", len(read))
            read.append(_describe_value(given[x]))
        return position[x]

    def normal(a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: ref(x) if isinstance(x, fx.Node) else repr(x))

    # Inputs merely passed on (as they are, or through the ``contiguous`` the stage code adds to every
    # output) cost nothing: left out, as are those outputs.
    passed = {
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        or (
            n.op in ("call_method", "call_function")
            and str(getattr(n.target, "__name__", n.target)) == "contiguous"
            and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "placeholder"
            and all(u.op == "output" for u in n.users)
        )
    }
    items: list[Any] = []
    for node in gm.graph.nodes:
        if node in passed:
            continue
        if node.op == "output":
            leaves: list[Any] = []
            fx.node.map_aggregate(node.args, leaves.append)  # every leaf of the output's args, in order
            computed = [position[x] for x in leaves if isinstance(x, fx.Node) and x not in passed]
            items.append(("out", sorted(computed)))
            continue
        if node.op == "get_attr":
            item: tuple[Any, ...] = ("attr", _describe_value(_attr(gm, str(node.target))))
        elif node.op == "call_module":
            sub = _attr(gm, str(node.target))
            params = [_describe_value(p) for p in sub.parameters()]
            item = ("module", type(sub).__qualname__, params, normal(node.args), normal(node.kwargs))
        else:  # call_function, call_method
            target = node.target if isinstance(node.target, str) else fx.node._get_qualified_name(node.target)
            item = (node.op, target, normal(node.args), normal(node.kwargs))
        position[node] = ("%", len(items))
        items.append(item)
    return hashlib.sha256(repr((items, read)).encode()).hexdigest()[:16]
