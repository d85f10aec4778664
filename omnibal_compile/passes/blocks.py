"""Blocks pass: group the captured graph's nodes into a chain of blocks and find what crosses each cut.

Glossary:
    layer stack   a container whose children are named 0, 1, 2, ... and share one class (an
                  ``nn.ModuleList`` of transformer layers). Each child is one ``layer`` block.
    module block  the outermost submodule that holds no layer stack (embeddings, projector, head).
    glue          ops that run in a module holding a stack but outside any block (mask and rotary
                  table construction, splicing image features into text, the loss).
    cut k         the boundary between block k-1 and block k (1 <= k < number of blocks).
    crossing value  a value produced before cut k (by a block, or a model input) and used at or
                  after it (by a block, or as a model output): it must be sent across a pipeline
                  boundary at that cut. Skip tensors (masks, rotary tables, labels) cross many cuts.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
from torch import nn

from omnibal_compile.errors import InputError
from omnibal_compile.passes.capture import Captured
from omnibal_compile.passes.subgraph import module_path
from omnibal_compile.tables import format_table

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Block", "BlockEdge", "CrossingValue", "BlockGraph", "build_blocks", "find_layer_stacks"]

BlockKind = Literal["layer", "module", "glue"]
INPUT = -1
"""Producer index of model inputs."""


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
    block_prefixes: tuple[str, ...] | None = None
    """The ``block_prefixes`` the blocks were built with (None: the default grouping)."""

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
        return tuple(v for v in self.values if v.producer < cut <= v.last_use)

    def cut_bytes(self, cut: int) -> int:
        """Bytes sent across cut ``cut`` per batch."""
        return sum(v.nbytes for v in self.crossing(cut))

    def summary(self) -> str:
        """A table: index, name, kind, node count, parameters, bytes crossing the cut after it."""
        rows = [("#", "block", "kind", "nodes", "params", "send after (bytes)")]
        for b in self.blocks:
            after = "-" if b.index == self.num_blocks - 1 else f"{self.cut_bytes(b.index + 1):,}"
            rows.append((str(b.index), b.name, b.kind, str(len(b.nodes)), f"{b.num_params:,}", after))
        return format_table(rows, "lllrrr")


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


def _value_info(node: fx.Node, example: Any = None) -> tuple[tuple[int, ...] | None, str | None, int]:
    val = node.meta.get("val", example)
    if val is None and "tensor_meta" in node.meta:
        tm = node.meta["tensor_meta"]
        if hasattr(tm, "shape"):
            numel = 1
            for d in tm.shape:
                numel *= int(d)
            return tuple(int(d) for d in tm.shape), str(tm.dtype), numel * tm.dtype.itemsize
    if isinstance(val, torch.Tensor):
        shape = tuple(int(d) for d in val.shape)
        return shape, str(val.dtype), val.numel() * val.element_size()
    return None, None, 0


_SKIP_TARGETS = {"_guards_fn"}


def build_blocks(
    captured: Captured,
    model: nn.Module,
    *,
    block_prefixes: Sequence[str] | None = None,
) -> BlockGraph:
    """Group ``captured``'s nodes into blocks along ``model``'s module boundaries.

    By default each element of every layer stack of ``model`` is a block, the outermost other
    submodules are blocks, and the glue between them forms blocks of its own. ``block_prefixes``
    overrides the grouping: a node belongs to the longest listed module path that contains it.
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
    node_block: dict[str, int] = {}
    params_of: list[list[str]] = []
    blocks_raw: list[tuple[str, BlockKind, list[fx.Node]]] = []
    for i, ((path, kind), nodes) in enumerate(runs):
        base = f"{path or '<root>'}:glue" if kind == "glue" else path
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        blocks_raw.append((name, kind, nodes))
        for n in nodes:
            node_block[n.name] = i
        attrs: list[str] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a.target not in attrs:
                    attrs.append(str(a.target))
            if n.op == "call_module":
                sub = captured.graph_module.get_submodule(str(n.target))
                attrs.extend(f"{n.target}.{p}" for p, _ in sub.named_parameters() if f"{n.target}.{p}" not in attrs)
        params_of.append(attrs)

    gm = captured.graph_module
    blocks = []
    for i, (name, kind, nodes) in enumerate(blocks_raw):
        num = 0
        for target in params_of[i]:
            try:
                num += gm.get_parameter(target).numel()
            except AttributeError:
                pass  # a buffer or constant
        blocks.append(
            Block(index=i, name=name, kind=kind, nodes=tuple(n.name for n in nodes), params=tuple(params_of[i]), num_params=num)
        )

    # 3. Crossing values: produced in block p (or input), read in a later block (or output).
    n_blocks = len(blocks)
    examples = dict(zip([n.name for n in graph.nodes if n.op == "placeholder"], captured.example_flat_inputs))
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
        shape, dtype, nbytes = _value_info(node, examples.get(node.name))
        values.append(
            CrossingValue(name=node.name, producer=producer, last_use=max(later), shape=shape, dtype=dtype, nbytes=nbytes)
        )
        for u in sorted(set(later)):
            if producer >= 0 and u < n_blocks:
                names, total = edges.get((producer, u), ([], 0))
                edges[(producer, u)] = ([*names, node.name], total + nbytes)
    return BlockGraph(
        captured=captured,
        blocks=tuple(blocks),
        node_block=node_block,
        values=tuple(values),
        stacks=tuple(block_prefixes) if block_prefixes is not None else stacks,
        block_prefixes=tuple(block_prefixes) if block_prefixes is not None else None,
        edges=tuple(
            BlockEdge(producer=i, consumer=j, values=tuple(names), nbytes=total) for (i, j), (names, total) in edges.items()
        ),
    )
