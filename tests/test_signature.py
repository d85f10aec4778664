"""Block signatures: equal for every layer of a stack, different when structure or input shapes differ."""

import dataclasses
import json

import torch
from torch import nn

from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.costs import annotate as cost_mod
from omnibal_compile.costs._signature import block_signature
from omnibal_compile.costs.annotate import annotate_costs, block_inputs, block_modules
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

CFG = TinyVLMConfig(vit_layers=3, llm_layers=4, vit_hidden=32, vit_mlp=64, llm_hidden=48, llm_mlp=96)


def _blocks(batch=2, text=16):
    torch.manual_seed(0)
    model = TinyVLM(CFG)
    graph = build_blocks(
        capture(model, make_example_batch(CFG, batch=batch, tiles_per_sample=1, text_tokens=text)), model
    )
    modules = block_modules(graph, model)
    return model, graph, modules, block_inputs(graph, modules)


def test_every_layer_of_a_stack_has_one_signature_and_other_blocks_differ():
    _, graph, modules, inputs = _blocks()
    sig = {n: block_signature(m, x) for n, m, x in zip(graph.names, modules, inputs)}
    vit = {sig[f"vision.layers.{i}"] for i in range(CFG.vit_layers)}
    llm = {sig[f"llm.layers.{i}"] for i in range(CFG.llm_layers)}  # first and last layers included
    assert len(vit) == 1 and len(llm) == 1 and vit != llm
    others = [s for n, s in sig.items() if ".layers." not in n]
    assert len(set(others)) == len(others)  # glue, embeddings, projector, head: all distinct
    # different values, same shapes: same signature; another shape: another signature
    k = graph.names.index("llm.layers.1")
    noisy = [x + 1 if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs[k]]
    assert block_signature(modules[k], noisy) == sig["llm.layers.1"]
    _, graph2, modules2, inputs2 = _blocks(text=24)
    k2 = graph2.names.index("llm.layers.1")
    assert block_signature(modules2[k2], inputs2[k2]) != sig["llm.layers.1"]


def test_cost_pass_times_each_signature_once_and_says_so():
    model, graph, _, _ = _blocks()
    table = annotate_costs(graph, model, device="cpu", repeats=3, warmup=0)
    by_name = {b.name: b for b in table.blocks}
    for stack, n in (("vision", CFG.vit_layers), ("llm", CFG.llm_layers)):
        first = by_name[f"{stack}.layers.0"]
        assert first.profiled_as == "" and first.time_spread >= 0
        for i in range(1, n):
            b = by_name[f"{stack}.layers.{i}"]
            assert b.profiled_as == f"{stack}.layers.0" and b.signature == first.signature
            assert (b.forward_s, b.backward_s, b.flops, b.recompute_s) == (
                first.forward_s,
                first.backward_s,
                first.flops,
                first.recompute_s,
            )
    assert all(not b.profiled_as for b in table.blocks if ".layers." not in b.name)
    assert "share the times of an identical block" in table.summary()
    again = CostTable.from_json(table.to_json())
    assert again == table and again.blocks[3].profiled_as == table.blocks[3].profiled_as
    # tables written before these fields existed still load
    data = json.loads(table.to_json())
    for b in data["blocks"]:
        for field in ("signature", "profiled_as", "time_spread"):
            b.pop(field)
    assert CostTable.from_dict(data).blocks[3] == dataclasses.replace(
        table.blocks[3], signature="", profiled_as="", time_spread=0.0
    )


# -- on the meta device, as real-size planning costs them --------------------------------------------
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


def _meta_graph(widths):
    with torch.device("meta"):
        model = _Stack(widths).to(torch.bfloat16)
    x = torch.empty(2, 64, widths[0], device="meta", dtype=torch.bfloat16)
    return model, build_blocks(capture(model, (x,)), model, block_prefixes=[f"layers.{i}" for i in range(len(widths))]
                               + [f"proj.{i}" for i in range(len(widths))])


def test_identical_layers_share_a_signature_on_meta():
    model, graph = _meta_graph([512, 512, 512, 256])
    modules = block_modules(graph, model)
    inputs = block_inputs(graph, modules)
    sig = {b.name: block_signature(m, x) for b, m, x in zip(graph.blocks, modules, inputs)}
    assert sig["layers.1"] == sig["layers.2"] != sig["layers.3"]  # names differ, ops do not
    assert sig["layers.0"] != sig["layers.1"]  # its input is the model's, which needs no gradient
    assert sig["proj.0"] == sig["proj.1"] != sig["proj.2"]  # 512 -> 256 differs


def test_roofline_costs_each_signature_once(monkeypatch):
    model, graph = _meta_graph([512] * 6)
    calls = []
    real = cost_mod.record_ops
    monkeypatch.setattr(cost_mod, "record_ops", lambda m, x, **kw: calls.append(1) or real(m, x, **kw))
    table = annotate_costs(graph, model, device="a100-80gb")
    assert len(calls) < graph.num_blocks
    layers = [b for b in table.blocks if b.name.startswith("layers.")]
    assert len({(b.flops, b.forward_s, tuple(b.activation_bytes.values())) for b in layers[1:]}) == 1
