"""Block signatures: identical layers share one, and the roofline cost pass costs each signature once."""

from __future__ import annotations

import torch
from torch import nn

from omnibal_compile.passes import cost as cost_mod
from omnibal_compile.passes.block_signature import block_signature
from omnibal_compile.passes.blocks import build_blocks
from omnibal_compile.passes.capture import capture
from omnibal_compile.passes.cost import annotate_costs, block_inputs, block_modules


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Stack(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(w) for w in widths)
        self.proj = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:] + widths[-1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, proj in zip(self.layers, self.proj):
            x = proj(layer(x))
        return x.sum()


def _graph(widths):
    with torch.device("meta"):
        model = _Stack(widths).to(torch.bfloat16)
    x = torch.empty(2, 64, widths[0], device="meta", dtype=torch.bfloat16)
    return model, build_blocks(capture(model, (x,)), model, block_prefixes=[f"layers.{i}" for i in range(len(widths))]
                               + [f"proj.{i}" for i in range(len(widths))])


def test_identical_layers_share_a_signature():
    model, graph = _graph([512, 512, 512, 256])
    modules = block_modules(graph, model)
    inputs = block_inputs(graph, modules)
    sig = {b.name: block_signature(m, x) for b, m, x in zip(graph.blocks, modules, inputs)}
    assert sig["layers.1"] == sig["layers.2"] != sig["layers.3"]  # names differ, ops do not
    assert sig["layers.0"] != sig["layers.1"]  # its input is the model's, which needs no gradient
    assert sig["proj.0"] == sig["proj.1"] != sig["proj.2"]  # 512 -> 256 differs
    assert block_signature(modules[0], inputs[0], "charged") != sig[graph.blocks[0].name]


def test_roofline_costs_each_signature_once(monkeypatch):
    model, graph = _graph([512] * 6)
    calls = []
    real = cost_mod.record_ops
    monkeypatch.setattr(cost_mod, "record_ops", lambda m, x, **kw: calls.append(1) or real(m, x, **kw))
    table = annotate_costs(graph, model, device="a100-80gb")
    assert len(calls) < graph.num_blocks
    layers = [b for b in table.blocks if b.name.startswith("layers.")]
    assert len({(b.flops, b.forward_s, tuple(b.activation_bytes.values())) for b in layers[1:]}) == 1
