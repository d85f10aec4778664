"""The recompute policy: what selective recomputation keeps, and the one checkpoint wrapper.

The cost pass measures activation bytes and rerun time with these definitions and the recompute
pass applies them at run time, so the planner optimises for the memory the runtime produces.
(torchtitan keeps one save list for the same reason.)

Glossary:
    option       ``none`` (keep what autograd keeps), ``selective`` or ``full``.
    full         non-reentrant ``torch.utils.checkpoint``: only the inputs are kept for backward,
                 and the whole function runs again before its backward.
    selective    the same under a selective-checkpoint policy: outputs of :data:`SAVED_OPS` are
                 kept, every other op is rerun before backward.
    saved ops    the expensive ATen ops: matmuls (:data:`MATMUL_OPS`, convolutions included) and
                 attention forwards (:data:`ATTENTION_OPS`). Composite ops such as ``linear`` are
                 listed too, although they usually reach the policy already decomposed (``addmm``).
    op class     ``matmul``, ``attention`` or ``memory`` (:func:`op_class`; the roofline's classes).
                 ``memory`` ops are exactly the ops selective recomputation reruns.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["MATMUL_OPS", "ATTENTION_OPS", "SAVED_OPS", "op_class", "selective_policy", "with_recompute"]


def _packets(*names: str) -> frozenset[Any]:
    """ATen op packets by name; names this torch build lacks are skipped."""
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


MATMUL_OPS: frozenset[Any] = _packets(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "_slow_conv2d_forward",
    "mkldnn_convolution",
)
"""Matrix products and convolutions (CPU variants included)."""

ATTENTION_OPS: frozenset[Any] = _packets(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""Forward kernels of scaled-dot-product attention (flash, memory-efficient, cuDNN, CPU)."""

SAVED_OPS: frozenset[Any] = MATMUL_OPS | ATTENTION_OPS
"""Ops whose outputs selective recomputation keeps; every other op is rerun."""


def op_class(func: Any) -> str:
    """``matmul``, ``attention`` or ``memory`` for an ATen op overload (or packet)."""
    packet = getattr(func, "overloadpacket", func)
    if packet in MATMUL_OPS:
        return "matmul"
    if packet in ATTENTION_OPS:
        return "attention"
    return "memory"


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def with_recompute(fn: Callable[..., Any], option: str) -> Callable[..., Any]:
    """``fn`` run under recompute ``option``: ``none`` (as is), ``selective`` or ``full`` checkpointing."""
    if option == "none":
        return fn
    if option == "full":
        return partial(checkpoint, fn, use_reentrant=False)
    if option == "selective":
        context_fn = partial(create_selective_checkpoint_contexts, selective_policy)
        return partial(checkpoint, fn, use_reentrant=False, context_fn=context_fn)
    raise ValueError(f"unknown recompute option {option!r}; use 'none', 'selective' or 'full'")
