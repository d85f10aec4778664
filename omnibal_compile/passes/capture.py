"""Capture pass: a model and one example batch -> an FX graph with flat tensor inputs.

Glossary:
    flat inputs   the example batch flattened with pytree into a list of leaves, one graph
                  placeholder each (``None`` leaves vanish, as in ``torch.export``).
    export        ``torch.export.export(strict=False)``: runs the Python code on fake tensors and
                  records ATen ops; works on Hugging Face models. The default.
    fx            ``torch.fx.symbolic_trace``: records module calls symbolically; enough for plain
                  modules without data-dependent Python control flow on shapes.
Parameters and buffers appear as ``get_attr`` nodes whose targets are the original qualified
names, and the graph's ``GraphModule`` shares the model's parameter objects (no copy).
"""

from __future__ import annotations

import inspect
import traceback
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.errors import CaptureError, InputError

__all__ = ["Captured", "capture", "differentiated_name", "normalize_example_inputs", "scalar_to_differentiate", "split_batch"]

CaptureMethod = Literal["export", "fx"]


@dataclass(frozen=True, kw_only=True)
class Captured:
    """A captured model: its graph and how to feed and read it."""

    graph_module: fx.GraphModule
    """The graph; placeholders are the flat inputs, parameters are ``get_attr`` nodes."""
    model_name: str
    """Class name of the captured model, for messages."""
    method: CaptureMethod
    """How the graph was obtained."""
    in_spec: pytree.TreeSpec
    """Structure of ``(args, kwargs)`` whose leaves are the placeholders."""
    out_spec: pytree.TreeSpec | None
    """Structure of the model's output whose leaves are the graph's flat outputs (export only)."""
    example_flat_inputs: tuple[Any, ...]
    """The example batch, flattened."""

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Flatten a batch like the example one into the graph's placeholder order."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(
                f"inputs do not have the structure of the example inputs {self.model_name} was captured with: "
                f"expected {self.in_spec}, got {spec}"
            )
        return tuple(leaves)

    def unflatten_output(self, flat: tuple[Any, ...] | Any) -> Any:
        """Rebuild the model's output structure from the graph's flat outputs."""
        if self.out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.out_spec)


def normalize_example_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Accept a tuple/list (positional), a dict (keyword), ``(args, kwargs)`` or a single tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        return example_inputs[0], dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(
        f"example_inputs must be a tensor, a tuple/list of positional inputs, a dict of keyword inputs or "
        f"(args, kwargs); got {type(example_inputs).__name__}"
    )


def split_batch(flat_inputs: Sequence[Any], num_microbatches: int) -> list[tuple[Any, ...]]:
    """Slice every tensor of a flat batch into ``num_microbatches`` equal parts along dim 0."""
    parts: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for i, x in enumerate(flat_inputs):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise InputError(
                f"batch input #{i} is {type(x).__name__ if not isinstance(x, torch.Tensor) else 'a 0-dim tensor'}: "
                "pipelined batches must hold only tensors with a batch dimension"
            )
        if x.shape[0] % num_microbatches:
            raise InputError(
                f"batch input #{i} has {x.shape[0]} rows, not divisible by {num_microbatches} micro-batches; "
                f"use a batch whose dim 0 is a multiple of {num_microbatches}"
            )
        for j, chunk in enumerate(x.chunk(num_microbatches, dim=0)):
            parts[j].append(chunk)
    return [tuple(p) for p in parts]


def scalar_to_differentiate(flat_out: Sequence[Any]) -> torch.Tensor:
    """The scalar a training step differentiates: the model's scalar loss, else the sum of its float outputs."""
    tensors, scalars = _differentiable(flat_out)
    return scalars[0] if scalars else sum(t.float().sum() for t in tensors)  # type: ignore[return-value]


def differentiated_name(flat_out: Sequence[Any]) -> str:
    """What ``scalar_to_differentiate`` picks, in words: "loss" or "sum of the outputs"."""
    return "loss" if _differentiable(flat_out)[1] else "sum of the outputs"


def _differentiable(flat_out: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tensors = [t for t in flat_out if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise InputError("the model's output has no floating-point tensor that requires grad; nothing to differentiate")
    return tensors, [t for t in tensors if t.dim() == 0]


def _check_signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # builtins or C extensions: nothing to check
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"example_inputs do not match {type(model).__name__}.forward{sig}: {e}. "
            "Pass a tuple of positional inputs or a dict of keyword inputs that the model accepts."
        ) from None


def _culprit(model: nn.Module, exc: BaseException) -> tuple[str | None, str | None]:
    """The innermost submodule of ``model`` executing when ``exc`` was raised, and the source line."""
    paths = {id(m): name for name, m in model.named_modules()}
    module_path, line = None, None
    tb = exc.__traceback__
    for frame, lineno in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            module_path = paths[id(owner)] or "<root>"
            summary = traceback.extract_tb(tb)
            for fs in summary:
                if fs.filename == frame.f_code.co_filename and fs.lineno == lineno:
                    line = f"{fs.filename}:{fs.lineno}: {(fs.line or '').strip()}"
    return module_path, line


def _capture_error(model: nn.Module, method: str, exc: BaseException) -> CaptureError:
    path, line = _culprit(model, exc)
    name = type(model).__name__
    where = f" in module '{path}' ({type(model.get_submodule('' if path == '<root>' else path)).__name__})" if path else ""
    at = f"\n  at {line}" if line else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = (
        "Make the code shape-static (no Python branching on tensor values), move the offending logic out of "
        "forward, or try capture='fx' for plain modules"
        if method == "export"
        else "symbolic_trace cannot follow Python control flow on tensor shapes or values; use capture='export'"
    )
    if "Cache" in first:
        hint = "The output holds a KV cache object: set use_cache=False (config or inputs); training needs no cache"
    return CaptureError(f"could not capture {name} with {method}{where}: {type(exc).__name__}: {first}{at}\n  {hint}.")


def _drop_specialized_placeholders(gm: fx.GraphModule, keep: int) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph in placeholders[keep:]:
        doomed: list[fx.Node] = []
        frontier = [ph]
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user not in doomed:
                    doomed.append(user)
                    frontier.append(user)
        for node in sorted(doomed, key=lambda n: -list(gm.graph.nodes).index(n)):
            if node.op == "output":
                raise CaptureError(f"fx capture: defaulted argument '{ph.target}' flows into the output; pass it explicitly")
            gm.graph.erase_node(node)
        gm.graph.erase_node(ph)
    gm.recompile()


def capture(model: nn.Module, example_inputs: Any, *, method: CaptureMethod = "export") -> Captured:
    """Trace ``model`` on ``example_inputs`` into a :class:`Captured` graph. The model is not modified."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if method not in ("export", "fx"):
        raise InputError(f"capture method must be 'export' or 'fx', got {method!r}")
    args, kwargs = normalize_example_inputs(example_inputs)
    _check_signature(model, args, kwargs)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    if method == "export":
        try:
            ep = torch.export.export(model, args, kwargs, strict=False)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise _capture_error(model, method, e) from e
        gm = ep.module()
        # The unlifted module checks input shapes in a `_guards_fn` submodule; stages drop it.
        out_spec = ep.call_spec.out_spec
        flat_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(flat_placeholders) != len(leaves):
            raise CaptureError(
                f"captured graph of {type(model).__name__} has {len(flat_placeholders)} inputs but the example "
                f"batch flattens to {len(leaves)} leaves; pass only tensors and None in example_inputs"
            )
        return Captured(
            graph_module=gm,
            model_name=type(model).__name__,
            method="export",
            in_spec=in_spec,
            out_spec=out_spec,
            example_flat_inputs=tuple(leaves),
        )
    # fx: positional tensors only, so the given inputs are the first placeholders in order.
    if kwargs or any(isinstance(v, (list, tuple, dict)) for v in args):
        raise InputError(
            "capture='fx' takes a tuple of positional tensor inputs; use capture='export' for keyword or nested inputs"
        )
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args)
    missing = [p for p in sig.parameters if p not in bound.arguments]
    try:
        gm = fx.symbolic_trace(model, concrete_args={p: sig.parameters[p].default for p in missing})
    except Exception as e:  # noqa: BLE001
        raise _capture_error(model, method, e) from e
    # Defaulted arguments were baked in as constants; fx keeps a placeholder for each, read only by
    # asserts that the value did not change. Drop those so the graph's inputs are the given ones.
    _drop_specialized_placeholders(gm, len(bound.arguments))
    values = tuple(args)
    _, spec = pytree.tree_flatten((values, {}))
    return Captured(
        graph_module=gm,
        model_name=type(model).__name__,
        method="fx",
        in_spec=spec,
        out_spec=None,
        example_flat_inputs=values,
    )
