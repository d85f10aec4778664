"""--freeze REGEX: frozen parameters get no gradient, no optimizer state, no reduction; the planner is told
(weights-only static bytes, no weight gradients, no backward before the first trained block); a 2-rank run
keeps them frozen and equal, through a checkpoint and a resumed run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile import progress
from omnibal_compile.config import Config
from omnibal_compile.costs.analytic import LLAVA15_7B, MicroBatch, cost_table
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BF16_ADAM, DataParallel, with_frozen
from omnibal_compile.models import TinyVLM
from omnibal_compile.models.freeze import freeze_parameters
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM


def test_patterns_are_regexes_split_on_commas_and_one_matching_nothing_is_named():
    model = TinyVLM(SMALL_VLM)
    names = freeze_parameters(model, ("vision,projector\\.fc1",))
    assert names and all(n.startswith(("vision.", "projector.fc1.")) for n in names)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in names)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in names)
    with pytest.raises(InputError, match=r"freeze pattern 'vision_tower' \(--freeze\) matches no parameter.*"
                                         r"vision\.patch_embed\.pos.*llm\."):
        freeze_parameters(TinyVLM(SMALL_VLM), ("vision_tower",))
    with pytest.raises(InputError, match=r"freeze pattern '\(' \(--freeze\) is not a regular expression"):
        Config(freeze=("(",))
    assert Config(freeze="vision,llm").freeze == ("vision", "llm")
    assert RunConfig.from_json(RunConfig(plan="p", freeze=("a", "b")).to_json()).freeze == ("a", "b")


def test_the_plan_of_a_frozen_vision_tower_is_costed_as_such_and_predicts_a_faster_iteration():
    found = {}
    for freeze in ((), ("vision",)):
        torch.manual_seed(0)
        model = TinyVLM(SMALL_VLM)
        with progress.quiet():
            found[freeze] = oc.optimize(model, num_stages=2, device="cpu", freeze=freeze, num_microbatches=4)
    plain, frozen = found[()], found[("vision",)]
    assert all(not p.requires_grad for n, p in frozen.model.named_parameters() if n.startswith("vision."))
    for a, b in zip(plain.costs.blocks, frozen.costs.blocks):
        if b.name.startswith("vision."):  # before the first trained block: weights only, no backward, nothing kept
            assert b.frozen_params == b.num_params > 0
            assert b.static_bytes == b.num_params * BF16_ADAM.frozen_bytes_per_param < a.static_bytes
            assert b.backward_s == 0.0 < a.backward_s and b.activation_bytes["none"] == 0
        else:
            assert b.frozen_params == 0 and b.static_bytes == a.static_bytes
    kept = [a.activation_bytes["none"] for a in plain.costs.blocks if a.name.startswith("vision.")]
    assert sum(kept) > 0  # what the unfrozen tower keeps for its backward
    # the planner is told: on the same forward times (profiles on a shared machine are noisy run to run), the
    # frozen costs plan a faster iteration (bench/freeze_cpu.py compares profiled plans and measured runs)
    from omnibal_compile.ir.schedule import Schedule
    from omnibal_compile.planning.build import plan_stages

    same = with_frozen(plain.costs, [b.frozen_params for b in frozen.costs.blocks])
    assert [b.backward_s == 0 for b in same.blocks] == [b.backward_s == 0 for b in frozen.costs.blocks]
    times = [plan_stages(plain.graph, num_stages=2, schedule=Schedule.for_stages(2, num_microbatches=4),
                         costs=table).iteration_time_s for table in (plain.costs, same)]
    assert times[1] < times[0]
    assert frozen.plan.notes["freeze"] == ["vision"] and "freeze" not in plain.plan.notes
    assert frozen.plan.notes["compute dtype"] == "float32"


def test_data_parallel_reduces_no_gradient_of_frozen_parameters_and_modelled_tables_drop_their_backward():
    table = cost_table(LLAVA15_7B, MicroBatch(tiles=1, tokens=1024, attention_pairs=1024 * 1025 // 2))
    frozen = with_frozen(table, [b.num_params if b.name.startswith("vision") else 0 for b in table.blocks])
    dp = DataParallel(size=4, shard="fsdp")
    for a, b, ca, cb in zip(table.blocks, frozen.blocks, table.data_parallel_costs(dp), frozen.data_parallel_costs(dp)):
        if b.name.startswith("vision"):
            assert b.backward_s == 0.0 and b.static_bytes < a.static_bytes
            assert cb.reduce_s == 0.0 < ca.reduce_s and cb.gather_s == pytest.approx(ca.gather_s)
            assert cb.static_bytes == pytest.approx(b.num_params * BF16_ADAM.frozen_bytes_per_param / 4)
        else:
            assert (b.backward_s, b.static_bytes, cb.reduce_s) == (a.backward_s, a.static_bytes, ca.reduce_s)
    # a frozen block after a trained one still passes input gradients back: only the weight gradients go
    late = with_frozen(table, [b.num_params if b.name.startswith("llm.layers.0") else 0 for b in table.blocks])
    k = table.names.index("llm.layers.0")
    assert 0 < late.blocks[k].backward_s < table.blocks[k].backward_s


@pytest.mark.distributed
def test_a_two_rank_run_keeps_frozen_parameters_equal_through_a_checkpoint_and_trains_like_the_unsplit_model(
        tmp_path: Path):
    model_config = dataclasses.asdict(SMALL_VLM)
    probe = RunConfig(plan="-", model_config=model_config, freeze=("vision",))
    model = build_model(probe)
    with progress.quiet():
        plan = oc.optimize(model, num_stages=2, planner="uniform", num_microbatches=2).plan
    # stage 0 all frozen (glue, patch embedding, first ViT layer): a stage with no gradient at all
    plan = dataclasses.replace(plan, boundaries=(0, 3, plan.boundaries[-1]))
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = RunConfig(plan=str(tmp_path / "plan.json"), model_config=model_config, freeze=("vision",), steps=2,
                       batch_size=4, optimizer="sgd", lr=0.5, save=str(tmp_path / "ck"))
    first = launch(config, timeout_s=240, quiet=True)
    resumed = launch(dataclasses.replace(config, steps=3, resume=str(tmp_path / "ck")), timeout_s=240, quiet=True)
    # the unsplit frozen model, trained on the same batches
    ref = build_model(config)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # SGD: exact to float noise (AdamW's eps=1e-8 turns the noise of an exactly-zero gradient into a step)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    source, want = batch_source(config, ref), []
    for step in range(3):
        opt.zero_grad()
        loss = ref(**source(step))
        want.append(float(loss.detach()))
        loss.backward()
        opt.step()
    got = [e.loss for e in first] + [e.loss for e in resumed]
    assert got == pytest.approx(want, abs=1e-5)
    from omnibal_compile.runtime.checkpoint import load_into_model

    saved = TinyVLM(SMALL_VLM)
    assert load_into_model(saved, tmp_path / "ck") == 3  # every name saved, frozen ones included (else refused)
    state = dict(saved.named_parameters())
    for n in (n for n in start if n.startswith("vision.")):
        assert torch.equal(state[n], start[n]), n  # never moved, through the resume too
    assert not torch.equal(state["projector.fc1.weight"], start["projector.fc1.weight"])
