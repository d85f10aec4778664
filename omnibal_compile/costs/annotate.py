"""Cost pass: annotate every block with FLOPs, memory and time -> a torch-free :class:`CostTable`.

Glossary:
    block module     the block cut out as a standalone ``GraphModule`` (codegen with one stage per
                     block): its inputs are the values crossing the cut before it, its outputs
                     those crossing the cut after it.
    charged input    a block input produced by an earlier block and read by no later one. If the
                     block keeps it for backward, its bytes are charged to this block. Model inputs
                     (held by the data loader) and skip tensors that travel on (charged to their last
                     reader) are not, so every kept storage is counted once over the chain.
    activation bytes bytes kept alive from a block's forward to its backward (live-storage
                     accounting), per recompute option: ``none``, ``selective`` (matmul and
                     attention outputs kept, the rest recomputed) and ``full`` (inputs only).
    recompute time   ``full``: one more forward; ``selective``: the forward time share of the ops
                     that are rerun (measured per op here, or modelled by the roofline).
    profiled         times measured here (``cpu``/``cuda``): warm-up, repeats, median.
    roofline         times modelled for a target GPU (:mod:`omnibal_compile.costs.devices`): per op the
                     slower of FLOPs / peak and bytes / bandwidth, divided by the op class's
                     calibration; backward = 2 x forward (gradients for inputs and for weights),
                     except fused attention, 2.5 x: its backward recomputes the scores (5 matmuls
                     against the forward's 2). Measured on the ``meta`` device (no weights, no
                     arithmetic) in the training precision's compute dtype, with attention run as
                     the GPU's fused kernel; blocks with the same signature are costed once.
    runtime checks   asserts in the graph (and what feeds only them) are left out when costing.
    precision        bytes per parameter for weights, gradients, fp32 master copy and optimizer
                     states, with optional sharding of the last two over data-parallel ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.compile.blocks import Block, BlockGraph, build_blocks
from omnibal_compile.compile.capture import capture, normalize_example_inputs, scalar_to_differentiate
from omnibal_compile.compile.codegen import generate_stages, stage_info
from omnibal_compile.compile.recompute_policy import with_recompute
from omnibal_compile.costs._cache import CACHE_FORMAT, read_cache, store_in_cache
from omnibal_compile.costs._measure import (
    CLOCKS,
    OpRecord,
    kept_bytes,
    median_time,
    peak_bytes,
    record_ops,
    relative_spread,
    tensor_leaves,
    timed_runs,
)
from omnibal_compile.costs._signature import block_signature
from omnibal_compile.costs.devices import PROFILED_DEVICES, DeviceSpec, get_device
from omnibal_compile.costs.meta import check_only_nodes, check_values_available, costing_graph, drop_checks, model_dtype
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BF16_ADAM, RECOMPUTE_OPTIONS, BlockCost, CostTable, Precision, SharedParameter
from omnibal_compile.ir.plan import Plan
from omnibal_compile.progress import track

__all__ = [
    "CPU_LINK_BANDWIDTH",
    "CACHE_FORMAT",
    "annotate_costs",
    "profile_costs",
    "shared_parameters",
    "block_modules",
    "block_inputs",
    "charged_inputs",
    "measured_activation_bytes",
    "measured_step_time",
]

COST_MODEL = 3
"""Version of what a cost table measures, part of every cache key (2: ``workspace_bytes``; 3: ``peak_bytes``)."""

CPU_LINK_BANDWIDTH = 5e9
"""Bytes/s assumed between pipeline stages on CPU (gloo over shared memory; override per call)."""

T = TypeVar("T")


# -- helpers -------------------------------------------------------------------------------------


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Pin intra-op threads while timing: shared machines make multi-threaded timings noisy."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _check_inputs(names: Sequence[str], values: Iterable[Any]) -> None:
    for name, v in zip(names, values):
        if isinstance(v, torch.Tensor) and v.numel() == 0:
            raise InputError(
                f"example input '{name}' has shape {tuple(v.shape)} with a zero-size dimension; costs need a "
                "non-empty batch: give at least one element along every dimension"
            )


def block_modules(graph: BlockGraph, model: nn.Module | None = None) -> tuple[fx.GraphModule, ...]:
    """One standalone module per block (codegen with a stage per block); they share the model's parameters.

    Runtime checks are left out (:mod:`~omnibal_compile.costs.meta`): they cost nothing and read
    values that ``meta`` tensors do not have. A value that stages rebuild (attention masks) is a block input
    here, charged to its last reader as a sent one is: a stage holds one copy of it per micro-batch, whichever
    of its blocks read it, as it held the one it received (its rebuild costs next to nothing).
    """
    plan = Plan(block_names=graph.names, boundaries=tuple(range(graph.num_blocks + 1)))
    modules = generate_stages(graph.sending_all(), plan, model)
    checks = check_only_nodes(graph.captured.graph_module.graph)
    for m in modules:
        drop_checks(m, checks)
    return modules


def block_inputs(graph: BlockGraph, modules: Sequence[fx.GraphModule]) -> list[tuple[Any, ...]]:
    """Each block's example inputs: leaves that require grad exactly where the real chain's values do."""
    ph = [n.name for n in graph.captured.graph_module.graph.nodes if n.op == "placeholder"]
    vals: dict[str, Any] = dict(zip(ph, graph.captured.example_flat_inputs))
    result: list[tuple[Any, ...]] = []
    with torch.enable_grad():
        for m in modules:
            info = stage_info(m)
            ins = tuple(vals[n] for n in info.input_names)
            result.append(ins)
            if info.is_last:
                break
            outs = m(*ins)
            for name, o in zip(info.output_names, outs):
                vals[name] = o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor) else o
    return result


def charged_inputs(graph: BlockGraph, k: int, input_names: Sequence[str]) -> list[bool]:
    """For each input of block ``k``, whether its bytes are charged to the block (see the glossary)."""
    values = {v.name: v for v in graph.values}
    return [n in values and values[n].producer >= 0 and values[n].last_use == k for n in input_names]


def _backward_args(outs: Any, wrt: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    diff = [t for t in tensor_leaves(outs) if t.requires_grad]
    if not diff or not wrt:
        return None
    return diff, [torch.ones_like(t) for t in diff]


@dataclass(frozen=True, kw_only=True)
class _Timing:
    forward_s: float
    backward_s: float
    selective_s: float
    weight_s: float = 0.0
    """W, the weight-gradient part of ``backward_s``."""
    spread: float = 0.0


PROFILE_ROUNDS = 3
"""Rounds the timed repeats are spread over, every distinct block once per round, so that a slow
spell of a shared machine falls on all blocks alike instead of on whichever was being timed."""


class _Profile:
    """Timed forward and backward runs of one block, collected over rounds."""

    def __init__(
        self, m: fx.GraphModule, inputs: Sequence[Any], records: Sequence[Any], *, cuda: bool, clock: str
    ) -> None:
        self.m, self.inputs, self.records, self.cuda, self.clock = m, inputs, records, cuda, clock
        self.inputs_wrt: list[torch.Tensor] = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        self.params_wrt: list[torch.Tensor] = [p for p in m.parameters() if p.requires_grad]
        self.wrt = self.inputs_wrt + self.params_wrt
        self.has_backward = _backward_args(self._forward(None), self.wrt) is not None
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.bin: list[float] = []  # the input-gradient part alone (B)
        self.rerun: list[float] = [_rerun_share(records)]

    def _forward(self, _: Any) -> Any:
        with torch.enable_grad():
            return self.m(*self.inputs)

    def run(self, *, warmup: int, repeats: int) -> None:
        kw: dict[str, Any] = {"warmup": warmup, "repeats": repeats, "cuda": self.cuda, "clock": self.clock}
        self.fwd += timed_runs(self._forward, **kw)
        for _ in range(repeats):  # the selective share is timed per op: as many samples, their median kept
            records, _ = record_ops(
                self.m, self.inputs, sync=torch.cuda.synchronize if self.cuda else None, clock=self.clock
            )
            self.rerun.append(_rerun_share(records))
        if self.has_backward:
            self.bwd += timed_runs(
                lambda st: torch.autograd.grad(st[0], self.wrt, st[1], allow_unused=True),
                setup=lambda: _backward_args(self._forward(None), self.wrt),
                **kw,
            )
            if self.inputs_wrt and self.params_wrt:  # B alone; autograd skips the weight-gradient branches
                self.bin += timed_runs(
                    lambda st: torch.autograd.grad(st[0], self.inputs_wrt, st[1], allow_unused=True),
                    setup=lambda: _backward_args(self._forward(None), self.inputs_wrt),
                    **kw,
                )

    def timing(self) -> _Timing:
        fwd = statistics.median(self.fwd)
        bwd = statistics.median(self.bwd) if self.bwd else 0.0
        # W = the whole backward less B, so that B + W is the backward timed; no trained parameter: W = 0; no input
        # needing a gradient: the backward is all W
        if not self.params_wrt:
            weight = 0.0
        elif not self.inputs_wrt:
            weight = bwd
        else:
            weight = max(0.0, bwd - statistics.median(self.bin))
        spread = max(relative_spread(self.fwd), relative_spread(self.bwd))
        return _Timing(forward_s=fwd, backward_s=bwd, selective_s=fwd * statistics.median(self.rerun),
                       weight_s=weight if self.has_backward else 0.0, spread=spread)


def _rerun_share(records: Sequence[OpRecord]) -> float:
    """Share of a forward's op time in the ops selective recomputation reruns (``memory`` ops)."""
    total = sum(r.seconds for r in records)
    return sum(r.seconds for r in records if r.op_class == "memory") / total if total > 0 else 0.0


ATTENTION_BACKWARD = 2.5
"""Fused attention's backward over its forward: 5 matmuls (the scores recomputed) against 2."""


def _roofline_times(records: Sequence[OpRecord], spec: DeviceSpec, *, frozen: float = 0.0,
                    backward: bool = True) -> _Timing:
    """Roofline times; ``frozen``: the share of the block's parameters that are frozen (no weight gradients: the
    backward loses that share of its matmuls' forward time); ``backward=False``: nothing needs a gradient here."""
    fwd = sum(spec.op_time(r.op_class, r.flops, r.nbytes) for r in records)
    attention = sum(spec.op_time(r.op_class, r.flops, r.nbytes) for r in records if r.op_class == "attention")
    matmul = sum(spec.op_time(r.op_class, r.flops, r.nbytes) for r in records if r.op_class == "matmul")
    rerun = sum(spec.op_time(r.op_class, r.flops, r.nbytes) for r in records if r.op_class == "memory")
    bwd = 2 * fwd + (ATTENTION_BACKWARD - 2) * attention - frozen * matmul if backward else 0.0
    # a matmul's backward is two matmuls of its forward's size, one for the input's gradient (B), one for the
    # weight's (W): W is the trained share of the matmul time
    weight = min(max(0.0, bwd), (1 - frozen) * matmul) if backward else 0.0
    return _Timing(forward_s=fwd, backward_s=max(0.0, bwd), selective_s=rerun, weight_s=weight)


def _frozen_share(m: nn.Module) -> float:
    """Share of the block's parameter elements that are frozen (``requires_grad=False``)."""
    params = list(m.parameters())
    total = sum(p.numel() for p in params)
    return sum(p.numel() for p in params if not p.requires_grad) / total if total else 0.0


def _needs_backward(m: nn.Module, inputs: Sequence[Any]) -> bool:
    """Whether a backward runs through the block: an input or a parameter of it requires grad."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs) or any(
        p.requires_grad for p in m.parameters())


def attention_kernel(records: Sequence[OpRecord]) -> str:
    """The attention kernel a GPU runs for these ops, in words (the cost table's ``attention``)."""
    fused = [r for r in records if r.name == "scaled_dot_product_attention"]
    if fused:
        kinds = sorted({"memory-efficient (masked)" if r.masked else "flash" for r in fused})
        return " and ".join(kinds) + " attention: no score matrix kept, its backward recomputes the scores"
    if any("softmax" in r.name for r in records):
        return ("as traced: matmuls and a softmax, the score matrix kept for backward (build the model with "
                "scaled_dot_product_attention, e.g. attn_implementation='sdpa', to cost a fused kernel)")
    return "none"


def _roofline_blocks(
    graph: BlockGraph, modules: Sequence[fx.GraphModule], all_inputs: Sequence[Sequence[Any]], spec: DeviceSpec,
    precision: Precision, *, progress: bool,
) -> tuple[list[BlockCost], str]:
    """Roofline costs of every block, each distinct block signature costed once; and the attention kernel."""
    done: dict[tuple[str, tuple[bool, ...], float, bool], tuple[float, _Timing, _Memory, str]] = {}
    records_all: list[OpRecord] = []
    blocks: list[BlockCost] = []
    for k in track(range(graph.num_blocks), f"costing blocks for {spec.name}", enabled=progress):
        m, inputs, block = modules[k], all_inputs[k], graph.blocks[k]
        charged = charged_inputs(graph, k, stage_info(m).input_names)
        signature = block_signature(m, inputs)
        frozen, backward = _frozen_share(m), _needs_backward(m, inputs)
        # the bytes kept depend on which inputs are charged to the block; the backward on what trains
        key = (signature, tuple(charged), frozen, backward)
        if key not in done:
            records, counted = record_ops(m, inputs)
            records_all += records
            done[key] = (float(counted), _roofline_times(records, spec, frozen=frozen, backward=backward),
                         _memory(m, inputs, charged), block.name)
        flops, timing, memory, first = done[key]
        blocks.append(_block_cost(block, precision, flops, timing, memory, signature=signature,
                                  profiled_as="" if first == block.name else first, frozen=_frozen_params(m, block)))
    return blocks, attention_kernel(records_all)


def shared_parameters(graph: BlockGraph) -> tuple[SharedParameter, ...]:
    """The parameters of ``graph``'s captured model that several blocks read (tied weights), in block order."""
    gm = graph.captured.graph_module
    readers: dict[str, list[int]] = {}
    for b in graph.blocks:
        for target in b.params:
            readers.setdefault(target, []).append(b.index)
    found = []
    for target, on in readers.items():
        if len(on) < 2:
            continue
        try:
            p = gm.get_parameter(target)
        except AttributeError:  # a buffer or constant
            continue
        found.append(SharedParameter(name=target, blocks=tuple(sorted(set(on))), numel=p.numel(),
                                     frozen=not p.requires_grad))
    return tuple(sorted(found, key=lambda sp: (sp.blocks, sp.name)))


def _training_tag(m: nn.Module, inputs: Sequence[Any]) -> str:
    """"" when every parameter trains; else which parameters and inputs need gradients (for the signature)."""
    if all(p.requires_grad for p in m.parameters()):
        return ""
    grads = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
    return f":frozen{[p.requires_grad for p in m.parameters()]}{grads}"


def _frozen_params(m: nn.Module, block: Block) -> int:
    """Frozen parameter elements the block reads (at most its ``num_params``)."""
    return min(block.num_params, sum(p.numel() for p in m.parameters() if not p.requires_grad))


_Memory = tuple[dict[str, int], int, dict[str, int]]
"""(kept bytes per option, workspace bytes, peak bytes per option) of one block."""


def _memory(m: fx.GraphModule, inputs: Sequence[Any], charged: Sequence[bool]) -> _Memory:
    """Bytes kept for backward per recompute option, the block's peak under each, and its workspace."""
    activation = {opt: kept_bytes(with_recompute(m, opt), inputs, charged) for opt in RECOMPUTE_OPTIONS}
    params = [p for p in m.parameters() if p.requires_grad]
    # A recomputing block rebuilds its activations before the same backward, so its peak is the
    # plain block's (measured on CPU: equal under full, within 1 MiB of 40 under selective); beyond
    # what it keeps, that is the most for the option keeping the least.
    plain = peak_bytes(m, inputs, charged, params)
    peak = {opt: max(plain, kept) for opt, kept in activation.items()}
    return activation, max(0, plain - min(activation.values())), peak


def _block_cost(
    block: Block, precision: Precision, flops: float, timing: _Timing, memory: _Memory,
    *, signature: str = "", profiled_as: str = "", frozen: int = 0,
) -> BlockCost:
    """``frozen``: parameter elements of the block with ``requires_grad=False``: their weights only are static."""
    activation, workspace, peak = memory
    return BlockCost(
        name=block.name,
        kind=block.kind,
        flops=flops,
        num_params=block.num_params,
        static_bytes=round((block.num_params - frozen) * precision.bytes_per_param
                           + frozen * precision.frozen_bytes_per_param),
        frozen_params=frozen,
        forward_s=timing.forward_s,
        backward_s=timing.backward_s,
        weight_grad_s=timing.weight_s,
        activation_bytes=activation,
        recompute_s={"none": 0.0, "selective": timing.selective_s, "full": timing.forward_s},
        workspace_bytes=workspace,
        peak_bytes=peak,
        signature=signature,
        profiled_as=profiled_as,
        time_spread=timing.spread,
    )


def _on_meta(model: nn.Module, flat_inputs: Sequence[Any]) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *(x for x in flat_inputs if isinstance(x, torch.Tensor))]
    return any(t.is_meta for t in tensors)


# -- cache ---------------------------------------------------------------------------------------


def _cache_key(graph: BlockGraph, model: nn.Module, device: str, settings: Mapping[str, Any]) -> str:
    """Hash of the model structure (graph code, blocks, parameter shapes), inputs, device and settings."""
    h = hashlib.sha256()
    h.update(graph.captured.graph_module.code.encode())
    h.update(repr([(b.name, b.kind, len(b.nodes)) for b in graph.blocks]).encode())
    h.update(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]).encode())
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:  # keys of tables without frozen parameters stay as they were
        h.update(repr(("frozen", frozen)).encode())
    h.update(
        repr([
            (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
            for x in graph.captured.example_flat_inputs
        ]).encode()
    )
    h.update(json.dumps({"device": device, "torch": torch.__version__, "cost_model": COST_MODEL, **settings},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


# -- the pass ------------------------------------------------------------------------------------


def annotate_costs(
    graph: BlockGraph,
    model: nn.Module,
    *,
    device: str | DeviceSpec = "cpu",
    precision: Precision = BF16_ADAM,
    link: str = "nvlink",
    link_bandwidth: float | None = None,
    warmup: int = 2,
    repeats: int = 9,
    threads: int | None = 1,
    clock: str = "auto",
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    batch_shape: Mapping[str, int] | None = None,
    progress: bool = False,
) -> CostTable:
    """Costs of every block of ``graph`` for one micro-batch shaped like the captured example.

    Args:
        graph: blocks of the captured model (:func:`build_blocks`).
        model: the model the graph was captured from (parameters are shared, never modified).
        device: ``"cpu"``/``"cuda"`` profile on this machine (the model and example inputs must be
            there); a target name (``"a100-80gb"``, ``"h100-80gb"``, ``"h200"``) or a
            :class:`DeviceSpec` use the roofline model. Memory is measured in both cases.
        precision: bytes per parameter for :attr:`BlockCost.static_bytes`.
        link: ``"nvlink"`` or ``"infiniband"`` between stages (roofline targets).
        link_bandwidth: bytes/s between stages, overriding the device's.
        warmup, repeats: untimed and timed runs per measurement (the median is kept, the spread
            reported in :attr:`BlockCost.time_spread`). Blocks with the same
            :func:`~omnibal_compile.costs._signature.block_signature` (every layer of a stack) are
            timed once and share the figures (:attr:`BlockCost.profiled_as`), so the repeats go to
            the distinct blocks only.
        threads: intra-op threads while profiling (None: leave as is).
        clock: CPU timer: ``"wall"`` (perf_counter), ``"thread"`` (CPU time of this thread, steady
            on a shared machine; exact only with one thread), or ``"auto"`` (default): ``thread``
            when ``threads == 1``, else ``wall``. CUDA always times with events.
        cache: JSON file of profiled tables keyed by model structure, inputs, device and settings
            (:mod:`~omnibal_compile.costs._cache`: shared safely by processes; a file that is
            not a cost cache is an error, never overwritten).
        refresh: ignore (and overwrite) a cached entry.
        batch_shape: recorded in the table (e.g. ``{"tiles": 4, "text_tokens": 256}``).
        progress: show progress (:mod:`omnibal_compile.progress`).
    """
    name = device.name if isinstance(device, DeviceSpec) else str(device).strip().lower()
    spec = None if name in PROFILED_DEVICES else get_device(device)
    name = spec.name if spec is not None else name  # canonical, so aliases share cache entries
    if clock == "auto":
        clock = "thread" if threads == 1 else "wall"
    if clock not in CLOCKS:
        raise InputError(f"clock must be 'auto' or one of {list(CLOCKS)}, got {clock!r}")
    if warmup < 0 or repeats < 1:
        raise InputError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    ph = [n.name for n in graph.captured.graph_module.graph.nodes if n.op == "placeholder"]
    _check_inputs(ph, graph.captured.example_flat_inputs)
    cuda = name == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise InputError("device='cuda' needs a CUDA GPU; none is available here. Use 'cpu' or a roofline target")
        if any(not p.is_cuda for p in model.parameters()):
            raise InputError(
                "device='cuda' profiles where the model lives: move the model and example inputs to CUDA first"
            )
    if link_bandwidth is None:
        link_bandwidth = spec.link_bandwidth(link) if spec is not None else CPU_LINK_BANDWIDTH
    settings = {
        "precision": asdict(precision), "warmup": warmup, "repeats": repeats, "threads": threads, "clock": clock,
        "link_bandwidth": link_bandwidth, "batch_shape": dict(batch_shape or {}),
        "calibration": dict(spec.calibration) if spec else None,
    }
    path = Path(cache) if cache is not None else None
    shared = shared_parameters(graph)
    key = _cache_key(graph, model, name, settings) if path else ""
    entries = read_cache(path) if path else {}  # InputError now, before profiling, when it is not a cache of ours
    if path and not refresh and key in entries:
        try:
            # entries predating the fields: the precision asked for; the shared parameters, read from the graph
            return CostTable.from_dict({**entries[key], "precision": asdict(precision),
                                        "shared": [asdict(sp) for sp in shared]})
        except (TypeError, ValueError, KeyError) as e:
            warnings.warn(f"cost cache {path}: entry is malformed ({e}); profiling again", stacklevel=2)

    if spec is None and _on_meta(model, graph.captured.example_flat_inputs):
        raise InputError(
            "the model or its example inputs are on the meta device, which has no values to time: profile a real "
            "model, or cost it for a target GPU (device='a100-80gb', 'h100-80gb', 'h200' or a DeviceSpec)"
        )
    if spec is not None:  # measure on meta in the training precision, whatever the model was built in
        graph, model = costing_graph(graph, model, precision.compute_dtype)
        activation_dtype = precision.compute_dtype
    else:
        activation_dtype = str(model_dtype(model) or torch.get_default_dtype()).removeprefix("torch.")
    check_values_available(graph.captured.graph_module, graph.captured.example_flat_inputs)
    modules = block_modules(graph, model)
    sync = torch.cuda.synchronize if cuda else None
    blocks: list[BlockCost] = []
    # One measurement per signature: identical layers get identical figures instead of each its
    # own noise. Activation bytes are exact and depend on which inputs the block is charged for,
    # so every block gets its own.
    first_of: dict[str, int] = {}
    flops_of: dict[str, float] = {}
    profiles: dict[str, _Profile] = {}
    timings: dict[str, _Timing] = {}
    rows: list[tuple[str, str, _Memory]] = []  # (signature, block timed for it, its memory)
    frozen_of: dict[str, int] = {}
    with _threads(threads if not cuda else None):
        all_inputs = block_inputs(graph, modules)
        if spec is not None:
            blocks, attention = _roofline_blocks(graph, modules, all_inputs, spec, precision, progress=progress)
        else:
            attention = f"as run on {name}"
            for k in track(range(graph.num_blocks), f"costing blocks on {name}", enabled=progress):
                m, inputs = modules[k], all_inputs[k]
                charged = charged_inputs(graph, k, stage_info(m).input_names)
                # what trains decides the backward: a frozen copy of a layer is timed on its own
                signature = block_signature(m, inputs) + _training_tag(m, inputs)
                frozen_of[graph.blocks[k].name] = _frozen_params(m, graph.blocks[k])
                if signature not in first_of:
                    first_of[signature] = k
                    records, flops_of[signature] = record_ops(m, inputs, sync=sync, clock=clock)
                    profiles[signature] = _Profile(m, inputs, records, cuda=cuda, clock=clock)
                rows.append((signature, graph.blocks[first_of[signature]].name, _memory(m, inputs, charged)))
            per_round = -(-repeats // PROFILE_ROUNDS)
            for r in track(
                range(PROFILE_ROUNDS), f"timing {len(profiles)} distinct blocks", enabled=progress and bool(profiles)
            ):
                for prof in profiles.values():
                    prof.run(warmup=warmup if r == 0 else 1, repeats=min(per_round, repeats - r * per_round) or 1)
            timings = {sig: prof.timing() for sig, prof in profiles.items()}
            for block, (signature, timed, memory) in zip(graph.blocks, rows):
                blocks.append(_block_cost(block, precision, flops_of[signature], timings[signature], memory,
                                          signature=signature, profiled_as="" if timed == block.name else timed,
                                          frozen=frozen_of[block.name]))
    n = graph.num_blocks
    table = CostTable(
        blocks=tuple(blocks),
        cut_bytes=(0, *(graph.cut_bytes(k) for k in range(1, n)), 0),
        link_bandwidth=link_bandwidth,
        device=name,
        source="roofline" if spec is not None else "profiled",
        batch_shape=dict(batch_shape or {}),
        precision=precision,
        activation_dtype=activation_dtype,
        attention=attention,
        shared=shared,
    )
    if path:
        try:
            store_in_cache(path, key, json.loads(table.to_json()))
        except OSError as e:
            warnings.warn(
                f"cost cache {path} could not be written ({e}); the costs were measured but not cached", stacklevel=2
            )
    return table


def profile_costs(
    model: nn.Module,
    example_inputs: Any,
    *,
    block_prefixes: Sequence[str] | None = None,
    **kwargs: Any,
) -> CostTable:
    """Capture ``model`` on ``example_inputs``, build its blocks and :func:`annotate_costs` them."""
    graph = build_blocks(capture(model, example_inputs), model, block_prefixes=block_prefixes)
    return annotate_costs(graph, model, **kwargs)


# -- ground truth for the accuracy checks ---------------------------------------------------------


def measured_activation_bytes(graph: BlockGraph, model: nn.Module, option: str) -> int:
    """Bytes kept for backward by the whole chain run at once with every block under ``option``.

    The reference the per-block figures are checked against: one forward over all blocks, then the
    live storages the autograd graph of the output holds.
    """
    if option not in RECOMPUTE_OPTIONS:
        raise InputError(f"unknown recompute option {option!r}; use one of {list(RECOMPUTE_OPTIONS)}")
    fns: list[Callable[..., Any]] = [with_recompute(m, option) for m in block_modules(graph, model)]

    def chain(*values: Any) -> Any:
        for fn in fns:
            values = fn(*values)
        return values

    inputs = graph.captured.example_flat_inputs
    return kept_bytes(chain, inputs, [False] * len(inputs))  # model inputs are held by the data loader


def measured_step_time(
    model: nn.Module,
    example_inputs: Any,
    *,
    warmup: int = 1,
    repeats: int = 5,
    threads: int | None = 1,
    clock: str = "wall",
) -> float:
    """Median seconds of one forward + backward of the unsplit model (gradients of every parameter)."""
    args, kwargs = normalize_example_inputs(example_inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = any(p.is_cuda for p in params)

    def step(_: Any) -> None:
        with torch.enable_grad():
            loss = scalar_to_differentiate(pytree.tree_leaves(model(*args, **kwargs)))
            torch.autograd.grad(loss, params, allow_unused=True)

    with _threads(threads if not cuda else None):
        return median_time(step, warmup=warmup, repeats=repeats, cuda=cuda, clock=clock)
