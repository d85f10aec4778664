"""Kernel-substitution pass: rewrite matching modules and patterns of the captured graph into fused ops.

Glossary:
    site         one place the pass rewrites: a module call (every node whose module stack holds
                 that call) or a small node pattern, replaced by one ``torch.ops.omnibal.*`` node.
    RMSNorm site a call of a module whose class name ends in ``RMSNorm``, with a 1-d ``weight`` and
                 an ``eps``/``variance_epsilon``, that passes a probe: run on a small random input
                 it must agree with :func:`reference.rms_norm` (so Gemma-style ``1 + weight`` norms
                 are left alone).
    LayerNorm site  an ``aten.layer_norm`` node over the last dim with a weight and a bias.
    SwiGLU site  ``mul(silu(a), b)`` with ``a`` and ``b`` of one shape and dtype, silu used only there.
    rotary site  ``x * cos + cat(-x2, x1) * sin`` (``x1``/``x2`` the halves of ``x``, by ``chunk`` or
                 ``slice``) for a q and a k of one module call sharing ``cos``/``sin`` of shape
                 ``[b|1, 1, t, d]`` that no trainable parameter feeds: one ``rope`` node for both.
    loss site    ``cross_entropy(<casts/slices/reshapes of> linear(h, W), labels)`` with mean
                 reduction, no class weights or smoothing, and logits used by nothing else: it
                 becomes the chunked fused linear + cross-entropy, the slices replayed on ``h``.
Parameters stay ``get_attr`` inputs of the new nodes, so the blocks pass, the stage parameter
maps and the gradients see the same parameters as before. New nodes inherit the module stack
of the nodes they replace, so they land in the same blocks; their ``val`` comes from the ops'
fake implementations.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.fx as fx
from torch import nn
from torch._guards import detect_fake_mode

from omnibal_compile.compile._subgraph import module_call, strip_call_suffix
from omnibal_compile.compile.capture import Captured
from omnibal_compile.errors import InputError
from omnibal_compile.kernels import ops, reference

__all__ = ["Substitution", "KernelReport", "substitute_kernels"]

aten = torch.ops.aten
_ASSERT = aten._assert_tensor_metadata.default
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.contiguous.default, aten.clone.default}
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


@dataclass(frozen=True, kw_only=True)
class Substitution:
    """One rewritten site."""

    kernel: str
    """Op that replaced it (``rms_norm``, ``layer_norm``, ``swiglu``, ``rope``, ``fused_linear_cross_entropy``)."""
    where: str
    """Module path of the site (or the replaced node's name where it has no module of its own)."""
    removed: int
    """Graph nodes removed."""


@dataclass(frozen=True, kw_only=True)
class KernelReport:
    """What :func:`substitute_kernels` rewrote."""

    backend: str
    """Backend argument given to every new op node."""
    substitutions: tuple[Substitution, ...]
    """Every rewritten site, in graph order per kernel."""

    def counts(self) -> dict[str, int]:
        """Sites per kernel."""
        out: dict[str, int] = {}
        for s in self.substitutions:
            out[s.kernel] = out.get(s.kernel, 0) + 1
        return out

    def summary(self) -> str:
        parts = ", ".join(f"{k} x{v}" for k, v in self.counts().items()) or "nothing matched"
        return f"kernels ({self.backend}): {parts}"


# --------------------------------------------------------------------------- helpers


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _real_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target is not _ASSERT]


if TYPE_CHECKING:

    class _Call(fx.Node):
        """For the type checker only: a matched call's arguments are whatever its aten op takes."""

        @property
        def args(self) -> tuple[Any, ...]: ...
        @args.setter
        def args(self, a: tuple[Any, ...]) -> None: ...
        @property
        def kwargs(self) -> dict[str, Any]: ...
        @kwargs.setter
        def kwargs(self, k: dict[str, Any]) -> None: ...

else:
    _Call = fx.Node


def _is_call(node: Any, targets: Iterable[Any]) -> TypeGuard[_Call]:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in set(targets)


class _Rewriter:
    """Shared mechanics: add an op node with a computed ``val``, drop dead nodes."""

    def __init__(self, gm: fx.GraphModule, backend: str) -> None:
        self.gm, self.graph, self.backend = gm, gm.graph, backend
        vals = [n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(vals)
        self.done: list[Substitution] = []

    def add(self, before: fx.Node, target: Any, args: tuple[Any, ...], meta_from: fx.Node) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        node.meta.update({k: v for k, v in meta_from.meta.items() if k not in ("val", "tensor_meta")})
        if self.fake_mode is not None:
            fake_args = fx.map_arg(args, _val)
            with self.fake_mode:
                node.meta["val"] = target(*fake_args)
        return node

    def erase(self, nodes: Iterable[fx.Node]) -> int:
        """Erase ``nodes`` (and assertions reading them), users first; all must be otherwise dead."""
        doomed = set(nodes)
        for n in list(doomed):
            doomed.update(u for u in n.users if u.target is _ASSERT)
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for n in sorted(doomed, key=lambda n: -order[n]):
            self.graph.erase_node(n)
        return len(doomed)


# --------------------------------------------------------------------------- RMSNorm (module calls)


def _rms_eps(module: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def _rms_candidates(model: nn.Module) -> dict[str, float]:
    """Module path -> eps for every RMSNorm-like module that passes the probe."""
    out: dict[str, float] = {}
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        eps = _rms_eps(module)
        if not type(module).__name__.endswith("RMSNorm") or eps is None:
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.device.type == "meta":
            continue
        try:
            with torch.no_grad():
                x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
                ok = torch.allclose(module(x), reference.rms_norm(x, weight, eps), rtol=1e-3, atol=1e-3)
        except Exception:  # noqa: BLE001 - a module that cannot run the probe is simply not substituted
            ok = False
        if ok:
            out[path] = eps
    return out


def _module_sites(graph: fx.Graph, paths: dict[str, float]) -> dict[str, list[fx.Node]]:
    """Call site (module path, with ``@n`` for repeated calls) -> its call_function nodes."""
    sites: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for raw, _cls in (node.meta.get("nn_module_stack") or {}).values():
            if strip_call_suffix(str(raw)) in paths:
                sites.setdefault(str(raw), []).append(node)
                break
    return sites


def _same_as(node: fx.Node, x: fx.Node) -> bool:
    """Whether ``node`` is ``x`` through casts that keep its dtype and shape (the same values)."""
    x_val = _val(x)
    if not isinstance(x_val, torch.Tensor):
        return False
    while node is not x:
        val = _val(node)
        if not _is_call(node, _CASTS) or not isinstance(val, torch.Tensor):
            return False
        if val.dtype != x_val.dtype or val.shape != x_val.shape:
            return False
        node = node.args[0]
    return True


def _rms_norm_sites(rw: _Rewriter, model: nn.Module) -> None:
    paths = _rms_candidates(model)
    attrs = {n.target: n for n in rw.graph.nodes if n.op == "get_attr"}
    for site, nodes in _module_sites(rw.graph, paths).items():
        path = strip_call_suffix(site)
        members = set(nodes)
        inputs = {a for n in nodes for a in n.all_input_nodes if a not in members and a.op != "get_attr"}
        weight = attrs.get(f"{path}.weight")
        if len(inputs) != 1 or weight is None:
            continue
        (x,) = inputs
        x_val = _val(x)
        # `x.to(float32)` of an fp32 x is x itself; export may let the residual read that node.
        for n in nodes:
            if _same_as(n, x):
                for u in [u for u in n.users if u not in members]:
                    u.replace_input_with(n, x)
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if len(outputs) != 1:
            continue
        (y,) = outputs
        if isinstance(x_val, torch.Tensor) and tuple(_val(y).shape) != tuple(x_val.shape):
            continue
        new = rw.add(y, torch.ops.omnibal.rms_norm.default, (x, weight, paths[path], rw.backend), y)
        y.replace_all_uses_with(new)
        rw.done.append(Substitution(kernel="rms_norm", where=site, removed=rw.erase(nodes)))


# --------------------------------------------------------------------------- LayerNorm and SwiGLU (node patterns)


def _where(node: fx.Node) -> str:
    call = module_call(node)
    return call if call is not None else node.name


def _layer_norm_sites(rw: _Rewriter) -> None:
    for node in list(rw.graph.nodes):
        if not _is_call(node, [aten.layer_norm.default]):
            continue
        x, shape, weight, bias, eps = (list(node.args) + [None, None, 1e-5])[:5]
        eps = node.kwargs.get("eps", eps)
        x_val = _val(x)
        if weight is None or bias is None or len(shape) != 1 or not isinstance(x_val, torch.Tensor):
            continue
        if x_val.shape[-1] != shape[0]:
            continue
        new = rw.add(node, torch.ops.omnibal.layer_norm.default, (x, weight, bias, float(eps), rw.backend), node)
        node.replace_all_uses_with(new)
        rw.done.append(Substitution(kernel="layer_norm", where=_where(node), removed=rw.erase([node])))


def _swiglu_sites(rw: _Rewriter) -> None:
    for silu in list(rw.graph.nodes):
        if not _is_call(silu, [aten.silu.default]):
            continue
        users = _real_users(silu)
        if len(users) != 1 or not _is_call(users[0], [aten.mul.Tensor]):
            continue
        mul = users[0]
        a, b = mul.args[:2]
        up = b if a is silu else a
        gate = silu.args[0]
        g_val, u_val = _val(gate), _val(up)
        if up is silu or not isinstance(up, fx.Node) or not isinstance(g_val, torch.Tensor):
            continue
        if not isinstance(u_val, torch.Tensor) or g_val.shape != u_val.shape or g_val.dtype != u_val.dtype:
            continue
        new = rw.add(mul, torch.ops.omnibal.swiglu.default, (gate, up, rw.backend), mul)
        mul.replace_all_uses_with(new)
        rw.done.append(Substitution(kernel="swiglu", where=_where(mul), removed=rw.erase([mul, silu])))


# --------------------------------------------------------------------------- rotary embedding


def _halves(a: Any, b: Any) -> fx.Node | None:
    """``x`` when ``a``/``b`` are the first/second halves of ``x``'s last dim (chunk or slice)."""
    if _is_call(a, [operator.getitem]) and _is_call(b, [operator.getitem]) and a.args[0] is b.args[0]:
        chunk = a.args[0]
        if _is_call(chunk, [aten.chunk.default]) and chunk.args[1] == 2 and a.args[1] == 0 and b.args[1] == 1:
            x = chunk.args[0]
            dim = chunk.args[2] if len(chunk.args) > 2 else 0
            return x if dim % _val(x).dim() == _val(x).dim() - 1 else None
        return None
    if _is_call(a, [aten.slice.Tensor]) and _is_call(b, [aten.slice.Tensor]) and a.args[0] is b.args[0]:
        x = a.args[0]
        rank, d = _val(x).dim(), _val(x).shape[-1]
        lo, hi = (list(a.args) + [None, None, None])[1:4], (list(b.args) + [None, None, None])[1:4]
        if lo[0] % rank == rank - 1 == hi[0] % rank and lo[1] == 0 and lo[2] == d // 2 == hi[1] and hi[2] >= d:
            return x
    return None


def _rotary_of(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """``(x, cos, sin, pattern nodes)`` when ``add`` computes ``x * cos + rotate_half(x) * sin``."""
    if not _is_call(add, [aten.add.Tensor]) or len(add.args) != 2 or add.kwargs:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (_is_call(m1, [aten.mul.Tensor]) and _is_call(m2, [aten.mul.Tensor])):
            continue
        for cat, sin in (m2.args, m2.args[::-1]):
            if not _is_call(cat, [aten.cat.default]) or len(cat.args[0]) != 2:
                continue
            neg, first = cat.args[0]
            if not _is_call(neg, [aten.neg.default]):
                continue
            x = _halves(first, neg.args[0])
            if x is None or x not in m1.args or not isinstance(sin, fx.Node):
                continue
            cos = m1.args[1] if m1.args[0] is x else m1.args[0]
            if not isinstance(cos, fx.Node):
                continue
            parts = [add, m1, m2, cat, neg, first, neg.args[0]]
            if _is_call(first, [operator.getitem]):
                parts.append(first.args[0])
            return x, cos, sin, parts
    return None


def _feeds_from_parameters(node: fx.Node, trainable: set[str]) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and n.target in trainable:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _rope_sites(rw: _Rewriter, model: nn.Module) -> None:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    order = {n: i for i, n in enumerate(rw.graph.nodes)}
    groups: dict[tuple[Any, ...], list[tuple[fx.Node, fx.Node, list[fx.Node]]]] = {}
    for add in list(rw.graph.nodes):
        found = _rotary_of(add)
        if found is None:
            continue
        x, cos, sin, parts = found
        xv, cv, sv = _val(x), _val(cos), _val(sin)
        if not all(isinstance(v, torch.Tensor) for v in (xv, cv, sv)) or xv.dim() != 4 or xv.shape[-1] % 2:
            continue
        b, _, t, d = xv.shape
        if cv.shape != sv.shape or cv.dim() != 4 or tuple(cv.shape[1:]) != (1, t, d) or cv.shape[0] not in (1, b):
            continue
        if cv.dtype != sv.dtype or _val(add).dtype != torch.promote_types(xv.dtype, cv.dtype):
            continue
        members = set(parts)
        if any(u not in members for p in parts[1:] for u in _real_users(p)):
            continue  # an intermediate value is used outside the pattern
        groups.setdefault((_where(add), cos, sin, xv.dtype), []).append((x, add, parts))
    for (where, cos, sin, _dtype), sites in groups.items():
        if _feeds_from_parameters(cos, trainable) or _feeds_from_parameters(sin, trainable):
            continue  # the op treats cos/sin as constants
        for (q, q_add, q_parts), (k, k_add, k_parts) in zip(sites[0::2], sites[1::2], strict=False):
            first = min(q_add, k_add, key=order.__getitem__)
            if max(order[q], order[k], order[cos], order[sin]) > order[first]:
                continue
            pair = rw.add(first, torch.ops.omnibal.rope.default, (q, k, cos, sin, rw.backend), q_add)
            q_new = rw.add(first, operator.getitem, (pair, 0), q_add)
            k_new = rw.add(first, operator.getitem, (pair, 1), k_add)
            q_add.replace_all_uses_with(q_new)
            k_add.replace_all_uses_with(k_new)
            rw.done.append(Substitution(kernel="rope", where=where, removed=rw.erase([*q_parts, *k_parts])))


# --------------------------------------------------------------------------- the loss


def _loss_sites(rw: _Rewriter) -> None:
    for ce in list(rw.graph.nodes):
        if not _is_call(ce, [aten.cross_entropy_loss.default]):
            continue
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        args: dict[str, Any] = dict(zip(names, (None, None, None, 1, -100, 0.0), strict=True))
        args.update(zip(names, ce.args, strict=False))  # trailing defaults may be omitted
        args.update(ce.kwargs)
        if args["weight"] is not None or args["reduction"] != 1 or args["label_smoothing"] != 0.0:
            continue
        logits_val, target_val = _val(args["input"]), _val(args["target"])
        if not isinstance(logits_val, torch.Tensor) or logits_val.dim() != 2 or target_val is None:
            continue
        # Walk back from the loss to the head: casts and reshapes first, then casts and slices.
        chain: list[fx.Node] = []
        cur, seen_slice = args["input"], False
        while isinstance(cur, fx.Node) and not _is_call(cur, [aten.linear.default]):
            if _is_call(cur, [aten.slice.Tensor]):
                seen_slice = True
            elif not (_is_call(cur, _CASTS) or (_is_call(cur, _RESHAPES) and not seen_slice)):
                break
            chain.append(cur)
            cur = cur.args[0]
        if not _is_call(cur, [aten.linear.default]):
            continue
        linear = cur
        h, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        h_val = _val(h)
        if bias is not None or not isinstance(weight, fx.Node) or weight.op != "get_attr" or h_val is None:
            continue
        if h_val.dtype != _val(weight).dtype:
            continue
        if any(len(_real_users(n)) != 1 for n in [linear, *chain]):
            continue  # the logits (or a view of them) are used elsewhere, e.g. returned
        rank = _val(linear).dim()
        if any(_is_call(n, [aten.slice.Tensor]) and n.args[1] % rank == rank - 1 for n in chain):
            continue  # a slice over the vocabulary cannot be replayed on the hidden states
        cur = h
        for n in reversed(chain):
            if _is_call(n, [aten.slice.Tensor]):
                cur = rw.add(ce, aten.slice.Tensor, (cur, *n.args[1:]), n)
        flat = rw.add(ce, aten.reshape.default, (cur, [-1, h_val.shape[-1]]), ce)
        target = args["target"]
        fused = rw.add(
            ce,
            torch.ops.omnibal.fused_linear_cross_entropy.default,
            (flat, weight, target, int(args["ignore_index"]), 0, rw.backend),
            ce,
        )
        loss = rw.add(ce, operator.getitem, (fused, 0), ce)
        ce.replace_all_uses_with(loss)
        rw.done.append(
            Substitution(
                kernel="fused_linear_cross_entropy", where=_where(linear), removed=rw.erase([ce, *chain, linear])
            )
        )


# --------------------------------------------------------------------------- the pass


def substitute_kernels(captured: Captured, model: nn.Module, *, backend: str) -> tuple[Captured, KernelReport]:
    """A new capture in which every matching site runs one fused op, and what was rewritten; see the glossary.

    ``captured`` is not modified: its graph is copied first, and the new graph module shares the
    model's parameters. ``backend`` is ``"triton"`` (Triton kernels where Triton can run, eager
    elsewhere; raises with the install hint when Triton is not installed) or ``"eager"`` (the ops'
    eager implementations).
    """
    if backend not in ops.BACKENDS:
        raise InputError(f"kernels must be one of {ops.BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        ops.check_triton_installed()
    if captured.method != "export":
        raise InputError("kernels= needs capture_method='export' (fx graphs keep modules as call_module nodes)")
    src = captured.graph_module
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(src.graph._codegen)  # keeps the pytree calling convention of export graphs
    graph.output(graph.graph_copy(src.graph, {}))
    gm = fx.GraphModule(src, graph, class_name=type(src).__name__)
    gm.meta.update(src.meta)
    rw = _Rewriter(gm, backend)
    _rms_norm_sites(rw, model)
    _layer_norm_sites(rw)
    _swiglu_sites(rw)
    _rope_sites(rw, model)
    _loss_sites(rw)
    gm.graph.lint()
    gm.recompile()
    return dataclasses.replace(captured, graph_module=gm), KernelReport(backend=backend, substitutions=tuple(rw.done))
