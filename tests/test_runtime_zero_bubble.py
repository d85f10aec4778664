"""The zero-bubble schedules on the pipeline runtime: two gloo ranks train the reference VLM for one step with the
loss and gradients of the unsplit model (fp32, <= 1e-5), each rank running its two stages in a V for zbv and
dualpipev, and with recomputation."""

from __future__ import annotations

import dataclasses

import pytest
from test_runtime import _spawn, _vlm_batch, check_parity

import omnibal_compile as oc
from omnibal_compile import PlanError
from omnibal_compile.ir.plan import Plan
from omnibal_compile.planning.build import uniform
from omnibal_compile.runtime import check_pipeline, rank_stages

WORLD = 2


@pytest.fixture(scope="module")
def vlm_model(vlm):
    return {"vlm": (vlm[0], _vlm_batch())}


@pytest.fixture(scope="module")
def vlm4(vlm_model):
    model, batch = vlm_model["vlm"]
    return uniform(oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph, 4)


def _cases(four: Plan) -> list[tuple[str, str, Plan]]:

    def p(schedule: str) -> Plan:
        return dataclasses.replace(four, schedule=schedule, num_microbatches=4, virtual_stages=2)

    return [("vlm-zbv", "vlm", p("zbv")), ("vlm-interleaved-zb", "vlm", p("interleaved-zb")),
            ("vlm-dualpipev", "vlm", p("dualpipev"))]


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_bubble_schedules_match_the_unsplit_model(vlm_model, vlm4, tmp_path):
    cases = _cases(vlm4)
    assert rank_stages(cases[0][2], 0) == (0, 3) and rank_stages(cases[0][2], 1) == (1, 2)  # the V
    ranks = _spawn(WORLD, tmp_path, vlm_model, cases)
    check_parity(ranks, cases, vlm_model, WORLD)


def test_split_backward_schedules_refuse_data_parallelism_and_recomputation(vlm4):
    plan = dataclasses.replace(vlm4, schedule="zbv", num_microbatches=4, virtual_stages=2)
    check_pipeline(plan, world_size=2)
    with pytest.raises(PlanError, match="'zbv' splits each backward .* use --dp 1"):
        check_pipeline(plan, world_size=4, dp=2)
    full = dataclasses.replace(plan, recompute=("full",) * plan.num_blocks)
    with pytest.raises(PlanError, match="reruns a recomputed block once per parameter group .* recompute 'none'"):
        check_pipeline(full, world_size=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_run_zbv_trains_like_the_unsplit_model(tmp_path, vlm4):
    """``run`` (the launcher) with a zbv plan: rank 0 holds the last stage, so the logged losses must come from it."""
    import torch
    from test_runtime import TOL, _run_config

    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.launch import launch

    plan = dataclasses.replace(vlm4, schedule="zbv", num_microbatches=4, virtual_stages=2)
    config = _run_config(tmp_path, plan, schedule="zbv", num_microbatches=4, virtual_stages=2)
    logs = launch(config, timeout_s=200, quiet=True)
    reference = build_model(config)
    source = batch_source(config, reference)
    opt = torch.optim.SGD(reference.parameters(), lr=config.lr)
    for step in range(config.steps):
        opt.zero_grad()
        loss = reference(**source(step))
        assert abs(float(loss.detach()) - logs[step].loss) <= TOL, step
        loss.backward()
        opt.step()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stage_whose_branch_skips_its_inputs_is_refused_under_a_split_backward(tmp_path, vlm):
    """These cut points put the LLM's token embedding in stage 1 after the vision blocks: its output depends on no
    stage input, and torch's split backward would drop the embedding's gradient (measured: 0.013 off)."""
    from test_runtime import _run_config

    from omnibal_compile.errors import LaunchError
    from omnibal_compile.runtime.launch import launch

    model, batch = vlm
    cuts = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=4, planner="parameters").plan
    assert cuts.boundaries == (0, 3, 6, 10, 14)
    plan = dataclasses.replace(cuts, schedule="zbv", num_microbatches=4, virtual_stages=2)
    with pytest.raises(LaunchError, match="stage 1 returns output.* do not depend on any stage input"):
        launch(_run_config(tmp_path, plan, schedule="zbv", num_microbatches=4, virtual_stages=2, steps=1),
               timeout_s=200, quiet=True)
