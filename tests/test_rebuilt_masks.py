"""Values cheap to make again are rebuilt by the stages that read them, not sent: the rule on a small graph, and
packed Hugging Face VLMs whose pipeline stages rebuild the pack's attention mask from its positions and still
give every sample exactly what it gets alone (compile/blocks.py, integrations/hf/masks.py)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import omnibal_compile as oc
from omnibal_compile.compile.blocks import build_blocks
from omnibal_compile.compile.capture import capture, training_config
from omnibal_compile.compile.codegen import generate_stages, run_stages, stage_info
from omnibal_compile.ir.plan import Plan

L = 16


class _Toy(nn.Module):
    """Glue that makes five values of one input before block ``a``, read after it by ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, L), nn.Linear(L, L)
        self.w = nn.Parameter(torch.randn(1, 1, L))

    def forward(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = (seg[:, :, None] == seg[:, None, :]) & causal  # cheap, from seg, L x larger than it: rebuilt
        heavy = torch.matmul(x, x.transpose(1, 2))  # no parameter, larger than x, but a matmul: sent
        weighted = seg[:, :, None].float() * self.w  # reads a parameter: sent
        noisy = torch.rand(1, L, L) < 2.0  # of no input, but random (always true here): sent
        small = seg * 2  # cheap, but no larger than seg: sent
        h = self.a(x)
        extra = heavy + weighted + noisy.float() + small[:, :, None].float()
        return self.b(h.masked_fill(~mask, 0.0) + extra)


def _toy_graph():
    torch.manual_seed(0)
    model = _Toy()
    x = torch.randn(1, L, 4)
    seg = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4])
    captured = capture(model, (x, seg))
    return model, (x, seg), captured, build_blocks(captured, model, block_prefixes=["a", "b"])


def _kinds(values):
    """(shape, dtype) of each value."""
    return sorted((v.shape, v.dtype) for v in values)


def test_a_cheap_parameter_free_value_is_rebuilt_and_nothing_else():
    model, inputs, captured, graph = _toy_graph()
    cut = graph.names.index("a") + 1  # after block a: the glue after it reads all five
    rebuilt = graph.rebuilt_across(cut)
    assert _kinds(rebuilt) == [((1, L, L), "torch.bool")]
    assert rebuilt[0].rebuilt_from == ("seg",)
    sent = graph.crossing(cut)
    assert "seg" in {v.name for v in sent}  # seg travels in the mask's place
    kinds = _kinds(sent)
    for kept in [((1, L, L), "torch.float32"), ((1, L, L), "torch.bool"), ((1, L), "torch.int64")]:
        assert kept in kinds, (kept, kinds)  # the matmul and the parameter's product, the random draw, seg * 2
    assert kinds.count(((1, L, L), "torch.float32")) == 3  # with block a's output
    old = build_blocks(captured, model, block_prefixes=["a", "b"], rebuild=False)
    assert not old.rebuilt_across(cut)
    assert old.cut_bytes(cut) - graph.cut_bytes(cut) == L * L - (0 if "seg" in {v.name for v in old.crossing(cut)}
                                                                   else 8 * L)
    # the stage after the cut makes the mask itself, from seg, and gives the unsplit model's output
    plan = Plan(block_names=graph.names, boundaries=(0, cut, graph.num_blocks))
    stages = generate_stages(graph, plan, model)
    assert rebuilt[0].name not in stage_info(stages[1]).input_names
    assert rebuilt[0].name in {n.name for n in stages[1].graph.nodes}
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, inputs)[0], model(*inputs), rtol=0, atol=1e-6)


# -- packed Hugging Face VLMs ---------------------------------------------------------------------------------------

PACK = [(1, 9), (2, 6), (1, 5)]
"""(tiles, text tokens) of the packed samples."""


def _families():
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import hf_families

    return hf_families


def _pack(model, samples, *, row: int | None = None):
    from omnibal_compile.data.collate import PackingCollator, synthetic_sample
    from omnibal_compile.data.packing import PackShape
    from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_pack_inputs

    facts = hf_data_facts(model)
    tpt = facts["tokens_per_tile"]
    g = torch.Generator().manual_seed(3)
    made = [synthetic_sample(t, t * tpt + n, tokens_per_tile=tpt, image_token_id=facts["image_token_id"],
                             vocab_size=facts["image_token_id"], image_shape=facts["image_shape"], generator=g)
            for t, n in samples]
    tiles, tokens = sum(t for t, _ in samples), sum(t * tpt + n for t, n in samples)

    def collate(part, tiles, tokens, seq_len):
        return hf_pack_inputs(model, PackingCollator(shape=PackShape(tiles=tiles, tokens=tokens), seq_len=seq_len,
                                                     tokens_per_tile=tpt, image_token_id=facts["image_token_id"],
                                                     image_shape=facts["image_shape"])(part))

    alone = [collate([s], t, t * tpt + n, t * tpt + n) for s, (t, n) in zip(made, samples)]
    return collate(made, tiles, tokens, row or tokens), alone


def _model(name):
    model, _ = _families().build(name)
    if name == "gemma3":  # its projector starts at zero: every image token would get the same features, and
        with torch.no_grad():  # attention over identical values cannot tell a bidirectional block from a causal one
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return model


def _logits_alone(model, alone):
    out = []
    for batch in alone:
        given = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask", "position_ids")}
        with torch.no_grad(), training_config(model):
            out.append(model(**given).logits[0])  # the model's own masking and positions
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3", "paligemma"])
def test_pipelined_pack_gives_each_sample_its_own_logits_without_sending_the_mask(family):
    model = _model(family)
    packed, alone = _pack(model, PACK, row=None)
    L = packed["input_ids"].shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = oc.optimize(model, packed, num_stages=3 if family != "llava" else 2, planner="uniform")
    graph = result.graph
    for s, stage in enumerate(result.stages[1:], start=1):
        for name in stage_info(stage).input_names:
            v = graph.value_named(name)
            assert v is not None and not (v.shape and len(v.shape) >= 2 and v.shape[-2:] == (L, L)), (s, name, v)
        assert not any(name.startswith("attention_mask") for name in stage_info(stage).input_names)
    masks = [v for v in graph.values if v.rebuilt and v.shape is not None and v.shape[-2:] == (L, L)]
    assert masks and all("position_ids" in v.rebuilt_from for v in masks)
    # the plan prints what each stage sends: the stage's outputs, no mask among them
    plan = result.plan
    assert "sends KiB" in plan.summary()
    assert plan.stage_send_bytes[:-1] == tuple(graph.cut_bytes(b) for b in plan.boundaries[1:-1])
    assert Plan.from_json(plan.to_json()).stage_send_bytes == plan.stage_send_bytes
    flat = result.captured.flatten_inputs(**packed)
    with torch.no_grad():
        out = result.captured.unflatten_output(run_stages(result.stages, flat))
    logits = out["logits"][0] if isinstance(out, dict) else out.logits[0]
    start = 0
    for want in _logits_alone(model, alone):
        n = want.shape[0]
        diff = float((logits[start:start + n] - want).abs().max())
        assert diff <= 1e-5, (family, start, diff)
        start += n


@pytest.mark.slow
def test_a_mask_that_is_not_the_pack_mask_of_its_positions_is_read_as_given():
    """The graph makes the mask of the positions only where that gives the example's mask bit for bit."""
    from omnibal_compile.integrations.hf.collate import block_causal_mask

    model = _model("llava")
    packed, _ = _pack(model, PACK[:2])
    L = packed["input_ids"].shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = capture(model, packed)
        given = capture(model, {**packed, "attention_mask": block_causal_mask([L])})  # one causal segment
    for captured, read in ((made, False), (given, True)):
        (ph,) = [n for n in captured.graph_module.graph.nodes if n.op == "placeholder" and n.name == "attention_mask"]
        assert any(u.op != "call_module" for u in ph.users) == read


def test_gemma3_own_packed_masks_are_not_exact():
    """Why the pack keeps its explicit mask: transformers 5.24 builds Gemma 3's sliding-window mask of packed
    positions with the image blocks read at the positions within each sample, so a later sample's image tokens lose
    their bidirectional attention. If this starts passing, the model's own masks would do."""
    model = _model("gemma3")
    packed, alone = _pack(model, PACK)
    given = {k: v for k, v in packed.items() if k not in ("labels", "attention_mask")}
    with torch.no_grad(), training_config(model):
        logits = model(**given).logits[0]
    wants = _logits_alone(model, alone)
    first = wants[0].shape[0]
    assert float((logits[:first] - wants[0]).abs().max()) <= 1e-5
    assert float((logits[first:first + wants[1].shape[0]] - wants[1]).abs().max()) > 1e-3
