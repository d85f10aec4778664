"""Measuring tools of the cost pass: op recording, live-storage accounting, timers.

Glossary:
    op record      one ATen op run during a block's forward: its op class, FLOPs (the formulas of
                   ``torch.utils.flop_counter``), bytes read + written, and wall time.
    fused attention  a ``scaled_dot_product_attention`` graph node is recorded as one op (FLOPs of
                   its two matmuls, bytes of q, k, v, mask and output) whatever kernel runs it here,
                   because on a GPU it runs as one flash kernel that never writes the score matrix.
    live storage   a tensor storage allocated inside the tracking mode and not freed yet; what
                   the autograd graph keeps alive after forward is exactly what backward needs.
    op class       ``matmul``, ``attention`` or ``memory``, from the recompute policy
                   (:mod:`~omnibal_compile.compile.recompute_policy`): ``memory`` ops are the ones
                   selective recomputation reruns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from omnibal_compile.compile.recompute_policy import op_class

__all__ = [
    "OpRecord",
    "record_ops",
    "LiveStorages",
    "PeakLiveStorages",
    "kept_bytes",
    "peak_bytes",
    "median_time",
    "timed_runs",
    "relative_spread",
    "count_flops",
    "tensor_leaves",
    "CLOCKS",
    "FlashOnMeta",
]

CLOCKS: tuple[str, ...] = ("wall", "thread")
"""CPU timers: wall clock, or CPU time of the calling thread."""

aten = torch.ops.aten

_SDPA_TARGETS = {aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention}


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True, kw_only=True)
class OpRecord:
    """One op run during a forward."""

    name: str
    """ATen op (or ``scaled_dot_product_attention`` for a fused attention node)."""
    op_class: str
    """``matmul``, ``attention`` or ``memory``."""
    flops: float
    """FLOPs by the formulas of torch.utils.flop_counter (0 for ops it does not count)."""
    nbytes: int
    """Bytes of tensor inputs plus outputs (0 for views, which move no data)."""
    seconds: float
    """Wall time of the call (synchronised on CUDA); meaningless on the meta device."""
    masked: bool = False
    """Fused attention only: whether it was given a mask (a GPU then runs memory-efficient attention, not flash)."""


class _Recorder(TorchDispatchMode):
    def __init__(self, sync: Callable[[], None] | None, now: Callable[[], float]) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self.paused = False
        self.sync = sync
        self.now = now
        self.flop_registry = _flop_counter().flop_registry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if self.sync:
            self.sync()
        start = self.now()
        out = func(*args, **kwargs)
        if self.sync:
            self.sync()
        seconds = self.now() - start
        ins, outs = tensor_leaves((args, kwargs)), tensor_leaves(out)
        in_storages = {StorageWeakRef(t.untyped_storage()).cdata for t in ins}
        is_view = all(StorageWeakRef(t.untyped_storage()).cdata in in_storages for t in outs)
        packet = func.overloadpacket
        flops = self.flop_registry[packet](*args, **kwargs, out_val=out) if packet in self.flop_registry else 0
        nbytes = 0 if is_view else sum(_nbytes(t) for t in ins + outs)
        self.records.append(
            OpRecord(name=str(func), op_class=op_class(func), flops=float(flops), nbytes=nbytes, seconds=seconds)
        )
        return out


class _FusedAttention(fx.Interpreter):
    """Runs a graph, recording each scaled-dot-product-attention node as one fused op."""

    def __init__(self, gm: fx.GraphModule, recorder: _Recorder) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.recorder = recorder

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target not in _SDPA_TARGETS:
            return super().call_function(target, args, kwargs)
        rec = self.recorder
        q, k, v = args[:3]
        if rec.sync:
            rec.sync()
        start = rec.now()
        rec.paused = True
        try:
            out = super().call_function(target, args, kwargs)
        finally:
            rec.paused = False
        if rec.sync:
            rec.sync()
        seconds = rec.now() - start
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        nbytes = sum(_nbytes(t) for t in (q, k, v, out)) + (_nbytes(mask) if isinstance(mask, torch.Tensor) else 0)
        flops = _flop_counter().sdpa_flop_count(tuple(q.shape), tuple(k.shape), tuple(v.shape))
        rec.records.append(
            OpRecord(
                name="scaled_dot_product_attention",
                op_class="attention",
                flops=float(flops),
                nbytes=nbytes,
                seconds=seconds,
                masked=isinstance(mask, torch.Tensor),
            )
        )
        return out


class FlashOnMeta(TorchFunctionMode):
    """Runs attention on meta tensors with the flash kernel's meta function, as a GPU would.

    Left alone, attention on the meta device takes the math path, whose autograd graph keeps the
    full score matrix; flash attention keeps only its output and log-sum-exp.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA_TARGETS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            opts = {**dict(zip(names, args[3:])), **kwargs}
            q, k, v = args[:3]
            # Grouped-query attention needs no copies of k and v: GPU kernels read each once per group
            # of query heads, and this meta kernel takes the heads as given.
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, opts.get("dropout_p", 0.0), opts.get("is_causal", False),
                attn_mask=opts.get("attn_mask"), scale=opts.get("scale"),
            )[0]
        return func(*args, **kwargs)


def _cpu_flash_flops(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _flop_counter().sdpa_flop_count(q_shape, k_shape, v_shape)


def _flop_counter() -> Any:
    """``torch.utils.flop_counter``, imported on first use: it imports Triton when Triton is installed,
    which would slow ``import omnibal_compile`` and fix Triton's interpreter setting too early."""
    import torch.utils.flop_counter as fc

    return fc


def count_flops() -> Any:
    """A ``FlopCounterMode`` that also counts PyTorch's CPU flash-attention kernel (absent upstream)."""
    return _flop_counter().FlopCounterMode(
        display=False, custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops}
    )


def record_ops(
    gm: fx.GraphModule, inputs: Sequence[Any], *, sync: Callable[[], None] | None = None, clock: str = "wall"
) -> tuple[list[OpRecord], int]:
    """Run ``gm`` once on ``inputs`` (grad enabled, as in training): its op records and total FLOPs.

    The FLOP total comes from :class:`FlopCounterMode`; the records are what the roofline and the
    selective-recompute estimate use. ``clock`` times each op as in :func:`median_time`.
    """
    recorder = _Recorder(sync, time.perf_counter if clock == "wall" else time.thread_time)
    with torch.enable_grad(), FlashOnMeta(), count_flops() as counter, recorder:
        _FusedAttention(gm, recorder).run(*inputs)
    return recorder.records, int(counter.get_total_flops())


class LiveStorages(TorchDispatchMode):
    """Tracks every storage that an op allocates while the mode is active (views and in-place excluded).

    ``alive_bytes()`` is the sum over those storages not yet freed. Unlike ``saved_tensors_hooks``
    it also sees what selective checkpointing caches outside the autograd graph.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        in_storages = {StorageWeakRef(t.untyped_storage()).cdata for t in tensor_leaves((args, kwargs))}
        for t in tensor_leaves(out):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in in_storages:
                self._refs[ref.cdata] = (ref, storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self._refs.values() if not ref.expired())


class PeakLiveStorages(LiveStorages):
    """:class:`LiveStorages` that also records the peak of ``alive_bytes()`` over its ops (``peak_bytes``).

    Freed storages are dropped before every op, so each op costs O(live storages) of Python: for
    measurement runs only. ``track(tensors)`` counts storages made before the mode (weights,
    optimizer states) until they are freed. DTensors count their local shard.
    """

    def __init__(self) -> None:
        super().__init__()
        self._alive = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for k in [k for k, (ref, _) in self._refs.items() if ref.expired()]:  # freed since the last op
            self._alive -= self._refs.pop(k)[1]
        out = func(*args, **(kwargs or {}))
        in_storages = {StorageWeakRef(_local(t).untyped_storage()).cdata for t in tensor_leaves((args, kwargs or {}))}
        self._add(t for t in tensor_leaves(out) if StorageWeakRef(_local(t).untyped_storage()).cdata not in in_storages)
        self.peak_bytes = max(self.peak_bytes, self._alive)
        return out

    def track(self, tensors: Any) -> None:
        """Count the storages of ``tensors`` (any nesting), made outside the mode, while they live."""
        self._add(tensor_leaves(tensors))
        self.peak_bytes = max(self.peak_bytes, self._alive)

    def _add(self, tensors: Any) -> None:
        for t in tensors:
            storage = _local(t).untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in self._refs:
                self._refs[ref.cdata] = (ref, storage.nbytes())
                self._alive += storage.nbytes()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s own storage: a DTensor's local shard, else ``t``."""
    return getattr(t, "_local_tensor", t)


def kept_bytes(fn: Callable[..., Any], inputs: Sequence[Any], charged: Sequence[bool]) -> int:
    """Bytes one forward of ``fn`` on ``inputs`` keeps alive for its backward (live storages).

    An input flagged in ``charged`` is copied inside the accounting, so it counts when kept; the
    others count only through what ``fn`` allocates.
    """
    with torch.enable_grad(), FlashOnMeta():
        with LiveStorages() as live:
            ins = [
                x.detach().clone().requires_grad_(x.requires_grad) if c and isinstance(x, torch.Tensor) else x
                for x, c in zip(inputs, charged, strict=True)
            ]
            outs = fn(*ins)
        keep = [t.grad_fn for t in tensor_leaves(outs) if t.grad_fn is not None]  # keeps the graph, not the outputs
        del outs, ins
        nbytes = live.alive_bytes()
        del keep
    return nbytes


def peak_bytes(
    fn: Callable[..., Any], inputs: Sequence[Any], charged: Sequence[bool], params: Sequence[torch.Tensor]
) -> int:
    """Peak live bytes of one forward and backward of ``fn`` on ``inputs`` (the ``charged`` rule of
    :func:`kept_bytes`): what it keeps for backward plus temporaries, the incoming gradient, the
    backward's scratch.

    ``params`` get gradients that exist beforehand (as after a first micro-batch; the static bytes
    count them), so accumulating into them is not charged; their ``.grad`` is restored afterwards.
    """
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.enable_grad(), FlashOnMeta():
            ins = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
            with PeakLiveStorages() as live:
                ins = [
                    x.clone().requires_grad_(x.requires_grad) if c and isinstance(x, torch.Tensor) else x
                    for x, c in zip(ins, charged, strict=True)
                ]
                outs = fn(*ins)
                diff = [t for t in tensor_leaves(outs) if t.requires_grad]
                # The outputs stay referenced through the backward call, which a pipeline does not do
                # (they were sent on): their bytes come off the backward's peak.
                held = sum(t.untyped_storage().nbytes() for t in diff)
                fwd_peak = live.peak_bytes
                if diff:
                    torch.autograd.backward(diff, [torch.ones_like(t) for t in diff])
                del outs, diff, ins
        return max(fwd_peak, live.peak_bytes - held)
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def median_time(call: Callable[[Any], Any], **kwargs: Any) -> float:
    """Median seconds of ``call(setup())`` over the timed runs of :func:`timed_runs` (same arguments)."""
    return statistics.median(timed_runs(call, **kwargs))


def relative_spread(times: Sequence[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than 2 or a zero median)."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    med = statistics.median(times)
    return (q3 - q1) / med if med > 0 else 0.0


def timed_runs(
    call: Callable[[Any], Any],
    *,
    setup: Callable[[], Any] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    cuda: bool = False,
    clock: str = "wall",
) -> list[float]:
    """Seconds of each of ``repeats`` timed runs of ``call(setup())`` after ``warmup`` untimed ones.

    CPU: ``time.perf_counter`` (``clock="wall"``) or ``time.thread_time`` (``clock="thread"``: CPU
    time of this thread, blind to time spent descheduled on a busy machine; exact only with one
    intra-op thread). CUDA: events around the call, synchronised before reading.
    ``setup`` runs outside the timed region (e.g. the forward whose backward is timed).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {list(CLOCKS)}, got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.thread_time
    times: list[float] = []
    for i in range(warmup + repeats):
        state = setup() if setup else None
        if cuda:
            start_ev, stop_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start_ev.record()
            call(state)
            stop_ev.record()
            torch.cuda.synchronize()
            seconds = start_ev.elapsed_time(stop_ev) / 1e3
        else:
            start = now()
            call(state)
            seconds = now() - start
        del state
        if i >= warmup:
            times.append(seconds)
    return times
