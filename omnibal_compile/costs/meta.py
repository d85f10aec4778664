"""Costing without weights: runtime checks left out, costing copies on ``meta`` in the training dtype,
and the inputs whose values the model really reads.

Glossary:
    runtime check    an op that only asserts (``_assert_async``, ``_assert_scalar``,
                     ``_assert_tensor_metadata``, ...); it computes nothing a later op reads.
    check-only node  a node whose every use ends in runtime checks, e.g. the ``item()`` with which a
                     LLaVA model checks that its image tokens match its image features, and the
                     comparisons on it. Costing leaves them out: they cost nothing on a GPU and
                     cannot run on ``meta`` tensors, which hold no values.
    value read       any other node that turns tensor values into Python numbers or shapes
                     (``item``, ``nonzero``, ``masked_select``...: export marks each with the
                     unbacked symbols it defines). The inputs it reads must hold real values.
    costing copy     the model rebuilt on the ``meta`` device in the compute dtype: a deep copy
                     whose parameters and buffers are meta tensors (floating ones cast, as
                     ``model.to(dtype)`` would), so nothing is allocated whatever the model's size.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.compile._subgraph import module_path
from omnibal_compile.compile.blocks import BlockGraph, build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.errors import InputError, OmnibalError

__all__ = [
    "RUNTIME_CHECKS",
    "check_only_nodes",
    "drop_checks",
    "value_reads",
    "inputs_read",
    "check_values_available",
    "meta_copy",
    "to_dtype",
    "model_dtype",
    "costing_graph",
]

aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


RUNTIME_CHECKS: frozenset[Any] = _packets(
    "_assert_async", "_assert_scalar", "_functional_assert_async", "_functional_assert_scalar",
    "_assert_tensor_metadata", "sym_constrain_range", "sym_constrain_range_for_size", "_functional_sym_constrain_range",
)
"""ATen ops that only check (packets)."""

_VALUE_READS: frozenset[Any] = _packets("item", "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")
"""Ops that read values even where export records no unbacked symbol for them."""


def _packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)


def _is_check(node: fx.Node) -> bool:
    return node.op == "call_function" and (_packet(node) in RUNTIME_CHECKS or node.target is torch._check)


def check_only_nodes(graph: fx.Graph) -> frozenset[str]:
    """Names of the runtime checks of ``graph`` and of the nodes that feed only them (module glossary)."""
    only: set[str] = set()
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        if _is_check(node) or (node.users and all(u.name in only for u in node.users)):
            only.add(node.name)
    return frozenset(only)


def drop_checks(gm: fx.GraphModule, names: Iterable[str]) -> int:
    """Erase the nodes of ``gm`` named in ``names`` (check-only nodes); returns how many went.

    A dropped value that the module returns (a check crossing a block cut) is returned as None.
    """
    names = set(names)
    graph = gm.graph
    doomed = [n for n in graph.nodes if n.op == "call_function" and n.name in names]
    if not doomed:
        return 0
    out = next(n for n in graph.nodes if n.op == "output")
    gone = set(doomed)
    out.args = fx.map_arg(out.args, lambda a: None if a in gone else a)
    for n in reversed(doomed):
        graph.erase_node(n)
    gm.recompile()
    return len(doomed)


def value_reads(graph: fx.Graph, checks: frozenset[str] | None = None) -> tuple[fx.Node, ...]:
    """Nodes that read tensor values into Python (module glossary), checks excluded."""
    checks = check_only_nodes(graph) if checks is None else checks
    return tuple(
        n for n in graph.nodes
        if n.op == "call_function" and n.name not in checks
        and (n.meta.get("unbacked_bindings") or _packet(n) in _VALUE_READS)
    )


def _read_args(node: fx.Node) -> list[fx.Node]:
    """The arguments whose values a value read reads: its boolean and integer tensors (masks, indices)
    when it has any, else all of them (``item`` of a float)."""
    args = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)] or list(
        node.all_input_nodes
    )
    discrete = [a for a in args if not a.meta["val"].is_floating_point()] if all("val" in a.meta for a in args) else []
    return discrete or args


def _sources(node: fx.Node) -> list[fx.Node]:
    """Placeholders and parameter/buffer reads whose values the value read ``node`` depends on."""
    seen: set[fx.Node] = set()
    stack, found = list(_read_args(node)), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            found.append(n)
        else:
            stack.extend(n.all_input_nodes)
    return found


def _describe(node: fx.Node) -> str:
    where = module_path(node)
    return f"'{node.name}' ({_packet(node)}{f' in {where}' if where else ''})"


def inputs_read(gm: fx.GraphModule) -> dict[int, list[str]]:
    """Flat input index -> the value reads that depend on it (see :func:`value_reads`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders)}
    found: dict[int, list[str]] = {}
    for node in value_reads(gm.graph):
        for src in _sources(node):
            if src in index:
                found.setdefault(index[src], []).append(_describe(node))
    return found


def check_values_available(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> None:
    """Raise when a value read depends on a ``meta`` input or a ``meta`` parameter/buffer, naming it and why."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, flat_inputs))
    for node in value_reads(gm.graph):
        for src in _sources(node):
            if src.op == "placeholder":
                x = values.get(src)
                if isinstance(x, torch.Tensor) and x.is_meta:
                    name = src.name
                    raise InputError(
                        f"input '{name}' is on the meta device, but the model reads its values: node {_describe(node)} "
                        "turns them into a Python number or a shape, which meta tensors do not have. Give "
                        f"'{name}' as a real (CPU) tensor; the model and the other inputs can stay on meta"
                    )
            else:
                t = _attr(gm, str(src.target))
                if not isinstance(t, torch.Tensor):
                    continue
                if t.is_meta:
                    raise InputError(
                        f"parameter or buffer '{src.target}' is on the meta device, but the model reads its values: "
                        f"node {_describe(node)} turns them into a Python number or a shape. Build the model with "
                        "that tensor on the CPU (the rest can stay on meta)"
                    )


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def to_dtype(x: Any, dtype: torch.dtype, *, meta: bool) -> Any:
    """``x`` as a costing input: floating tensors cast to ``dtype``, on ``meta`` when ``meta``; others as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    want = dtype if x.is_floating_point() else x.dtype
    device = torch.device("meta") if meta else x.device
    if x.dtype == want and x.device == device:
        return x
    if device.type == "meta":
        return torch.empty_strided(x.shape, x.stride(), dtype=want, device="meta").requires_grad_(x.requires_grad)
    return x.detach().to(dtype=want).requires_grad_(x.requires_grad)


def meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A costing copy of ``model`` (module glossary): same modules, meta parameters and buffers, no data copied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        new = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
        memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating parameters (the first one's), None when it has none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _on_meta_in(tensors: Iterable[torch.Tensor], dtype: torch.dtype) -> bool:
    return all(t.is_meta and (not t.is_floating_point() or t.dtype == dtype) for t in tensors)


def costing_graph(graph: BlockGraph, model: nn.Module, dtype_name: str) -> tuple[BlockGraph, nn.Module]:
    """``graph`` and ``model`` as the cost pass runs them for a target GPU: on ``meta``, in the compute dtype.

    When the model already lives on ``meta`` in that dtype, with its inputs there too (those whose
    values it reads excepted), they are returned as they are. Otherwise the model is captured
    again as a costing copy (module glossary) on its example inputs, floating ones cast and all
    moved to ``meta`` except those whose values it reads: a graph captured in another dtype carries
    that dtype in its casts. The blocks must come out the same.
    """
    dtype = getattr(torch, dtype_name)
    cap = graph.captured
    flat = cap.example_flat_inputs
    real = set(inputs_read(cap.graph_module))
    tensors = [x for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and i not in real]
    if _on_meta_in([*model.parameters(), *model.buffers(), *tensors], dtype):
        return graph, model
    copied = meta_copy(model, dtype)
    inputs = [to_dtype(x, dtype, meta=i not in real) for i, x in enumerate(flat)]
    args, kwargs = pytree.tree_unflatten(inputs, cap.in_spec)
    again = capture(copied, (tuple(args), dict(kwargs)), method=cap.method)
    backends = {n.args[-1] for n in cap.graph_module.graph.nodes
                if n.op == "call_function" and getattr(n.target, "namespace", None) == "omnibal"}
    if backends:  # the kernel pass ran: cost the same fused ops
        from omnibal_compile.compile.fuse import substitute_kernels

        again, _ = substitute_kernels(again, copied, backend=str(next(iter(backends))))
    costed = build_blocks(again, copied, block_prefixes=graph.block_prefixes)
    if costed.names != graph.names:
        raise OmnibalError(
            f"{cap.model_name} captured in {dtype_name} on the meta device has other blocks than as given "
            f"({costed.num_blocks} vs {graph.num_blocks}); build the model in {dtype_name} on the meta device "
            "(with torch.device('meta'): ... .to(dtype)) and capture that"
        )
    return costed, copied
