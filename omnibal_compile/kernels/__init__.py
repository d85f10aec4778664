"""Fused training kernels (Triton) as torch custom ops, with eager torch fallbacks.

Glossary:
    kernel      one fused op with a forward and a backward: RMSNorm, LayerNorm, SwiGLU
                (``silu(gate) * up``), rotary embedding of q and k, and a chunked linear +
                cross-entropy loss that never holds the full logits.
    backend     ``"triton"``: the Triton kernel where it can run (CUDA, or ``TRITON_INTERPRET=1``),
                the eager implementation elsewhere; ``"eager"``: always the eager implementation.
    reference   the unfused torch expression (:mod:`.reference`); the oracle for tests and the
                baseline of ``omnibal-compile bench kernels``.
Every op appears as one node (``torch.ops.omnibal.*``) to torch.export, FX and the cost pass.
Triton is imported lazily: this package imports and runs without it.
"""

from omnibal_compile.kernels.ops import (
    BACKENDS,
    INSTALL_HINT,
    Backend,
    MissingBackendError,
    fused_linear_cross_entropy,
    layer_norm,
    require_triton,
    rms_norm,
    rope,
    swiglu,
    triton_available,
    triton_runs_on,
)

__all__ = [
    "Backend",
    "BACKENDS",
    "INSTALL_HINT",
    "MissingBackendError",
    "triton_available",
    "triton_runs_on",
    "require_triton",
    "rms_norm",
    "layer_norm",
    "swiglu",
    "rope",
    "fused_linear_cross_entropy",
]
