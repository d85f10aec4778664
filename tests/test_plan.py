import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal_compile import Plan, PlanError


@st.composite
def plans(draw):
    n = draw(st.integers(1, 40))
    s = draw(st.integers(1, n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=s - 1, max_size=s - 1))) if s > 1 else []
    names = tuple(f"b{i}" for i in range(n))
    params = tuple(draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n)))
    return Plan(block_names=names, boundaries=(0, *cuts, n), block_params=params, planner="random")


@given(plans())
@settings(max_examples=200, deadline=None)
def test_every_block_in_exactly_one_contiguous_nonempty_stage(plan):
    seen = [b for stage in plan.stages for b in stage.blocks]
    assert seen == list(plan.block_names)  # each block once, in order => contiguous
    assert all(len(stage.blocks) >= 1 for stage in plan.stages)
    for stage in plan.stages:
        assert all(plan.stage_of(b) == stage.index for b in stage.blocks)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_stages([s.blocks for s in plan.stages], planner="random", block_params=plan.block_params) == plan


def test_non_contiguous_assignment_is_rejected():
    with pytest.raises(PlanError, match="contiguous"):
        Plan.from_assignment(["a", "b", "c", "d"], [0, 1, 0, 1])
    with pytest.raises(PlanError, match="contiguous"):
        Plan.from_assignment(["a", "b", "c"], [0, 2, 2])
    with pytest.raises(PlanError, match="stage 0"):
        Plan.from_assignment(["a", "b"], [1, 1])


def test_empty_stage_and_bad_boundaries_are_rejected():
    with pytest.raises(PlanError, match="stage 1 is empty"):
        Plan(block_names=("a", "b"), boundaries=(0, 1, 1, 2))
    with pytest.raises(PlanError, match="start at 0"):
        Plan(block_names=("a", "b"), boundaries=(0, 3))
    with pytest.raises(PlanError, match="unique"):
        Plan(block_names=("a", "a"), boundaries=(0, 2))
    with pytest.raises(PlanError, match="no blocks"):
        Plan.from_stages([["a"], []])


def test_json_errors_are_clear():
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json("{not json")
    with pytest.raises(PlanError, match="unknown plan fields"):
        Plan.from_json(json.dumps({"block_names": ["a"], "boundaries": [0, 1], "bogus": 1}))
    with pytest.raises(PlanError, match="format"):
        Plan.from_json(json.dumps({"block_names": ["a"], "boundaries": [0, 1], "format": 99}))


def test_summary_shows_stages_and_imbalance():
    plan = Plan(block_names=("a", "b", "c"), boundaries=(0, 1, 3), block_params=(10, 5, 5), block_kinds=("layer",) * 3)
    text = plan.summary()
    assert "2 stages" in text and "imbalance (max/mean): 1.000" in text


def test_data_parallel_round_trips_and_old_json_reads_as_one_replica():
    plan = Plan(block_names=["a", "b", "c"], boundaries=[0, 1, 3], data_parallel=4, data_parallel_shard="fsdp",
                reshard_after_forward=False)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.dp.size == 4 and again.dp.shard == "fsdp" and not again.dp.reshard_after_forward
    data = json.loads(plan.to_json())
    assert data["data_parallel"] == 4 and data["data_parallel_shard"] == "fsdp"  # flat fields
    for key in ("data_parallel", "data_parallel_shard", "reshard_after_forward"):
        del data[key]
    old = Plan.from_json(json.dumps(data))
    assert old.data_parallel == 1 and old.dp.size == 1 and "data parallel" not in old.summary()
    assert "4 data-parallel replicas, FSDP (weights kept gathered)" in plan.summary()


def test_bad_data_parallel_fields_name_the_input():
    from omnibal_compile import InputError

    with pytest.raises(InputError, match="dp_shard"):
        Plan(block_names=["a"], boundaries=[0, 1], data_parallel=2, data_parallel_shard="zero9")
    with pytest.raises(InputError, match="positive integer"):
        Plan(block_names=["a"], boundaries=[0, 1], data_parallel=0)


def test_summary_speaks_in_sentences_and_counts_in_the_right_number():
    plan = Plan(
        block_names=("a", "b"),
        boundaries=(0, 1, 2),
        num_microbatches=1,
        schedule="gpipe",
        iteration_time_s=0.5,
        notes={
            "binding": "time of stage 1",
            "status": "Optimal",
            "solve seconds": 0.012,
            "gap": 0.0,
            "max_stage_params": 1234,
        },
    )
    text = plan.summary()
    assert "1 micro-batch" in text and "1 micro-batches" not in text and "2 blocks in 2 stages" in text
    assert "Binding constraint: the time of stage 1." in text
    assert "Solver: optimal in 0.012 s, proven gap 0.00%." in text and "Largest stage: 1,234 parameters." in text
    # no raw "key: value" line of an internal name
    assert not any(
        line.startswith(("binding:", "status:", "solve seconds:", "gap:", "max_stage_params"))
        for line in text.splitlines()
    )
