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
    replicated  every parameter outside a pair or a vocab part (norms, refused parts): a whole copy on
                each ``tp`` rank, with whole gradients (no sequence parallelism: every rank computes the
                same replicated activations).
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

__all__ = ["LOSS_PARALLEL", "TensorParallelPair", "TensorParallelReport", "VocabParallelPart", "find_pairs",
           "tensor_parallel_stage"]

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
    """Bytes of the column-wise layers' inputs, whose gradients the backward all-reduces, one per layer (0 when
    refused)."""

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

    @property
    def sharded(self) -> tuple[TensorParallelPair, ...]:
        return tuple(p for p in self.pairs if p.sharded)

    @property
    def loss_parallel(self) -> bool:
        """Whether the stage computes its loss on vocabulary shards (it must run under ``loss_parallel()``)."""
        return any(v.sharded and v.kind == LOSS_PARALLEL for v in self.vocab)

    def blocks(self) -> dict[str, TensorParallelBlock]:
        """Per block with a sharded pair, what the costs need (:func:`omnibal_compile.costs.tensor_parallel.
        tensor_parallel_table`): the sums over its sharded pairs, per micro-batch of the traced shape."""
        out: dict[str, TensorParallelBlock] = {}
        for p in self.sharded:
            old = out.get(p.block, TensorParallelBlock(pairs=0, backward_reduces=0, params=0, flops=0.0,
                                                       forward_bytes=0, backward_bytes=0))
            out[p.block] = TensorParallelBlock(
                pairs=old.pairs + 1, backward_reduces=old.backward_reduces + len(p.column),
                params=old.params + p.params, flops=old.flops + p.flops,
                forward_bytes=old.forward_bytes + p.forward_bytes, backward_bytes=old.backward_bytes + p.backward_bytes)
        return out

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
        return head + "\n" + format_table(rows, "llll")


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


def find_pairs(stage: fx.GraphModule, graph: BlockGraph, tp: int) -> tuple[list[_Found], TensorParallelReport]:
    """Every candidate pair and vocab part in ``stage``'s blocks, checked for ``tp`` (nothing is changed); the
    pairs to shard and the report."""
    found, _, report = _find_all(stage, graph, tp)
    return found, report


def _find_all(stage: fx.GraphModule, graph: BlockGraph, tp: int
              ) -> tuple[list[_Found], list[_VocabFound], TensorParallelReport]:
    if not isinstance(tp, int) or tp < 1:
        raise InputError(f"tp (tensor-parallel degree) must be an integer >= 1, got {tp!r}")
    info = stage_info(stage)
    blocks = {b.name: b for b in graph.blocks}
    nodes = {n.name: n for n in stage.graph.nodes}
    order = {n: i for i, n in enumerate(stage.graph.nodes)}
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
            pair = dataclasses.replace(pair, **_pair_facts(stage, (*column, row), inside))
            pairs.append(pair)
            found.append(_Found(pair, (*column, row), rewrites))
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
    report = TensorParallelReport(tp=tp, pairs=shown, unpaired=tuple(unpaired), vocab=tuple(v.part for v in vocab))
    return found, [v for v in vocab if v.part.sharded], report


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
    pad = None if padding is None or padding == -1 else int(padding)
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
    twin = by_name[v.node.name]
    source = cast(fx.Node, v.node.args[1 if v.part.kind == "embedding" else 0])  # ids, or the head's input
    with g.inserting_before(twin):
        call = g.call_module(v.owner, (by_name[source.name],))
    call.meta.update(twin.meta)
    twin.replace_all_uses_with(call)
    g.erase_node(twin)
    call._rename(v.node.name)
    by_name[call.name] = call
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
    stage: fx.GraphModule, graph: BlockGraph, mesh: Any
) -> tuple[fx.GraphModule, TensorParallelReport, dict[int, nn.Parameter]]:
    """A new stage module whose pairs are sharded over the 1-D DeviceMesh ``mesh`` (dim ``tp``).

    ``stage`` is a module made by codegen from ``graph``; it is not modified. Returns the new module, the report of
    what was sharded and what stays replicated, and ``id(old parameter) -> new DTensor parameter`` for the
    parameters it replaced (their names are unchanged).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    found, vocab, report = _find_all(stage, graph, tp)
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
            twin = by_name[lin.node.name]
            with new.graph.inserting_before(twin):
                call = new.graph.call_module(lin.owner, (by_name[lin.node.args[0].name],))  # type: ignore[union-attr]
            call.meta.update(twin.meta)
            twin.replace_all_uses_with(call)
            new.graph.erase_node(twin)
            call._rename(lin.node.name)  # the block's node names (recompute regions find their nodes by them)
            layout[lin.owner] = RowwiseParallel() if i == len(f.linears) - 1 else ColwiseParallel()
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
