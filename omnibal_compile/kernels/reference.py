"""Eager torch references of the fused kernels: the unfused maths, differentiable by autograd.

Glossary:
    reference   the plain torch expression a kernel replaces, written as models write it (cast to
                fp32 where they do, back to the input dtype where they do). Tests compare kernels
                against it; the bench times it as the baseline.
    rotate_half ``cat(-x2, x1)`` over the last dim, the rotary convention of Llama/Qwen/InternVL.
These functions are also the ground truth of each op's semantics: same output dtype, same
broadcasting, same ``ignore_index`` handling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnibal_compile._utils.labels import IGNORE_INDEX

__all__ = ["rms_norm", "layer_norm", "swiglu", "rope", "linear_cross_entropy", "rotate_half"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x / rms(x)).to(x.dtype) * weight``, statistics in fp32 (Llama's RMSNorm)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm`` over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated MLP activation of Llama-style models."""
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [b, h, t, d]`` and ``k [b, hk, t, d]``; ``cos``/``sin`` broadcast to ``[b, 1, t, d]``."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden [n, h] @ weight[v, h].T`` against ``labels [n]``: the full logits exist."""
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=ignore_index)
