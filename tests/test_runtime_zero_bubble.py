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
