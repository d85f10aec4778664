"""Bad input by class (issue 16): numbers, files, samplers, defaults. Each case asserts the error
type and that the message names the input (and the value, where there is one)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import omnibal_compile as oc
from omnibal_compile._utils.units import parse_size
from omnibal_compile.cli import main
from omnibal_compile.compile.codegen import generate_stages
from omnibal_compile.data import BalancedBatchSampler, DataOptions, LengthStats, PackShape, load_lengths, plan_data
from omnibal_compile.data.balance import balance_pack
from omnibal_compile.data.packing import MAX_PACK_TOKENS
from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule
from omnibal_compile.runtime.settings import RunConfig

# Model facts for the data pass without a model (so the sampler tests build no torch module).
FACTS = dict(source_tokens_per_tile=None, tokens_per_tile=4, image_token_id=63, image_shape=(3, 16, 16), vocab_size=64)


def _stats(n: int = 48, seed: int = 0) -> LengthStats:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, 4, n)
    return LengthStats.from_arrays(tiles, tiles * 4 + rng.integers(2, 40, n))


@pytest.fixture(scope="module")
def planned(vlm):
    model, batch = vlm
    return oc.optimize(model, batch, num_stages=2, device="a100-80gb")


# -- numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "needles"),
    [
        (lambda: DataOptions(samples_per_pack=float("nan")), InputError, ["samples_per_pack", "nan"]),
        (lambda: DataOptions(samples_per_pack=float("inf")), InputError, ["samples_per_pack", "inf"]),
        (lambda: DataOptions(dp=1.5), InputError, ["DataOptions.dp", "1.5"]),
        (lambda: DataOptions(seed=-1), InputError, ["DataOptions.seed", "-1"]),
        (lambda: parse_size(float("nan"), "memory_budget"), InputError, ["memory_budget", "nan"]),
        (lambda: parse_size(float("inf"), "--memory-budget"), InputError, ["--memory-budget", "inf"]),
        (lambda: LengthStats.from_arrays([1], [10**12]), InputError, ["tokens[0]", "1000000000000"]),
        (lambda: PackShape(tiles=1, tokens=10**12), InputError,
         ["pack shape tokens (Q_t)", "1000000000000", f"{MAX_PACK_TOKENS:,}"]),
        (lambda: balance_pack(_stats(), dp=1, samples_per_pack=float("nan")), InputError, ["samples_per_pack", "nan"]),
        (lambda: RunConfig(plan="p.json", lr=float("nan")), InputError, ["lr (--lr)", "nan"]),
        (lambda: RunConfig(plan="p.json", samples_per_pack=0.5), InputError,
         ["samples_per_pack (--samples-per-pack)", "0.5"]),
        (lambda: RunConfig(plan="p.json", batch_size=0), InputError, ["batch_size (--batch-size)", "0"]),
        (lambda: Plan(block_names=["a", "b"], boundaries=[0, 2], stage_time_s=[float("nan")]), PlanError,
         ["stage_time_s[0]", "nan"]),
        (lambda: Schedule(num_microbatches=10**20), PlanError,
         ["num_microbatches", "65,536", "100,000,000,000,000,000,000"]),
    ],
)
def test_numbers_are_checked_at_the_boundary_with_name_and_value(make, error, needles) -> None:
    with pytest.raises(error) as e:
        make()
    for needle in needles:
        assert needle in str(e.value)


def test_numbers_from_length_files_and_optimize_keywords(tmp_path: Path, vlm) -> None:
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps([{"vit_num": 1, "token_num": 1e19}]))
    with pytest.raises(InputError, match=r"huge.json record 0: field 'token_num' .* got 1e\+19"):
        load_lengths(huge)
    zeros = tmp_path / "zeros.json"  # all-zero lengths used to divide by zero in the metrics
    zeros.write_text(json.dumps([{"vit_num": 0, "token_num": 0}] * 4))
    with pytest.raises(InputError, match=r"zeros.json record 0: field 'token_num' .* got 0"):
        load_lengths(zeros)
    model, batch = vlm
    with pytest.raises(InputError, match=r"memory_budget must be a finite number >= 0, got nan"):
        oc.optimize(model, batch, num_stages=2, device="a100-80gb", memory_budget=float("nan"))
    with pytest.raises(InputError, match=r"memory_budget\[1\] must be"):
        oc.optimize(model, batch, num_stages=2, device="a100-80gb", memory_budget=["1GiB", -1])
    with pytest.raises(InputError, match=r"solver_time_limit must be a finite number > 0, got nan"):
        oc.optimize(model, batch, num_stages=2, device="a100-80gb", solver_time_limit=float("nan"))


def test_a_sample_no_pack_may_hold_is_refused_before_a_shape_is_made() -> None:
    # Within the per-sample limit, beyond a pack's: the derived shape would allocate ~3M-token rows.
    big = LengthStats.from_arrays([1] * 8 + [1], [40] * 8 + [3 * MAX_PACK_TOKENS // 2])
    for options in (DataOptions(**FACTS), DataOptions(**FACTS, method="random")):
        with pytest.raises(InputError, match=r"sample 8 has 1 tiles and 3,145,728 tokens, more than any pack"):
            plan_data(big, options)
    with pytest.raises(InputError, match=r"sample 8 .* more than any pack"):  # its own pack would be as large
        plan_data(big, DataOptions(**FACTS, shape=PackShape(tiles=4, tokens=200), oversized="own-pack"))
    cut = plan_data(big, DataOptions(**FACTS, shape=PackShape(tiles=4, tokens=200), oversized="truncate"))
    assert cut.shape == PackShape(tiles=4, tokens=200)  # the way out the message names works


def test_cli_options_name_the_flag_and_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in (
        (["data", "x.json", "--samples-per-pack", "0"],
         "argument --samples-per-pack: the value must be an integer >= 1, got 0"),
        (["data", "x.json", "--dp", "two"], "argument --dp: 'two' is not an integer"),
        (["run", "--plan", "p.json", "--samples-per-pack", "nan"],
         "argument --samples-per-pack: the value must be a finite"),
        (["run", "--plan", "p.json", "--lr", "-1"], "argument --lr: the value must be a finite number > 0, got -1"),
        (["plan", "tiny-vlm", "--seed", "-3"], "argument --seed: the value must be an integer >= 0"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


# -- files -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        ("a.csv", "vit_num,token_num,image_flags\n1,300,1\n2,600\n", ["record 1 (line 3)", "column 'image_flags'"]),
        ("b.csv", "vit_num,token_num\n1,300,7\n", ["record 0 (line 2)", "beyond the header"]),
        ("c.csv", "vit_num,token_num,image_flags\n1,300,\n", ["record 0 (line 2)", "'image_flags'", "''"]),
        ("d.json", '[{"vit_num": 1, "token_num": "300"}]', ["record 0", "'token_num'", "'300'"]),
        ("e.json", '[{"vit_num": 1, "token_num": 300, "image_flags": null}]', ["record 0", "'image_flags'", "null"]),
    ],
)
def test_length_files_are_checked_field_by_field(tmp_path: Path, name: str, text: str, needles: list[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_lengths(path)
    assert str(path) in str(e.value)
    for needle in needles:
        assert needle in str(e.value)


def test_a_directory_given_as_a_file_says_so(tmp_path: Path, vlm) -> None:
    with pytest.raises(InputError, match="length statistics file .* is a directory"):
        load_lengths(tmp_path)
    with pytest.raises(InputError, match="plan file .* is a directory"):
        Plan.from_file(tmp_path)
    model, batch = vlm
    with pytest.raises(InputError, match=r"cost table file \(costs=\) .* is a directory"):
        oc.optimize(model, batch, num_stages=2, costs=tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "needles"),
    [
        ("boundaries", [0, 12.5, 19], ["boundaries[1]", "12.5"]),
        ("boundaries", [0, "3", 19], ["boundaries[1]", "'3'"]),
        ("stage_time_s", ["fast", 1.0], ["stage_time_s[0]", "'fast'"]),
        ("block_params", [1] * 18 + [None], ["block_params[18]", "None"]),
        ("block_names", "ab", ["block_names", "list of strings"]),
        ("reshard_after_forward", "yes", ["reshard_after_forward", "'yes'"]),
        ("num_microbatches", 2.5, ["num_microbatches", "2.5"]),
    ],
)
def test_plan_files_are_checked_field_by_field(tmp_path: Path, planned, field: str, value, needles: list[str]) -> None:
    data = json.loads(planned.plan.to_json())
    data[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as e:
        Plan.from_file(path)
    assert str(path) in str(e.value)
    for needle in needles:
        assert needle in str(e.value)


def test_a_plan_for_other_parameter_counts_is_refused(planned, vlm) -> None:
    model, _ = vlm
    params = list(planned.plan.block_params)
    i = next(k for k, p in enumerate(params) if p)
    params[i] *= 2  # same block names, another width: made for another configuration
    other = dataclasses.replace(planned.plan, block_params=tuple(params))
    with pytest.raises(PlanError) as e:
        generate_stages(planned.graph, other, model)
    name = planned.plan.block_names[i]
    assert f"{name}: plan {params[i]:,}, model {params[i] // 2:,}" in str(e.value)
    generate_stages(planned.graph, planned.plan, model)  # the plan it was made with still passes


def test_run_config_files_refuse_unknown_fields() -> None:
    text = json.dumps({**json.loads(RunConfig(plan="p.json").to_json()), "batchsize": 8})
    with pytest.raises(InputError, match=r"unknown fields \['batchsize'\]"):
        RunConfig.from_json(text)


# -- samplers --------------------------------------------------------------------------------------
def _data(**options):
    return plan_data(_stats(), DataOptions(**FACTS, **options))


def test_sampler_state_resumes_only_the_sequence_it_was_saved_from() -> None:
    a = _data(samples_per_pack=4).sampler(0)
    it = iter(a)
    got = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON
    same = _data(samples_per_pack=4).sampler(0)
    same.load_state_dict(state)
    a.set_epoch(0)
    assert got + list(same) == list(a)  # the same sequence continues
    with pytest.raises(InputError, match=r"samples_per_pack=4.0 but this sampler has samples_per_pack=3.0"):
        _data(samples_per_pack=3).sampler(0).load_state_dict(state)
    with pytest.raises(InputError, match=r"seed=0 but this sampler has seed=1"):
        _data(samples_per_pack=4, seed=1).sampler(0).load_state_dict(state)
    other = plan_data(_stats(seed=5), DataOptions(**FACTS, samples_per_pack=4)).sampler(0)
    with pytest.raises(InputError, match="lengths_digest"):
        other.load_state_dict(state)


def test_sampler_state_beyond_the_epoch_or_incomplete_is_refused() -> None:
    s = _data().sampler(0)
    state = s.state_dict()
    with pytest.raises(InputError, match=rf"step 1000 is beyond epoch 0's {len(s)} steps"):
        s.load_state_dict({**state, "step": 1000})
    with pytest.raises(InputError, match=r"sampler state 'step' must be an integer >= 0, got 2.5"):
        s.load_state_dict({**state, "step": 2.5})
    with pytest.raises(InputError, match=r"lacks \['settings', 'packing'"):
        s.load_state_dict({k: state[k] for k in ("epoch", "step", "seed", "world_size", "num_samples")})


def test_sampler_without_settings_still_checks_the_packing_itself() -> None:
    stats = _stats()

    def sampler(k: int) -> BalancedBatchSampler:
        return BalancedBatchSampler(lambda seed: balance_pack(stats, dp=1, samples_per_pack=k, seed=seed),
                                    num_samples=len(stats))

    state = sampler(4).state_dict()
    sampler(4).load_state_dict(state)
    with pytest.raises(InputError, match="packs of epoch 0 differ from those the state was saved with"):
        sampler(3).load_state_dict(state)
    with pytest.raises(InputError, match=r"num_samples must be an integer >= 1, got nan"):
        BalancedBatchSampler(lambda seed: None, num_samples=math.nan)


# -- defaults --------------------------------------------------------------------------------------
def test_defaults_a_pipeline_user_expects(vlm, planned) -> None:
    model, batch = vlm
    plan = planned.plan  # device given, no micro-batch count: one per stage, every stage holds layers
    assert plan.num_microbatches == plan.num_stages == 2
    assert "2 micro-batches" in plan.summary()
    assert all(any(plan.block_kinds[i] == "layer" for i in range(st.start, st.stop)) for st in plan.stages)
    free = oc.optimize(model, batch, num_stages=2, schedule="gpipe", num_microbatches=6, recompute="full")
    assert (free.plan.schedule, free.plan.num_microbatches) == ("gpipe", 6)  # kept without device
    assert set(free.plan.block_recompute) == {"full"}  # applied, not dropped
    for kwargs, error, needle in (
        (dict(schedule="zigzag"), PlanError, "schedule 'zigzag' is unknown"),
        (dict(num_microbatches=-1), PlanError, "num_microbatches must be an integer >= 1, got -1"),
        (dict(virtual_stages=0), PlanError, "virtual_stages must be an integer >= 1, got 0"),
        (dict(recompute="bogus"), InputError, "recompute must be one of"),
        (dict(solver="cbc"), InputError, "solver='cbc' picks the ILP backend"),
        (dict(cost_cache="c.json"), InputError, "cost_cache only apply when device="),
        (dict(plan=planned.plan, num_microbatches=4), InputError, "num_microbatches=4 differs from the given plan's 2"),
        (dict(plan=planned.plan, schedule="gpipe"), InputError,
         "schedule='gpipe' differs from the given plan's '1f1b'"),
        (dict(plan=planned.plan, memory_budget="1GiB"), InputError, "memory_budget choose a new plan"),
    ):
        with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)")):
            oc.optimize(model, batch, num_stages=2, **kwargs)
    again = oc.optimize(model, batch, num_stages=2, plan=planned.plan, num_microbatches=2, schedule="1f1b")
    assert again.plan == planned.plan  # keywords equal to the plan's are fine


def test_plan_command_without_matplotlib_writes_the_rest_and_says_how(tmp_path: Path, monkeypatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, as on the base install
    out = tmp_path / "out"
    argv = [
        "plan",
        "tiny-vlm",
        "--num-stages",
        "2",
        "--num-microbatches",
        "2",
        "--device",
        "a100-80gb",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert (out / "plan.json").is_file() and (out / "trace.json").is_file()
    assert not list(out.glob("*.png"))
    assert "pip install 'omnibal-compile[viz]'" in capsys.readouterr().out
