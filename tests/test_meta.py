"""Costing on the meta device: runtime checks dropped, value reads named, the training dtype, fused attention.

Models have realistic widths and a few layers; nothing is allocated (every weight is on ``meta``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import omnibal_compile as oc
from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.costs._measure import kept_bytes
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.costs.meta import check_only_nodes, drop_checks, inputs_read, meta_copy
from omnibal_compile.errors import InputError


def _meta(module_cls, *args, dtype=torch.float32):
    with torch.device("meta"):
        return module_cls(*args).to(dtype)


# -- runtime checks and value reads ------------------------------------------------------------------


class _Checked(nn.Module):
    """Checks its input like HF LLaVA checks image tokens against image features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        torch._check_tensor_all((ids == 3).sum() == 2)
        return self.lin(x).sum()


class _Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(x[ids > 0]).sum()  # the shape depends on the values of ids


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Gather()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(x, ids)


def test_runtime_checks_are_dropped_when_costing_on_meta():
    model = _meta(_Checked)
    x, ids = torch.empty(1, 4, 256, device="meta"), torch.empty(1, 4, dtype=torch.long, device="meta")
    gm = capture(model, (x, ids)).graph_module
    checks = check_only_nodes(gm.graph)
    targets = {str(n.target) for n in gm.graph.nodes if n.name in checks}
    assert {"aten.item.default", "aten._assert_scalar.default", "aten._is_all_true.default"} <= targets
    assert not any("linear" in t for t in targets) and inputs_read(gm) == {}
    result = oc.optimize(model, (x, ids), num_stages=1, device="a100-80gb")
    assert sum(b.flops for b in result.costs.blocks) == 2 * 4 * 256 * 256
    # Left in, the check reads a value the meta device does not have.
    with pytest.raises(RuntimeError, match="meta"):
        gm(x, ids)
    assert drop_checks(gm, checks) == len(checks)
    gm(x, ids)


def test_a_value_read_names_the_input_that_must_be_real():
    model = _meta(_Reads)
    x = torch.empty(1, 4, 256, device="meta")
    ids = torch.tensor([[3, 3, 1, 0]])
    with pytest.raises(InputError, match=r"input 'ids' is on the meta device, but the model reads its values: node "
                                         r"'index' \(aten.index in inner\).*Give 'ids' as a real \(CPU\) tensor"):
        oc.optimize(model, (x, ids.to("meta")), num_stages=1, device="a100-80gb")
    table = oc.optimize(model, (x, ids), num_stages=1, device="a100-80gb").costs  # x and the weights stay on meta
    assert sum(b.flops for b in table.blocks) == 2 * 3 * 256 * 256  # three ids > 0


def test_meta_copy_allocates_nothing_and_keeps_ties():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    model[1].weight = model[0].weight
    model.register_buffer("steps", torch.zeros(3, dtype=torch.long))
    copy = meta_copy(model, torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in copy.parameters())
    assert copy[1].weight is copy[0].weight and copy.steps.dtype == torch.long
    assert not any(p.is_meta for p in model.parameters()) and model[0].weight.dtype == torch.float32


# -- the training dtype and the attention kernel -----------------------------------------------------


def _llama(dtype, layers=2):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg).to(dtype)


def _ids(tokens):
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama_tables():
    """bf16-built at 512 and 1024 tokens, fp32-built at 512 (every input on meta)."""
    out = {}
    for key, dtype, tokens in (
        ("bf16", torch.bfloat16, 512),
        ("fp32", torch.float32, 512),
        ("bf16x2", torch.bfloat16, 1024),
    ):
        model = _llama(dtype)
        graph = build_blocks(capture(model, _ids(tokens)), model)
        out[key] = annotate_costs(graph, model, device="h100-80gb")
    return out


def test_bf16_and_fp32_builds_cost_the_same(llama_tables):
    bf16, fp32 = llama_tables["bf16"], llama_tables["fp32"]
    assert bf16 == fp32
    assert bf16.activation_dtype == "bfloat16" and "Activations in bfloat16." in bf16.summary()
    layer = next(b for b in bf16.blocks if b.kind == "layer")
    # bf16 activations, with the fp32 copies HF's RMSNorm makes: ~2/3 of the fp32-computed figure.
    assert layer.activation_bytes["none"] < 80_000 * 512


def test_fused_attention_keeps_no_score_matrix(llama_tables):
    one, two = llama_tables["bf16"], llama_tables["bf16x2"]
    assert one.attention.startswith("memory-efficient (masked) attention: no score matrix kept")
    a, b = (next(x for x in t.blocks if x.kind == "layer") for t in (one, two))
    # Kept bytes grow with the tokens, not their square (a score matrix would be 16 heads x L^2 x 2 B).
    assert b.activation_bytes["none"] == pytest.approx(2 * a.activation_bytes["none"], rel=0.02)
    assert b.backward_s > 2 * b.forward_s  # fused attention's backward recomputes the scores


def test_grouped_query_attention_keeps_k_and_v_once():
    q = torch.empty(1, 32, 512, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, 8, 512, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q * 1, k * 1, v * 1, is_causal=True, enable_gqa=True)

    kept = kept_bytes(attend, (q, k, k), [False] * 3)
    qb, kb = q.numel() * 2, k.numel() * 2
    lse = 32 * 512 * 4  # fp32 log-sum-exp per query
    assert kept == qb + 2 * kb + qb + lse  # q, k, v copies, the output, the log-sum-exp: no repeated k, v


class _EagerAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(256, 768)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).sum()


def test_eager_attention_is_named_as_traced():
    table = oc.optimize(_meta(_EagerAttention), (torch.empty(1, 64, 256, device="meta"),), num_stages=1,
                        device="h200").costs
    assert table.attention.startswith("as traced: matmuls and a softmax, the score matrix kept")


def test_meta_models_cannot_be_profiled_here():
    with pytest.raises(InputError, match="meta device, which has no values to time.*target GPU"):
        oc.optimize(_meta(_Checked), (torch.empty(1, 4, 256, device="meta"), torch.zeros(1, 4, dtype=torch.long)),
                    num_stages=1, device="cpu")


# -- a LLaVA-shaped model with every input on meta ---------------------------------------------------


def test_llava_with_every_input_on_meta_plans():
    tf = pytest.importorskip("transformers")
    tc = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32000, use_cache=False)
    vc = tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
                             image_size=336, patch_size=14)
    cfg = tf.LlavaConfig(text_config=tc, vision_config=vc, image_token_index=31999, vision_feature_layer=-2)
    with torch.device("meta"):
        model = tf.LlavaForConditionalGeneration(cfg)  # fp32, as built by default
    ids = torch.zeros(1, 576 + 64, dtype=torch.long, device="meta")
    batch = {"pixel_values": torch.empty(1, 3, 336, 336, device="meta"), "input_ids": ids, "labels": ids}
    result = oc.optimize(model, batch, num_stages=2, device="a100-80gb", memory_budget="80GiB")
    costs = result.costs
    assert costs.activation_dtype == "bfloat16"
    assert "flash" in costs.attention and "memory-efficient" in costs.attention  # ViT unmasked, LLM masked
    layers = [b for b in costs.blocks if b.kind == "layer"]
    assert len(layers) == 4 and all(b.flops > 0 for b in layers)
    llm = layers[-1]
    assert llm.flops == pytest.approx(2 * 640 * (4 * 4096**2 + 3 * 4096 * 11008) + 4 * 640**2 * 4096, rel=1e-6)
    assert result.plan.num_stages == 2 and result.plan.iteration_time_s > 0
