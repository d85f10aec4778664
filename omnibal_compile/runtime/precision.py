"""Mixed precision of a run (``--precision``): fp32 master weights always, the compute in bf16.

Glossary:
    fp32           everything in float32 (the default: this is what CPU runs and the tests compare).
    bf16           parameters, gradients and optimizer states stay float32; the compute runs in
                   bfloat16: each stage module's forward runs inside ``torch.autocast`` (pipelining
                   calls the stage's forward itself, so the context is entered there, not around
                   ``schedule.step``), under dp = 1, DDP and FSDP2 alike (FSDP2 gathers the fp32
                   weights and reduces fp32 gradients). FSDP2's ``MixedPrecisionPolicy(param_dtype=
                   bfloat16)`` is not used: the captured graph keeps the casts of the model's code to
                   the dtype it was captured in (``x.to(hidden.dtype)`` became ``to(float32)``), so
                   with bf16 weights an op meets float32 and bfloat16 operands (``masked_scatter``
                   refuses them). Each stage hands float32 tensors on (its float outputs are cast
                   back), so the pipeline's send and receive buffers keep the dtypes the stages were
                   built with; the captured dtype checks (``_assert_tensor_metadata``) are removed.
                   bf16 is the setting meant for GPUs; the default stays fp32 until it is checked on one.
    fp16           refused: it needs loss scaling whose found-inf check every pipeline rank agrees
                   on, which the runtime does not do yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.errors import InputError

__all__ = ["compute_dtype", "drop_dtype_checks", "PrecisionStage"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def compute_dtype(precision: str | None) -> torch.dtype | None:
    """The low-precision dtype a run computes in (None: float32); fp16 and unknown names are InputErrors."""
    if precision in (None, "fp32"):
        return None
    if precision == "fp16":
        raise InputError(
            "precision fp16 (--precision) needs loss scaling with a found-inf check agreed by every pipeline rank, "
            "which the runtime does not do yet: use --precision bf16 (no loss scaling needed) or fp32"
        )
    if precision not in _DTYPES:
        raise InputError(f"precision (--precision) must be one of bf16, fp16, fp32, got {precision!r}")
    return _DTYPES[precision]


def drop_dtype_checks(module: nn.Module) -> int:
    """Remove the captured graphs' ``_assert_tensor_metadata`` checks (torch.export records one per ``.to(dtype)``
    of the model's code, naming the float32 dtype it was captured in) from every graph module in ``module``;
    under autocast the checked values are bf16. Returns how many were removed."""
    import torch.fx as fx

    check = torch.ops.aten._assert_tensor_metadata.default
    removed = 0
    for gm in module.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is check and not n.users]
        for n in nodes:
            gm.graph.erase_node(n)
        if nodes:
            gm.recompile()
            removed += len(nodes)
    return removed


class PrecisionStage(nn.Module):
    """A stage module whose forward runs under ``torch.autocast`` and whose float outputs are cast back to
    float32, so that what pipelining sends and receives keeps the built dtypes."""

    def __init__(self, stage: nn.Module, device_type: str, dtype: torch.dtype, *, autocast: bool = True) -> None:
        super().__init__()
        drop_dtype_checks(stage)
        self.stage = stage
        self.device_type = device_type
        self.dtype = dtype
        self.autocast = autocast

    def forward(self, *args: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast):
            out = self.stage(*args)
        return pytree.tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32
            else x, out)
