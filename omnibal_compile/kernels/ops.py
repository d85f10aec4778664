"""The kernels as torch custom ops (``torch.ops.omnibal.*``): fake impls, autograd, backend dispatch.

Glossary:
    op          one ``torch.library.custom_op``: torch.export, FX and the cost pass see a single
                node for it, and its fake impl gives shapes without running anything.
    backward op each forward op's gradient is itself a custom op (``*_backward``), so AOT autograd
                and ``torch.library.opcheck`` can trace the backward on fake tensors.
    backend     the op's last argument: ``"triton"`` runs the Triton kernel where Triton can run
                (CUDA tensors, or any tensor once ``TRITON_INTERPRET=1``), else the eager torch
                implementation; ``"eager"`` always runs the eager implementation.
Triton is imported only when a Triton kernel is about to run; without it the package still works.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile.errors import InputError, MissingBackendError
from omnibal_compile.kernels import eager

__all__ = [
    "Backend", "BACKENDS", "INSTALL_HINT", "MissingBackendError", "triton_available", "check_triton_installed",
    "require_triton",
    "triton_runs_on", "python_impl", "rms_norm", "layer_norm", "swiglu", "rope", "fused_linear_cross_entropy",
]

Backend = Literal["triton", "eager"]
BACKENDS: tuple[str, ...] = ("triton", "eager")
INSTALL_HINT = "pip install 'omnibal-compile[triton]'"
_TRITON_MODULE = "omnibal_compile.kernels.triton_impl"


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def check_triton_installed() -> None:
    """Raise :class:`MissingBackendError` with the install hint unless Triton can be imported."""
    if not triton_available():
        raise MissingBackendError(f"Triton kernels were asked for but triton is not installed: {INSTALL_HINT}")


def require_triton() -> ModuleType:
    """The Triton kernel module (imported on first use); raises with the install hint without Triton."""
    check_triton_installed()
    return importlib.import_module(_TRITON_MODULE)


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether ``backend="triton"`` runs Triton (not the eager fallback) for tensors on ``device``."""
    if not triton_available():
        return False
    if torch.device(device).type == "cuda":
        return True
    if not _interpret_env():
        return False
    # Kernels are decorated for the interpreter or the GPU once, when their module is imported
    # (and Triton's own library when triton is); the interpreter also reads the variable while
    # it runs, so all must hold.
    return bool(require_triton().INTERPRETED)


_PY_IMPLS: dict[str, Callable[..., Any]] = {}


def _op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op`` in our namespace, remembering the Python implementation."""

    def register(fn: Callable[..., Any]) -> Any:
        _PY_IMPLS[f"omnibal::{name}"] = fn
        return torch.library.custom_op(f"omnibal::{name}", mutates_args=())(fn)

    return register


def python_impl(qualname: str) -> Callable[..., Any]:
    """The Python function behind op ``omnibal::<name>`` (lets a dispatch mode look inside the op)."""
    return _PY_IMPLS[qualname]


def _impl(backend: str, t: Tensor) -> Any:
    if backend == "eager":
        return eager
    if backend != "triton":
        raise InputError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    check_triton_installed()  # asked for by name: never an eager run in its place when it is missing
    if t.is_cuda:
        return require_triton()
    return require_triton() if triton_runs_on(t.device) else eager  # installed, but no GPU and no interpreter


# --------------------------------------------------------------------------- RMSNorm


@_op("rms_norm")
def _rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
    return _impl(backend, x).rms_norm_fwd(x, weight, eps)


@_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@_op("rms_norm_backward")
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    return _impl(backend, x).rms_norm_bwd(dy, x, weight, eps)


@_rms_norm_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, eps, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.backend = eps, backend


def _rms_norm_grad(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, ctx.eps, ctx.backend)
    return dx, dw, None, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# --------------------------------------------------------------------------- LayerNorm


@_op("layer_norm")
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, backend: str) -> Tensor:
    return _impl(backend, x).layer_norm_fwd(x, weight, bias, eps)


@_layer_norm.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float, backend: str) -> Tensor:
    return x.new_empty(x.shape)


@_op("layer_norm_backward")
def _layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return _impl(backend, x).layer_norm_bwd(dy, x, weight, eps)


@_layer_norm_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, eps: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _bias, eps, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.backend = eps, backend


def _layer_norm_grad(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
    x, weight = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(dy, x, weight, ctx.eps, ctx.backend)
    return dx, dw, db, None, None


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# --------------------------------------------------------------------------- SwiGLU


@_op("swiglu")
def _swiglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _impl(backend, gate).swiglu_fwd(gate, up)


@_swiglu.register_fake
def _(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@_op("swiglu_backward")
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _impl(backend, gate).swiglu_bwd(dy, gate, up)


@_swiglu_backward.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _swiglu_grad(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward(dy, gate, up, ctx.backend)
    return dg, du, None


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# --------------------------------------------------------------------------- Rotary embedding


@_op("rope")
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _impl(backend, q).rope_fwd(q, k, cos, sin)


@_rope.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)


@_op("rope_backward")
def _rope_backward(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype, backend: str
) -> tuple[Tensor, Tensor]:
    return _impl(backend, dq).rope_bwd(dq, dk, cos, sin, q_dtype, k_dtype)


@_rope_backward.register_fake
def _(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype, backend: str
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(dq, dtype=q_dtype), torch.empty_like(dk, dtype=k_dtype)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.q_dtype, ctx.k_dtype, ctx.backend = q.dtype, k.dtype, backend


def _rope_grad(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise NotImplementedError("omnibal::rope treats cos/sin as constants; they must not require grad")
    cos, sin = ctx.saved_tensors
    gq, gk = _rope_backward(dq, dk, cos, sin, ctx.q_dtype, ctx.k_dtype, ctx.backend)
    return gq, gk, None, None, None


_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


# --------------------------------------------------------------------------- Fused linear + cross-entropy


@_op("fused_linear_cross_entropy")
def _flce(
    hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    impl = _impl(backend, hidden)
    if impl is eager:
        return eager.fused_linear_cross_entropy(hidden, weight, labels, ignore_index, chunk_size)
    return impl.fused_linear_cross_entropy(hidden, weight, labels, ignore_index, chunk_size)


@_flce.register_fake
def _(
    hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _flce_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _loss, dh, dw = output
    ctx.save_for_backward(dh, dw)
    ctx.mark_non_differentiable(dh, dw)
    ctx.set_materialize_grads(False)  # no weight-sized zeros for the gradients of dh and dw


def _flce_grad(
    ctx: Any, dloss: Tensor | None, _ddh: Any, _ddw: Any
) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
    if dloss is None:
        return None, None, None, None, None, None
    dh, dw = ctx.saved_tensors
    return dloss.to(dh.dtype) * dh, dloss.to(dw.dtype) * dw, None, None, None, None


_flce.register_autograd(_flce_grad, setup_context=_flce_setup)


# --------------------------------------------------------------------------- Python entry points


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise InputError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, backend: Backend = "triton") -> Tensor:
    """``(x / rms(x)).to(x.dtype) * weight`` over the last dim, one fused kernel each way."""
    _check(backend)
    return torch.ops.omnibal.rms_norm(x, weight, eps, backend)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5, *, backend: Backend = "triton") -> Tensor:
    """``F.layer_norm`` over the last dim with an affine weight and bias."""
    _check(backend)
    return torch.ops.omnibal.layer_norm(x, weight, bias, eps, backend)


def swiglu(gate: Tensor, up: Tensor, *, backend: Backend = "triton") -> Tensor:
    """``silu(gate) * up`` (same shapes)."""
    _check(backend)
    if gate.shape != up.shape:
        raise InputError(f"swiglu needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return torch.ops.omnibal.swiglu(gate, up, backend)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: Backend = "triton") -> tuple[Tensor, Tensor]:
    """Rotary embedding (rotate-half convention) of ``q [b, h, t, d]`` and ``k [b, hk, t, d]``.

    ``cos``/``sin`` broadcast to ``[b, 1, t, d]`` and are constants (no gradient flows into them).
    """
    _check(backend)
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2:
        raise InputError(f"rope needs 4-d q and k with an even head dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, t, d = q.shape
    return torch.ops.omnibal.rope(q, k, cos.expand(b, 1, t, d), sin.expand(b, 1, t, d), backend)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = 0,
    backend: Backend = "triton",
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the logits.

    ``hidden [..., h]``, ``weight [v, h]``, ``labels [...]``; ``chunk_size`` rows of logits exist at a
    time (0 picks a chunk about the size of ``hidden``). Gradients are computed during the forward.
    """
    _check(backend)
    if hidden.dtype != weight.dtype:
        raise InputError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    return torch.ops.omnibal.fused_linear_cross_entropy(h, weight, flat_labels, ignore_index, chunk_size, backend)[0]
