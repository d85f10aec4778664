"""The zero-bubble schedules (interleaved-zb, zbv, dualpipev) on the pipeline runtime, each rank running its two
stages in a V for zbv and dualpipev: losses, gradients and final parameters equal the unsplit model's (fp32,
<= 1e-5) on the reference VLM, a tiny Llava and a tiny Llama with tied embedding and head, at dp = 1 (2 ranks) and
dp = 2 (4 ranks, FSDP2 and DDP); ``run`` resumes one from a DCP checkpoint as if never stopped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_runtime import TOL, _llama_batch, _llava_batch, _run_config, _spawn, _vlm_batch, check_parity
from test_runtime_dp import _dp_worker, _reference, check_dp_parity

import omnibal_compile as oc
from omnibal_compile import PlanError
from omnibal_compile.ir.costs import DataParallel
from omnibal_compile.ir.plan import Plan
from omnibal_compile.planning.build import uniform
from omnibal_compile.runtime import check_pipeline, rank_stages

ZERO_BUBBLE = ("zbv", "interleaved-zb", "dualpipev")


def _zb(four: Plan, schedule: str, m: int = 4) -> Plan:
    return dataclasses.replace(four, schedule=schedule, num_microbatches=m, virtual_stages=2)


def _four(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Plan:
    return uniform(oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph, 4)


@pytest.fixture(scope="module")
def vlm4(vlm):
    return _four(vlm[0], _vlm_batch())


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_bubble_schedules_match_the_unsplit_model(vlm, tiny_llava, tiny_llama, vlm4, tmp_path):
    """dp = 1, 2 ranks, one step. The tied Llama's embedding (stage 0) and head (stage 3) share rank 0 under the V
    and sit on ranks 0 and 1 under interleaved-zb (their gradients then summed over the two)."""
    models = {"vlm": (vlm[0], _vlm_batch()), "llava": (tiny_llava[0], _llava_batch()),
              "llama": (tiny_llama[0], _llama_batch())}
    fours = {"vlm": vlm4, "llava": _four(*models["llava"]), "llama": _four(*models["llama"])}
    cases = [(f"{key}-{s}", key, _zb(fours[key], s)) for key in ("vlm", "llava") for s in ZERO_BUBBLE]
    cases += [("llama-tied-zbv", "llama", _zb(fours["llama"], "zbv")),
              ("llama-tied-interleaved-zb", "llama", _zb(fours["llama"], "interleaved-zb"))]
    # the LLM's token embedding inside stage 1, after the projector it is merged with: its weight gradient reaches
    # torch's weight-gradient pass through the merge (a stage that returned the embedding apart is refused)
    assert [vlm4.block_names[i] for i in (4, 5, 6)] == ["projector", "llm.embed_tokens", "<root>:glue#2"]
    mid = dataclasses.replace(vlm4, boundaries=(0, 4, 8, 11, 14))
    cases.append(("vlm-zbv-embed-mid-stage", "vlm", _zb(mid, "zbv")))
    assert rank_stages(cases[0][2], 0) == (0, 3) and rank_stages(cases[0][2], 1) == (1, 2)  # the V
    assert rank_stages(cases[1][2], 0) == (0, 2)  # the loop
    ranks = _spawn(2, tmp_path, models, cases)
    check_parity(ranks, cases, models, 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_bubble_schedules_under_data_parallelism_match_the_unsplit_model(vlm, tiny_llava, tiny_llama, vlm4,
                                                                              tmp_path):
    """dp = 2 x pp = 2, two AdamW steps of 8 rows (4 micro-batches of 1 row per dp rank): every schedule on both
    models, FSDP2 (gathered weights kept, as the split backward needs) and DDP (``replicate``) alternating, and the
    tied Llama across pipeline ranks under FSDP2."""
    models = {
        "vlm": (vlm[0], [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in
                         ((_vlm_batch(3), _vlm_batch(4)), (_vlm_batch(5), _vlm_batch(6)))]),
        "llava": (tiny_llava[0], [_llava_batch(rows=8, seed=s) for s in (5, 6)]),
        "llama": (tiny_llama[0], [_llama_batch(rows=8, seed=s) for s in (7, 8)]),
    }
    fours = {key: _four(model, batches[0]) for key, (model, batches) in models.items()}
    kept, ddp = DataParallel(size=2, shard="fsdp", reshard_after_forward=False), DataParallel(size=2, shard="ddp")
    cases = [(f"{key}-{s}-{layout.shard}", key, _zb(fours[key], s), layout, False)
             for i, key in enumerate(("vlm", "llava")) for j, s in enumerate(ZERO_BUBBLE)
             for layout in [(kept, ddp)[(i + j) % 2]]]
    cases.append(("llama-tied-interleaved-zb-fsdp", "llama", _zb(fours["llama"], "interleaved-zb"), kept, False))
    ranks = _spawn(4, tmp_path, models, cases, worker=_dp_worker)
    for name, key, _, layout, _ in cases:
        check_dp_parity(ranks, name, layout.shard, _reference(*models[key]))


def test_split_backward_schedules_refuse_resharding_after_forward_and_recomputation(vlm4):
    plan = _zb(vlm4, "zbv")
    check_pipeline(plan, world_size=2)
    for layout in (DataParallel(size=2, shard="fsdp", reshard_after_forward=False), DataParallel(size=2, shard="ddp")):
        check_pipeline(plan, world_size=4, dp=2, data_parallel=layout)
    resharding = DataParallel(size=2, shard="fsdp")
    with pytest.raises(PlanError, match="'zbv' splits each backward, and FSDP resharding after forward .*"
                                        "--no-reshard-after-forward"):
        check_pipeline(plan, world_size=4, dp=2, data_parallel=resharding)
    with pytest.raises(PlanError, match="FSDP resharding after forward"):  # 16 bits: FSDP on the 1-rank dp mesh
        check_pipeline(plan, world_size=2, data_parallel=DataParallel(size=1), precision="bf16")
    check_pipeline(_zb(vlm4, "interleaved"), world_size=4, dp=2, data_parallel=resharding)  # whole backward: fine
    full = dataclasses.replace(plan, recompute=("full",) * plan.num_blocks)
    with pytest.raises(PlanError, match="reruns a recomputed block once per parameter group .* recompute 'none'"):
        check_pipeline(full, world_size=2)


def test_the_run_keeps_fsdp_weights_gathered_under_a_split_backward_unless_told(tmp_path, vlm4):
    from omnibal_compile.runtime.settings import run_data_parallel

    config = _run_config(tmp_path, vlm4, schedule="zbv", num_microbatches=4, virtual_stages=2, dp=2)
    assert not run_data_parallel(config).reshard_after_forward
    assert run_data_parallel(dataclasses.replace(config, schedule="1f1b", virtual_stages=None)).reshard_after_forward
    told = dataclasses.replace(config, reshard_after_forward=True)
    assert run_data_parallel(told).reshard_after_forward  # said so: kept, and refused before any process starts
    from omnibal_compile.runtime.launch import precheck

    with pytest.raises(PlanError, match="FSDP resharding after forward"):
        precheck(dataclasses.replace(told, batch_size=8))


@pytest.mark.slow
@pytest.mark.distributed
def test_run_zbv_at_dp2_trains_like_the_unsplit_model_and_resumes_exactly(tmp_path, vlm4):
    """``run`` (the launcher), dp = 2 x pp = 2 FSDP2, zbv: rank 0 holds the last stage, so the logged losses come
    from it; a run resumed from the checkpoint after two steps logs the uninterrupted run's losses and ends with its
    weights (DCP: the FSDP shards of two stages per rank, the step and the data position)."""
    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.checkpoint import load_into_model
    from omnibal_compile.runtime.launch import launch

    steps = 4
    config = _run_config(tmp_path, vlm4, schedule="zbv", num_microbatches=4, virtual_stages=2, dp=2, batch_size=8,
                         steps=steps, save=str(tmp_path / "full"), save_every=2)  # SGD: AdamW's eps=1e-8 turns
    full = launch(config, timeout_s=300, quiet=True)  # float noise on zero gradients into lr-sized steps (1.2e-5 off)
    reference = build_model(config)
    source = batch_source(config, reference)
    opt = torch.optim.SGD(reference.parameters(), lr=config.lr)
    for step in range(steps):
        opt.zero_grad()
        loss = reference(**source(step))
        assert abs(float(loss.detach()) - full[step].loss) <= TOL, step
        loss.backward()
        opt.step()
    resumed = launch(dataclasses.replace(config, resume=str(tmp_path / "full" / "step-000002"),
                                         save=str(tmp_path / "resumed"), save_every=0), timeout_s=300, quiet=True)
    assert [e.step for e in resumed] == [2, 3]
    for a, b in zip(resumed, full[2:]):
        assert abs(a.loss - b.loss) <= 1e-6, (a, b)
    want, got = build_model(config), build_model(dataclasses.replace(config, seed=7))
    assert load_into_model(want, tmp_path / "full") == steps and load_into_model(got, tmp_path / "resumed") == steps
    for (n, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert float((a - b).abs().max()) <= 1e-6, n


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stage_whose_branch_skips_its_inputs_is_refused_under_a_split_backward(tmp_path, vlm):
    """These cut points put the LLM's token embedding in stage 1 after the vision blocks: its output depends on no
    stage input, and torch's split backward would drop the embedding's gradient (measured: 0.013 off)."""
    from omnibal_compile.errors import LaunchError
    from omnibal_compile.runtime.launch import launch

    model, batch = vlm
    cuts = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=4, planner="parameters").plan
    assert cuts.boundaries == (0, 3, 6, 10, 14)
    plan = _zb(cuts, "zbv")
    with pytest.raises(LaunchError, match="stage 1 returns output.* do not depend on any stage input"):
        launch(_run_config(tmp_path, plan, schedule="zbv", num_microbatches=4, virtual_stages=2, steps=1),
               timeout_s=200, quiet=True)
