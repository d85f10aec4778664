"""Capture pass: a model and one example batch -> an FX graph with flat tensor inputs.

Glossary:
    flat inputs   the example batch flattened with pytree into a list of leaves, one graph
                  placeholder each (``None`` leaves vanish, as in ``torch.export``).
    export        ``torch.export.export(strict=False)``: runs the Python code on fake tensors and
                  records ATen ops; works on Hugging Face models. The default.
    fx            ``torch.fx.symbolic_trace``: records module calls symbolically; enough for plain
                  modules without data-dependent Python control flow on shapes.
    data-dependent size  a size computed from input *values* rather than input shapes: image
                  features scattered into placeholder tokens (``masked_scatter``, ``nonzero``),
                  per-image sizes (``image_sizes``, ``image_grid_thw``) read with ``.tolist()``.
                  ``torch.export`` names them by unbacked symbols (``u0``) with no value. When the
                  model has any, it is captured again with the example's real values propagated
                  alongside (``fake_tensor_propagate_real_tensors``): every such size gets the
                  example's value as its hint, and every branch taken on one is decided by the
                  example and asserted in the graph, so another batch that would branch otherwise
                  fails loudly instead of computing something else. Qwen2-VL's per-image grids are
                  made shape-static for the export instead (:func:`_family_substitutions`).
    size hint     the example's concrete value of a (possibly symbolic) size: :func:`size_hint`.
    use_cache     Hugging Face models build a KV cache unless their config says ``use_cache=False``;
                  training needs none, so capture turns it off (:func:`training_config`).
Parameters and buffers appear as ``get_attr`` nodes whose targets are the original qualified
names, and the graph's ``GraphModule`` shares the model's parameter objects (no copy).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import logging
import re
import sys
import traceback
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch._functorch.config  # fake_tensor_propagate_real_tensors; not loaded by `import torch` alone
import torch.fx as fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    PendingUnbackedSymbolNotFound,
    free_unbacked_symbols,
    guarding_hint_or_throw,
)
from torch.utils import _pytree as pytree

from omnibal_compile import progress
from omnibal_compile.errors import CaptureError, InputError

__all__ = [
    "Captured",
    "capture",
    "differentiated_name",
    "input_names",
    "is_data_dependent",
    "normalize_example_inputs",
    "scalar_to_differentiate",
    "size_hint",
    "split_batch",
    "structure_mismatch",
    "training_config",
]

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
    data_dependent: bool = False
    """Whether the graph has data-dependent sizes (captured with the example's values; see the glossary)."""
    dropped_outputs: tuple[str, ...] = ()
    """Outputs next to the loss whose shape depends on input values (``image_outputs``...), returned as None:
    pipeline stages cannot send them, and training needs only the loss."""

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Flatten a batch like the example one into the graph's placeholder order.

        Raises :class:`InputError` naming the input at fault: an unknown or missing keyword (with the
        accepted ones), or a tensor whose shape differs from the example's (the graph is specialised to it).
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(structure_mismatch(self.model_name, self.in_spec, spec))
        for name, x, ref in zip(input_names(self.in_spec), leaves, self.example_flat_inputs):
            if isinstance(ref, torch.Tensor) and (not isinstance(x, torch.Tensor) or x.shape != ref.shape):
                got = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
                raise InputError(
                    f"input '{name}' has {got} but {self.model_name} was captured with shape {list(ref.shape)}; "
                    "the captured graph and its stages are specialised to the example's shapes: pad or pack the "
                    "batch to that shape, or capture again with a batch of this shape"
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


def _named_keywords(sig: inspect.Signature) -> list[str]:
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _close(name: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _check_signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """Refuse inputs ``forward`` cannot take; returns the keywords it takes only through ``**kwargs``.

    Those are accepted as ``model(**inputs)`` accepts them (HF models pass ``use_cache``, processor-side
    vision inputs and the like on through their ``**kwargs``); a tensor among them that the captured
    graph never reads is refused after capture (:func:`_check_read`): a misspelled ``pixel_value`` would
    otherwise drop the image silently.
    """
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # builtins or C extensions: nothing to check
        return set()
    name, named = type(model).__name__, _named_keywords(sig)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    through_kwargs = {k for k in kwargs if k not in named}
    if through_kwargs and not takes_any:
        first = sorted(through_kwargs, key=list(kwargs).index)[0]
        raise InputError(
            f"example input '{first}' is not an input of {name}.forward{_close(first, named)}; "
            f"it accepts {', '.join(named)}"
        )
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"example_inputs do not match {name}.forward{sig}: {e}. "
            "Pass a tuple of positional inputs or a dict of keyword inputs that the model accepts."
        ) from None
    return through_kwargs


def _check_read(model: nn.Module, gm: fx.GraphModule, in_spec: pytree.TreeSpec, leaves: Sequence[Any],
                through_kwargs: set[str]) -> None:
    """Refuse a tensor input passed through ``**kwargs`` that the captured graph never reads (see above)."""
    if not through_kwargs:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unread = {
        name.split("[", 1)[0]
        for name, node, leaf in zip(input_names(in_spec), placeholders, leaves)
        if isinstance(leaf, torch.Tensor) and all(u.target == "_guards_fn" for u in node.users)  # shape checks only
    } & through_kwargs
    if unread:
        first = sorted(unread)[0]
        named = _named_keywords(inspect.signature(model.forward))
        raise InputError(
            f"example input '{first}' is not an input of {type(model).__name__}.forward{_close(first, named)}: it "
            f"reaches forward only through **kwargs and the model never reads it; it accepts {', '.join(named)}"
        )


def input_names(spec: pytree.TreeSpec) -> list[str]:
    """A name for each leaf of an ``(args, kwargs)`` spec: the keyword (``pixel_values``, ``images[1]``) or
    ``positional input #i``."""
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    names = [""] * spec.num_leaves
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        head, rest = path[0], pytree.keystr(path[2:])
        if getattr(head, "idx", 0) == 0:
            names[i] = f"positional input #{cast(pytree.SequenceKey, path[1]).idx}{rest}"
        else:
            names[i] = f"{cast(pytree.MappingKey, path[1]).key}{rest}"
    return names


def structure_mismatch(model_name: str, expected: pytree.TreeSpec, got: pytree.TreeSpec) -> str:
    """A sentence saying how a batch's ``(args, kwargs)`` structure differs from the captured one."""
    e_args, e_kw = pytree.tree_unflatten([0] * expected.num_leaves, expected)
    g_args, g_kw = pytree.tree_unflatten([0] * got.num_leaves, got)
    problems = []
    if len(g_args) != len(e_args):
        problems.append(f"{len(g_args)} positional inputs instead of {len(e_args)}")
    missing = [k for k in e_kw if k not in g_kw]
    problems += [f"unknown input '{k}'{_close(k, missing or list(e_kw))}" for k in g_kw if k not in e_kw]
    if missing:
        problems.append("missing " + ", ".join(f"'{k}'" for k in missing))
    if not problems:
        differ = [k for k in e_kw if pytree.tree_structure(e_kw[k]) != pytree.tree_structure(g_kw[k])]
        problems.append(
            "input " + ", ".join(f"'{k}'" for k in differ) + " is nested differently" if differ
            else f"expected {expected}, got {got}"
        )
    accepted = ", ".join(e_kw) if e_kw else f"{len(e_args)} positional inputs"
    return (
        f"inputs do not match those {model_name} was captured with: {'; '.join(problems)}. "
        f"Accepted inputs: {accepted}"
    )


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
    where = (
        f" in module '{path}' ({type(model.get_submodule('' if path == '<root>' else path)).__name__})" if path else ""
    )
    at = f"\n  at {line}" if line else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = (
        "Make the code shape-static (no Python branching on tensor values), move the offending logic out of "
        "forward, or try capture_method='fx' for plain modules"
        if method == "export"
        else "symbolic_trace cannot follow Python control flow on tensor shapes or values; use capture_method='export'"
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
                raise CaptureError(
                    f"fx capture: defaulted argument '{ph.target}' flows into the output; pass it explicitly"
                )
            gm.graph.erase_node(node)
        gm.graph.erase_node(ph)
    gm.recompile()


_DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound)


def _is_data_dependent_error(exc: BaseException | None) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _DATA_DEPENDENT_ERRORS) or "data-dependent" in str(exc).split("\n", 1)[0]:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _sizes(val: Any) -> Iterator[int | torch.SymInt]:
    if isinstance(val, torch.Tensor):
        yield from val.shape
    elif isinstance(val, torch.SymInt):
        yield val


def is_data_dependent(size: int | torch.SymInt) -> bool:
    """Whether ``size`` depends on input values (an unbacked symbol the graph cannot pin to a constant)."""
    if not isinstance(size, torch.SymInt):
        return False
    env = size.node.shape_env
    return bool(free_unbacked_symbols(env.simplify(size.node.expr)))


def size_hint(size: int | torch.SymInt) -> int:
    """The example's value of ``size``: a plain int, a shape symbol's hint, or a data-dependent size's value
    in the example (known when the capture propagated real tensors; see the glossary)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    node = size.node
    try:
        return int(guarding_hint_or_throw(node))
    except GuardOnDataDependentSymNode:
        pass
    env = node.shape_env
    expr = env.simplify(node.expr).xreplace(env.backed_var_to_val).xreplace(env.real_tensor_prop_unbacked_vals)
    if not expr.is_number:
        raise CaptureError(
            f"size {node.expr} depends on input values and has no value from the example batch; "
            "capture the model with capture() so that data-dependent sizes take the example's values"
        )
    return int(expr)


def _has_data_dependent_sizes(gm: fx.GraphModule) -> bool:
    return any(is_data_dependent(d) for n in gm.graph.nodes for d in _sizes(n.meta.get("val")))


@contextlib.contextmanager
def _quiet_real_tensor_propagation() -> Iterator[None]:
    """Real-tensor propagation logs a warning per size it evaluates and per mismatched fake kernel; we say it once."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor",
                                               "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with torch._functorch.config.patch(
            fake_tensor_propagate_real_tensors=True, generate_fake_kernels_from_real_mismatches=True
        ):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.export.ExportedProgram, bool]:
    """``torch.export`` (non-strict); again with the example's real values when sizes depend on input values.

    Returns the program and whether it has data-dependent sizes.
    """
    # torch.export prints the partial graph of a failed export to stderr: noise when we try again.
    printed = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")  # "Unable to find user code ...": noise
    level = shapes_log.level
    try:
        shapes_log.setLevel(logging.ERROR)
        with contextlib.redirect_stderr(printed):
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised with context unless a data-dependent guard
        if not _is_data_dependent_error(e):
            sys.stderr.write(printed.getvalue())
            raise _capture_error(model, "export", e) from e
    else:
        on_meta = any(
            isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves((args, kwargs, model.state_dict()))
        )
        if on_meta or not _has_data_dependent_sizes(ep.graph_module):
            # Meta tensors have no values to propagate: the sizes stay symbolic, and the cost pass
            # names any input whose values it would need.
            return ep, False
    finally:
        shapes_log.setLevel(level)
    try:
        with _quiet_real_tensor_propagation():
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001
        raise _capture_error(model, "export", e) from e
    return ep, True


_ASSERT = re.compile(r"Runtime assertion failed for expression (.+) on node '[^']*'")


def _explain_runtime_asserts(gm: fx.GraphModule, model_name: str) -> bool:
    """Reword the graph's checks of the example's data-dependent choices (``u0 >= 1``), which fail on a batch that
    would choose otherwise, to say what happened and what to change; whether it has any."""
    changed = False
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_scalar.default and len(node.args) == 2:
            found = _ASSERT.fullmatch(str(node.args[1]))
            if found:
                node.args = (node.args[0], (
                    f"{model_name}: this batch differs from the example the model was captured with in a value its "
                    f"code decided on ({found.group(1)}): the captured graph holds only the example's choice (a "
                    "Python `if` on a tensor value, or a size read with .item() or .tolist()); make the choice with "
                    "tensor ops (torch.where), or keep those values the same in every batch"))
                changed = True
    if changed:
        gm.recompile()
    return changed


def _check_example_path(gm: fx.GraphModule, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run the graph once on its own example: a choice torch.export made without the example's value (a branch on a
    value computed from the weights) fails here, at capture, instead of in every later run. Not on meta tensors:
    they have no values to check (the cost pass drops the checks)."""
    tensors = pytree.tree_leaves((args, kwargs, model.state_dict()))
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return
    try:
        with torch.no_grad():
            gm(*args, **kwargs)
    except RuntimeError as e:
        if "this batch differs from the example" not in str(e):
            raise
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        except Exception as own:  # noqa: BLE001 - the model's own error on its example, named as it is
            raise CaptureError(
                f"{type(model).__name__} fails on the example inputs itself ({type(own).__name__}: "
                f"{str(own).strip().splitlines()[0] if str(own).strip() else ''}); give an example batch the model "
                "runs on (a micro-batch: its rows and their images)"
            ) from None
        raise CaptureError(
            f"{type(model).__name__}: its code decides on a tensor value that torch.export could not take from the "
            "example (a Python `if`, .item() or .tolist() on a value computed from the weights, not the inputs), so "
            "the captured graph takes another path than the model does on the example itself; make that choice with "
            "tensor ops (torch.where), or from the inputs' shapes"
        ) from None


def _drop_data_dependent_outputs(gm: fx.GraphModule, out_spec: pytree.TreeSpec | None,
                                 returned_none: Collection[str] = ()) -> tuple[str, ...]:
    """Return None instead of the outputs of data-dependent shape when the model also returns a scalar loss,
    and instead of those whose path starts with one of ``returned_none`` (stand-ins, see :func:`_family_substitutions`).

    Such outputs (Idefics3's ``image_outputs``, the vision tower's features) would have to travel to the
    last stage through every cut after the vision tower, and a data-dependent shape cannot be sent.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in flat]
    has_loss = any(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() for v in vals)
    paths = [f"output {i}" for i in range(len(flat))]
    if out_spec is not None and out_spec.num_leaves == len(flat):
        tree = pytree.tree_unflatten(list(range(len(flat))), out_spec)
        for path, i in pytree.tree_flatten_with_path(tree)[0]:
            paths[i] = "".join(f".{k.key}" if hasattr(k, "key") else f"[{k.idx}]" if hasattr(k, "idx") else str(k)
                               for k in path).lstrip(".")
    doomed = [i for i, v in enumerate(vals)
              if (has_loss and any(is_data_dependent(d) for d in _sizes(v)))
              or any(paths[i].startswith(p) for p in returned_none)]
    if not doomed:
        return ()
    for i in doomed:
        flat[i] = None
    out.args = (type(out.args[0])(flat) if isinstance(out.args[0], (tuple, list)) else flat[0], *out.args[1:])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return tuple(paths[i] for i in doomed)


_TOLD_USE_CACHE: set[str] = set()


def _configs(model: nn.Module) -> list[Any]:
    """The Hugging Face configs of ``model`` and its submodules, with their sub-configs (text, vision)."""
    found: dict[int, Any] = {}
    frontier = [getattr(m, "config", None) for m in model.modules()]
    while frontier:
        cfg = frontier.pop()
        if cfg is None or id(cfg) in found or not hasattr(cfg, "to_dict"):
            continue
        found[id(cfg)] = cfg
        frontier.extend(v for v in vars(cfg).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return list(found.values())


@contextlib.contextmanager
def training_config(model: nn.Module) -> Iterator[None]:
    """Within: every config of ``model`` that says ``use_cache=True`` says False (training needs no KV cache).

    Restored on exit, so the user's model is left as it was. Said once per model class per process.
    """
    changed = [cfg for cfg in _configs(model) if getattr(cfg, "use_cache", None) is True]
    name = type(model).__name__
    if changed and name not in _TOLD_USE_CACHE:
        _TOLD_USE_CACHE.add(name)
        progress.info(
            f"{name}: its config says use_cache=True; it is captured and checked with use_cache=False (training "
            "keeps no KV cache), and its config is left as it is."
        )
    for cfg in changed:
        cfg.use_cache = False
    try:
        yield
    finally:
        for cfg in changed:
            cfg.use_cache = True


def _family_substitutions(model: nn.Module) -> contextlib.AbstractContextManager[set[str]]:
    """Within: code of a Hugging Face family replaced by code whose sizes follow the input shapes only
    (Qwen2-VL's per-image grids: :mod:`omnibal_compile.integrations.hf.grids`); other models as they are.

    Yields the paths of outputs that hold stand-ins (per-image features no shape-static graph can return),
    filled during the export: the capture returns them as None."""
    if "transformers" not in sys.modules:  # not a Hugging Face model
        return contextlib.nullcontext(set())
    from omnibal_compile.integrations.hf.grids import grid_free_capture

    return grid_free_capture(model)


def capture(model: nn.Module, example_inputs: Any, *, method: CaptureMethod = "export",
            masks_from_positions: bool = True) -> Captured:
    """Trace ``model`` on ``example_inputs`` into a :class:`Captured` graph. The model is not modified.

    ``masks_from_positions``: a Hugging Face pack's attention mask is made in the graph of its positions
    (:mod:`omnibal_compile.integrations.hf.masks`); False reads the mask input, as before (for comparisons).
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if method not in ("export", "fx"):
        raise InputError(f"capture method must be 'export' or 'fx', got {method!r}")
    args, kwargs = normalize_example_inputs(example_inputs)
    through_kwargs = _check_signature(model, args, kwargs)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    if method == "export":
        with training_config(model), _family_substitutions(model) as returned_none:
            ep, data_dependent = _export(model, args, kwargs)
        gm = ep.module()
        if _explain_runtime_asserts(gm, type(model).__name__):  # choices made on the example's values
            _check_example_path(gm, model, args, kwargs)
        dropped = (_drop_data_dependent_outputs(gm, ep.call_spec.out_spec, returned_none)
                   if data_dependent or returned_none else ())
        # The unlifted module checks input shapes in a `_guards_fn` submodule; stages drop it.
        out_spec = ep.call_spec.out_spec
        flat_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(flat_placeholders) != len(leaves):
            raise CaptureError(
                f"captured graph of {type(model).__name__} has {len(flat_placeholders)} inputs but the example "
                f"batch flattens to {len(leaves)} leaves; pass only tensors and None in example_inputs"
            )
        _check_read(model, gm, in_spec, leaves, through_kwargs)
        if masks_from_positions and "transformers" in sys.modules:  # a pack's mask made in the graph: not sent
            from omnibal_compile.integrations.hf.masks import mask_from_positions

            mask_from_positions(gm, model, input_names(in_spec), leaves)
        return Captured(
            graph_module=gm,
            model_name=type(model).__name__,
            method="export",
            in_spec=in_spec,
            out_spec=out_spec,
            example_flat_inputs=tuple(leaves),
            data_dependent=data_dependent,
            dropped_outputs=dropped,
        )
    # fx: positional tensors only, so the given inputs are the first placeholders in order.
    if kwargs or any(isinstance(v, (list, tuple, dict)) for v in args):
        raise InputError(
            "capture_method='fx' takes a tuple of positional tensor inputs; use capture_method='export' for keyword or "
            "nested inputs"
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
