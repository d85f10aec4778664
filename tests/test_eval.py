"""``run --epochs N`` (passes over the packs, the last step padded with empty rows) and ``--eval-data`` (the
held-out set's loss through the pipeline, forward only)."""

import dataclasses
import json
import math

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile.errors import InputError
from omnibal_compile.runtime.batches import batch_source, build_model, eval_source, run_steps
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from tests.conftest import SMALL_VLM

TOL = 1e-5
MODEL_CONFIG = dataclasses.asdict(SMALL_VLM)


def _lengths(path, n, seed):
    """``n`` samples in OmniBal's format (InternVL units, scaled to the small model on load)."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(n):
        tiles = int(torch.randint(1, 4, (1,), generator=g))
        records.append({"vit_num": tiles, "token_num": tiles * 256 + int(torch.randint(64, 700, (1,), generator=g)),
                        "image_flags": tiles})
    path.write_text(json.dumps(records))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-data")
    return _lengths(folder / "train.json", 40, 0), _lengths(folder / "eval.json", 9, 1)


def _ids(source, steps, dp):
    return [i for step in range(steps) for r in range(dp) for ids in source.sample_ids(step, r) for i in ids]


def test_one_epoch_trains_every_sample_once_and_pads_the_last_step(data):
    train, _ = data
    config = RunConfig(plan="-", model_config=MODEL_CONFIG, lengths=(train,), batch_size=4, dp=2, epochs=1)
    source = batch_source(config, build_model(config))
    per_epoch, rows = source.packs_per_epoch, 2
    assert per_epoch % rows, "the data must leave a partial last step for this test"
    steps = run_steps(config, source)
    assert steps == math.ceil(per_epoch / rows)
    assert sorted(_ids(source, steps, 2)) == list(range(40))
    last = source(steps - 1)
    trained = (last["labels"][:, 1:] != -100).sum(dim=1)
    assert trained.tolist().count(0) == 2  # one empty row per dp rank, no loss
    twice = dataclasses.replace(config, epochs=2)
    ids = _ids(batch_source(twice, build_model(twice)), run_steps(twice, source), 2)
    assert sorted(ids) == sorted(list(range(40)) * 2)


def test_steps_and_epochs_are_exclusive_and_epochs_needs_data(data):
    with pytest.raises(InputError, match=r"steps \(--steps\) or epochs \(--epochs\), not both"):
        RunConfig(plan="-", steps=3, epochs=1)
    config = RunConfig(plan="-", model_config=MODEL_CONFIG, epochs=1)
    with pytest.raises(InputError, match="--epochs.*--dataset FILE or --lengths FILE"):
        run_steps(config, batch_source(config, build_model(config)))
    assert run_steps(RunConfig(plan="-"), lambda step: None) == 5  # neither: the old default
    built_in = RunConfig(plan="-", model_config=MODEL_CONFIG, eval_data=data[1])
    model = build_model(built_in)
    with pytest.raises(InputError, match="--eval-data.*needs --dataset FILE or --lengths FILE"):
        eval_source(built_in, model, batch_source(built_in, model))


def test_eval_packs_keep_the_training_shape_and_hold_every_eval_sample_once(data):
    train, held_out = data
    config = RunConfig(plan="-", model_config=MODEL_CONFIG, lengths=(train,), batch_size=4, dp=2, eval_data=held_out)
    model = build_model(config)
    source = batch_source(config, model)
    evals, steps = eval_source(config, model, source)
    shapes = {k: tuple(v.shape) for k, v in source(0).items()}
    assert all({k: tuple(v.shape) for k, v in evals(k).items()} == shapes for k in range(steps))
    assert sorted(_ids(evals, steps, 2)) == list(range(9))


def _plan(tmp_path, train, stages):
    model = build_model(RunConfig(plan="-", model_config=MODEL_CONFIG))
    probe = RunConfig(plan="-", model_config=MODEL_CONFIG, lengths=(train,), batch_size=1)
    plan = oc.optimize(model, batch_source(probe, model)(0), num_stages=stages, planner="uniform").plan
    path = tmp_path / f"plan{stages}.json"
    path.write_text(plan.to_json())
    return str(path)


@pytest.mark.slow
@pytest.mark.distributed
def test_an_epoch_on_two_dp_ranks_logs_every_sample_once_and_resumes(tmp_path, data):
    train, _ = data
    root = tmp_path / "ck"
    config = RunConfig(plan=_plan(tmp_path, train, 1), model_config=MODEL_CONFIG, lengths=(train,), batch_size=4,
                       dp=2, num_microbatches=2, epochs=1, optimizer="sgd", lr=0.1, log=str(tmp_path / "steps.jsonl"),
                       save=str(root), save_every=1)
    logged = launch(config, timeout_s=240, quiet=True)
    source = batch_source(config, build_model(config))
    assert len(logged) == run_steps(config, source) == math.ceil(source.packs_per_epoch / 2) == 3
    assert all(math.isfinite(e.loss) and math.isfinite(e.grad_norm) for e in logged)  # an empty micro-batch: 0
    ids = [i for e in logged for rank in e.samples for i in rank]
    assert sorted(ids) == list(range(40))
    resumed = launch(dataclasses.replace(config, resume=str(root / "step-000002"), save=None, save_every=0, log=None),
                     timeout_s=240, quiet=True)  # the epoch's steps in all: step 2 is left
    assert [(e.step, e.loss, e.samples) for e in resumed] == [(e.step, e.loss, e.samples) for e in logged[2:]]


@pytest.mark.slow
@pytest.mark.distributed
def test_eval_loss_is_the_unsplit_models_and_leaves_training_alone(tmp_path, data):
    train, held_out = data
    config = RunConfig(plan=_plan(tmp_path, train, 2), model_config=MODEL_CONFIG, lengths=(train,), batch_size=2,
                       steps=2, optimizer="sgd", lr=0.5, num_microbatches=2, schedule="1f1b")
    plain = launch(config, timeout_s=240, quiet=True)
    evaluated = launch(dataclasses.replace(config, eval_data=held_out, eval_every=1,
                                           log=str(tmp_path / "steps.jsonl")), timeout_s=240, quiet=True)
    assert [e.loss for e in evaluated] == [e.loss for e in plain]  # eval changes no weight, no batch
    assert [e.step for e in evaluated.evals] == [1, 2]
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r.get("record", "step") for r in records] == ["step", "eval", "step", "eval"]
    model = build_model(config)
    source = batch_source(config, model)
    evals, eval_steps = eval_source(dataclasses.replace(config, eval_data=held_out), model, source)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step, entry in enumerate(evaluated.evals):
        opt.zero_grad()
        model(**source(step)).backward()
        opt.step()
        with torch.no_grad():
            batches = [evals(k) for k in range(eval_steps)]
            tokens = [float((b["labels"][:, 1:] != -100).sum()) for b in batches]
            # the unsplit model's mean over each eval step's labelled tokens, weighted by them
            want = sum(float(model(**b)) * t for b, t in zip(batches, tokens)) / sum(tokens)
        assert entry.tokens == sum(tokens) and entry.samples == 9
        assert abs(entry.loss - want) <= TOL, (entry.step, entry.loss, want)
