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
    fp16           as bf16 (autocast in float16, fp32 weights and gradients), plus a dynamic loss scale
                   (:class:`LossScaler`, ``torch.amp.GradScaler``'s rule): the step's loss is multiplied by
                   the scale, the gradients are divided by it before clipping, and when any rank's gradients
                   hold an inf or nan (a flag all-reduced over every rank of the world, pipeline and dp) every
                   rank skips the optimizer step and halves the scale; after ``growth_interval`` good steps
                   in a row the scale doubles. Its state goes into checkpoints (trainer ``loss_scale``).
    not done       FSDP2 ``MixedPrecisionPolicy`` (16-bit parameters in compute): see bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.errors import InputError

__all__ = ["compute_dtype", "drop_dtype_checks", "LossScaler", "PrecisionStage"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def compute_dtype(precision: str | None) -> torch.dtype | None:
    """The low-precision dtype a run computes in (None: float32); unknown names are InputErrors."""
    if precision in (None, "fp32"):
        return None
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


class LossScaler:
    """fp16's dynamic loss scale (``torch.amp.GradScaler`` semantics), agreed by every rank of the world.

    Per step: run the step with the loss times :attr:`scale`, then :meth:`unscale` (divides every local
    gradient by the scale and returns whether any rank found an inf or nan), clip, step the optimizer
    unless skipped, and :meth:`update` with the flag.
    """

    def __init__(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise InputError(f"loss scaler: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1 are needed, got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0

    def unscale(self, params: list[nn.Parameter], device: torch.device) -> bool:
        """Divide every local gradient by the scale; whether any rank's gradients are not finite (a collective
        over the default group: every rank of the world calls it)."""
        import torch.distributed as dist

        bad = torch.zeros((), dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in params:
                g = p.grad
                if g is None:
                    continue
                local = g.to_local() if hasattr(g, "to_local") else g
                local.mul_(1.0 / self.scale)
                # on the device, no host sync per parameter: one read after the all-reduce
                bad = torch.maximum(bad, (~torch.isfinite(local)).any().to(bad.dtype))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad)

    def update(self, skipped: bool) -> None:
        """Halve (backoff) the scale after a skipped step; grow it after ``growth_interval`` good steps in a row."""
        if skipped:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
