"""Graph helpers shared by the passes: copying nodes into a new graph, reading a node's module path.

Glossary:
    subgraph copy  a new ``fx.Graph`` filled with copies of nodes of a source graph (a stage, a
                   recompute region). Each parameter or buffer read (``get_attr``) is created once
                   per target, on first use, so a parameter read only by nodes left out stays out.
    module call    the innermost entry of a node's ``nn_module_stack``: the module path of the call
                   that ran it, with an ``@n`` suffix when the module is called more than once.
    module path    the module call without its ``@n`` suffix (``llm.layers.3``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.fx as fx

__all__ = ["SubgraphCopy", "module_call", "module_path", "strip_call_suffix"]

_CALL_SUFFIX = re.compile(r"@\d+$")


def strip_call_suffix(call: str) -> str:
    """``llm.norm@2`` -> ``llm.norm``: the module path of a module call."""
    return _CALL_SUFFIX.sub("", call)


def module_call(node: fx.Node) -> str | None:
    """The innermost module call that ran ``node`` (``@n`` kept); None when it has no module stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return str(list(stack.values())[-1][0])


def module_path(node: fx.Node) -> str:
    """Module path of the innermost module that ran ``node``; ``""`` when it has no module stack."""
    # Strict-mode export spells paths as L['self'].a.b or L__self___a_b; we use non-strict only.
    call = module_call(node)
    return strip_call_suffix(call) if call is not None else ""


class SubgraphCopy:
    """Builds a new ``fx.Graph`` from copies of nodes of another graph.

    ``env`` maps source nodes to their counterparts in the new graph: the inputs (:meth:`input`),
    every copy (:meth:`copy`), and whatever the caller emits itself.
    """

    def __init__(self, missing: Callable[[fx.Node], Exception]) -> None:
        """``missing(x)`` is raised when a copied node reads a value ``x`` the new graph lacks."""
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self._attrs: dict[str, fx.Node] = {}
        self._missing = missing

    def input(self, node: fx.Node, meta: Mapping[str, Any]) -> fx.Node:
        """A placeholder named like ``node`` that stands for it, with ``meta``."""
        ph = self.graph.placeholder(node.name)
        ph.meta.update(meta)
        self.env[node] = ph
        return ph

    def read(self, x: fx.Node) -> fx.Node:
        """The new graph's value for source node ``x``; a ``get_attr`` is created on first use."""
        if x in self.env:
            return self.env[x]
        if x.op != "get_attr":
            raise self._missing(x)
        target = str(x.target)
        if target not in self._attrs:
            self._attrs[target] = self.graph.get_attr(target)
            self._attrs[target].meta.update(x.meta)
        self.env[x] = self._attrs[target]
        return self.env[x]

    def copy(self, nodes: Iterable[fx.Node]) -> None:
        """Append a copy of each of ``nodes`` (in the order given) to the new graph."""
        for n in nodes:
            self.env[n] = self.graph.node_copy(n, self.read)
