"""Mixed precision of a run (``--precision``): 16-bit parameters in compute over fp32 master weights.

Glossary:
    fp32           everything in float32 (auto's choice on cpu, ``config.precision_for``: what the tests compare).
    bf16           (auto's choice on cuda) the model is captured with its parameters in bfloat16
                   (:func:`cast_for_capture`) and its
                   float inputs in bfloat16 (:func:`cast_inputs`), so the graph's casts are those of a bf16
                   model (an RMSNorm upcasts to fp32 and back to bf16; buffers such as rotary tables keep
                   their dtype, as in a bf16 Hugging Face model). Each stage module then holds fp32 master
                   weights, the values the model had before the cast, and is wrapped by FSDP2
                   ``fully_shard`` (``fsdp``, and dp = 1 on its 1-rank dp mesh) or composable
                   ``replicate`` (``ddp``) with :func:`mixed_precision_policy`: the weights are gathered
                   (cast) to bf16 for forward and backward, the stage computes and hands on bf16
                   activations (pipelining's buffers take the dtypes of the stage examples, run in
                   bf16), the bf16 gradients are reduced in fp32 into fp32 gradients of the fp32 masters,
                   which the optimizer steps and checkpoints save. Across the micro-batches of a step,
                   pipelining defers the reduction to the last one, so the unsharded gradients add up in
                   bf16 until then. The loss is returned in fp32 (the model's own cross-entropy upcasts).
    compute bytes  the unsharded bf16 parameters and their gradients: half of fp32's; the fp32 master
                   (and its gradient) is held besides, sharded over dp under FSDP.
    fp16           as bf16 (float16 parameters in compute, fp32 masters), plus a dynamic loss scale
                   (:class:`LossScaler`, ``torch.amp.GradScaler``'s rule): the step's loss is multiplied by
                   the scale, the gradients are divided by it before clipping, and when any rank's gradients
                   hold an inf or nan (a flag all-reduced over every rank of the world, pipeline and dp) every
                   rank skips the optimizer step and halves the scale; after ``growth_interval`` good steps
                   in a row the scale doubles. Its state goes into checkpoints (trainer ``loss_scale``).
    TF32           on CUDA, every precision's fp32 matmuls and convolutions (an fp32 run's, and the fp32 parts of
                   mixed precision: norms upcast to fp32, the loss) run as TF32 on tensor cores
                   (:func:`enable_tf32`, set by each rank at start); CPU runs are left as they are.
    not done       two stages on one rank sharing a parameter (a 1-rank pipeline with tied weights) in
                   16 bits: FSDP2 wraps each stage on its own, so such a run is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils import _pytree as pytree

from omnibal_compile.errors import InputError

__all__ = ["compute_dtype", "enable_tf32", "cast_for_capture", "cast_inputs", "compile_in_precision",
           "mixed_precision_policy",
           "restore_masters", "ComputeParams", "LossScaler"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def compute_dtype(precision: str | None) -> torch.dtype | None:
    """The 16-bit dtype a run's parameters compute in (None: float32); unknown names are InputErrors."""
    if precision in (None, "fp32"):
        return None
    if precision not in _DTYPES:
        raise InputError(f"precision (--precision) must be one of bf16, fp16, fp32, got {precision!r}")
    return _DTYPES[precision]


def enable_tf32(device: str | torch.device) -> bool:
    """TF32 matmuls and cuDNN convolutions on for a run on ``device`` when it is a CUDA device (``cuda``, ``cuda:N``);
    whether they were set. Through the legacy switches only (``set_float32_matmul_precision("high")``,
    ``cudnn.allow_tf32``): torch 2.13 refuses to read a precision set through a mix of those and ``fp32_precision``."""
    if torch.device(device).type != "cuda":
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return True


def cast_for_capture(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast ``model``'s floating parameters to ``dtype`` in place (the parameter objects stay, so stages made
    from it share them) and return their values before the cast, by every name (``named_parameters`` with
    duplicates): the fp32 master weights :func:`~omnibal_compile.runtime.pipeline.build_pipeline` gives the
    stages back. Buffers keep their dtype (FSDP2's policy casts parameters only)."""
    masters: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.is_floating_point() and p.dtype != dtype:
                if name not in masters:
                    masters[name] = p.data
                p.data = p.data.to(dtype)
    return masters


def cast_inputs(batch: Any, dtype: torch.dtype | None) -> Any:
    """``batch`` with its floating tensors (pixel values) in ``dtype`` (None: unchanged), as the model is captured."""
    if dtype is None:
        return batch
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                           batch)


def compile_in_precision(model: nn.Module, batch: Any, plan: Any, precision: str | None, *,
                         kernels: str | None = None) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """``model`` captured and cut under ``plan`` for a run in ``precision``: in 16 bits as a 16-bit model on a 16-bit
    ``batch`` (:func:`cast_for_capture`, :func:`cast_inputs`); returns the ``OptimizeResult`` and the fp32 masters
    for :func:`~omnibal_compile.runtime.pipeline.build_pipeline` (None in fp32)."""
    from omnibal_compile.api import compile_for_microbatches

    low = compute_dtype(precision)
    masters = cast_for_capture(model, low) if low is not None else None
    return compile_for_microbatches(model, cast_inputs(batch, low), plan, kernels=kernels), masters


def mixed_precision_policy(dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for a run computing in ``dtype``: parameters gathered in it, gradients reduced in fp32.
    Forward inputs are not cast: the stages take the dtypes they were captured with (an fp32 skip tensor stays fp32)."""
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def restore_masters(module: nn.Module, masters: Mapping[str, torch.Tensor], names: Mapping[str, list[str]]) -> None:
    """Give ``module``'s 16-bit parameters their fp32 master values: ``masters`` by original name
    (:func:`cast_for_capture`), ``names`` module-local name -> original names; a parameter without one is upcast.
    A tensor-parallel (DTensor) parameter gets its shard of the whole master, which every rank holds."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for local, p in module.named_parameters(remove_duplicate=False):
            if not p.is_floating_point() or p.dtype == torch.float32:
                continue
            found = next((masters[n] for n in names.get(local, []) if n in masters), None)
            shard = p.data
            if isinstance(shard, DTensor):  # a new parameter: a DTensor keeps its dtype through ``.data =``
                whole = found.to(p.device) if found is not None else shard.full_tensor().float()
                parent, _, leaf = local.rpartition(".")
                setattr(module.get_submodule(parent), leaf, nn.Parameter(
                    distribute_tensor(whole, shard.device_mesh, shard.placements), requires_grad=p.requires_grad))
                continue
            p.data = found if found is not None else p.data.float()


class ComputeParams:
    """Records the parameters a rank's stage modules compute with and the gradients accumulated into them, by
    forward pre-hooks on every submodule (run after FSDP2's gather: the unsharded parameters then; sharded DTensors
    are skipped) and post-accumulate-grad hooks: for checks and ``bench/precision_memory.py``. Each tensor counts
    once, at its largest (its dtype x elements), however often it is gathered: what a step holds once every unit's
    weights and gradients are unsharded (pipelining keeps them so until the last micro-batch's backward)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.params: dict[int, tuple[torch.dtype, int]] = {}
        """id -> (dtype, bytes) of every parameter the stages computed with."""
        self.grads: dict[int, tuple[torch.dtype, int]] = {}
        """id -> (dtype, bytes) of the gradient accumulated into it."""
        self.storages: set[int] = set()
        """Data pointers of their storages when recorded (a tensor sharing one is no separate copy)."""
        self._held: list[nn.Parameter] = []  # keeps the ids unique while recording
        self._handles = [m.register_forward_pre_hook(self._forward) for mod in modules for m in mod.modules()]

    def _forward(self, module: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import DTensor

        for p in module.parameters():
            if isinstance(p, DTensor) or id(p) in self.params:
                continue
            self.params[id(p)] = (p.dtype, p.numel() * p.element_size())
            self.storages.add(p.untyped_storage().data_ptr())
            self._held.append(p)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad))

    def _grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None:
            self.grads[id(p)] = (g.dtype, max(g.numel() * g.element_size(), self.grads.get(id(p), (g.dtype, 0))[1]))

    @property
    def param_bytes(self) -> int:
        return sum(b for _, b in self.params.values())

    @property
    def grad_bytes(self) -> int:
        return sum(b for _, b in self.grads.values())

    def dtypes(self) -> set[torch.dtype]:
        """Dtypes of the parameters and gradients recorded."""
        return {d for d, _ in self.params.values()} | {d for d, _ in self.grads.values()}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._held = [], []


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
