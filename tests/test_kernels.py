"""Fused kernels: Triton (under TRITON_INTERPRET=1, on CPU) and eager against the unfused references.

Triton's interpreter must be chosen before ``triton`` is first imported, and importing torch's
export machinery (conftest does) imports it. So on CPU the Triton cases run in a child pytest
started with ``TRITON_INTERPRET=1`` (:func:`test_triton_cases_in_interpreter`); in this process
they skip, and nothing here changes the environment of other test files. With a GPU every case
runs here on CUDA tensors, through the compiled kernels (``bench/kernels_gpu.sh``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from omnibal_compile import kernels as K
from omnibal_compile.kernels import eager, ops
from omnibal_compile.kernels import reference as R

IN_INTERPRETER = ops.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and ops.triton_available() and not IN_INTERPRETER
DEVICE = torch.device("cuda" if CUDA else "cpu")
triton_impl = ops.require_triton() if IN_INTERPRETER or CUDA else None
needs_triton = pytest.mark.skipif(
    triton_impl is None, reason="on CPU, Triton cases run in a child pytest with TRITON_INTERPRET=1"
)


def run_triton_cases_in_child(path: str) -> None:
    """Run the ``triton`` cases of test file ``path`` in a child pytest under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", path, "-x", "-k", "triton", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) > 0 and " failed" not in out.stdout, tail


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) per dtype: a few ulps of the output dtype, since both sides round differently.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (6e-2, 3e-2), torch.float16: (6e-3, 4e-3)}
BACKENDS = [pytest.param("triton", marks=needs_triton), "eager"]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    atol, rtol = TOL[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale)


def _leaf(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype).requires_grad_()


def _grads(out: torch.Tensor | tuple[torch.Tensor, ...], inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g).to(device=o.device, dtype=o.dtype) for o in outs]
    return list(torch.autograd.grad(outs, inputs, cot))


def _check_against_reference(fn, ref, inputs, dtype, grad_scale: float = 1.0) -> None:
    out, expected = fn(*inputs), ref(*inputs)
    outs, refs = (out if isinstance(out, tuple) else (out,)), (expected if isinstance(expected, tuple) else (expected,))
    for a, e in zip(outs, refs, strict=True):
        _close(a, e, dtype)
    for a, e in zip(_grads(out, inputs, 7), _grads(expected, inputs, 7), strict=True):
        _close(a, e, dtype, grad_scale)


# rows x hidden: a single row, rows that do not fill the backward programs evenly, non-power-of-two widths
NORM_SHAPES = [(1, 8), (5, 7, 48), (3, 100)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_matches_reference(backend, dtype, shape):
    x = _leaf(*shape, dtype=dtype, seed=1)
    w = _leaf(shape[-1], dtype=dtype, seed=2, scale=0.5)
    _check_against_reference(
        lambda x, w: K.rms_norm(x, w, 1e-6, backend=backend), lambda x, w: R.rms_norm(x, w, 1e-6), [x, w], dtype,
        grad_scale=4.0,  # the weight gradient sums over rows in the reference's low precision
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_layer_norm_matches_reference(backend, dtype, shape):
    x = _leaf(*shape, dtype=dtype, seed=3, scale=2.0)
    w = _leaf(shape[-1], dtype=dtype, seed=4)
    b = _leaf(shape[-1], dtype=dtype, seed=5)
    _check_against_reference(
        lambda x, w, b: K.layer_norm(x, w, b, 1e-5, backend=backend),
        lambda x, w, b: R.layer_norm(x, w, b, 1e-5),
        [x, w, b], dtype, grad_scale=4.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 100), (1030,)])  # < one block, several rows, two blocks
def test_swiglu_matches_reference(backend, dtype, shape):
    g, u = _leaf(*shape, dtype=dtype, seed=6, scale=3.0), _leaf(*shape, dtype=dtype, seed=7)
    _check_against_reference(lambda g, u: K.swiglu(g, u, backend=backend), R.swiglu, [g, u], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,t,d", [(4, 2, 5, 8), (3, 1, 7, 12), (1, 1, 1, 2)])
def test_rope_matches_reference(backend, dtype, heads, kv_heads, t, d):
    # q and k laid out as attention makes them: [b, t, h, d] storage viewed as [b, h, t, d]
    q = _leaf(2, t, heads, d, dtype=dtype, seed=8).detach().transpose(1, 2).requires_grad_()
    k = _leaf(2, t, kv_heads, d, dtype=dtype, seed=9).detach().transpose(1, 2).requires_grad_()
    pos = torch.arange(t, dtype=torch.float32)[None, :, None] * torch.linspace(0.1, 1.0, d // 2)
    emb = torch.cat((pos, pos), dim=-1)  # [1, t, d]
    cos, sin = emb.cos().to(DEVICE, dtype).unsqueeze(1), emb.sin().to(DEVICE, dtype).unsqueeze(1)
    _check_against_reference(
        lambda q, k: K.rope(q, k, cos, sin, backend=backend), lambda q, k: R.rope(q, k, cos, sin), [q, k], dtype
    )
    qo, _ = K.rope(q, k, cos, sin, backend=backend)
    assert qo.stride() == q.stride()  # same layout as the input: no hidden transpose copy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", [(37, 16, 100, 8), (6, 8, 4100, 0), (5, 24, 33, 64)])
def test_fused_linear_cross_entropy_matches_reference(backend, dtype, n, h, v, chunk):
    # chunks with a ragged tail; a vocabulary over several CE blocks; one chunk larger than the rows
    hidden = _leaf(n, h, dtype=dtype, seed=10)
    weight = _leaf(v, h, dtype=dtype, seed=11, scale=0.3)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(12))
    labels[::4] = -100
    labels = labels.to(DEVICE)
    loss = K.fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, backend=backend)
    expected = R.linear_cross_entropy(hidden, weight, labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    _close(loss, expected, torch.float32, scale=10.0 if dtype != torch.float32 else 1.0)
    grads = torch.autograd.grad(loss * 3.0, [hidden, weight])
    ref_grads = torch.autograd.grad(expected * 3.0, [hidden, weight])
    for a, e in zip(grads, ref_grads, strict=True):
        _close(a, e, dtype)


def test_fused_loss_ignores_masked_rows_and_keeps_logits_unchanged():
    hidden = _leaf(8, 4, dtype=torch.float32, seed=13)
    weight = _leaf(10, 4, dtype=torch.float32, seed=14)
    labels = torch.tensor([1, -100, 2, 3, -100, 4, 5, 6], device=DEVICE)
    keep = labels != -100
    loss = K.fused_linear_cross_entropy(hidden, weight, labels, chunk_size=3, backend="eager")
    torch.testing.assert_close(loss, R.linear_cross_entropy(hidden[keep], weight, labels[keep]))
    (g,) = torch.autograd.grad(loss, [hidden])
    assert torch.all(g[~keep] == 0)


def test_auto_chunk_size_bounds():
    assert eager.auto_chunk_size(16384, 4096, 131072) == 512  # logits chunk ~ hidden states
    assert eager.auto_chunk_size(3, 64, 32) == 3  # never more rows than there are
    assert eager.auto_chunk_size(4096, 128, 131072) == eager.MIN_CHUNK


def _opcheck_cases(backend: str):
    x = _leaf(3, 40, dtype=torch.float32, seed=20)
    w = _leaf(40, dtype=torch.float32, seed=21)
    b = _leaf(40, dtype=torch.float32, seed=22)
    dy = torch.randn(3, 40, device=DEVICE)
    g, u = _leaf(2, 33, dtype=torch.float32, seed=23), _leaf(2, 33, dtype=torch.float32, seed=24)
    q = _leaf(1, 2, 3, 8, dtype=torch.float32, seed=25)
    k = _leaf(1, 1, 3, 8, dtype=torch.float32, seed=26)
    cos, sin = torch.rand(1, 1, 3, 8, device=DEVICE), torch.rand(1, 1, 3, 8, device=DEVICE)
    h = _leaf(6, 8, dtype=torch.float32, seed=27)
    wv = _leaf(20, 8, dtype=torch.float32, seed=28)
    labels = torch.tensor([1, 2, -100, 4, 5, 19], device=DEVICE)
    o = torch.ops.omnibal
    return [
        (o.rms_norm.default, (x, w, 1e-6, backend)),
        (o.rms_norm_backward.default, (dy, x.detach(), w.detach(), 1e-6, backend)),
        (o.layer_norm.default, (x, w, b, 1e-5, backend)),
        (o.layer_norm_backward.default, (dy, x.detach(), w.detach(), 1e-5, backend)),
        (o.swiglu.default, (g, u, backend)),
        (o.swiglu_backward.default, (torch.randn(2, 33, device=DEVICE), g.detach(), u.detach(), backend)),
        (o.rope.default, (q, k, cos, sin, backend)),
        (o.rope_backward.default, (q.detach() * 2, k.detach() * 2, cos, sin, torch.float32, torch.float32, backend)),
        (o.fused_linear_cross_entropy.default, (h, wv, labels, -100, 4, backend)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    for op, args in _opcheck_cases(backend):
        torch.library.opcheck(op, args)


def test_export_sees_one_node_per_kernel():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(16))
            self.head = torch.nn.Parameter(torch.randn(30, 16))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            y = K.rms_norm(x, self.w, backend="eager")
            y = K.swiglu(y, y * 2, backend="eager")
            return K.fused_linear_cross_entropy(y, self.head, labels, backend="eager")

    x, labels = torch.randn(2, 5, 16), torch.randint(0, 30, (2, 5))
    block = Block()
    ep = torch.export.export(block, (x, labels), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("omnibal.rms_norm" in t for t in targets) == 1
    assert sum("omnibal.swiglu" in t for t in targets) == 1
    assert sum("omnibal.fused_linear_cross_entropy" in t for t in targets) == 1
    assert not any("cross_entropy_loss" in t or "pow" in t or "silu" in t for t in targets)
    torch.testing.assert_close(ep.module()(x, labels), block(x, labels))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.rms_norm(torch.randn(2, 4), torch.ones(4), backend="cuda")


def test_missing_backend_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(ops.MissingBackendError, match=r"pip install 'omnibal-compile\[triton\]'"):
        ops.require_triton()
    # Asked for by name, a missing backend is an error, never the eager path in its place.
    assert not ops.triton_runs_on("cpu")
    x, w = torch.randn(3, 8), torch.rand(8)
    with pytest.raises(ops.MissingBackendError, match="triton is not installed"):
        K.rms_norm(x, w, backend="triton")
    torch.testing.assert_close(K.rms_norm(x, w, backend="eager"), R.rms_norm(x, w, 1e-6))


def test_package_works_without_the_optional_backend():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail, find_spec return None
        "import torch\n"
        "from omnibal_compile import kernels as K\n"
        "assert not K.triton_available()\n"
        "x, w = torch.randn(3, 8), torch.rand(8)\n"
        "y = K.rms_norm(x, w, backend='eager')\n"
        "try:\n"
        "    K.rms_norm(x, w, backend='triton')\n"
        "except K.MissingBackendError as e:\n"
        "    print('hint:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'omnibal-compile[triton]'" in out.stdout


@needs_triton
def test_triton_path_is_taken(monkeypatch):
    calls = []
    real = triton_impl.rms_norm_fwd
    monkeypatch.setattr(triton_impl, "rms_norm_fwd", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    K.rms_norm(x, w, backend="triton")
    K.rms_norm(x, w, backend="eager")
    assert calls == [1]


@pytest.mark.skipif(triton_impl is not None or not ops.triton_available(), reason="runs them itself, or no triton")
def test_triton_cases_in_interpreter():
    run_triton_cases_in_child(__file__)


def test_live_bytes_measures_the_fused_loss_below_the_unfused_one():
    from omnibal_compile.kernels import bench

    m = bench.loss_memory(torch.device("cpu"), torch.float32, tokens=256, hidden=32, vocab=8192, backend="eager")
    logits = 256 * 8192 * 4
    assert m.unfused_peak >= 2 * logits  # logits and their gradient at least
    assert m.fused_peak < 0.5 * m.unfused_peak
    meter = bench.LiveBytes()
    with meter:
        a = torch.empty(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view allocates nothing
        del a, b
        c = torch.empty(500)
    assert meter.peak == 4000 and meter.live == 2000
    del c


def test_bench_rows_and_cli_registration():
    from omnibal_compile.cli import build_parser
    from omnibal_compile.kernels import bench

    cpu = torch.device("cpu")
    rows = bench.run_bench(bench.cases(cpu, torch.float32, small=True)[:2], cpu, ["eager"])
    assert [(r.kernel, r.direction) for r in rows] == [
        ("rms_norm", "fwd"), ("rms_norm", "bwd"), ("layer_norm", "fwd"), ("layer_norm", "bwd"),
    ]
    assert all(r.max_error < 1e-4 and r.fused_ms > 0 for r in rows)
    assert "speedup" in bench.format_rows(rows)
    args = build_parser().parse_args(["bench", "kernels", "--dtype", "float32"])
    assert args.target == "kernels" and args.dtype == "float32"


def test_bench_times_liger_as_a_backend_of_the_ops_it_has(monkeypatch):
    """The Liger-Kernel rows (a GPU run with it installed) come from its functions, called as the references are;
    here the references stand in for them, and one that fails is said and left out."""
    from omnibal_compile.kernels import bench
    from omnibal_compile.kernels import reference as R

    cpu = torch.device("cpu")
    case_list = bench.cases(cpu, torch.float32, small=True)[:3]
    monkeypatch.setattr(bench, "liger_functions", lambda: None)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        bench.run_bench(case_list, cpu, ["liger"])

    def broken(g, u):
        raise RuntimeError("an API that changed")

    monkeypatch.setattr(bench, "liger_functions", lambda: {"rms_norm": lambda x, w: R.rms_norm(x, w, 1e-6),
                                                           "swiglu": broken})
    rows = bench.run_bench(case_list, cpu, ["eager", "liger"])
    liger = [(r.kernel, r.direction) for r in rows if r.backend == "liger"]
    assert liger == [("rms_norm", "fwd"), ("rms_norm", "bwd")]  # no layer_norm given, swiglu failed
    assert all(r.max_error == 0 for r in rows if r.backend == "liger")  # the reference itself: exact
    assert len([r for r in rows if r.backend == "eager"]) == 6


@pytest.mark.skipif(IN_INTERPRETER, reason="needs a process whose triton was imported without the interpreter")
def test_interpreter_chosen_too_late_falls_back_to_eager(monkeypatch):
    # conftest imported triton before this variable was set: Triton's library is compiled-mode
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ops.triton_runs_on("cpu")
    x, w = torch.randn(3, 8), torch.rand(8)
    torch.testing.assert_close(K.rms_norm(x, w, backend="triton"), R.rms_norm(x, w, 1e-6))
