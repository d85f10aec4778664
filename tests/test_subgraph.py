"""Subgraph helpers: node copies with parameters read once on first use; module paths of nodes."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from omnibal_compile.compile._subgraph import SubgraphCopy, module_call, module_path, strip_call_suffix


class _TwoParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.a
        z = y + self.a
        return z * self.b


def test_copy_reads_each_parameter_once_and_only_where_used():
    gm = fx.symbolic_trace(_TwoParams())
    nodes = list(gm.graph.nodes)
    x = next(n for n in nodes if n.op == "placeholder")
    first_two = [n for n in nodes if n.op == "call_function"][:2]  # x * a, y + a: b is not read
    sub = SubgraphCopy(lambda v: RuntimeError(f"missing {v.name}"))
    sub.input(x, {"note": 1})
    sub.copy(first_two)
    sub.graph.output(sub.env[first_two[-1]])
    attrs = [n.target for n in sub.graph.nodes if n.op == "get_attr"]
    assert attrs == ["a"]
    assert sub.env[x].name == "x" and sub.env[x].meta == {"note": 1}
    out = fx.GraphModule(gm, sub.graph)(torch.full((3,), 3.0))
    assert out.tolist() == [4.0, 4.0, 4.0]


def test_copy_without_an_input_raises_the_callers_error():
    gm = fx.symbolic_trace(_TwoParams())
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    sub = SubgraphCopy(lambda v: RuntimeError(f"missing {v.name}"))
    with pytest.raises(RuntimeError, match="missing x"):
        sub.copy([first])


def test_module_paths_drop_the_call_suffix():
    graph = fx.Graph()
    node = graph.placeholder("x")
    assert module_call(node) is None and module_path(node) == ""
    node.meta["nn_module_stack"] = {"k0": ("llm", nn.Module), "k1": ("llm.norm@2", nn.Module)}
    assert module_call(node) == "llm.norm@2"
    assert module_path(node) == "llm.norm"
    assert strip_call_suffix("llm.layers.10") == "llm.layers.10"
