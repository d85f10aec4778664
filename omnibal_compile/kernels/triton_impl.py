"""Triton kernels and their launchers. Imported lazily by :mod:`omnibal_compile.kernels.ops` only.

Glossary:
    row kernel   one program per row of a ``[rows, n]`` view (norms, rotary, the CE chunk); the row
                 fits one block of ``next_power_of_2(n)`` lanes, masked past ``n``.
    partial sums  norm weight gradients: each backward program loops over a run of rows and
                 writes one fp32 partial row; torch sums the few partials (no atomics, deterministic).
    interpreted  kernels decorated while ``TRITON_INTERPRET=1`` run on CPU tensors through
                 Triton's numpy interpreter (correctness only); :data:`INTERPRETED` records which.
All arithmetic is fp32; loads upcast and stores cast to the output's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from omnibal_compile.kernels import eager

__all__ = [
    "INTERPRETED", "rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd", "swiglu_fwd",
    "swiglu_bwd", "rope_fwd", "rope_bwd", "ce_chunk", "fused_linear_cross_entropy",
]



def _built_for_interpreter() -> bool:
    # Triton picks the interpreter per function when it is decorated: ours now, Triton's own
    # library (tl.sum, ...) when triton was first imported. Both must agree for kernels to run.
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return True
    return isinstance(getattr(tl.standard, "sum", None), InterpretedFunction)


INTERPRETED: bool = _built_for_interpreter()
"""Whether these kernels (and Triton's library) were built for Triton's CPU interpreter."""


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _programs(rows: int, device: torch.device) -> int:
    """Programs for the backward norm kernels: a few per multiprocessor, at most one per row."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_fwd_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    # Round the normalised row to x's dtype before the weight, as the reference does.
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (n * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_kernel(DY, X, W, DX, DWP, stride_dy, stride_x, stride_dx, M, N, eps, rows_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 row offsets below
    stop = tl.minimum(start + rows_per_prog, M)
    for row in range(start, stop):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)  # recomputed: cheaper than storing it
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DWP + pid * N + cols, dw, mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_fwd_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), y, x2.stride(0), y.stride(0), n, eps, BLOCK=block, num_warps=_warps(block)
        )
    return y.reshape(x.shape)


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n).contiguous(), dy.reshape(-1, n).contiguous()
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    progs = _programs(m, x.device)
    partial = torch.zeros((progs, n), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(n)
        _rms_bwd_kernel[(progs,)](
            dy2, x2, weight.contiguous(), dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0), m, n, eps,
            triton.cdiv(m, progs), BLOCK=block, num_warps=_warps(block),
        )
    return dx.reshape(x.shape), partial.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------- LayerNorm


@triton.jit
def _ln_fwd_kernel(X, W, B, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_kernel(
    DY, X, W, DX, DWP, DBP, stride_dy, stride_x, stride_dx, M, N, eps, rows_per_prog, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 row offsets below
    stop = tl.minimum(start + rows_per_prog, M)
    for row in range(start, stop):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        xhat = xc * rstd
        g = dy * w
        dx = rstd * (g - tl.sum(g, axis=0) / N - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DWP + pid * N + cols, dw, mask=mask)
    tl.store(DBP + pid * N + cols, db, mask=mask)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _ln_fwd_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), bias.contiguous(), y, x2.stride(0), y.stride(0), n, eps,
            BLOCK=block, num_warps=_warps(block),
        )
    return y.reshape(x.shape)


def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n).contiguous(), dy.reshape(-1, n).contiguous()
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    progs = _programs(m, x.device)
    pw = torch.zeros((progs, n), dtype=torch.float32, device=x.device)
    pb = torch.zeros((progs, n), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(n)
        _ln_bwd_kernel[(progs,)](
            dy2, x2, weight.contiguous(), dx, pw, pb, dy2.stride(0), x2.stride(0), dx.stride(0), m, n, eps,
            triton.cdiv(m, progs), BLOCK=block, num_warps=_warps(block),
        )
    return dx.reshape(x.shape), pw.sum(0).to(weight.dtype), pb.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------- SwiGLU

_SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=g.device)
    numel = g.numel()
    if numel:
        _swiglu_fwd_kernel[(triton.cdiv(numel, _SWIGLU_BLOCK),)](g, u, y, numel, BLOCK=_SWIGLU_BLOCK, num_warps=4)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, g, u = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    numel = g.numel()
    if numel:
        grid = (triton.cdiv(numel, _SWIGLU_BLOCK),)
        _swiglu_bwd_kernel[grid](d, g, u, dg, du, numel, BLOCK=_SWIGLU_BLOCK, num_warps=4)
    return dg, du


# --------------------------------------------------------------------------- Rotary embedding


@triton.jit
def _rope_kernel(
    X, COS, SIN, Y, T, H, HALF,
    sxb, sxh, sxt, syb, syh, syt, scb, sct, ssb, sst,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (batch, position): every head of that row, both halves of the head dim.
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (heads < H) & dmask
    c1 = tl.load(COS + b * scb + t * sct + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * scb + t * sct + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * ssb + t * sst + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * ssb + t * sst + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    xp = X + b * sxb + t * sxt + heads * sxh + d
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of y = x * cos + rotate_half(x) * sin
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    yp = Y + b * syb + t * syt + heads * syh + d
    tl.store(yp, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _rope_one(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, backward: bool
) -> torch.Tensor:
    b, h, t, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(b, 1, t, d), sin.expand(b, 1, t, d)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    y = torch.empty_like(x, dtype=dtype)
    if x.numel():
        _rope_kernel[(b * t,)](
            x, cos, sin, y, t, h, d // 2,
            x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
            BACKWARD=backward, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2), num_warps=4,
        )
    return y


def rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return _rope_one(q, cos, sin, dtype, False), _rope_one(k, cos, sin, dtype, False)


def rope_bwd(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_one(dq, cos, sin, q_dtype, True), _rope_one(dk, cos, sin, k_dtype, True)


# --------------------------------------------------------------------------- Cross-entropy on a chunk of logits

_CE_BLOCK = 4096


@triton.jit
def _ce_kernel(LOGITS, LABELS, LOSSES, stride, V, ignore_index, BLOCK: tl.constexpr):
    # Two passes over one row: online max/sum-exp -> logsumexp, then the gradient written in place.
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    m = -float("inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    picked = tl.load(ptr + safe).to(tl.float32)
    tl.store(LOSSES + row, tl.where(valid, lse - picked, 0.0))
    keep = tl.where(valid, 1.0, 0.0)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == safe, 1.0, 0.0)
        tl.store(ptr + cols, (g * keep).to(LOGITS.dtype.element_ty), mask=mask)


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor, ignore_index: int) -> None:
    rows, v = logits.shape
    if rows:
        block = min(_CE_BLOCK, triton.next_power_of_2(v))
        _ce_kernel[(rows,)](logits, labels, losses, logits.stride(0), v, ignore_index, BLOCK=block, num_warps=8)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked loop of :func:`eager.fused_linear_cross_entropy` with the Triton CE kernel."""
    return eager.fused_linear_cross_entropy(hidden, weight, labels.contiguous(), ignore_index, chunk_size, ce=ce_chunk)
