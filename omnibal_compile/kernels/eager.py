"""Eager torch implementations of every op's forward and backward, with the kernels' exact contract.

Glossary:
    explicit backward  the gradient formulas written out in torch (no autograd inside), the same
                       maths the Triton backward kernels run; used where Triton cannot run.
    CE chunk     one block of rows of logits that is turned in place into the gradient of the
                 summed cross-entropy with respect to those logits (``softmax - onehot``, zero for
                 ignored rows), while the per-row losses are written out.
Statistics are computed in fp32 whatever the input dtype; results are cast back at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnibal_compile.kernels import reference

__all__ = [
    "rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd", "swiglu_fwd", "swiglu_bwd",
    "rope_fwd", "rope_bwd", "ce_chunk", "fused_linear_cross_entropy", "auto_chunk_size",
]

CEChunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]
"""``(logits [c, v], labels [c], losses [c] fp32, ignore_index)``; rewrites logits in place."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps).contiguous()


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    xf, dyf = _rows(x).float(), _rows(dy).float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    g = dyf * weight.float()
    dx = rstd * (g - n * (g * n).mean(-1, keepdim=True))
    dw = (dyf * n.to(x.dtype).float()).sum(0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.layer_norm(x, weight, bias, eps).contiguous()


def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf, dyf = _rows(x).float(), _rows(dy).float()
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    xhat = (xf - mean) * rstd
    g = dyf * weight.float()
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dw, db = (dyf * xhat).sum(0), dyf.sum(0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), db.to(weight.dtype)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(torch.promote_types(gate.dtype, up.dtype)).contiguous()


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = d * u * s * (1 + g * (1 - s))
    dup = d * g * s
    return dgate.to(gate.dtype).contiguous(), dup.to(up.dtype).contiguous()


def _into(result: torch.Tensor, template: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Copy ``result`` into a tensor with ``template``'s strides, the layout the fake impl promises."""
    out = torch.empty_like(template, dtype=dtype)
    out.copy_(result)
    return out


def rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(q.dtype, cos.dtype)
    qo, ko = reference.rope(q.float(), k.float(), cos.float(), sin.float())
    return _into(qo, q, dtype), _into(ko, k, dtype)


def _rotate_half_t(v: torch.Tensor) -> torch.Tensor:
    """Transpose of ``rotate_half``: ``cat(v2, -v1)``."""
    a, b = v.chunk(2, dim=-1)
    return torch.cat((b, -a), dim=-1)


def rope_bwd(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos.float(), sin.float()
    dqf, dkf = dq.float(), dk.float()
    return (
        _into(dqf * c + _rotate_half_t(dqf * s), dq, q_dtype),
        _into(dkf * c + _rotate_half_t(dkf * s), dk, k_dtype),
    )


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor, ignore_index: int) -> None:
    lf = logits.float()  # logits themselves when fp32: the gradient is then built in place
    lse = torch.logsumexp(lf, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    picked = lf.gather(1, safe).squeeze(1)
    losses.copy_(torch.where(valid, lse - picked, 0.0))
    grad = lf.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))
    grad.mul_(valid.unsqueeze(1))
    if grad is not logits:
        logits.copy_(grad)


MIN_CHUNK = 128
"""Fewest rows per chunk (unless there are fewer rows): smaller chunks re-read the weight too often."""


def auto_chunk_size(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that one chunk of logits is about as large as the hidden states (a power of two)."""
    rows = max(MIN_CHUNK, -(-n // max(1, -(-vocab // hidden))))
    return min(1 << (rows - 1).bit_length(), max(n, 1))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
    ce: CEChunk = ce_chunk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of ``hidden @ weight.T`` and its gradients, ``chunk_size`` rows of logits at a time.

    The gradients are computed here, in the forward, so the logits never need to be kept (or
    recomputed) for the backward; the backward only scales them by the incoming gradient.
    """
    n = hidden.shape[0]
    chunk = chunk_size if chunk_size > 0 else auto_chunk_size(n, hidden.shape[1], weight.shape[0])
    hidden = hidden.contiguous()
    dh = torch.empty_like(hidden)
    # fp32 accumulation of the weight gradient across chunks.
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    vocab = weight.shape[0]
    vocab_block = max(1, -(-chunk * vocab // hidden.shape[1]))
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        h = hidden[start:stop]
        logits = h @ weight.t()
        ce(logits, labels[start:stop], losses[start:stop], ignore_index)
        torch.mm(logits, weight, out=dh[start:stop])
        if weight.dtype == torch.float32:
            dw.addmm_(logits.t(), h)
        else:
            # Low-precision products land in the fp32 accumulator a slice of vocab at a time, so the
            # temporary stays about the size of one chunk of logits instead of the whole weight.
            for v0 in range(0, vocab, vocab_block):
                dw[v0 : v0 + vocab_block].add_(logits[:, v0 : v0 + vocab_block].t() @ h)
    inv = 1.0 / (labels != ignore_index).sum().to(torch.float32)
    loss = losses.sum() * inv
    dh.mul_(inv)
    dw.mul_(inv)
    return loss, dh, dw if weight.dtype == torch.float32 else dw.to(weight.dtype)
