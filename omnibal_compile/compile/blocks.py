"""Blocks pass: group the captured graph's nodes into a chain of blocks and find what crosses each cut.

Glossary:
    layer stack   a container whose children are named 0, 1, 2, ... and share one class (an
                  ``nn.ModuleList`` of transformer layers). Each child is one ``layer`` block.
    module block  the outermost submodule that holds no layer stack (embeddings, projector, head).
    glue          ops that run in a module holding a stack but outside any block (mask and rotary
                  table construction, splicing image features into text, the loss).
    cut k         the boundary between block k-1 and block k (1 <= k < number of blocks).
    refused cut   a boundary that a value of data-dependent shape (see ``passes/capture.py``) would
                  cross: the blocks on both sides are merged into one (``first..last``), so no
                  planner can cut there, and ``BlockGraph.refused_cuts`` says why.
    crossing value  a value produced before cut k (by a block, or a model input) and used at or
                  after it (by a block, or as a model output): it must be sent across a pipeline
                  boundary at that cut. Skip tensors (masks, rotary tables, labels) cross many cuts.
    rebuilt value a crossing value that is cheap to make again: computed from model inputs only,
                  by ops that read no parameter or buffer, draw no random numbers, mutate nothing
                  and are not matmuls, convolutions or attention (:func:`is_cheap_op`), and
                  larger than the inputs it is made from (an attention mask of L x L from L
                  positions). It is not sent: every later stage that reads it recomputes it from
                  those inputs, which cross the cuts instead (``rebuilt_from``). ``build_blocks(...,
                  rebuild=False)`` sends it as any other value.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
from torch import nn

from omnibal_compile._utils.tables import format_table
from omnibal_compile.compile._subgraph import module_path
from omnibal_compile.compile.capture import Captured, is_data_dependent, size_hint
from omnibal_compile.errors import InputError

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "Block",
    "BlockEdge",
    "CrossingValue",
    "BlockGraph",
    "RefusedCut",
    "MERGED",
    "build_blocks",
    "find_layer_stacks",
    "is_cheap_op",
]

BlockKind = Literal["layer", "module", "glue"]
INPUT = -1
"""Producer index of model inputs."""
MERGED = ".."
"""Joins the first and last names of blocks merged across refused cuts (``visual.patch_embed..visual.blocks.31``)."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """A contiguous run of graph nodes that is never split across pipeline stages."""

    index: int
    """Position in the chain."""
    name: str
    """Module path of the block (``llm.layers.3``), or ``<path>:glue`` for glue."""
    kind: BlockKind
    """``layer`` (an element of a layer stack), ``module`` or ``glue``."""
    nodes: tuple[str, ...]
    """Names of its FX nodes, in graph order."""
    params: tuple[str, ...]
    """Qualified names of the parameters and buffers it reads."""
    num_params: int
    """Number of parameter elements it reads (buffers excluded)."""


@dataclass(frozen=True, kw_only=True)
class CrossingValue:
    """A value that lives across one or more cuts."""

    name: str
    """FX node name of the value (a placeholder name for model inputs)."""
    producer: int
    """Block that produces it; -1 for a model input."""
    last_use: int
    """Last block that reads it; the number of blocks when it is a model output."""
    shape: tuple[int, ...] | None
    """Tensor shape, or None for a non-tensor value."""
    dtype: str | None
    """Tensor dtype, e.g. ``torch.float32``."""
    nbytes: int
    """Bytes of the tensor (0 for non-tensors)."""
    data_dependent: bool = False
    """Its shape (or, for a size, its value) depends on input values, not only on input shapes."""
    rebuilt: bool = False
    """A rebuilt value (module glossary): never sent; a later stage reading it computes it again."""
    rebuilt_from: tuple[str, ...] = ()
    """The model inputs a rebuilt value is computed from (they cross the cuts in its place)."""


@dataclass(frozen=True, kw_only=True)
class RefusedCut:
    """A boundary between two blocks that cannot be a stage boundary; the two sides form one block."""

    after: str
    """Block before the boundary."""
    before: str
    """Block after the boundary."""
    values: tuple[CrossingValue, ...]
    """The values of data-dependent shape that would cross it."""

    def reason(self) -> str:
        """A sentence for people."""
        names = ", ".join(f"'{v.name}' ({_describe(v)})" for v in self.values[:3])
        more = f" and {len(self.values) - 3} more" if len(self.values) > 3 else ""
        return (
            f"not cut between {self.after} and {self.before}: {names}{more} would cross it, and its size depends on "
            "the input values (image sizes, image count), not only on the input shapes; pipeline stages send "
            "fixed shapes"
        )


def _square(shape: tuple[int, ...]) -> bool:
    """(B, 1, L, L): the shape of an attention mask."""
    return len(shape) == 4 and shape[-1] == shape[-2]


def _describe(v: CrossingValue) -> str:
    if v.shape is None:
        return "a size"
    return f"shape {list(v.shape)} in the example"


@dataclass(frozen=True, kw_only=True)
class BlockEdge:
    """Values one block sends to a later one."""

    producer: int
    """Block that produces them."""
    consumer: int
    """Later block that reads them."""
    values: tuple[str, ...]
    """FX node names of the values."""
    nbytes: int
    """Their bytes in total."""


@dataclass(frozen=True, kw_only=True)
class BlockGraph:
    """The chain of blocks of a captured graph, with the values crossing every cut."""

    captured: Captured
    """The capture this was built from."""
    blocks: tuple[Block, ...]
    """Blocks in execution order."""
    node_block: dict[str, int]
    """Block index of every assigned node."""
    values: tuple[CrossingValue, ...]
    """Every value used by a later block than the one producing it (or a model input/output)."""
    stacks: tuple[str, ...]
    """Module paths of the layer stacks found (or given)."""
    edges: tuple[BlockEdge, ...] = field(repr=False)
    """Block i -> block j for the values produced by i and read by j (i < j), in order of first value."""
    refused_cuts: tuple[RefusedCut, ...] = ()
    """Boundaries between module/layer blocks that values of data-dependent shape cross: those blocks were
    merged into one (named ``first..last``), so no plan cuts there."""
    block_prefixes: tuple[str, ...] | None = None
    """The ``block_prefixes`` the blocks were built with (None: the default grouping)."""
    rebuild: bool = True
    """Whether cheap values are rebuilt rather than sent (``build_blocks(rebuild=...)``; module glossary)."""

    @property
    def dag(self) -> nx.DiGraph:
        """The blocks as a networkx DAG (nodes: block indices; edges: :attr:`edges`), built on demand."""
        import networkx as nx  # only where a graph is drawn or analysed: keeps capture and planning light

        dag = nx.DiGraph()
        for b in self.blocks:
            dag.add_node(b.index, name=b.name, kind=b.kind, num_params=b.num_params)
        for e in self.edges:
            dag.add_edge(e.producer, e.consumer, values=list(e.values), nbytes=e.nbytes)
        return dag

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def crossing(self, cut: int) -> tuple[CrossingValue, ...]:
        """Values alive across cut ``cut`` (between block cut-1 and block cut), in a stable order."""
        if not 0 < cut < self.num_blocks:
            raise InputError(f"cut must lie in [1, {self.num_blocks - 1}], got {cut}")
        alive = {v.name for v in self.values if v.producer < cut <= v.last_use}
        # a rebuilt value is not sent; the model inputs it is made of are, while it is read
        alive |= {r for v in self.values if v.rebuilt and v.name in alive for r in v.rebuilt_from}
        return tuple(v for v in self.values if v.name in alive and not v.rebuilt)

    def cut_bytes(self, cut: int) -> int:
        """Bytes sent across cut ``cut`` per batch."""
        return sum(v.nbytes for v in self.crossing(cut))

    def sending_all(self) -> BlockGraph:
        """This graph with every rebuilt value sent instead (as ``build_blocks(rebuild=False)`` makes it)."""
        if not self.rebuild:
            return self
        values = tuple(dataclasses.replace(v, rebuilt=False, rebuilt_from=()) for v in self.values)
        edges: dict[tuple[int, int], tuple[list[str], int]] = {(e.producer, e.consumer): (list(e.values), e.nbytes)
                                                              for e in self.edges}
        for v in self.values:
            if v.rebuilt:
                users = {self.node_block[u.name] for u in self._node(v.name).users if u.name in self.node_block}
                for u in sorted(b for b in users if b > v.producer):
                    names, total = edges.get((v.producer, u), ([], 0))
                    edges[(v.producer, u)] = ([*names, v.name], total + v.nbytes)
        return dataclasses.replace(self, values=values, rebuild=False, edges=tuple(
            BlockEdge(producer=i, consumer=j, values=tuple(n), nbytes=b) for (i, j), (n, b) in edges.items()))

    def _node(self, name: str) -> fx.Node:
        return next(n for n in self.captured.graph_module.graph.nodes if n.name == name)

    def rebuilt_across(self, cut: int) -> tuple[CrossingValue, ...]:
        """Rebuilt values alive across cut ``cut``: made again after it instead of being sent."""
        return tuple(v for v in self.values if v.producer < cut <= v.last_use and v.rebuilt)

    def rebuild_nodes(self, names: Sequence[str]) -> tuple[str, ...]:
        """FX names of the nodes that compute the rebuilt values ``names`` from model inputs, in graph order
        (the inputs themselves left out): what a stage copies to make them again."""
        by_name = {n.name: n for n in self.captured.graph_module.graph.nodes}
        need: set[str] = set()
        todo = [by_name[n] for n in names]
        while todo:
            node = todo.pop()
            if node.op == "placeholder" or node.name in need:
                continue
            need.add(node.name)
            todo.extend(node.all_input_nodes)
        # A vmap level opened and closed around any of them: its nesting calls too (they hold no value).
        order = list(self.captured.graph_module.graph.nodes)
        opened: list[int] = []
        for i, node in enumerate(order):
            name = _op_name(node.target) if node.op == "call_function" else ""
            if name == _VMAP_NESTING[0]:
                opened.append(i)
            elif name == _VMAP_NESTING[1] and opened:
                start = opened.pop()
                if any(n.name in need for n in order[start:i]):
                    need.update((order[start].name, node.name))
        return tuple(n.name for n in order if n.name in need)

    def value_named(self, name: str) -> CrossingValue | None:
        """The crossing value of FX name ``name`` (a stage's input or output), or None."""
        return next((v for v in self.values if v.name == name), None)

    def describe_value(self, v: CrossingValue) -> str:
        """What ``v`` is, for a person: a model input by its name, else its kind (loss, mask, indices,
        activations) and the block that makes it, e.g. ``mask from <root>:glue``; never an FX name."""
        if v.producer < 0:
            return f"{v.name} (model input)"
        dtype = (v.dtype or "").removeprefix("torch.")
        kind = (
            "value" if v.shape is None else "loss" if v.shape == () and v.last_use >= self.num_blocks
            else "scalar" if v.shape == () else "mask" if dtype == "bool" or (v.rebuilt and _square(v.shape))
            else "indices" if dtype.startswith(("int", "uint")) else "activations"
        )
        same = [u for u in self.values if u.producer == v.producer and u.last_use > v.producer]
        nth = f" #{same.index(v) + 1}" if len(same) > 1 and kind == "activations" else ""
        return f"{kind}{nth} from {self.blocks[v.producer].name}"

    def summary(self) -> str:
        """A table: index, name, kind, node count, parameters, bytes crossing the cut after it."""
        rows = [("#", "block", "kind", "nodes", "params", "send after (bytes)")]
        for b in self.blocks:
            after = "-" if b.index == self.num_blocks - 1 else f"{self.cut_bytes(b.index + 1):,}"
            rows.append((str(b.index), b.name, b.kind, str(len(b.nodes)), f"{b.num_params:,}", after))
        table = format_table(rows, "lllrrr")
        rebuilt = [v for v in self.values if v.rebuilt]
        if rebuilt:
            shown = "; ".join(
                f"{self.describe_value(v)} ({_describe(v)}, {v.nbytes:,} bytes) from "
                f"{', '.join(v.rebuilt_from) or 'nothing'}" for v in rebuilt[:3]
            )
            more = f" and {len(rebuilt) - 3} more" if len(rebuilt) > 3 else ""
            table += f"\n  rebuilt by every stage that reads it, not sent: {shown}{more}"
        if not self.refused_cuts:
            return table
        return table + "\n" + "\n".join(f"  {r.reason()}" for r in self.refused_cuts)


def find_layer_stacks(model: nn.Module) -> tuple[str, ...]:
    """Module paths of the outermost containers whose >= 2 children are named 0..n-1 with one class."""
    stacks: list[str] = []
    for path, mod in model.named_modules():
        children = list(mod.named_children())
        if len(children) < 2 or not all(name.isdigit() for name, _ in children):
            continue
        if len({type(c) for _, c in children}) != 1:
            continue
        if any(path == s or path.startswith(s + ".") for s in stacks):
            continue  # nested in an element of an outer stack: part of that layer
        stacks.append(path)
    return tuple(stacks)


def _is_under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _key_for_path(
    path: str, stacks: Sequence[str], prefixes: Sequence[str] | None
) -> tuple[str, BlockKind]:
    if prefixes is not None:
        matches = [p for p in prefixes if _is_under(path, p)]
        if matches:
            return max(matches, key=len), "module"
        return path, "glue"
    for s in stacks:
        if path.startswith(s + "."):
            item = s + "." + path[len(s) + 1 :].split(".")[0]
            return item, "layer"
    parts = path.split(".") if path else []
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if not any(_is_under(s, prefix) for s in stacks):
            return prefix, "module"
    return path, "glue"


def _value_info(node: fx.Node, example: Any = None) -> tuple[tuple[int, ...] | None, str | None, int, bool]:
    """Shape (the example's sizes), dtype, bytes and whether the shape depends on input values."""
    val = node.meta.get("val", example)
    if val is None and "tensor_meta" in node.meta:
        tm = node.meta["tensor_meta"]
        if hasattr(tm, "shape"):
            shape = tuple(size_hint(d) for d in tm.shape)
            return (
                shape,
                str(tm.dtype),
                math.prod(shape) * tm.dtype.itemsize,
                any(is_data_dependent(d) for d in tm.shape),
            )
    if isinstance(val, torch.Tensor):
        shape = tuple(size_hint(d) for d in val.shape)
        return (
            shape,
            str(val.dtype),
            math.prod(shape) * val.element_size(),
            any(is_data_dependent(d) for d in val.shape),
        )
    return None, None, 0, is_data_dependent(val) if isinstance(val, torch.SymInt) else False


_SKIP_TARGETS = {"_guards_fn"}

_EXPENSIVE_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear", "bilinear", "einsum",
    "tensordot", "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "flex_attention", "_scaled_mm",
})
"""Ops whose work grows with a weight or a contraction (matmuls, convolutions, attention): never rebuilt."""
_RANDOM_OPS = frozenset({
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "rand", "randn",
    "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "normal", "uniform", "multinomial",
    "exponential", "geometric", "cauchy", "log_normal", "poisson",
})
"""Ops drawing random numbers: a copy would draw others (plain Python names; ATen ops say so by a tag)."""
_VMAP_NESTING = ("_vmap_increment_nesting", "_vmap_decrement_nesting")
"""Value-less calls that open and close a ``vmap`` level (transformers builds masks under ``vmap``): a
rebuilt value made inside one needs them copied too."""


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target._opname)
    return str(target) if isinstance(target, str) else str(getattr(target, "__name__", target))


def is_cheap_op(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` itself may be computed again in another stage: a function or method call that
    reads no parameter, buffer or tensor constant of ``root``, is not a matmul, convolution or attention,
    draws no random numbers, mutates nothing and has no data-dependent shape (see the glossary's rebuilt value).
    """
    if node.op not in ("call_function", "call_method"):
        return False
    target, name = node.target, _op_name(node.target)
    if name in _EXPENSIVE_OPS or name.rstrip("_") in _RANDOM_OPS:
        return False
    if name.endswith("_") and not name.startswith("_"):  # an in-place method (x.masked_fill_)
        return False
    if isinstance(target, torch._ops.OpOverload):
        from torch.utils.flop_counter import flop_registry

        if target.overloadpacket in flop_registry or torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if target._schema.is_mutable:
            return False
    for a in node.all_input_nodes:
        if a.op == "get_attr" and isinstance(_attr(root, str(a.target)), (torch.Tensor, nn.Module)):
            return False
    val = node.meta.get("val")
    return not (isinstance(val, torch.Tensor) and any(is_data_dependent(d) for d in val.shape))


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _rebuildable(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    """Node -> the model inputs it is computed from, for every node made from model inputs by cheap ops only."""
    roots: dict[fx.Node, frozenset[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            roots[node] = frozenset({node.name})
        elif node.op == "get_attr":
            if not isinstance(_attr(gm, str(node.target)), (torch.Tensor, nn.Module)):
                roots[node] = frozenset()
        elif is_cheap_op(node, gm) and all(a in roots for a in node.all_input_nodes):
            roots[node] = frozenset().union(*(roots[a] for a in node.all_input_nodes))
    return roots


def build_blocks(
    captured: Captured,
    model: nn.Module,
    *,
    block_prefixes: Sequence[str] | None = None,
    rebuild: bool = True,
) -> BlockGraph:
    """Group ``captured``'s nodes into blocks along ``model``'s module boundaries.

    By default each element of every layer stack of ``model`` is a block, the outermost other
    submodules are blocks, and the glue between them forms blocks of its own. ``block_prefixes``
    overrides the grouping: a node belongs to the longest listed module path that contains it.
    ``rebuild=False`` sends the values that would be rebuilt (module glossary) like any other.
    """
    if block_prefixes is not None:
        block_prefixes = list(block_prefixes)
        known = {p for p, _ in model.named_modules()}
        unknown = [p for p in block_prefixes if p not in known]
        if unknown:
            raise InputError(
                f"block_prefixes {unknown} are not module paths of {type(model).__name__}; "
                f"examples of valid paths: {sorted(known - {''})[:8]}"
            )
    stacks = find_layer_stacks(model)
    graph = captured.graph_module.graph

    # 1. A key per compute node; views of multi-output ops and value-less asserts follow their input.
    keys: dict[fx.Node, tuple[str, BlockKind]] = {}
    order: list[fx.Node] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_module" and node.target in _SKIP_TARGETS:
            continue
        follows = None
        if node.op == "call_function" and node.target is operator.getitem:
            follows = node.args[0]
        elif len(node.users) == 0 and not module_path(node):
            producers = [a for a in node.all_input_nodes if a in keys]
            follows = producers[-1] if producers else None
        if isinstance(follows, fx.Node) and follows in keys:
            keys[node] = keys[follows]
        else:
            path = module_path(node)
            if node.op == "call_module" and not path:
                path = str(node.target)
            keys[node] = _key_for_path(path, stacks, block_prefixes)
        order.append(node)
    if not order:
        raise InputError(f"the captured graph of {captured.model_name} has no operations to split")

    # 2. Runs of equal keys form blocks (consecutive glue runs form one); a recurring name gets #n.
    runs: list[tuple[tuple[str, BlockKind], list[fx.Node]]] = []
    for node in order:
        if runs and (runs[-1][0] == keys[node] or runs[-1][0][1] == keys[node][1] == "glue"):
            runs[-1][1].append(node)
        else:
            runs.append((keys[node], [node]))
    seen: dict[str, int] = {}
    named: list[tuple[str, BlockKind, list[fx.Node]]] = []
    for (path, kind), nodes in runs:
        base = f"{path or '<root>'}:glue" if kind == "glue" else path
        seen[base] = seen.get(base, 0) + 1
        named.append((base if seen[base] == 1 else f"{base}#{seen[base]}", kind, nodes))

    # 3. Crossing values. A cut that a value of data-dependent shape would cross cannot be a pipeline
    #    boundary (stages send fixed shapes): the blocks on both sides merge into one block.
    blocks, node_block, values, edges = _chain(captured, named, rebuild)
    refused = _refused_cuts(blocks, values)
    if refused:
        groups: list[list[int]] = []
        for b in blocks:
            if groups and b.index in refused:
                groups[-1].append(b.index)
            else:
                groups.append([b.index])
        named = [_merged([named[i] for i in g]) for g in groups]
        blocks, node_block, values, edges = _chain(captured, named, rebuild)
    return BlockGraph(
        captured=captured,
        blocks=tuple(blocks),
        node_block=node_block,
        values=tuple(values),
        stacks=tuple(block_prefixes) if block_prefixes is not None else stacks,
        block_prefixes=tuple(block_prefixes) if block_prefixes is not None else None,
        edges=edges,
        refused_cuts=tuple(refused.values()),
        rebuild=rebuild,
    )


def _merged(parts: list[tuple[str, BlockKind, list[fx.Node]]]) -> tuple[str, BlockKind, list[fx.Node]]:
    """One block of consecutive blocks: named ``first..last``, a ``layer`` only if all of them are."""
    if len(parts) == 1:
        return parts[0]
    kinds = {k for _, k, _ in parts}
    kind: BlockKind = "layer" if kinds == {"layer"} else "glue" if kinds == {"glue"} else "module"
    return f"{parts[0][0]}{MERGED}{parts[-1][0]}", kind, [n for _, _, nodes in parts for n in nodes]


def _refused_cuts(blocks: Sequence[Block], values: Sequence[CrossingValue]) -> dict[int, RefusedCut]:
    """Cut index -> why it cannot be a stage boundary: values of data-dependent shape cross it."""
    refused: dict[int, RefusedCut] = {}
    for k in range(1, len(blocks)):
        bad = tuple(v for v in values if v.data_dependent and v.producer < k <= v.last_use)
        if bad:
            refused[k] = RefusedCut(before=blocks[k].name, after=blocks[k - 1].name, values=bad)
    return refused


def _chain(
    captured: Captured, named: Sequence[tuple[str, BlockKind, list[fx.Node]]], rebuild: bool = True
) -> tuple[list[Block], dict[str, int], list[CrossingValue], tuple[BlockEdge, ...]]:
    """Blocks, node -> block, crossing values and block edges of a chain of named node runs."""
    gm = captured.graph_module
    graph = gm.graph
    node_block: dict[str, int] = {}
    blocks: list[Block] = []
    for i, (name, kind, nodes) in enumerate(named):
        attrs: list[str] = []
        for n in nodes:
            node_block[n.name] = i
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a.target not in attrs:
                    attrs.append(str(a.target))
            if n.op == "call_module":
                sub = gm.get_submodule(str(n.target))
                attrs.extend(f"{n.target}.{p}" for p, _ in sub.named_parameters() if f"{n.target}.{p}" not in attrs)
        num = 0
        for target in attrs:
            try:
                num += gm.get_parameter(target).numel()
            except AttributeError:
                pass  # a buffer or constant
        blocks.append(
            Block(
                index=i, name=name, kind=kind, nodes=tuple(n.name for n in nodes), params=tuple(attrs), num_params=num
            )
        )

    # Crossing values: produced in block p (or input), read in a later block (or output).
    n_blocks = len(blocks)
    examples = dict(zip([n.name for n in graph.nodes if n.op == "placeholder"], captured.example_flat_inputs))
    roots = _rebuildable(gm) if rebuild else {}
    input_bytes = {n.name: _value_info(n, examples.get(n.name))[2] for n in graph.nodes if n.op == "placeholder"}
    values: list[CrossingValue] = []
    edges: dict[tuple[int, int], tuple[list[str], int]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            producer = INPUT
        elif node.name in node_block:
            producer = node_block[node.name]
        else:
            continue
        uses = []
        for user in node.users:
            if user.op == "output":
                uses.append(n_blocks)
            elif user.name in node_block:
                uses.append(node_block[user.name])
        later = [u for u in uses if u > producer]
        if not later:
            continue
        shape, dtype, nbytes, dependent = _value_info(node, examples.get(node.name))
        # Rebuilt: a tensor made from model inputs by cheap ops, larger than those inputs.
        sources = roots.get(node) if producer >= 0 and shape is not None and not dependent else None
        rebuilt = sources is not None and sum(input_bytes[r] for r in sources) < nbytes
        values.append(
            CrossingValue(
                name=node.name,
                producer=producer,
                last_use=max(later),
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                data_dependent=dependent,
                rebuilt=rebuilt,
                rebuilt_from=tuple(sorted(sources)) if rebuilt and sources is not None else (),
            )
        )
        if rebuilt:
            continue  # nothing travels between blocks: each reader makes it again
        for u in sorted(set(later)):
            if producer >= 0 and u < n_blocks:
                names, total = edges.get((producer, u), ([], 0))
                edges[(producer, u)] = ([*names, node.name], total + nbytes)
    return blocks, node_block, values, tuple(
        BlockEdge(producer=i, consumer=j, values=tuple(names), nbytes=total) for (i, j), (names, total) in edges.items()
    )
