"""Tensor parallelism: the pass that finds Megatron pairs in generated stages, and ranks that train with it.

The pass is checked on the reference VLM's stages without processes (what it shards, what it refuses and
why). One 2-rank spawn (tp=2, pp=1; and saved at tp=2 after the first step, resumed at tp=2 and at pp=2 x tp=1;
with sequence parallelism, and with it and every layer recomputed)
and one 4-rank spawn (dp=2 x tp=2 under FSDP2 and under replicate, pp=2 x tp=2) train two AdamW steps with
gradient clipping and compare every loss, gradient norm and final parameter with the unsplit model's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime import TOL, _llava_batch, _rank_process, _spawn, _vlm_batch
from test_runtime_dp import _adamw

import omnibal_compile as oc
from omnibal_compile import InputError, PlanError
from omnibal_compile.compile.tensor_parallel import find_pairs
from omnibal_compile.ir.costs import DataParallel
from omnibal_compile.planning.build import uniform
from omnibal_compile.runtime.tensor_parallel import check_tensor_parallel

ONE = DataParallel()
"""No data parallelism (dp = 1)."""
MAX_NORM = 0.5
"""Clipping threshold of the distributed tests: below the first steps' norms, so clipping scales every gradient."""


@pytest.fixture(scope="module")
def one_stage(vlm):
    model, batch = vlm
    return oc.optimize(model, batch, num_stages=1)


def _rows(report: Any) -> dict[tuple[str, str], str]:
    return {(p.block, p.row): p.reason for p in report.pairs}


def test_pass_shards_llm_attention_and_mlps_and_says_why_vit_attention_stays_whole(one_stage):
    found, report = find_pairs(one_stage.stages[0], one_stage.graph, 2)
    rows = _rows(report)
    for i in range(3):
        assert rows[(f"llm.layers.{i}", f"llm.layers.{i}.attn.o_proj")] == ""
        assert rows[(f"llm.layers.{i}", f"llm.layers.{i}.mlp.down_proj")] == ""
    assert rows[("projector", "projector.fc2")] == ""
    for i in range(2):
        assert rows[(f"vision.layers.{i}", f"vision.layers.{i}.fc2")] == ""
        assert "fused projection" in rows[(f"vision.layers.{i}", f"vision.layers.{i}.attn.proj")]
    attn = next(p for p in report.pairs if p.row == "llm.layers.0.attn.o_proj")
    assert attn.column == tuple(f"llm.layers.0.attn.{x}_proj" for x in "qkv")
    assert not report.unpaired  # the LM head is a vocabulary-parallel part, not an unpaired block
    # the heads of the local shard: 4 query heads and 2 key/value heads of 8 -> 2 and 1 per rank
    f = next(f for f in found if f.pair.row == "llm.layers.0.attn.o_proj")
    assert sorted(args[1][2] for _, args, _ in f.rewrites) == [1, 1, 2]
    text = report.summary()
    assert "9 pairs and 2 vocabulary-parallel parts sharded" in text and "replicated: " in text
    assert "vocabulary-parallel LM head, loss on the shards" in text


def test_pass_shards_the_lm_head_and_token_embedding_on_the_vocabulary(one_stage, vlm):
    model, batch = vlm
    _, report = find_pairs(one_stage.stages[0], one_stage.graph, 2)
    parts = {v.module: v for v in report.vocab}
    assert set(parts) == {"lm_head", "llm.embed_tokens"}  # not the vision tower's position table
    head, embed = parts["lm_head"], parts["llm.embed_tokens"]
    assert (head.kind, head.reason, embed.kind, embed.reason) == ("head", "", "embedding", "")
    assert report.loss_parallel
    tokens, hidden, vocab = batch["input_ids"].numel(), model.lm_head.in_features, model.lm_head.out_features
    assert (head.params, head.flops) == (vocab * hidden, 2.0 * tokens * vocab * hidden)
    assert (head.backward_bytes, head.gathered_bytes) == (tokens * hidden * 4, 0)  # it returns only its loss
    assert (embed.params, embed.forward_bytes, embed.backward_bytes) == (vocab * hidden, tokens * hidden * 4, 0)
    _, report = find_pairs(one_stage.stages[0], one_stage.graph, 3)
    assert all("vocabulary of 64 is not divisible by tp=3" in v.reason for v in report.vocab)
    assert not report.loss_parallel


def test_tied_embedding_and_head_stay_replicated_with_the_reason(tiny_llama):
    model, batch = tiny_llama
    for stages in (1, 2):  # in one stage (one weight read twice), and cut apart (tied across pipeline ranks)
        result = oc.optimize(model, batch, num_stages=stages, planner="uniform")
        parts = [v for s in result.stages for v in find_pairs(s, result.graph, 2)[1].vocab]
        assert {v.kind for v in parts} == {"head", "embedding"}, stages
        assert all("tied" in v.reason for v in parts), parts


def test_qwen2_vl_embedding_with_a_padding_index_is_sharded_and_its_fused_qkv_refused(qwen2_vl):
    model, batches = qwen2_vl  # Qwen2's embedding has padding_idx = pad_token_id = 0 (the parity test trains it)
    result = oc.optimize(model, batches[0], num_stages=1)
    _, report = find_pairs(result.stages[0], result.graph, 2)
    parts = {v.kind: v for v in report.vocab}
    assert parts["embedding"].reason == "" and parts["head"].reason == "", parts
    # its vision attention's fused q/k/v: refused for the view that splits q, k and v, past the shape checks
    reason = _rows(report)[("model.visual.blocks.0", "model.visual.blocks.0.attn.proj")]
    assert "fused projection" in reason and "_assert" not in reason, reason


def test_gemma3_per_head_norms_shard_with_their_heads_and_their_weights_gradients_are_all_reduced(gemma3):
    model, batches = gemma3
    result = oc.optimize(model, batches[0], num_stages=1)
    found, report = find_pairs(result.stages[0], result.graph, 2)
    assert all(p.sharded for p in report.pairs), [p.reason for p in report.pairs if not p.sharded]
    attn = next(f for f in found if f.pair.row == "model.language_model.layers.0.self_attn.o_proj")
    assert attn.pair.whole_reads == 2 and len(attn.whole) == 2  # q_norm's and k_norm's (1 + weight)
    facts = report.blocks()["model.language_model.layers.0"]
    assert facts.backward_reduces == 3 + 2 + 2  # q, k, v inputs; gate, up input; the two norms' weights
    _, report4 = find_pairs(result.stages[0], result.graph, 4)  # 2 key/value heads do not split 4 ways
    assert any("not divisible by tp=4" in p.reason for p in report4.pairs)


# family -> (pairs sharded, pairs refused) at tp=2
FAMILY_PAIRS = {"qwen2_vl": (9, 2), "paligemma": (11, 0), "gemma3": (11, 0), "internvl": (11, 0),
                "mistral3": (7, 11), "idefics3": (6, 10)}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILY_PAIRS))
def test_the_pass_on_each_captured_family_shards_its_llm_and_says_why_the_rest_stays_whole(family):
    """The tiny HF families (tests/hf_families.py): Llama/Qwen2/Gemma/Mistral LLMs and CLIP/SigLIP/InternViT towers
    shard; fused q/k/v (Qwen2-VL's tower) and the towers the block finder merges into glue blocks (Pixtral, Idefics3)
    stay replicated with a reason."""
    import hf_families

    model, batch = hf_families.build(family)
    result = oc.optimize(model, batch, num_stages=1)
    _, report = find_pairs(result.stages[0], result.graph, 2)
    sharded, refused = [p for p in report.pairs if p.sharded], [p for p in report.pairs if not p.sharded]
    assert (len(sharded), len(refused)) == FAMILY_PAIRS[family], [(p.row, p.reason) for p in refused]
    llm = [p for p in sharded if ".language_model.layers." in p.block or ".text_model.layers." in p.block]
    assert len(llm) == 2 * hf_families.LAYERS, family  # attention and MLP of every LLM layer
    assert all(p.reason.strip() for p in refused)


def test_pass_gives_each_sharded_block_the_facts_its_costs_need(one_stage, vlm):
    model, _ = vlm
    _, report = find_pairs(one_stage.stages[0], one_stage.graph, 2)
    blocks = report.blocks()
    assert set(blocks) == {p.block for p in report.sharded} | {v.block for v in report.vocab if v.sharded}
    head, embed = blocks["lm_head"], blocks["llm.embed_tokens"]  # the vocabulary-parallel parts' collectives
    part = {v.kind: v for v in report.vocab}
    assert (head.pairs, head.backward_reduces, head.flops, head.params) == (3, 1, part["head"].flops,
                                                                           part["head"].params)
    assert (head.forward_bytes, head.backward_bytes) == (part["head"].forward_bytes, part["head"].backward_bytes)
    assert (embed.pairs, embed.backward_reduces, embed.flops, embed.forward_bytes) == (
        1, 0, 0.0, part["embedding"].forward_bytes)
    layer = model.llm.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    f = blocks["llm.layers.0"]
    assert (f.pairs, f.backward_reduces) == (2, 5)  # attention (q, k, v -> o) and the MLP (gate, up -> down)
    assert f.params == sum(p.numel() for m in linears for p in m.parameters())
    hidden = layer.attn.o_proj.out_features
    row_out = f.forward_bytes // 2  # o_proj's and down_proj's outputs: one hidden state each
    tokens = row_out // (4 * hidden)
    assert f.forward_bytes == 2 * tokens * hidden * 4 and f.backward_bytes == 5 * tokens * hidden * 4
    matmuls = 2.0 * tokens * sum(m.weight.numel() for m in linears)
    assert matmuls < f.flops < 1.5 * matmuls  # the linear layers plus the attention between q, k, v and o


def test_heads_that_do_not_divide_by_tp_stay_replicated_with_the_reason(one_stage):
    _, report = find_pairs(one_stage.stages[0], one_stage.graph, 4)  # 4 query heads but 2 key/value heads
    rows = _rows(report)
    reason = rows[("llm.layers.0", "llm.layers.0.attn.o_proj")]
    assert "not divisible by tp=4" in reason and "heads" in reason, reason
    assert rows[("llm.layers.0", "llm.layers.0.mlp.down_proj")] == ""  # 64 MLP features split 4 ways
    _, report = find_pairs(one_stage.stages[0], one_stage.graph, 3)
    assert not report.sharded  # 32 and 64 features: nothing splits 3 ways
    assert "not divisible by tp=3" in _rows(report)[("llm.layers.0", "llm.layers.0.mlp.down_proj")]


def test_sequence_parallel_splits_the_llm_residual_stream_and_says_why_the_vit_and_projector_stay_whole(one_stage):
    stage = one_stage.stages[0]
    assert find_pairs(stage, one_stage.graph, 2)[1].sequence == ()  # off unless asked for
    _, report = find_pairs(stage, one_stage.graph, 2, sequence_parallel=True)
    regions = {r.blocks[0]: r for r in report.sequence}
    llm = regions["llm.layers.0"]
    assert llm.sharded and llm.blocks == ("llm.layers.0", "llm.layers.1", "llm.layers.2", "llm.norm")
    assert llm.rows == tuple(f"llm.layers.{i}.{r}" for i in range(3) for r in ("attn.o_proj", "mlp.down_proj"))
    # layer 0's attention reads the whole embedding output; after it every column layer and the head read shards
    assert llm.columns[:2] == ("llm.layers.0.mlp.gate_proj", "llm.layers.0.mlp.up_proj")
    assert len(llm.columns) == 2 + 2 * 5 + 1 and llm.columns[-1] == "lm_head"
    assert "linear" in regions["vision.layers.0"].reason and "not token-wise" in regions["vision.layers.0"].reason
    assert "does not keep [batch, sequence, hidden]" in regions["projector"].reason
    assert "1 region on sequence shards, 2 regions whole" in report.summary()
    blocks = report.blocks()
    f, hidden = blocks["llm.layers.1"], 2 * 16 * 32 * 4  # one [batch, sequence, hidden] fp32 value
    # no all-reduce of o_proj / down_proj nor of the column inputs: 2 reduce-scatters, 2 all-gathers (q, k, v: one)
    assert (f.pairs, f.forward_bytes) == (0, 0)
    assert (f.sequence_forward_calls, f.sequence_forward_bytes) == (4, 4 * hidden)
    assert (f.sequence_backward_calls, f.sequence_backward_bytes) == (4, 4 * hidden)
    assert (f.backward_reduces, f.backward_bytes) == (2, 2 * 32 * 4)  # the two norm weights' gradients
    assert 0 < f.sequence_share < 1 and blocks["llm.norm"].sequence_share == 1.0
    # layer 0: its attention pair all-reduces as before; the residual entering the region is split (backward gather)
    f0 = blocks["llm.layers.0"]
    assert (f0.backward_reduces, f0.sequence_backward_calls) == (3 + 1, 4)
    _, odd = find_pairs(stage, one_stage.graph, 3, sequence_parallel=True)
    assert not odd.sequence  # nothing is sharded at tp=3, so no row to start a region from


def test_pass_leaves_the_stage_it_reads_unchanged(one_stage):
    before = [(n.name, n.target, n.args) for n in one_stage.stages[0].graph.nodes]
    find_pairs(one_stage.stages[0], one_stage.graph, 2)
    assert [(n.name, n.target, n.args) for n in one_stage.stages[0].graph.nodes] == before


def test_runtime_refuses_what_tensor_parallelism_does_not_run_with_yet(one_stage):
    plan = one_stage.plan
    check_tensor_parallel(plan, tp=1, compile=True)  # tp=1: nothing to refuse
    check_tensor_parallel(plan, tp=2)
    with pytest.raises(PlanError, match="--compile"):
        check_tensor_parallel(plan, tp=2, compile=True)
    with pytest.raises(PlanError, match="must be an integer >= 1"):
        check_tensor_parallel(plan, tp=0)
    with pytest.raises(InputError, match="needs tp > 1"):
        check_tensor_parallel(plan, tp=1, sequence_parallel=True)
    zb = dataclasses.replace(plan, schedule="interleaved-zb", virtual_stages=1)
    with pytest.raises(PlanError, match="splits each backward"):
        check_tensor_parallel(zb, tp=2)
    with pytest.raises(PlanError, match=r"dp=1 x pp=1 x tp=2 need 2 processes but world size is 3"):
        oc.runtime.check_pipeline(plan, world_size=3, tp=2)


# -- distributed ---------------------------------------------------------------------------------------
def _tp_worker(rank: int, world: int, port: int, out: str, models: dict[str, Any], cases: list[Any]) -> None:
    """One rank of a (dp, pp, tp) mesh: train every case for its steps with clipping; save losses, norms, params.

    A case is (name, model key, plan, tp, DataParallel, resume[, sequence_parallel]): with ``resume`` = (plan, tp,
    DataParallel) the first step trains on the first layout, which saves a DCP checkpoint; a pipeline of the second
    layout, built from the initial weights and a fresh AdamW, loads it and trains the remaining steps.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.runtime import build_pipeline
    from omnibal_compile.runtime.checkpoint import load_training_state, save_training_state

    def build(key: str, plan: oc.Plan, tp: int, dp: DataParallel, sequence: bool = False) -> Any:
        mesh = init_device_mesh("cpu", (dp.size, world // (tp * dp.size), tp), mesh_dim_names=("dp", "pp", "tp"))
        cls, config, weights, batches = models[key]
        model = cls(config)
        model.load_state_dict(weights)
        pipe = build_pipeline(compile_for_microbatches(model, _share(batches[0], mesh), plan), mesh=mesh,
                              data_parallel=dp, sequence_parallel=sequence)
        return pipe, _adamw(pipe.parameters()), mesh

    with _rank_process(rank, world, port, out):
        found: dict[str, Any] = {}
        for name, key, plan, tp, dp, resume, *sequence in cases:
            pipe, opt, mesh = build(key, plan, tp, dp, *sequence)
            losses, norms, sharded, gathers, scatters = [], [], set(), 0, 0
            for i, batch in enumerate(models[key][3]):
                if resume is not None and i == 1:
                    root = Path(out) / name
                    sharded |= {n for n, t in pipe.state.items() if type(t.data).__name__ == "DTensor"}
                    save_training_state(root, step=1, state=pipe.state, optimizer=opt, trainer={})
                    pipe, opt, mesh = build(key, *resume)
                    load_training_state(root, state=pipe.state, optimizer=opt)
                opt.zero_grad(set_to_none=True)
                # DTensor's collectives (a loss on gathered logits gathers; sequence parallelism reduce-scatters)
                with _counted("all_gather_single", "all_gather_tensor") as count, \
                        _counted("reduce_scatter_single", "reduce_scatter_tensor") as rs:
                    losses.append(pipe.step(_share(batch, mesh)))
                gathers += count[0]
                scatters += rs[0]
                norms.append(pipe.clip_grad_norm(MAX_NORM))
                opt.step()
            found[name] = {
                "losses": losses, "norms": norms,
                "params": {n: t for n, t in pipe.full_state().items() if n in pipe.named_grads()},
                "sharded": sorted(sharded | {n for n, t in pipe.state.items() if type(t.data).__name__ == "DTensor"}),
                "reports": [r.summary() for r in pipe.tensor_parallel], "gathers": gathers, "scatters": scatters,
            }
        torch.save(found, Path(out) / f"rank{rank}.pt")


@contextlib.contextmanager
def _counted(*collectives: str) -> Iterator[list[int]]:
    """Counts the calls of these functional collectives (DTensor's redistributions call them)."""
    import torch.distributed._functional_collectives as funcol

    count = [0]
    names = [n for n in collectives if hasattr(funcol, n)]
    real = {n: getattr(funcol, n) for n in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return real[name](*args, **kwargs)
        return call

    for n in names:
        setattr(funcol, n, counting(n))
    try:
        yield count
    finally:
        for n in names:
            setattr(funcol, n, real[n])


def _share(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """This dp rank's rows of a batch (the whole batch at dp = 1): Qwen2-VL's 3-D rotary positions (3, rows, L) on
    their dim 1; its flattened patches split evenly because every row holds one image of the same size."""
    dp, k = mesh["dp"].size(), mesh["dp"].get_local_rank()
    return {n: v.chunk(dp, dim=_row_dim(n, v))[k] for n, v in batch.items()}


def _row_dim(name: str, value: torch.Tensor) -> int:
    return 1 if name == "position_ids" and value.dim() == 3 else 0


def _qwen2_vl_batch(model: torch.nn.Module, seed: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """``rows`` one-image rows of the package's Qwen2-VL layout (each row alone has the same image size and length),
    joined on each input's row dimension."""
    from omnibal_compile.integrations.hf.inputs import hf_example_batch

    parts = [hf_example_batch(model, batch=1, text=12, seed=seed * 10 + r) for r in range(rows)]
    batch = {n: torch.cat([b[n] for b in parts], dim=_row_dim(n, v)) for n, v in parts[0].items()}
    # the padding id (0: its embedding row gets no gradient) and the first id of the second vocabulary shard at
    # tp=2 (64: row 0 of that rank's rows), which a padding index applied to local rows would stop
    batch["input_ids"][:, -3:-1] = batch["labels"][:, -3:-1] = torch.tensor([0, 64])
    return batch


def _reference(model: torch.nn.Module, batches: list[Any]) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    opt = _adamw(model.parameters())
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    # tied weights under each of their names, as the pipeline reports them
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _check(ranks: list[dict[str, Any]], cases: list[Any], models: dict[str, Any]) -> None:
    for name, key, *_ in cases:
        ref_losses, ref_norms, ref_params = _reference(*models[key])
        losses = [r[name]["losses"] for r in ranks]  # None on ranks without the last stage (of that step's layout)
        assert all(any(got[i] is not None for got in losses) for i in range(len(ref_losses))), (name, losses)
        assert all(abs(a - b) <= TOL for got in losses for a, b in zip(got, ref_losses) if a is not None), \
            (name, losses, ref_losses)
        for r in ranks:
            # relative: Gemma's scaled, tied embedding makes norms of thousands, where fp32 rounds at 1e-4
            assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(r[name]["norms"], ref_norms)) <= TOL, \
                (name, r[name]["norms"], ref_norms)
            assert r[name]["sharded"], name  # every rank shards something
        params: dict[str, torch.Tensor] = {}
        for r in ranks:
            params.update(r[name]["params"])
        assert set(params) == set(ref_params), (name, set(params) ^ set(ref_params))
        worst = max(ref_params, key=lambda n: float((params[n] - ref_params[n]).abs().max()))
        assert float((params[worst] - ref_params[worst]).abs().max()) <= TOL, (name, worst)


def _plan(model: torch.nn.Module, batch: dict[str, torch.Tensor], stages: int, micro: int = 2) -> oc.Plan:
    """A uniform ``stages``-stage 1F1B (GPipe below a micro-batch per stage) plan of ``micro`` micro-batches (its
    blocks found on one row, or on the whole ``batch`` when a step is one micro-batch)."""
    example = batch if micro == 1 else {k: v[:1] for k, v in batch.items()}
    graph = oc.optimize(model, example, num_stages=1).graph
    schedule = "1f1b" if micro >= stages else "gpipe"  # 1F1B needs a micro-batch per stage
    return dataclasses.replace(uniform(graph, stages), schedule=schedule, num_microbatches=micro)


@pytest.fixture(scope="module")
def qwen2_vl():
    """A tiny Qwen2-VL (tests/hf_families.py) and two steps of two one-image rows: with one micro-batch a step, as
    its flattened patches cannot be cut into micro-batches by rows of different images."""
    import hf_families

    torch.manual_seed(0)
    model, _ = hf_families.qwen2_vl(batch=1)
    return model, [_qwen2_vl_batch(model, seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def gemma3():
    """A tiny Gemma 3 (tests/hf_families.py; per-head q/k norms, sliding windows, tied embeddings) and one step of
    four rows: its first gradient norm is ~5,400 (the scaled, tied embedding), clipped to 0.5, and after that AdamW
    step the fp32 unsplit model's second norm is 2e-5 (relative) off its own fp64 value, more than the tolerance,
    while tp=2 is closer (2.6e-6): fp32 rounding, not the pass, would decide a second step's comparison."""
    import hf_families

    from omnibal_compile.integrations.hf.inputs import hf_example_batch

    model, _ = hf_families.build("gemma3", batch=1)
    return model, [hf_example_batch(model, batch=4, text=12, seed=3)]


def _full(plan: oc.Plan) -> oc.Plan:
    """``plan`` with every layer block fully recomputed (the pass's new nodes must join their blocks' regions)."""
    return dataclasses.replace(plan, recompute=tuple("full" if k == "layer" else "none" for k in plan.block_kinds))


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_trains_like_the_unsplit_model(vlm, tiny_llava, qwen2_vl, gemma3, tmp_path):
    models = {"vlm": (vlm[0], [_vlm_batch(seed) for seed in (3, 4)]),
              "llava": (tiny_llava[0], [_llava_batch(seed=seed) for seed in (5, 6)]), "qwen2_vl": qwen2_vl,
              "gemma3": gemma3}
    cases = [(f"{key}-tp2", key, _plan(m, b[0], 1, micro=1 if key == "qwen2_vl" else 2), 2, ONE, None)
             for key, (m, b) in models.items()]
    one, two = _plan(vlm[0], models["vlm"][1][0], 1), _plan(vlm[0], models["vlm"][1][0], 2)
    cases += [("vlm-tp2-resumed-tp2", "vlm", one, 2, ONE, (one, 2, ONE)),  # DCP: DTensor shards back into shards
              ("vlm-tp2-resumed-tp1", "vlm", one, 2, ONE, (two, 1, ONE)),  # into whole tensors (pp=2 x tp=1)
              ("vlm-tp2-sp", "vlm", one, 2, ONE, None, True),  # sequence parallel: norms on sequence shards
              ("vlm-tp2-sp-full", "vlm", _full(one), 2, ONE, None, True),  # and each layer recomputed
              ("llava-tp2-sp", "llava", cases[1][2], 2, ONE, None, True)]  # HF Llama layers (the llava-tp2 plan)
    ranks = _spawn(2, tmp_path, models, cases, worker=_tp_worker)
    _check(ranks, cases, models)
    for key, names in (("vlm", ("llm.layers.0.attn.q_proj.weight", "lm_head.weight", "llm.embed_tokens.weight")),
                       ("llava", ("lm_head.weight", "model.language_model.embed_tokens.weight")),
                       ("qwen2_vl", ("lm_head.weight", "model.language_model.embed_tokens.weight",
                                     "model.language_model.layers.0.self_attn.q_proj.weight",
                                     "model.visual.blocks.0.mlp.fc1.weight", "model.visual.merger.mlp.0.weight"))):
        assert set(names) <= set(ranks[0][f"{key}-tp2"]["sharded"]), key
    assert not any("attn.qkv" in n for n in ranks[0]["qwen2_vl-tp2"]["sharded"])  # the fused projection stays whole
    # Gemma 3's attention with its per-head q/k norms: sharded, the norms' weights whole (gradients all-reduced)
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in ranks[0]["gemma3-tp2"]["sharded"]
    assert "model.language_model.layers.0.self_attn.q_norm.weight" not in ranks[0]["gemma3-tp2"]["sharded"]
    assert "9 pairs and 2 vocabulary-parallel parts sharded" in ranks[0]["vlm-tp2"]["reports"][0]
    assert "logits gathered" not in ranks[0]["vlm-tp2"]["reports"][0]  # it returns only its loss
    assert ranks[0]["vlm-tp2"]["gathers"] == 0  # so the loss runs on the vocabulary shards: no all-gather at all
    assert "logits gathered for the stage's other readers" in ranks[0]["llava-tp2"]["reports"][0]  # HF: logits too
    assert ranks[0]["vlm-tp2"]["scatters"] == 0
    sp = ranks[0]["vlm-tp2-sp"]
    assert "1 region on sequence shards" in sp["reports"][0] and "sequence-parallel" in sp["reports"][0]
    # per micro-batch: 6 row outputs reduce-scattered and 6 column inputs all-gathered (q, k, v: one), mirrored in the
    # backward, plus the gradient of the residual entering layer 0 all-gathered
    assert (sp["scatters"], sp["gathers"]) == (2 * 2 * (6 + 6), 2 * 2 * (6 + 6 + 1)), (sp["scatters"], sp["gathers"])
    assert "1 region on sequence shards" in ranks[0]["llava-tp2-sp"]["reports"][0]  # its 17 image tokens: whole


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_tp2_trains_like_the_unsplit_model(vlm, tiny_llava, qwen2_vl, tmp_path):
    models = {"vlm": (vlm[0], [_vlm_batch(seed) for seed in (3, 4)]),
              "llava": (tiny_llava[0], [_llava_batch(seed=seed) for seed in (5, 6)]), "qwen2_vl": qwen2_vl}
    one, two = _plan(vlm[0], models["vlm"][1][0], 1), _plan(vlm[0], models["vlm"][1][0], 2)
    cases = [("vlm-dp2-fsdp-tp2", "vlm", one, 2, DataParallel(size=2, shard="fsdp"), None),  # FSDP2 over tp shards
             ("vlm-dp2-ddp-tp2", "vlm", one, 2, DataParallel(size=2, shard="ddp"), None),  # replicate over tp shards
             ("vlm-pp2-tp2", "vlm", two, 2, ONE, None),
             ("vlm-dp2-fsdp-tp2-sp", "vlm", one, 2, DataParallel(size=2, shard="fsdp"), None, True),
             ("vlm-pp2-tp2-sp", "vlm", two, 2, ONE, None, True)]  # the cut inside the region: gathered whole
    for key in ("llava", "qwen2_vl"):  # Qwen2-VL: one micro-batch a step (its fixture); at dp=2 one row per rank
        model, batches = models[key]
        micro = 1 if key == "qwen2_vl" else 2
        half = {n: v.chunk(2, dim=_row_dim(n, v))[0] for n, v in batches[0].items()}  # one dp rank's rows
        cases += [(f"{key}-dp2-fsdp-tp2", key, _plan(model, half, 1, micro), 2, DataParallel(size=2, shard="fsdp"),
                   None), (f"{key}-pp2-tp2", key, _plan(model, batches[0], 2, micro), 2, ONE, None)]
    ranks = _spawn(4, tmp_path, models, cases, worker=_tp_worker)
    _check(ranks, cases, models)
    first = ranks[0]["vlm-pp2-tp2-sp"]["reports"][0]  # stage 0 ends in llm.layers.0: its output leaves whole
    assert "1 region on sequence shards" in first and "llm.layers.0  " in first, first


@pytest.mark.slow
@pytest.mark.distributed
def test_run_with_tp2_and_sequence_parallel_launches_dp_x_pp_x_tp_ranks(vlm, tmp_path):
    from test_runtime import _run_config

    from omnibal_compile.runtime.launch import launch

    plan = _plan(vlm[0], _vlm_batch(), 1)
    config = _run_config(tmp_path, plan, tp=2, sequence_parallel=True, max_grad_norm=MAX_NORM)
    logs = launch(config, timeout_s=240)
    assert len(logs) == 2 and all(entry.loss > 0 and entry.grad_norm > 0 for entry in logs)
