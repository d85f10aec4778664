"""Packs under ``flex_attention``: a block mask made of the pack's segment ids (integrations/hf/flex.py), the same
rule as the 4-D mask, and pipeline stages that each make it again, giving every sample what it gets alone."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.collate import segment_mask
from omnibal_compile.integrations.hf.flex import BLOCK, PackBlockMask, pack_block_mask


def _pack_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


SEG = _pack_ids([100, 140, 60])
"""Three samples over 300 tokens: three blocks of 128 per side, samples crossing block edges."""
BLOCKS = torch.full_like(SEG, -1)
BLOCKS[0, 10:30], BLOCKS[0, 120:135], BLOCKS[0, 250:260] = 0, 1, 2  # bidirectional runs, one across a block edge


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("blocks", [None, BLOCKS])
def test_the_block_mask_is_the_4d_masks_rule_and_torchs_own_block_tables(blocks, window):
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    made = pack_block_mask(SEG, blocks=blocks, window=window)
    dense = segment_mask(SEG, blocks=blocks, window=window) == 0
    n = SEG.shape[1]
    assert torch.equal(create_mask(made.mask_mod, 1, 1, n, n, device="cpu"), dense)
    theirs = create_block_mask(made.mask_mod, 1, None, n, n, device="cpu", BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(made, name), getattr(theirs, name)), name
    for count, name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for row, k in enumerate(getattr(made, count)[0, 0].tolist()):  # the listed blocks; the order past them is free
            assert getattr(made, name)[0, 0, row, :k].tolist() == getattr(theirs, name)[0, 0, row, :k].tolist()
    assert int(made.kv_num_blocks.sum() + made.full_kv_num_blocks.sum()) < 9  # sparse: not every block pair


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex is the reference
def test_flex_attention_under_the_block_mask_equals_sdpa_under_the_4d_mask():
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, SEG.shape[1], 8, generator=g) for _ in range(3))
    for blocks, window in ((None, None), (BLOCKS, 40)):
        with torch.no_grad():
            got = flex_attention(q, k, v, block_mask=pack_block_mask(SEG, blocks=blocks, window=window))
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=segment_mask(SEG, blocks=blocks, window=window))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_pack_block_mask_travels_as_its_segment_ids():
    made = pack_block_mask(SEG, blocks=BLOCKS, window=40)
    leaves, spec = pytree.tree_flatten({"attention_mask": made})
    assert [t.shape for t in leaves] == [SEG.shape, BLOCKS.shape]  # (B, L) each: no L x L, no block tables
    again = pytree.tree_unflatten([_pack_ids([300]), BLOCKS], spec)["attention_mask"]
    assert isinstance(again, PackBlockMask) and again.window == 40
    assert torch.equal(again.kv_num_blocks, pack_block_mask(_pack_ids([300]), blocks=BLOCKS, window=40).kv_num_blocks)
    assert [getattr(t, "shape", t) for t in pytree.tree_leaves(pack_block_mask(SEG))] == [SEG.shape, None]


# -- packed Hugging Face VLMs through the pipeline stages -------------------------------------------------------------

def _helpers():
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import test_rebuilt_masks

    return test_rebuilt_masks


def test_a_family_without_flex_and_cpu_training_are_refused_by_name():
    from omnibal_compile.integrations.hf.inputs import pack_flex_mask

    h = _helpers()
    qwen = h._model("qwen2_vl")
    with pytest.raises(ValueError):  # transformers itself refuses
        qwen.set_attn_implementation("flex_attention")
    qwen.config._attn_implementation = "flex_attention"  # set behind its back: the pack says what to use
    with pytest.raises(InputError, match=r"Qwen2VLForConditionalGeneration \('qwen2_vl'\).*'sdpa'"):
        pack_flex_mask(qwen, SEG, None)
    llava = h._model("llava")
    llava.set_attn_implementation("flex_attention")
    with pytest.raises(InputError, match="no flex_attention backward on CPU.*'sdpa'"):
        pack_flex_mask(llava, SEG, None)
    llava.requires_grad_(False)
    assert isinstance(pack_flex_mask(llava, SEG, None), PackBlockMask)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "gemma3", "paligemma"])
def test_pipelined_flex_pack_gives_each_sample_its_own_logits_sending_segment_ids(family):
    import omnibal_compile as oc
    from omnibal_compile.compile.codegen import run_stages, stage_info
    from omnibal_compile.ir.plan import Plan

    h = _helpers()
    model = h._model(family)
    model.requires_grad_(False)  # flex_attention has no backward on CPU: a forward-only pipeline
    model.set_attn_implementation("flex_attention")
    packed, alone = h._pack(model, h.PACK)
    masks = packed["attention_mask"]
    assert all(isinstance(m, PackBlockMask) for m in (masks.values() if isinstance(masks, dict) else [masks]))
    L = packed["input_ids"].shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = oc.optimize(model, packed, num_stages=2 if family == "llava" else 3, planner="uniform")
    graph, plan = result.graph, result.plan
    assert len(result.stages) == len(plan.boundaries) - 1 >= 2
    for s, stage in enumerate(result.stages[1:], start=1):
        names = stage_info(stage).input_names
        assert any(n.endswith("segment_ids") for n in names), (s, names)  # the stage makes its block mask of these
        for name in names:
            v = graph.value_named(name)
            assert v is not None and v.shape is not None and not (len(v.shape) >= 2 and L in v.shape[-2:]
                                                                   and v.shape[-1] == v.shape[-2]), (s, name, v)
    tables = 2 * (-(-L // BLOCK)) ** 2 * 4 + 2 * (-(-L // BLOCK)) * 4  # a block mask's int32 block tables, kv and q
    for b in plan.boundaries[1:-1]:
        crossing = graph.crossing(b)
        ints = [v for v in crossing if v.dtype == "torch.int32"]
        assert sum(v.nbytes for v in ints) <= 2 * tables, (b, ints)  # the block tables, at most two masks' worth
        segments = [v for v in crossing if v.name.endswith("segment_ids")]
        assert segments and all(v.nbytes == 8 * L for v in segments)
        print(f"{family} cut {b}: {graph.cut_bytes(b)} bytes sent; a 4-D float mask alone would be {4 * L * L}")
    assert "sends KiB" in plan.summary()
    assert plan.stage_send_bytes[:-1] == tuple(graph.cut_bytes(b) for b in plan.boundaries[1:-1])
    assert Plan.from_json(plan.to_json()).stage_send_bytes == plan.stage_send_bytes
    with torch.no_grad():
        out = result.captured.unflatten_output(run_stages(result.stages, result.captured.flatten_inputs(**packed)))
    logits = out["logits"][0] if isinstance(out, dict) else out.logits[0]
    model.set_attn_implementation("sdpa")  # each sample alone, masked by the model itself under sdpa
    start = 0
    for want in h._logits_alone(model, alone):
        n = want.shape[0]
        diff = float((logits[start:start + n] - want).abs().max())
        assert diff <= 1e-5, (family, start, diff)
        start += n
