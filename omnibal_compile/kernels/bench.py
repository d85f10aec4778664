"""Benchmark of the fused kernels against their eager references: time, throughput, peak memory.

Glossary:
    speed run        on CUDA: ``triton.testing.do_bench`` (median ms) at realistic training shapes.
    correctness run  on CPU: the reference, the eager ops and (under ``TRITON_INTERPRET=1``) the
                     Triton kernels in the interpreter at small shapes; times are printed but say
                     nothing about speed, the error column is the point.
    peak             bytes allocated above what existed before the measured call, at its highest:
                     ``torch.cuda.max_memory_allocated`` on CUDA; on CPU a ``TorchDispatchMode``
                     that adds every new storage's bytes and subtracts them when it is freed
                     (:class:`LiveBytes`), looking inside the ``omnibal`` ops too.
    throughput       minimal bytes each kernel must move / time (GB/s) for the memory-bound
                     kernels; matmul FLOPs / time (TFLOP/s) for the fused loss.
    liger            backend ``liger``: Liger-Kernel's functions for the same ops (``liger_kernel.transformers.
                     functional``, when installed: :func:`liger_functions`), timed against the same reference.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from omnibal_compile._utils.tables import format_table
from omnibal_compile.kernels import ops
from omnibal_compile.kernels import reference as R

__all__ = [
    "LiveBytes", "Case", "BenchRow", "LossMemory", "cases", "run_bench", "loss_memory", "format_rows",
    "format_loss_memory", "liger_functions",
]


class LiveBytes(TorchDispatchMode):
    """Track bytes of tensor storages created while active; ``peak`` is the most alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "omnibal":
            # Run the op's Python body with this mode on, so its temporaries are counted too.
            with self:
                out = ops.python_impl(func._schema.name)(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        inputs = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._seen or key in inputs:
                    continue  # a view (or in-place result) of a storage that is already there
                nbytes = storage.nbytes()
                self._seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """Peak bytes allocated by ``fn()`` above the starting point, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    meter = LiveBytes()
    with meter:
        out = fn()
    return meter.peak, out


def time_ms(fn: Callable[[], Any], device: torch.device, *, reps: int = 1) -> float:
    """Median milliseconds of ``fn()``: ``do_bench`` on CUDA; on CPU (correctness runs) wall clock."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One kernel at one shape."""

    kernel: str
    """Op name."""
    shape: str
    """Shape, for the table."""
    make: Callable[[], list[torch.Tensor]]
    """Fresh inputs; the floating ones require grad."""
    reference: Callable[..., Any]
    """Unfused torch expression."""
    fused: Callable[..., Any]
    """``fused(*inputs, backend=...)``."""
    bytes_fwd: int
    """Bytes the forward must move at least."""
    bytes_bwd: int
    """Bytes the backward must move at least."""
    flops: int = 0
    """Matmul FLOPs of forward + backward (the fused loss only); 0 for memory-bound kernels."""


def cases(
    device: torch.device, dtype: torch.dtype, *, small: bool, loss_vocab: Sequence[int] = (128256,)
) -> list[Case]:
    """The benchmark cases: training-sized on a GPU, tiny (for the interpreter) when ``small``."""
    e = torch.tensor([], dtype=dtype).element_size()

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()

    tokens, hidden, vit_hidden, mlp = (64, 96, 80, 160) if small else (16384, 8192, 4096, 14336)
    b, t, heads, kv, d = (2, 8, 4, 2, 16) if small else (4, 4096, 32, 8, 128)
    out = [
        Case(
            kernel="rms_norm", shape=f"{tokens}x{hidden}",
            make=lambda: [leaf(tokens, hidden), leaf(hidden)],
            reference=lambda x, w: R.rms_norm(x, w, 1e-6),
            fused=lambda x, w, backend: ops.rms_norm(x, w, 1e-6, backend=backend),
            bytes_fwd=2 * tokens * hidden * e, bytes_bwd=3 * tokens * hidden * e,
        ),
        Case(
            kernel="layer_norm", shape=f"{tokens}x{vit_hidden}",
            make=lambda: [leaf(tokens, vit_hidden), leaf(vit_hidden), leaf(vit_hidden)],
            reference=lambda x, w, bias: R.layer_norm(x, w, bias, 1e-5),
            fused=lambda x, w, bias, backend: ops.layer_norm(x, w, bias, 1e-5, backend=backend),
            bytes_fwd=2 * tokens * vit_hidden * e, bytes_bwd=3 * tokens * vit_hidden * e,
        ),
        Case(
            kernel="swiglu", shape=f"{tokens}x{mlp}",
            make=lambda: [leaf(tokens, mlp), leaf(tokens, mlp)],
            reference=R.swiglu,
            fused=lambda g, u, backend: ops.swiglu(g, u, backend=backend),
            bytes_fwd=3 * tokens * mlp * e, bytes_bwd=5 * tokens * mlp * e,
        ),
    ]

    def rope_inputs() -> list[torch.Tensor]:
        q = leaf(b, t, heads, d).detach().transpose(1, 2).requires_grad_()
        k = leaf(b, t, kv, d).detach().transpose(1, 2).requires_grad_()
        pos = torch.arange(t, device=device, dtype=torch.float32)[:, None] * torch.rand(d // 2, device=device)
        emb = torch.cat((pos, pos), -1)[None, None]
        return [q, k, emb.cos().to(dtype), emb.sin().to(dtype)]

    qk = b * t * (heads + kv) * d
    out.append(
        Case(
            kernel="rope", shape=f"b{b} t{t} h{heads}/{kv} d{d}", make=rope_inputs,
            reference=R.rope,
            fused=lambda q, k, c, s, backend: ops.rope(q, k, c, s, backend=backend),
            bytes_fwd=2 * qk * e + 2 * t * d * e, bytes_bwd=2 * qk * e + 2 * t * d * e,
        )
    )
    n, h = (32, 32) if small else (16384, 4096)
    for v in (1000,) if small else loss_vocab:

        def loss_inputs(v: int = v) -> list[torch.Tensor]:
            labels = torch.randint(0, v, (n,), device=device)
            labels[::7] = -100
            return [leaf(n, h), leaf(v, h, scale=0.02), labels]

        out.append(
            Case(
                kernel="fused_linear_cross_entropy", shape=f"{n}x{h} vocab {v}", make=loss_inputs,
                reference=R.linear_cross_entropy,
                fused=lambda x, w, y, backend: ops.fused_linear_cross_entropy(x, w, y, backend=backend),
                bytes_fwd=2 * (n * h + v * h) * e, bytes_bwd=0, flops=3 * 2 * n * h * v,
            )
        )
    return out


@dataclass(frozen=True, kw_only=True)
class BenchRow:
    """One kernel, one direction, one backend against the reference."""

    kernel: str
    """Op name."""
    shape: str
    """Shape."""
    direction: str
    """``fwd``, ``bwd`` or ``fwd+bwd`` (the fused loss computes its gradients in the forward)."""
    backend: str
    """Backend of the fused op (``triton`` or ``eager``)."""
    reference_ms: float
    """Median time of the reference."""
    fused_ms: float
    """Median time of the fused op."""
    throughput: str
    """GB/s (memory-bound kernels) or TFLOP/s (the loss) of the fused op."""
    reference_peak: int
    """Peak bytes of the reference."""
    fused_peak: int
    """Peak bytes of the fused op."""
    max_error: float
    """Largest absolute difference from the reference (outputs, or gradients for bwd)."""

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.fused_ms if self.fused_ms > 0 else float("inf")


def _max_diff(a: Any, b: Any) -> float:
    pairs = zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True)
    diffs = [float((x.detach().float() - y.detach().float()).abs().max()) for x, y in pairs if x.numel()]
    return max(diffs, default=0.0)


def _grad_fn(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> Callable[[], Any]:
    """A closure running only the backward of ``fn(*inputs)`` (its graph kept for repeats)."""
    wrt = [x for x in inputs if x.requires_grad]
    outs = [o for o in pytree.tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor)]
    g = torch.Generator(device=outs[0].device).manual_seed(0)
    cot = [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs]
    return lambda: torch.autograd.grad(outs, wrt, cot, retain_graph=True)


def _throughput(case: Case, direction: str, ms: float) -> str:
    if case.flops:
        return f"{case.flops / ms / 1e9:.0f} TFLOP/s"
    nbytes = case.bytes_fwd if direction == "fwd" else case.bytes_bwd
    return f"{nbytes / ms / 1e6:.0f} GB/s"


def liger_functions() -> dict[str, Callable[..., Any]] | None:
    """Liger-Kernel's function for each benchmarked op, called as the case's reference is; None when it is not
    installed. Its RMSNorm out of place (in place it writes the input gradient over the output gradient, which the
    repeated backward reuses); its rotary takes ``cos``/``sin`` as ``[1, t, d]``."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers import functional as L

    return {
        "rms_norm": lambda x, w: L.liger_rms_norm(x, w, 1e-6, in_place=False),
        "layer_norm": lambda x, w, b: L.liger_layer_norm(x, w, b, 1e-5),
        "swiglu": L.liger_swiglu,
        "rope": lambda q, k, c, s: L.liger_rope(q, k, c[:, 0], s[:, 0]),
        "fused_linear_cross_entropy": lambda x, w, y: L.liger_fused_linear_cross_entropy(x, w, y),
    }


def run_bench(case_list: Sequence[Case], device: torch.device, backends: Sequence[str]) -> list[BenchRow]:
    """Time and measure every case in every direction for every backend; ``liger`` (:func:`liger_functions`, which
    must be installed) for the ops it has, a failure of one of its functions printed and its rows left out."""
    rows: list[BenchRow] = []
    liger = liger_functions() if "liger" in backends else None
    if "liger" in backends and liger is None:
        raise ImportError("backend liger needs Liger-Kernel (pip install liger-kernel)")
    for case in case_list:
        inputs = case.make()
        for backend in backends:
            if backend != "liger":
                rows += _bench_one(case, inputs, backend, device)
                continue
            assert liger is not None
            if case.kernel not in liger:
                continue
            try:
                rows += _bench_one(case, inputs, backend, device, fn=liger[case.kernel])
            except Exception as e:  # noqa: BLE001 - another library's API: said, and the others still run
                print(f"liger {case.kernel} {case.shape}: {type(e).__name__}: {e}", flush=True)
    return rows


def _bench_one(case: Case, inputs: list[torch.Tensor], backend: str, device: torch.device,
               fn: Callable[..., Any] | None = None) -> list[BenchRow]:
    def fused(*xs: Any) -> Any:
        return fn(*xs) if fn is not None else case.fused(*xs, backend=backend)

    def row(
        direction: str, ref: Callable[[], Any], mine: Callable[[], Any], err: float, peaks: tuple[int, int]
    ) -> BenchRow:
        ref_ms, fused_ms = time_ms(ref, device), time_ms(mine, device)
        return BenchRow(
            kernel=case.kernel, shape=case.shape, direction=direction, backend=backend, reference_ms=ref_ms,
            fused_ms=fused_ms, throughput=_throughput(case, direction, fused_ms), reference_peak=peaks[0],
            fused_peak=peaks[1], max_error=err,
        )

    if case.flops:  # the loss computes its gradients in its forward: time both directions together
        wrt = [x for x in inputs if x.requires_grad]
        ref_both = lambda: torch.autograd.grad(case.reference(*inputs), wrt)  # noqa: E731
        fused_both = lambda: torch.autograd.grad(fused(*inputs), wrt)  # noqa: E731
        ref_peak, ref_grads = peak_bytes(ref_both, device)
        fused_peak, fused_grads = peak_bytes(fused_both, device)
        err = _max_diff(fused_grads, ref_grads)
        del ref_grads, fused_grads
        return [row("fwd+bwd", ref_both, fused_both, err, (ref_peak, fused_peak))]
    ref_fwd = lambda: case.reference(*inputs)  # noqa: E731
    fused_fwd = lambda: fused(*inputs)  # noqa: E731
    ref_peak, ref_out = peak_bytes(ref_fwd, device)
    fused_peak, fused_out = peak_bytes(fused_fwd, device)
    err = _max_diff(fused_out, ref_out)
    del ref_out, fused_out
    rows = [row("fwd", ref_fwd, fused_fwd, err, (ref_peak, fused_peak))]
    ref_bwd, fused_bwd = _grad_fn(case.reference, inputs), _grad_fn(fused, inputs)
    ref_peak, ref_grads = peak_bytes(ref_bwd, device)
    fused_peak, fused_grads = peak_bytes(fused_bwd, device)
    err = _max_diff(fused_grads, ref_grads)
    del ref_grads, fused_grads
    rows.append(row("bwd", ref_bwd, fused_bwd, err, (ref_peak, fused_peak)))
    return rows


@dataclass(frozen=True, kw_only=True)
class LossMemory:
    """Peak memory of the fused loss against the unfused one (forward + backward)."""

    tokens: int
    """Rows of hidden states."""
    hidden: int
    """Hidden size."""
    vocab: int
    """Vocabulary size."""
    dtype: str
    """Dtype of hidden states and weight."""
    backend: str
    """Backend of the fused op."""
    unfused_peak: int
    """Peak bytes of ``cross_entropy(hidden @ weight.T)`` and its gradients."""
    fused_peak: int
    """Peak bytes of the fused op and its gradients."""

    @property
    def ratio(self) -> float:
        return self.fused_peak / self.unfused_peak


def loss_memory(
    device: torch.device, dtype: torch.dtype, *, tokens: int, hidden: int, vocab: int, backend: str
) -> LossMemory:
    """Measure the fused and unfused loss's peak memory, forward and backward, on ``device``."""
    h = torch.randn(tokens, hidden, device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    kind = cast(ops.Backend, backend)  # a str from the command line: the op refuses any other name (ops._check)
    unfused, _ = peak_bytes(lambda: torch.autograd.grad(R.linear_cross_entropy(h, w, labels), [h, w]), device)
    fused, _ = peak_bytes(
        lambda: torch.autograd.grad(ops.fused_linear_cross_entropy(h, w, labels, backend=kind), [h, w]), device
    )
    return LossMemory(
        tokens=tokens, hidden=hidden, vocab=vocab, dtype=str(dtype).removeprefix("torch."), backend=backend,
        unfused_peak=unfused, fused_peak=fused,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_rows(rows: Sequence[BenchRow]) -> str:
    """A table of the rows."""
    table = [("kernel", "shape", "dir", "backend", "ref ms", "fused ms", "speedup", "fused throughput",
              "ref peak MiB", "fused peak MiB", "max |err|")]
    for r in rows:
        table.append((
            r.kernel, r.shape, r.direction, r.backend, f"{r.reference_ms:.3f}", f"{r.fused_ms:.3f}",
            f"{r.speedup:.2f}x", r.throughput, _mib(r.reference_peak), _mib(r.fused_peak), f"{r.max_error:.2e}",
        ))
    return format_table(table, "llll" + "r" * (len(table[0]) - 4))


def format_loss_memory(m: LossMemory) -> str:
    return (
        f"fused loss peak memory at vocab {m.vocab:,} ({m.tokens} tokens x hidden {m.hidden}, {m.dtype}, "
        f"{m.backend}): unfused {_mib(m.unfused_peak)} MiB, fused {_mib(m.fused_peak)} MiB, "
        f"ratio {m.ratio:.3f} (1/{1 / m.ratio:.1f})"
    )
