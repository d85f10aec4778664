"""Tensor-parallel pass: Megatron column/row pairs found in a generated stage's blocks, sharded with DTensor.

Glossary:
    pair        one or more linear layers sharded column-wise (output features split over ``tp``:
                attention q/k/v, MLP gate/up) whose outputs reach exactly one linear layer sharded
                row-wise (input features split: attention out, MLP down), within one block, through
                ops that keep each rank's part independent (heads, elementwise ops). Forward: the
                column layers take the replicated input, the row layer all-reduces its partial
                output; backward: the column layers all-reduce their input gradient. DTensor's
                ``ColwiseParallel`` / ``RowwiseParallel`` do both, with local (plain tensor)
                outputs, so the ops between them run on each rank's shard as ordinary tensors.
    local shape a captured graph bakes in global sizes (``view(b, t, 4, 8)``: 4 heads of 8). The pass
                follows the sharded dimension from the column outputs to the row input, op by op,
                and rewrites the constant that counts heads (4 -> 4 / tp) in views, reshapes and
                expands; ``-1`` sizes are left alone. An op it has no rule for, a shard that would
                cut across a fused projection (q, k and v in one weight) or across a head, or a
                sharded value read outside the pair: the pair stays replicated, with the reason.
    vocab       vocabulary-parallel parts (:class:`VocabParallelPart`), each rank holding ``V / tp`` rows of
                a ``V x H`` weight. The LM head: a linear layer whose logits reach a cross-entropy loss
                through slices, views and casts; ``ColwiseParallel(use_local_output=False)`` keeps its
                logits a DTensor sharded on the vocabulary, and the loss runs on the shards under
                torch's ``loss_parallel()`` (per-shard max and sum of exponentials, and the target's logit,
                all-reduced over ``tp``; the runtime enters it around forward and backward,
                :data:`LOSS_PARALLEL`); the scalar loss leaves as a plain tensor. Any other reader of the
                logits (a model that also returns them) gets them gathered whole. The token embedding: an
                ``embedding`` of a model input, ``RowwiseParallel(input_layouts=Replicate())``: each rank
                looks up the ids in its rows (zeros elsewhere) and the output is all-reduced whole, so
                what follows (the VLM's image-token merge) sees the whole embedding output; a padding
                index (``padding_idx``) is kept by passing no gradient from the positions holding it. A weight
                tied to another (embedding and head) stays replicated: tied copies on other pipeline
                ranks sum whole gradients.
    sequence    with ``sequence_parallel`` (off by default), a region (:class:`SequenceRegion`): the values grown
                forward from the sharded pairs' row-wise outputs of shape ``[batch, sequence, hidden]``
                (sequence divisible by tp) through token-wise ops (elementwise ops, residual adds, casts,
                RMSNorm's mean over the hidden dim, ``layer_norm``, dropout), each rank holding its 1 / tp of
                the sequence, Megatron's sequence parallelism. Its rows run ``RowwiseParallel(output_layouts=
                Shard(1))`` (a reduce-scatter, not an all-reduce); each value the column-wise layers (or the
                vocabulary-parallel head) read is all-gathered once into a replicated DTensor they share, so
                their input gradients are summed and reduce-scattered once (q, k and v: one, not three
                all-reduces). A whole value it reads with the full sequence (the residual stream entering it) is
                split to this rank's shard (its gradient all-gathered); a whole tensor it reads broadcast over
                the sequence (a norm weight) has its gradient all-reduced over tp, each rank having summed only
                its tokens. A stage output it computes is all-gathered whole, so pipeline cuts are unchanged.
                A region that any other op reads (a linear layer not sharded, a reshape across tokens), or that
                reaches no column-wise layer, stays whole with the reason: the ViT (its fused q, k, v stay
                replicated) and the projector (its tokens are merged into the text) stay whole.
    whole read  a whole value a pair's shards read that carries a gradient (a per-head norm's weight):
                each rank's gradient covers its heads only, so the backward all-reduces it over ``tp``.
    replicated  every parameter outside a pair or a vocab part (norms, refused parts): a whole copy on
                each ``tp`` rank, with whole gradients (without sequence parallelism every rank computes the
                same replicated activations; with it, norm weights read by shards sum their gradients).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn

from omnibal_compile._utils.tables import counted, format_table
from omnibal_compile.compile.blocks import BlockGraph
from omnibal_compile.compile.codegen import _META_KEY, stage_info
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import TensorParallelBlock

__all__ = ["LOSS_PARALLEL", "SequenceRegion", "TensorParallelPair", "TensorParallelReport", "VocabParallelPart",
           "find_pairs", "tensor_parallel_stage"]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class TensorParallelPair:
    """One Megatron pair of a block, or a candidate the pass refused."""

    block: str
    """Block it lies in."""
    column: tuple[str, ...]
    """Module paths of the linear layers sharded column-wise."""
    row: str
    """Module path of the linear layer sharded row-wise."""
    reason: str = ""
    """Why it stays replicated; empty when it is sharded."""
    params: int = 0
    """Parameter elements of its linear layers (0 when refused)."""
    flops: float = 0.0
    """Forward FLOPs each rank runs on its shard only: its linear layers and the matmuls and attention between them
    (``torch.utils.flop_counter``'s formulas; 0 when refused)."""
    forward_bytes: int = 0
    """Bytes of the row-wise layer's output, which the forward all-reduces (0 when refused)."""
    backward_bytes: int = 0
    """Bytes of the column-wise layers' inputs, whose gradients the backward all-reduces, one per layer, and of the
    whole values its shards read that carry gradients (0 when refused)."""
    whole_reads: int = 0
    """Whole values its shards read that carry gradients (a per-head norm's weight): the backward all-reduces each
    one's gradient, which every rank computes from its heads only."""

    @property
    def sharded(self) -> bool:
        return not self.reason


@dataclass(frozen=True, kw_only=True)
class VocabParallelPart:
    """A vocabulary-parallel LM head or token embedding of a block (module glossary), or a candidate refused."""

    block: str
    """Block it lies in."""
    module: str
    """Module path of the layer (its weight is ``V x H``, sharded on ``V``)."""
    kind: str
    """``head`` (linear layer feeding a cross-entropy loss) or ``embedding`` (token ids -> hidden states)."""
    reason: str = ""
    """Why it stays replicated; empty when it is sharded."""
    params: int = 0
    """Parameter elements of the layer, whole (each rank holds 1 / tp; 0 when refused)."""
    flops: float = 0.0
    """Forward FLOPs split over the ranks: the head's matmul (0 for an embedding, a lookup; 0 when refused)."""
    forward_bytes: int = 0
    """Bytes the forward all-reduces: the embedding's output; the head's loss reduces 3 floats per token (its
    max, its sum of exponentials and its target logit)."""
    backward_bytes: int = 0
    """Bytes the backward all-reduces: the head's input gradient (0 for an embedding)."""
    gathered_bytes: int = 0
    """Bytes of logits all-gathered whole for readers other than the loss (a model that returns its logits)."""

    @property
    def sharded(self) -> bool:
        return not self.reason


LOSS_PARALLEL = "head"
""":attr:`VocabParallelPart.kind` whose stage must run forward and backward under ``loss_parallel()``."""


SEQ_DIM = 1
"""The sequence dim of the ``[batch, sequence, hidden]`` values a sequence-parallel region splits."""


@dataclass(frozen=True, kw_only=True)
class SequenceRegion:
    """Token-wise ops between row-wise outputs and the column-wise inputs they reach, run on each rank's 1 / tp of
    the sequence (module glossary: sequence), or a candidate refused."""

    blocks: tuple[str, ...]
    """Blocks its ops lie in, in graph order."""
    rows: tuple[str, ...]
    """Row-wise layers whose outputs it reduce-scatters on the sequence instead of all-reducing."""
    columns: tuple[str, ...] = ()
    """Column-wise layers (and vocabulary-parallel heads) that read it all-gathered (0 when refused)."""
    column_bytes: tuple[int, ...] = ()
    """Bytes of each column-wise layer's whole input (its gradient is reduce-scattered, not all-reduced)."""
    reason: str = ""
    """Why it stays whole (its rows all-reduce); empty when it runs sequence-parallel."""
    forward: tuple[tuple[str, int], ...] = ()
    """(block, bytes of the whole value) of each reduce-scatter or all-gather its forward issues: one per row, one
    per value the column-wise layers read, one per stage output gathered whole (a pipeline cut)."""
    backward: tuple[tuple[str, int], ...] = ()
    """(block, bytes) of each reduce-scatter or all-gather its backward issues: one per row (the output gradient
    all-gathered), one per value the column layers read (their input gradients reduce-scattered), one per whole
    value split into it (the residual stream entering it: its gradient all-gathered)."""
    reduced: tuple[tuple[str, int], ...] = ()
    """(block, bytes) of each whole tensor it reads broadcast over the sequence (norm weights): the backward
    all-reduces its gradient, summed over the ranks' tokens."""
    shares: tuple[tuple[str, float], ...] = ()
    """(block, share of the bytes of the block's values that are sequence shards): each rank keeps 1 / tp of them."""

    @property
    def sharded(self) -> bool:
        return not self.reason


@dataclass(frozen=True, kw_only=True)
class TensorParallelReport:
    """What :func:`tensor_parallel_stage` sharded in one stage and what it left replicated, and why."""

    tp: int
    """Tensor-parallel degree."""
    pairs: tuple[TensorParallelPair, ...]
    """Every candidate pair, sharded or refused, in graph order."""
    unpaired: tuple[tuple[str, str], ...] = ()
    """(block, reason) of blocks with linear layers but no candidate pair nor vocab part."""
    vocab: tuple[VocabParallelPart, ...] = ()
    """Vocabulary-parallel candidates (LM head, token embedding), sharded or refused."""
    sequence: tuple[SequenceRegion, ...] = ()
    """Sequence-parallel candidate regions, sharded or refused (empty without sequence parallelism)."""

    @property
    def sharded(self) -> tuple[TensorParallelPair, ...]:
        return tuple(p for p in self.pairs if p.sharded)

    @property
    def loss_parallel(self) -> bool:
        """Whether the stage computes its loss on vocabulary shards (it must run under ``loss_parallel()``)."""
        return any(v.sharded and v.kind == LOSS_PARALLEL for v in self.vocab)

    def blocks(self) -> dict[str, TensorParallelBlock]:
        """Per block with a sharded pair or vocabulary part, what the costs need (:func:`omnibal_compile.costs.
        tensor_parallel.tensor_parallel_table`): the sums over its sharded pairs and parts, per micro-batch of the
        traced shape (logits gathered for other readers are not counted). A row of a
        sequence-parallel region reduce-scatters instead of all-reducing, a column layer reading it all-gathered
        has no all-reduce of its own; the region's collectives are counted in its blocks instead."""
        regions = [r for r in self.sequence if r.sharded]
        rows = {row for r in regions for row in r.rows}
        gathered = {c: b for r in regions for c, b in zip(r.columns, r.column_bytes)}
        facts: dict[str, dict[str, Any]] = {}
        for p in self.sharded:
            f = facts.setdefault(p.block, dict.fromkeys(_FACT_FIELDS, 0))
            cols = [c for c in p.column if c not in gathered]
            f["pairs"] += p.row not in rows
            f["forward_bytes"] += 0 if p.row in rows else p.forward_bytes
            f["backward_reduces"] += len(cols) + p.whole_reads
            f["backward_bytes"] += p.backward_bytes - sum(gathered[c] for c in p.column if c in gathered)
            f["params"] += p.params
            f["flops"] += p.flops
        for v in self.vocab:  # the vocabulary-parallel head (its loss: 3 all-reduces) and embedding (1)
            if not v.sharded:
                continue
            f = facts.setdefault(v.block, dict.fromkeys(_FACT_FIELDS, 0))
            f["pairs"] += 3 if v.kind == LOSS_PARALLEL else 1
            f["forward_bytes"] += v.forward_bytes
            f["backward_reduces"] += v.backward_bytes > 0
            f["backward_bytes"] += v.backward_bytes
            f["params"] += v.params
            f["flops"] += v.flops
        for r in regions:
            for field, items in (("sequence_forward", r.forward), ("sequence_backward", r.backward)):
                for block, nbytes in items:
                    f = facts.setdefault(block, dict.fromkeys(_FACT_FIELDS, 0))
                    f[field + "_calls"] += 1
                    f[field + "_bytes"] += nbytes
            for block, nbytes in r.reduced:  # norm weights: their gradients all-reduced
                f = facts.setdefault(block, dict.fromkeys(_FACT_FIELDS, 0))
                f["backward_reduces"] += 1
                f["backward_bytes"] += nbytes
            for block, share in r.shares:
                f = facts.setdefault(block, dict.fromkeys(_FACT_FIELDS, 0))
                f["sequence_share"] += share
        return {b: TensorParallelBlock(**f) for b, f in facts.items()}

    def summary(self) -> str:
        rows = [["block", "column-wise", "row-wise", "tp=" + str(self.tp)]]
        for p in self.pairs:
            rows.append([p.block, ", ".join(_leaf(c, p.block) for c in p.column), _leaf(p.row, p.block),
                         "sharded" if p.sharded else "replicated: " + p.reason])
        rows += [[block, "-", "-", "replicated: " + reason] for block, reason in self.unpaired]
        for v in self.vocab:
            what = "vocabulary-parallel " + ("LM head, loss on the shards" if v.kind == LOSS_PARALLEL else v.kind) \
                + (" (logits gathered for the stage's other readers)" if v.gathered_bytes else "")
            rows.append([v.block, _leaf(v.module, v.block) + f" ({v.kind})", "-",
                         what if v.sharded else "replicated: " + v.reason])
        vocab = sum(v.sharded for v in self.vocab)
        refused = len(self.pairs) - len(self.sharded) + len(self.unpaired) + len(self.vocab) - vocab
        head = f"tensor parallel: {counted(len(self.sharded), 'pair')}" \
               + (f" and {counted(vocab, 'vocabulary-parallel part')}" if vocab else "") \
               + f" sharded, {counted(refused, 'part')} replicated"
        text = head + "\n" + format_table(rows, "llll")
        if self.sequence:
            regions = [r for r in self.sequence if r.sharded]
            text += (f"\nsequence parallel: {counted(len(regions), 'region')} on sequence shards, "
                     f"{counted(len(self.sequence) - len(regions), 'region')} whole")
            rows = [["blocks", "reduce-scattered", "all-gathered", "sequence"]]
            for r in self.sequence:
                span = r.blocks[0] if len(r.blocks) == 1 else f"{r.blocks[0]} .. {r.blocks[-1]}"
                rows.append([span, counted(len(r.rows), "row output"), counted(len(r.columns), "column layer"),
                             "sequence-parallel" if r.sharded else "whole: " + r.reason])
            text += "\n" + format_table(rows, "llll")
        return text


_FACT_FIELDS = ("pairs", "backward_reduces", "params", "flops", "forward_bytes", "backward_bytes",
                "sequence_forward_calls", "sequence_forward_bytes", "sequence_backward_calls",
                "sequence_backward_bytes", "sequence_share")


def _leaf(path: str, block: str) -> str:
    return path.removeprefix(block + ".")


# -- finding pairs ---------------------------------------------------------------------------------
@dataclass
class _Linear:
    node: fx.Node
    owner: str  # module path holding weight (and bias)
    weight: str
    bias: str | None


def _as_linear(node: fx.Node) -> _Linear | None:
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    w, b = args[1], node.kwargs.get("bias", args[2])
    if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and not
                                                                 (isinstance(b, fx.Node) and b.op == "get_attr")):
        return None
    owner, _, leaf = str(w.target).rpartition(".")
    if leaf != "weight" or (b is not None and str(b.target) != owner + ".bias"):
        return None
    return _Linear(node, owner, str(w.target), None if b is None else str(b.target))


def _shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape):
        return tuple(int(s) for s in v.shape)
    return None


class _Refused(Exception):
    pass


_SAME_SHAPE = {aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
               aten.dropout.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _view_dim(src: tuple[int, ...], out: tuple[int, ...], d: int, tp: int, where: str) -> int:
    """The output dim a view of ``src`` (sharded on ``d``) into ``out`` puts the shard on; refuses a view that
    cannot keep each rank's part contiguous."""
    before = math.prod(src[:d])
    acc = 1
    for e, size in enumerate(out):
        if acc == before and size > 1:
            if size % tp:
                raise _Refused(f"{where} splits the sharded size {src[d]} into {out[e:]} whose first dim {size} is "
                               f"not divisible by tp={tp} (a fused projection such as q, k and v in one weight, "
                               "or heads not divisible by tp)")
            if size < src[d] and src[d] % size or size > src[d] and size % src[d]:
                raise _Refused(f"{where} regroups the sharded size {src[d]} as {size}")
            return e
        acc *= size
    raise _Refused(f"{where} moves the sharded size {src[d]} across dims ({src} -> {out})")


def _propagate(region: Sequence[fx.Node], starts: dict[fx.Node, int], tp: int
               ) -> tuple[dict[fx.Node, int], list[tuple[fx.Node, tuple[Any, ...], dict[str, Any]]]]:
    """Sharded dim of every region node, and the (node, args, kwargs) rewrites that make its constants local."""
    sd: dict[fx.Node, int] = dict(starts)
    rewrites: list[tuple[fx.Node, tuple[Any, ...], dict[str, Any]]] = []
    for n in region:
        if n in sd:
            continue
        args: Any = n.args
        t, where = n.target, f"{n.name} ({getattr(n.target, '__name__', n.target)})"
        ins = [a for a in n.all_input_nodes if a in sd]
        out = _shape(n)
        if t is operator.getitem:
            sd[n] = sd[args[0]]
            continue
        x = args[0] if args else None
        src = _shape(x)
        d = sd.get(x) if isinstance(x, fx.Node) else None
        if t is aten._assert_tensor_metadata.default:  # a check of global sizes: keep the dtype/device checks
            rewrites.append((n, args[:1], {k: v for k, v in n.kwargs.items() if k not in ("size", "stride")}))
            sd[n] = 0
            continue
        if t is aten.scaled_dot_product_attention.default:
            q, k, v = args[:3]
            heads = len(_shape(q) or ()) - 3
            if any(sd.get(a) != heads for a in (q, k, v)):
                raise _Refused(f"{where}: q, k and v are not all sharded on their heads dim")
            mask = args[3] if len(args) > 3 else n.kwargs.get("attn_mask")
            ms = _shape(mask)
            if isinstance(mask, fx.Node) and ms is not None and len(ms) > 2 and ms[heads - 4 + len(ms)] != 1:
                raise _Refused(f"{where}: the attention mask has a size per head")
            sd[n] = heads
            continue
        if t is aten.cat.default:
            parts, dim = args[0], args[1] if len(args) > 1 else 0
            first = _shape(parts[0])
            dims = {sd.get(p, -1) for p in parts}
            if len(dims) != 1 or -1 in dims or first is None or _norm_dim(int(dim), len(first)) in dims:
                raise _Refused(f"{where} joins values that are not all sharded alike, or along the shard")
            sd[n] = dims.pop()
            continue
        if d is None or src is None or (out is None and t not in (aten.chunk.default, aten.split.Tensor,
                                                                  aten.unbind.int)):
            raise _Refused(f"{where} reads a sharded value in a way the pass has no rule for")
        if t in _VIEWS:
            shape = list(args[1])
            assert out is not None
            e = _view_dim(src, out, d, tp, where)
            if not isinstance(shape[e], int):
                raise _Refused(f"{where} has a symbolic size on the sharded dim")
            if shape[e] != -1:
                shape[e] //= tp
                rewrites.append((n, (x, shape, *args[2:]), dict(n.kwargs)))
            sd[n] = e
        elif t is aten.transpose.int:
            a, b = (_norm_dim(int(i), len(src)) for i in args[1:3])
            sd[n] = b if d == a else a if d == b else d
        elif t is aten.permute.default:
            sd[n] = [_norm_dim(int(i), len(src)) for i in args[1]].index(d)
        elif t is aten.unsqueeze.default:
            k_ = _norm_dim(int(args[1]), len(src) + 1)
            sd[n] = d + (k_ <= d)
        elif t is aten.expand.default:
            sizes = list(args[1])
            e = d + len(sizes) - len(src)
            if sizes[e] != -1:
                sizes[e] //= tp
                rewrites.append((n, (x, sizes, *args[2:]), dict(n.kwargs)))
            sd[n] = e
        elif t is aten.repeat_interleave.self_int:
            if n.kwargs.get("output_size") is not None:
                raise _Refused(f"{where} names its output size")
            sd[n] = d  # along the heads dim: rank r's kv heads give exactly its query heads' copies
        elif t in (aten.chunk.default, aten.split.Tensor, aten.unbind.int, aten.select.int, aten.slice.Tensor,
                   aten._softmax.default, aten.softmax.int):
            dim = args[2] if t in (aten.chunk.default, aten.split.Tensor) else (args[1] if len(args) > 1 else 0)
            if _norm_dim(int(dim), len(src)) == d:
                raise _Refused(f"{where} works along the sharded dim")
            sd[n] = d - (t in (aten.unbind.int, aten.select.int) and _norm_dim(int(dim), len(src)) < d)
        elif t is aten.matmul.default:
            b_ = args[1]
            if sd.get(b_) != d or d >= len(src) - 2:
                raise _Refused(f"{where} multiplies along the sharded dim")
            sd[n] = d
        elif t in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default):  # a per-head norm's mean square
            axes = cast(Sequence[int] | None, args[1] if len(args) > 1 else n.kwargs.get("dim"))
            keep = bool(args[2] if len(args) > 2 else n.kwargs.get("keepdim", False))
            if not axes:
                raise _Refused(f"{where} reduces over every dim, the sharded one too")
            reduced = {_norm_dim(int(i), len(src)) for i in axes}
            if d in reduced:
                raise _Refused(f"{where} reduces along the sharded dim")
            sd[n] = d if keep else d - sum(i < d for i in reduced)
        elif t in _SAME_SHAPE or torch.Tag.pointwise in getattr(t, "tags", ()):
            assert out is not None
            e = d + len(out) - len(src)
            for inp in n.all_input_nodes:
                s = _shape(inp)
                if inp in ins:
                    if sd[inp] + len(out) - len(s or ()) != e:
                        raise _Refused(f"{where} combines values sharded on different dims")
                elif s is not None and (j := e - len(out) + len(s)) >= 0 and s[j] != 1:
                    raise _Refused(f"{where} combines the shard with a whole value ({inp.name}, shape {s})")
            sd[n] = e
        else:
            raise _Refused(f"{where} reads a sharded value; the pass has no rule for this op")
    return sd, rewrites


@dataclass
class _Found:
    pair: TensorParallelPair
    linears: tuple[_Linear, ...]  # column ones, then the row one
    rewrites: list[tuple[fx.Node, tuple[Any, ...], dict[str, Any]]]
    whole: tuple[tuple[fx.Node, tuple[fx.Node, ...]], ...] = ()  # (whole value carrying gradients, its readers)


def _check_weights(stage: fx.GraphModule, found: Sequence[_Linear], tp: int, used: dict[str, int],
                   param_map: dict[str, tuple[str, ...]], column: bool) -> None:
    for lin in found:
        w = stage.get_parameter(lin.weight)
        if used.get(lin.weight, 0) != 1 or (lin.bias and used.get(lin.bias, 0) != 1):
            raise _Refused(f"{lin.owner}'s weight is read elsewhere in the stage")
        if len(param_map.get(lin.weight, ())) > 1:
            raise _Refused(f"{lin.owner}'s weight is tied to {param_map[lin.weight][1:]}")
        size = w.shape[0] if column else w.shape[1]
        if size % tp:
            raise _Refused(f"{lin.owner} has {size} {'output' if column else 'input'} features, not divisible by "
                           f"tp={tp}")
        owner = stage.get_submodule(lin.owner)
        if list(owner.children()) or {n for n, _ in owner.named_parameters()} - {"weight", "bias"}:
            raise _Refused(f"{lin.owner} holds more than a linear layer's weight and bias")


def _nbytes(node: Any) -> int:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _pair_facts(stage: fx.GraphModule, linears: Sequence[_Linear], inside: Sequence[fx.Node]) -> dict[str, Any]:
    """A sharded pair's :class:`TensorParallelPair` cost fields: parameters, sharded FLOPs, all-reduced bytes."""
    from torch.utils.flop_counter import sdpa_flop_count

    params = sum(stage.get_parameter(t).numel() for lin in linears for t in (lin.weight, lin.bias) if t)
    flops = 0.0
    for lin in linears:
        out = _shape(lin.node)
        flops += 2.0 * math.prod(out or (0,)) * stage.get_parameter(lin.weight).shape[1]
    for n in inside:
        if n.target is aten.scaled_dot_product_attention.default:
            q, k, v = (_shape(a) for a in n.args[:3])
            if q and k and v:
                flops += float(sdpa_flop_count(q, k, v))
        elif n.target is aten.matmul.default and (out := _shape(n)) and (a := _shape(n.args[0])):
            flops += 2.0 * math.prod(out) * a[-1]
    return {"params": params, "flops": flops, "forward_bytes": _nbytes(linears[-1].node),
            "backward_bytes": sum(_nbytes(lin.node.args[0]) for lin in linears[:-1])}


def _graded(stage: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose values can carry gradients: trainable parameters, floating-point stage inputs and what is
    computed from them."""
    out: set[fx.Node] = set()
    for n in stage.graph.nodes:
        if n.op == "get_attr":
            try:
                if stage.get_parameter(str(n.target)).requires_grad:
                    out.add(n)
            except AttributeError:  # a buffer or constant: no gradient
                pass
        elif n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _whole_reads(inside: Sequence[fx.Node], sd: dict[fx.Node, int], graded: set[fx.Node]
                 ) -> tuple[tuple[fx.Node, tuple[fx.Node, ...]], ...]:
    """The whole floating-point values carrying gradients that a pair's sharded nodes read (a per-head norm's
    weight), each with its readers there: every rank's gradient of one covers its own heads only."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    for n in inside:
        if n.target is aten._assert_tensor_metadata.default:
            continue
        for a in n.all_input_nodes:
            val = a.meta.get("val")
            if a not in sd and a in graded and isinstance(val, torch.Tensor) and val.is_floating_point():
                readers.setdefault(a, []).append(n)
    return tuple((a, tuple(r)) for a, r in readers.items())


def find_pairs(stage: fx.GraphModule, graph: BlockGraph, tp: int, *, sequence_parallel: bool = False
               ) -> tuple[list[_Found], TensorParallelReport]:
    """Every candidate pair and vocab part in ``stage``'s blocks, checked for ``tp`` (nothing is changed), and with
    ``sequence_parallel`` the sequence-parallel regions; the pairs to shard and the report."""
    found, _, _, report = _find_all(stage, graph, tp, sequence_parallel)
    return found, report


def _find_all(stage: fx.GraphModule, graph: BlockGraph, tp: int, sequence_parallel: bool = False
              ) -> tuple[list[_Found], list[_VocabFound], list[_SeqFound], TensorParallelReport]:
    if not isinstance(tp, int) or tp < 1:
        raise InputError(f"tp (tensor-parallel degree) must be an integer >= 1, got {tp!r}")
    if not isinstance(sequence_parallel, bool):
        raise InputError(f"sequence_parallel must be true or false, got {sequence_parallel!r}")
    info = stage_info(stage)
    blocks = {b.name: b for b in graph.blocks}
    nodes = {n.name: n for n in stage.graph.nodes}
    order = {n: i for i, n in enumerate(stage.graph.nodes)}
    graded = _graded(stage)
    used: dict[str, int] = {}
    for n in stage.graph.nodes:
        if n.op == "get_attr":
            used[str(n.target)] = used.get(str(n.target), 0) + len(n.users)
    found: list[_Found] = []
    vocab: list[_VocabFound] = []
    pairs: list[TensorParallelPair] = []
    unpaired: list[tuple[str, str]] = []
    taken: set[fx.Node] = set()
    for name in info.blocks:
        mine = {nodes[m] for m in blocks[name].nodes if m in nodes}
        linears = {n: lin for n in sorted(mine, key=order.__getitem__) if (lin := _as_linear(n)) is not None}
        candidates = 0
        for node, row in linears.items():
            x = node.args[0]
            if not isinstance(x, fx.Node):
                continue
            back: set[fx.Node] = set()
            cols: set[fx.Node] = set()
            stack = [x]
            while stack:
                n = stack.pop()
                if n in back or n in cols or n not in mine:
                    continue
                if n in linears:
                    cols.add(n)
                    continue
                back.add(n)
                stack.extend(n.all_input_nodes)
            region = [n for n in sorted(back, key=order.__getitem__)]
            sharded = set(cols)
            for n in region:
                if any(a in sharded for a in n.all_input_nodes):
                    sharded.add(n)
            if x not in sharded:
                continue
            candidates += 1
            column = tuple(linears[c] for c in sorted(cols, key=order.__getitem__))
            pair = TensorParallelPair(block=name, column=tuple(c.owner for c in column), row=row.owner)
            # shape checks of sharded values (global sizes) join the region: their sizes are dropped there
            checks = {u for n in [*cols, *region] if n in sharded for u in n.users
                      if u.target is aten._assert_tensor_metadata.default and u not in sharded}
            inside = sorted([n for n in region if n in sharded] + list(checks), key=order.__getitem__)
            try:
                if cols & taken or node in taken:
                    raise _Refused("a layer of it belongs to another pair")
                _check_weights(stage, column, tp, used, info.param_map, column=True)
                _check_weights(stage, [row], tp, used, info.param_map, column=False)
                for n in [*cols, *inside]:
                    outside = [u for u in n.users if u not in sharded and u is not node and u not in checks]
                    if outside:
                        raise _Refused(f"the sharded value {n.name} is also read by {outside[0].name}")
                    if n is x and len(n.users) != 1:
                        raise _Refused(f"the row-wise input {n.name} is read elsewhere")
                sd, rewrites = _propagate(inside, {c: len(_shape(c) or (0,)) - 1 for c in cols}, tp)
                if sd[x] != len(_shape(x) or (0,)) - 1:
                    raise _Refused(f"the row-wise input {x.name} is sharded on dim {sd[x]}, not on its features")
            except _Refused as e:
                pairs.append(TensorParallelPair(block=name, column=pair.column, row=pair.row, reason=str(e)))
                continue
            taken |= cols | {node}
            whole = _whole_reads(inside, sd, graded)
            pair = dataclasses.replace(pair, **_pair_facts(stage, (*column, row), inside),
                                       whole_reads=len(whole))
            pair = dataclasses.replace(pair, backward_bytes=pair.backward_bytes + sum(_nbytes(a) for a, _ in whole))
            pairs.append(pair)
            found.append(_Found(pair, (*column, row), rewrites, whole))
        heads = [v for lin in linears.values() if lin.node not in taken
                 and (v := _vocab_head(stage, name, lin, tp, used, info.param_map)) is not None]
        embeds = [v for n in sorted(mine, key=order.__getitem__)
                  if (v := _vocab_embedding(stage, name, n, tp, used, info.param_map)) is not None]
        vocab += heads + embeds
        if linears and not candidates and not heads:
            unpaired.append((name, f"{counted(len(linears), 'linear layer')}, none fed by another through "
                                   "per-head or elementwise ops, none feeding a cross-entropy loss"))
    # a refused candidate whose layers another candidate shards is no news: leave it out of the report
    done = {c for p in pairs if p.sharded for c in (*p.column, p.row)}
    shown = tuple(p for p in pairs if p.sharded or not ({*p.column, p.row} & done))
    sharded_vocab = [v for v in vocab if v.part.sharded]
    seq: list[_SeqFound] = []
    if sequence_parallel and tp > 1:
        block_of = {nodes[m]: name for name in info.blocks for m in blocks[name].nodes if m in nodes}
        seq = _find_sequence(stage, tp, found, sharded_vocab, block_of, order)
    report = TensorParallelReport(tp=tp, pairs=shown, unpaired=tuple(unpaired), vocab=tuple(v.part for v in vocab),
                                  sequence=tuple(f.region for f in seq))
    return found, sharded_vocab, [f for f in seq if f.region.sharded], report


# -- vocabulary-parallel parts ------------------------------------------------------------------------------------
@dataclass
class _VocabFound:
    part: VocabParallelPart
    node: fx.Node  # the linear or embedding call
    owner: str
    weight: str
    bias: str | None = None
    losses: tuple[fx.Node, ...] = ()  # cross-entropy calls on the sharded logits
    drop: tuple[fx.Node, ...] = ()  # metadata checks of the sharded logits (global sizes; DTensor has no rule)
    gather: tuple[tuple[fx.Node, fx.Node], ...] = ()  # (reader, sharded value it reads whole)
    padding: int | None = None  # the embedding's padding index (its row gets no gradient)


_CARRY = {aten.slice.Tensor, *_VIEWS, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
          aten.contiguous.default, aten.clone.default, aten.alias.default}
"""Ops the sharded logits pass through to the loss as DTensors (their sizes stay global): the vocabulary stays
the last dim."""


def _vocab_weight(stage: fx.GraphModule, weight: str, owner: str, tp: int, used: dict[str, int],
                  param_map: dict[str, tuple[str, ...]], bias: str | None = None) -> str:
    """Why a ``V x H`` weight cannot be vocab-sharded over ``tp`` ("" when it can)."""
    tied = param_map.get(weight, ())
    if len(tied) > 1 or used.get(weight, 0) != 1:
        return (f"its weight is tied to {', '.join(tied[1:]) or 'another reader in the stage'}; a tied embedding "
                "and head stay replicated (their copies on other pipeline ranks sum whole gradients)")
    if bias and used.get(bias, 0) != 1:
        return f"{owner}'s bias is read elsewhere in the stage"
    size = stage.get_parameter(weight).shape[0]
    if size % tp:
        return f"its vocabulary of {size} is not divisible by tp={tp}"
    module = stage.get_submodule(owner)
    if list(module.children()) or {n for n, _ in module.named_parameters()} - {"weight", "bias"}:
        return f"{owner} holds more than the layer's weight and bias"
    return ""


def _vocab_head(stage: fx.GraphModule, block: str, lin: _Linear, tp: int, used: dict[str, int],
                param_map: dict[str, tuple[str, ...]]) -> _VocabFound | None:
    """The LM head candidate ``lin`` is (its logits reach a cross-entropy loss through :data:`_CARRY` ops), checked
    for ``tp``; None when its output reaches no loss."""
    vocab = stage.get_parameter(lin.weight).shape[0]
    region, losses, drop, gather = [lin.node], [], [], []
    reason = ""
    i = 0
    while i < len(region):
        n = region[i]
        i += 1
        for u in n.users:
            t, shape = u.target, _shape(u)
            if t is aten.cross_entropy_loss.default and u.args[0] is n:
                args = list(u.args) + [None] * (6 - len(u.args))
                weight = u.kwargs.get("weight", args[2])
                smoothing = u.kwargs.get("label_smoothing", args[5]) or 0.0
                src = _shape(n)
                if src is None or len(src) != 2:
                    reason = reason or f"the loss {u.name} reads logits of shape {src}, not (tokens, vocabulary)"
                elif weight is not None or smoothing:
                    reason = reason or f"the loss {u.name} has class weights or label smoothing (loss_parallel " \
                                       "has no rule for them)"
                losses.append(u)
            elif t is aten._assert_tensor_metadata.default:
                drop.append(u)
            elif t in _CARRY and u.args[0] is n and len(u.all_input_nodes) == 1 and shape and shape[-1] == vocab \
                    and not (t is aten.slice.Tensor and _norm_dim(cast(int, u.args[1]), len(shape)) == len(shape) - 1):
                if u not in region:
                    region.append(u)
            else:
                gather.append((u, n))
    if not losses:
        return None
    reason = reason or _vocab_weight(stage, lin.weight, lin.owner, tp, used, param_map, lin.bias)
    if reason:
        return _VocabFound(VocabParallelPart(block=block, module=lin.owner, kind=LOSS_PARALLEL, reason=reason),
                           lin.node, lin.owner, lin.weight, lin.bias)
    w = stage.get_parameter(lin.weight)
    tokens = math.prod((_shape(lin.node) or (0,))[:-1])
    part = VocabParallelPart(
        block=block, module=lin.owner, kind=LOSS_PARALLEL,
        params=sum(stage.get_parameter(t).numel() for t in (lin.weight, lin.bias) if t),
        flops=2.0 * tokens * w.numel(), forward_bytes=3 * 4 * tokens, backward_bytes=_nbytes(lin.node.args[0]),
        gathered_bytes=sum(_nbytes(v) for _, v in gather))
    return _VocabFound(part, lin.node, lin.owner, lin.weight, lin.bias, tuple(losses), tuple(drop), tuple(gather))


def _vocab_embedding(stage: fx.GraphModule, block: str, node: fx.Node, tp: int, used: dict[str, int],
                     param_map: dict[str, tuple[str, ...]]) -> _VocabFound | None:
    """The token embedding ``node`` is (an ``embedding`` of a model input by a weight), checked for ``tp``; None
    for any other node (a position table looked up by a buffer is no vocabulary)."""
    if node.target is not aten.embedding.default:
        return None
    w, ids = node.args[:2]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and isinstance(ids, fx.Node) and ids.op == "placeholder"):
        return None
    owner, _, leaf = str(w.target).rpartition(".")
    names = ("padding_idx", "scale_grad_by_freq", "sparse")
    given = dict(zip(names, node.args[2:])) | {k: node.kwargs[k] for k in names if k in node.kwargs}
    padding = given.get("padding_idx")
    if leaf != "weight":
        reason = f"its weight {w.target} is not a module's weight"
    elif given.get("scale_grad_by_freq") or given.get("sparse"):
        reason = "it scales gradients by frequency or makes sparse gradients (not sharded yet)"
    else:
        reason = _vocab_weight(stage, str(w.target), owner, tp, used, param_map)
    part = VocabParallelPart(block=block, module=owner, kind="embedding", reason=reason)
    if not reason:
        part = dataclasses.replace(part, params=stage.get_parameter(str(w.target)).numel(),
                                   forward_bytes=_nbytes(node))
    # 0 is a padding index (not False); -1 or None: none
    pad = None if padding is None or padding == -1 else int(cast(int, padding))
    return _VocabFound(part, node, owner, str(w.target), padding=pad)


def _without_padding_grad(out: torch.Tensor, ids: torch.Tensor, padding: int) -> torch.Tensor:
    """``out`` (an embedding of ``ids``) whose rows at the padding id pass no gradient back: what the lookup's
    ``padding_idx`` does (the padding row's weight gets none), kept outside the vocabulary-sharded lookup, whose
    local rows are numbered from each rank's offset."""
    return torch.where((ids == padding).unsqueeze(-1), out.detach(), out)


def _whole(x: Any) -> torch.Tensor:
    """A vocab-sharded DTensor gathered whole, as a plain tensor (for readers other than the loss)."""
    return x.full_tensor()


def _local(x: Any) -> torch.Tensor:
    """The loss computed on vocabulary shards (a replicated DTensor) as a plain tensor."""
    return x.to_local()


# -- sequence parallelism ------------------------------------------------------------------------------------------
@dataclass
class _SeqFound:
    region: SequenceRegion
    rows: tuple[_Linear, ...]
    nodes: tuple[fx.Node, ...]  # the region's nodes (rows included), graph order
    gathers: dict[fx.Node, list[fx.Node]]  # value -> column-wise readers (one all-gather each value)
    outputs: tuple[fx.Node, ...]  # values the stage returns: gathered whole
    entries: dict[fx.Node, list[tuple[fx.Node, str]]]  # whole value -> (region reader, "scatter" or "partial")


_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}


def _tokenwise(u: fx.Node, seq: int) -> str:
    """Why ``u``, reading a sequence-sharded value, must see it whole ("" when it works token by token)."""
    t, where = u.target, f"{u.name} ({getattr(u.target, '__name__', u.target)})"
    if t is aten._assert_tensor_metadata.default or (u.op, t) == ("call_method", "contiguous"):  # codegen's, for sends
        return ""
    out = _shape(u)
    if out is None or len(out) != 3 or out[SEQ_DIM] != seq:
        return f"{where} does not keep [batch, sequence, hidden] (shape {out})"
    if t in _SAME_SHAPE or torch.Tag.pointwise in getattr(t, "tags", ()):
        return ""
    if t in _REDUCTIONS and all(_norm_dim(int(d), 3) > SEQ_DIM for d in cast(Sequence[int], u.args[1])):
        return ""
    if t in _NORMS and len(cast(Sequence[int], u.args[1])) < 3 - SEQ_DIM:
        return ""
    return f"{where} is not token-wise"


def _find_sequence(stage: fx.GraphModule, tp: int, found: Sequence[_Found], vocab: Sequence[_VocabFound],
                   block_of: dict[fx.Node, str], order: dict[fx.Node, int]) -> list[_SeqFound]:
    """The sequence-parallel regions grown from the sharded pairs' row outputs (module glossary: sequence)."""
    rows = {f.linears[-1].node: f.linears[-1] for f in found}
    columns = {lin.node: lin.owner for f in found for lin in f.linears[:-1]}
    columns.update({v.node: v.owner for v in vocab if v.part.kind == LOSS_PARALLEL})
    out: list[_SeqFound] = []
    seeds = []
    for n, lin in rows.items():
        s = _shape(n)
        if s is None or len(s) != 3:
            why = f"its output has shape {s}, not [batch, sequence, hidden]"
        elif s[SEQ_DIM] % tp:
            why = f"its sequence of {s[SEQ_DIM]} is not divisible by tp={tp}"
        else:
            seeds.append(n)
            continue
        out.append(_SeqFound(SequenceRegion(blocks=(block_of[n],), rows=(lin.owner,), reason=why), (lin,), (), {},
                             (), {}))
    # grow forward through token-wise readers; union-find joins the seeds whose regions meet
    parent: dict[fx.Node, fx.Node] = {n: n for n in seeds}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    bad: dict[fx.Node, str] = {}  # region node -> why a reader needs it whole
    queue = list(seeds)
    seq = {n: (_shape(n) or (0, 0))[SEQ_DIM] for n in seeds}
    while queue:
        n = queue.pop()
        for u in n.users:
            if u.op == "output" or (u in columns and u.args[0] is n):
                continue
            if u in parent:
                if u not in rows:
                    parent[root(u)] = root(n)
                continue
            why = "" if u not in rows else f"{u.name} is a row-wise layer"
            why = why or _tokenwise(u, seq[n])
            if why:
                bad.setdefault(n, why)
                continue
            parent[u] = root(n)
            seq[u] = seq[n]
            queue.append(u)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in sorted(parent, key=order.__getitem__):
        groups.setdefault(root(n), []).append(n)
    for nodes in groups.values():
        inside = set(nodes)
        mine = tuple(rows[n] for n in nodes if n in rows)
        blocks = tuple(dict.fromkeys(block_of[n] for n in nodes if n in block_of))
        gathers: dict[fx.Node, list[fx.Node]] = {}
        outputs = []
        for n in nodes:
            readers = [u for u in n.users if u in columns and u.args[0] is n]
            if readers:
                gathers[n] = sorted(readers, key=order.__getitem__)
            if any(u.op == "output" for u in n.users):
                outputs.append(n)
        why = next((f"{n.name} is sequence-sharded but {bad[n]}" for n in nodes if n in bad), "")
        if not why and not gathers:
            why = "it reaches no column-wise layer (nothing would take its all-gather)"
        if why:
            out.append(_SeqFound(SequenceRegion(blocks=blocks, rows=tuple(r.owner for r in mine), reason=why), mine,
                                 (), {}, (), {}))
            continue
        entries: dict[fx.Node, list[tuple[fx.Node, str]]] = {}
        for n in nodes:
            if n in rows or n.target is aten._assert_tensor_metadata.default:
                continue
            for x in n.all_input_nodes:
                if x in inside:
                    continue
                s = _shape(x)
                k = len(s or ()) - 3 + SEQ_DIM  # the dim of x that broadcasts against the sequence
                kind = "scatter" if s and k >= 0 and s[k] == seq[n] and s[k] > 1 else "partial"
                if s is None or kind == "scatter" and k != SEQ_DIM:
                    why = why or f"{n.name} reads {x.name} of shape {s}, not split or broadcast on dim {SEQ_DIM}"
                entries.setdefault(x, []).append((n, kind))
        if why:
            out.append(_SeqFound(SequenceRegion(blocks=blocks, rows=tuple(r.owner for r in mine), reason=why), mine,
                                 (), {}, (), {}))
            continue
        fwd = [(block_of[n], _nbytes(n)) for n in nodes if n in rows]
        fwd += [(block_of[r[0]], _nbytes(n)) for n, r in gathers.items()]
        back = list(fwd)
        fwd += [(block_of.get(n, blocks[-1]), _nbytes(n) or _nbytes(n.args[0])) for n in outputs]
        back += [(block_of.get(r[0][0], blocks[0]), _nbytes(x)) for x, r in entries.items() if r[0][1] == "scatter"]
        reduced = [(block_of.get(r[0][0], blocks[0]), _nbytes(x)) for x, r in entries.items() if r[0][1] == "partial"
                   and x.op == "get_attr"]
        shares = []
        for b in blocks:
            total = sum(_nbytes(n) for n in block_of if block_of[n] == b)
            part = sum(_nbytes(n) for n in nodes if block_of.get(n) == b and n not in rows)
            shares.append((b, part / total if total else 0.0))
        cols = [(columns[u], _nbytes(n)) for n, rs in gathers.items() for u in rs]
        region = SequenceRegion(blocks=blocks, rows=tuple(r.owner for r in mine), columns=tuple(c for c, _ in cols),
                                column_bytes=tuple(b for _, b in cols), forward=tuple(fwd), backward=tuple(back),
                                reduced=tuple(reduced), shares=tuple(shares))
        out.append(_SeqFound(region, mine, tuple(nodes), gathers, tuple(outputs), entries))
    return out


class _Redistribute(nn.Module):
    """A plain tensor's layout over the ``tp`` ranks changed with DTensor (module glossary: sequence):

    ``scatter``  whole -> this rank's sequence shard (forward: no communication; backward: all-gather).
    ``gather``   sequence shard -> a replicated DTensor, for column-wise layers (forward: all-gather; backward:
                 their summed partial input gradients reduce-scattered, once for all of them).
    ``whole``    sequence shard -> a whole plain tensor, for the stage's outputs (forward: all-gather).
    ``partial``  a whole tensor read by shards, unchanged (backward: its gradient all-reduced over ``tp``).
    """

    def __init__(self, mesh: Any, kind: str) -> None:
        super().__init__()
        self.mesh, self.kind = mesh, kind

    def forward(self, x: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if self.kind == "partial":
            return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
        if self.kind == "scatter":
            whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            return whole.redistribute(self.mesh, [Shard(SEQ_DIM)]).to_local()
        gathered = DTensor.from_local(x, self.mesh, [Shard(SEQ_DIM)], run_check=False).redistribute(
            self.mesh, [Replicate()])
        return gathered if self.kind == "gather" else gathered.to_local()


def _apply_sequence(new: fx.GraphModule, f: _SeqFound, mesh: Any, by_name: dict[str, fx.Node]) -> None:
    """Rewrite ``new``'s graph for the kept region ``f``: its entries, metadata checks and exits (``by_name``: the
    stage's node names -> ``new``'s nodes)."""
    g = new.graph

    def helper(kind: str, x: fx.Node, before: fx.Node) -> fx.Node:
        name = "sequence_" + kind
        if not hasattr(new, name):
            new.add_submodule(name, _Redistribute(mesh, kind))
        with g.inserting_before(before):
            call = g.call_module(name, (x,))
        call.meta.update(x.meta)
        return call

    for n in f.nodes:
        if n.target is aten._assert_tensor_metadata.default:  # a check of global sizes: keep dtype/device checks
            twin = by_name[n.name]
            twin.kwargs = {k: v for k, v in twin.kwargs.items() if k not in ("size", "stride")}
    for x, entry in f.entries.items():  # its readers in graph order: the first is where the value is split
        users = [by_name[r.name] for r, _ in entry]
        call = helper(entry[0][1], by_name[x.name], users[0])
        for u in users:
            u.replace_input_with(by_name[x.name], call)
    for n, readers in f.gathers.items():
        users = [by_name[r.name] for r in readers]
        call = helper("gather", by_name[n.name], users[0])
        for u in users:
            u.replace_input_with(by_name[n.name], call)
    out = next(n for n in g.nodes if n.op == "output")
    for n in f.outputs:
        out.replace_input_with(by_name[n.name], helper("whole", by_name[n.name], out))


# -- applying them ---------------------------------------------------------------------------------
def _linear_module(stage: fx.GraphModule, lin: _Linear) -> nn.Linear:
    w = stage.get_parameter(lin.weight)
    b = stage.get_parameter(lin.bias) if lin.bias else None
    with torch.device("meta"):
        module = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
    module.weight = w
    if b is not None:
        module.bias = b
    return module


def _call_module(node: fx.Node, target: str, arg: fx.Node) -> None:
    """Turn ``node`` into a call of the module ``target`` on ``arg`` in place: it keeps its name, which recompute
    regions find a block's nodes by (a new node cannot take an erased node's name: FX numbers it anew)."""
    node.op, node.target = "call_module", target
    node.args, node.kwargs = (arg,), {}


def _apply_vocab(new: fx.GraphModule, v: _VocabFound, by_name: dict[str, fx.Node]) -> Any:
    """Rewrite ``new``'s graph for the vocab part ``v`` (module glossary); its DTensor layout for
    ``parallelize_module``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    w = new.get_parameter(v.weight)
    module: nn.Module
    if v.part.kind == LOSS_PARALLEL:
        module = _linear_module(new, _Linear(v.node, v.owner, v.weight, v.bias))
    else:
        with torch.device("meta"):
            module = nn.Embedding(w.shape[0], w.shape[1], dtype=w.dtype)
        module.weight = w
    parent, _, leaf = v.owner.rpartition(".")
    setattr(new.get_submodule(parent) if parent else new, leaf, module)
    g = new.graph
    source = cast(fx.Node, v.node.args[1 if v.part.kind == "embedding" else 0])  # ids, or the head's input
    call = by_name[v.node.name]
    _call_module(call, v.owner, by_name[source.name])
    if v.part.kind != LOSS_PARALLEL:
        if v.padding is not None:
            with g.inserting_after(call):
                kept = g.call_function(_without_padding_grad, (call, by_name[source.name], v.padding))
            kept.meta.update(call.meta)
            for user in [u for u in call.users if u is not kept]:
                user.replace_input_with(call, kept)
        return RowwiseParallel(input_layouts=Replicate())
    for n in v.drop:
        g.erase_node(by_name[n.name])
    for reader, value in v.gather:
        user, val = by_name[reader.name], by_name[value.name]
        with g.inserting_before(user):
            whole = g.call_function(_whole, (val,))
        whole.meta.update(val.meta)
        user.replace_input_with(val, whole)
    for n in v.losses:
        loss = by_name[n.name]
        with g.inserting_after(loss):
            local = g.call_function(_local, (loss,))
        local.meta.update(loss.meta)
        for user in [u for u in loss.users if u is not local]:
            user.replace_input_with(loss, local)
    return ColwiseParallel(use_local_output=False)


def tensor_parallel_stage(
    stage: fx.GraphModule, graph: BlockGraph, mesh: Any, *, sequence_parallel: bool = False
) -> tuple[fx.GraphModule, TensorParallelReport, dict[int, nn.Parameter]]:
    """A new stage module whose pairs are sharded over the 1-D DeviceMesh ``mesh`` (dim ``tp``), and with
    ``sequence_parallel`` the token-wise ops between them run on sequence shards (module glossary: sequence).

    ``stage`` is a module made by codegen from ``graph``; it is not modified. Returns the new module, the report of
    what was sharded and what stays replicated, and ``id(old parameter) -> new DTensor parameter`` for the
    parameters it replaced (their names are unchanged).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    found, vocab, seq, report = _find_all(stage, graph, tp, sequence_parallel)
    new = fx.GraphModule(stage, copy.deepcopy(stage.graph), class_name=type(stage).__name__)
    new.meta.update(stage.meta)
    if not (found or vocab) or tp == 1:
        return new, report, {}
    by_name = {n.name: n for n in new.graph.nodes}
    layout: dict[str, Any] = {}
    old = {id(stage.get_parameter(t)): t for f in found for lin in f.linears for t in (lin.weight, lin.bias) if t}
    old.update({id(stage.get_parameter(t)): t for v in vocab for t in (v.weight, v.bias) if t})
    for v in vocab:
        layout[v.owner] = _apply_vocab(new, v, by_name)
    for f in found:
        for node, args, kwargs in f.rewrites:
            twin = by_name[node.name]
            twin.args = fx.map_arg(args, lambda a: by_name[a.name])
            twin.kwargs = fx.map_arg(kwargs, lambda a: by_name[a.name])
        for i, lin in enumerate(f.linears):
            module = _linear_module(new, lin)
            parent, _, leaf = lin.owner.rpartition(".")
            setattr(new.get_submodule(parent) if parent else new, leaf, module)
            _call_module(by_name[lin.node.name], lin.owner, by_name[lin.node.args[0].name])  # type: ignore[union-attr]
            layout[lin.owner] = RowwiseParallel() if i == len(f.linears) - 1 else ColwiseParallel()
        for value, readers in f.whole:  # each rank's gradient covers its heads: all-reduced in the backward
            if not hasattr(new, "tensor_parallel_partial"):
                new.add_submodule("tensor_parallel_partial", _Redistribute(mesh, "partial"))
            users = [by_name[r.name] for r in readers]
            with new.graph.inserting_before(users[0]):
                call = new.graph.call_module("tensor_parallel_partial", (by_name[value.name],))
            call.meta.update(by_name[value.name].meta)
            for u in users:
                u.replace_input_with(by_name[value.name], call)
    for sf in seq:  # after the pairs: the readers it rewires are their call_module nodes
        _apply_sequence(new, sf, mesh, by_name)
        for lin in sf.rows:  # reduce-scatter on the sequence instead of all-reduce
            layout[lin.owner] = RowwiseParallel(output_layouts=Shard(SEQ_DIM))
    for n in list(new.graph.nodes):
        if n.op == "get_attr" and not n.users:  # the weights the call_module nodes now read themselves
            new.graph.erase_node(n)
    new.graph.lint()
    new.recompile()
    parallelize_module(new, mesh, layout)
    replaced = {k: new.get_parameter(t) for k, t in old.items()}
    info = new.meta[_META_KEY]
    assert set(info.param_map) >= set(old.values())
    return new, report, replaced
