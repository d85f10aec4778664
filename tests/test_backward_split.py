"""The backward split into its input-gradient part (B) and weight-gradient part (W), as the cost pass measures
and models it: B + W is the whole backward, a frozen block has W = 0, a matmul's backward splits 1:1.

Timings on this shared CPU are noisy: the measured split is checked loosely, the rules exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnibal_compile.costs.analytic import INTERNVL_6B_20B, MicroBatch, cost_table
from omnibal_compile.costs.annotate import profile_costs
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.costs.mix import scale_costs
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BlockCost, with_frozen


class _Layer(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(h) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_roofline_splits_matmul_backward_one_to_one():
    h, t = 4096, 4096
    with torch.device("meta"):
        model = _Stack(h, 3).to(torch.bfloat16)
    table = profile_costs(model, (torch.empty(t, h, device="meta", dtype=torch.bfloat16),), device="a100-80gb")
    layer = table.blocks[1]
    matmul = 2 * (2 * t * h * 4 * h) / A100_80G.calibration["matmul"] / A100_80G.peak_flops
    assert layer.weight_grad_s is not None
    assert layer.weight_grad_s == pytest.approx(matmul, rel=0.02)  # W = the weight matmuls' forward time
    assert layer.weight_grad_s + layer.backward_input_s == pytest.approx(layer.backward_s)
    assert 0.4 * layer.backward_s < layer.weight_grad_s <= 0.5 * layer.backward_s  # B also has the elementwise part


def test_profiled_split_adds_up_and_a_frozen_block_has_no_weight_gradient():
    torch.manual_seed(0)
    model = _Stack(96, 3)
    for p in model.layers[2].parameters():
        p.requires_grad_(False)
    table = profile_costs(model, (torch.randn(256, 96),), device="cpu", repeats=5, clock="thread")
    layers = [b for b in table.blocks if b.num_params]
    assert len(layers) == 3
    first, middle, frozen = layers
    # the model's input needs no gradient: the first layer's whole backward is its weight gradient
    assert first.weight_grad_s == first.backward_s > 0
    assert middle.weight_grad_s is not None and frozen.weight_grad_s == 0.0
    assert middle.weight_grad_s + middle.backward_input_s == pytest.approx(middle.backward_s)
    # two matmuls each way: W is about half the backward (loose: a shared, noisy CPU)
    assert 0.15 * middle.backward_s < middle.weight_grad_s < 0.85 * middle.backward_s
    assert frozen.backward_s > 0 and frozen.backward_input_s == frozen.backward_s


def test_modelled_tables_carry_the_split_through_freezing_and_scaling():
    table = cost_table(INTERNVL_6B_20B, MicroBatch(tiles=8, tokens=4096, attention_pairs=4096 * 4097 / 2))
    layer = next(b for b in table.blocks if b.name.startswith("llm") and b.kind == "layer")
    assert layer.weight_grad_s is not None and 0 < layer.weight_grad_s < layer.backward_s
    frozen = with_frozen(table, [b.num_params if b.name.startswith("vision") else 0 for b in table.blocks])
    vit = [b for b in frozen.blocks if b.name.startswith("vision")]
    assert vit and all(b.weight_grad_s == 0.0 for b in vit)
    doubled = scale_costs(table, 2.0)
    assert doubled.blocks[5].weight_grad_s == pytest.approx(2 * table.blocks[5].weight_grad_s)


def test_weight_gradient_is_a_part_of_the_backward():
    kw = dict(name="b", kind="layer", flops=1.0, num_params=1, static_bytes=1, forward_s=1.0, backward_s=2.0,
              activation_bytes=dict.fromkeys(("none", "selective", "full"), 0),
              recompute_s=dict.fromkeys(("none", "selective", "full"), 0.0))
    assert BlockCost(**kw).weight_grad_s is None and BlockCost(**kw).backward_input_s == 2.0  # unknown: all B
    assert BlockCost(**kw, weight_grad_s=0.5).backward_input_s == 1.5
    with pytest.raises(InputError, match="weight_grad_s 3.0 must lie within 0..backward_s"):
        BlockCost(**kw, weight_grad_s=3.0)
