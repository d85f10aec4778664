"""Data-parallel pipelines: a ("dp", "pp") mesh, FSDP2 / replicate per stage, per-rank balanced packs.

One 4-rank spawn (dp=2 x pp=2) trains several cases for two AdamW steps and compares every loss,
the first step's gradients and the final parameters with the unsplit model trained on the same
global batches (the union of the dp ranks' rows). One launch covers dp=2 x pp=1 on
balanced packs through ``omnibal-compile run``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime import TOL, _alternating, _llama_batch, _llava_batch, _rank_process, _spawn, _vlm_batch
from test_runtime_data import _config

import omnibal_compile as oc
from omnibal_compile import PlanError
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import DataParallel
from omnibal_compile.planning.build import uniform
from omnibal_compile.runtime.batches import _dp_part, batch_source, build_model
from omnibal_compile.runtime.launch import launch


def _adamw(params: Any) -> torch.optim.Optimizer:
    # eps well above float noise: a key bias has an exactly-zero true gradient, and Adam's default
    # eps=1e-8 turns its 1e-10 rounding noise (which differs with any change of summation order)
    # into a step of lr/100 in the unsplit model and the pipeline alike.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dp_worker(rank: int, world: int, port: int, out: str, models: dict[str, Any], cases: list[Any]) -> None:
    """One rank of dp=2 x pp=world/2: train every case for its steps; save losses, grads, parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.runtime import build_pipeline

    with _rank_process(rank, world, port, out):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
        d = mesh["dp"].get_local_rank()
        found: dict[str, Any] = {}
        for name, key, plan, dp_shard, recompute in cases:
            cls, config, weights, batches = models[key]
            model = cls(config)  # a fresh model per case: fully_shard takes over the stages' parameters
            model.load_state_dict(weights)
            parts = [_dp_part(b, 2, d) for b in batches]
            layout = dp_shard if isinstance(dp_shard, DataParallel) else DataParallel(size=2, shard=dp_shard)
            pipe = build_pipeline(
                compile_for_microbatches(model, parts[0], plan), mesh=mesh, recompute=recompute, data_parallel=layout
            )
            opt = _adamw(pipe.parameters())
            losses, grads = [], {}
            for k, part in enumerate(parts):
                opt.zero_grad(set_to_none=True)
                losses.append(pipe.step(part))
                if k == 0:
                    grads = {n: _full(g) for n, g in pipe.named_grads().items() if g is not None}
                opt.step()
            found[name] = {
                "losses": losses,
                "grads": grads,
                "params": {n: t for n, t in pipe.full_state().items() if n in pipe.named_grads()},
                "dp": (pipe.dp_rank, pipe.dp_size, pipe.dp_shard),
                "units": sum(
                    type(m).__name__.startswith(("FSDP", "Replicate")) for mod in pipe.modules for m in mod.modules()
                ),
            }
        torch.save(found, Path(out) / f"rank{rank}.pt")


def _reference(
    model: torch.nn.Module, batches: list[Any]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The unsplit model trained like the pipelines: losses, the first step's gradients, final parameters."""
    import copy

    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]  # tied: each name
    opt = _adamw(model.parameters())
    losses, grads = [], {}
    for k, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        losses.append(float(loss.detach()))
        if k == 0:
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in named}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    worst = max(want, key=lambda n: float((got[n] - want[n]).abs().max()))
    return worst, float((got[worst] - want[worst]).abs().max())


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_pp2_trains_like_the_unsplit_model(vlm, tiny_llava, tiny_llama, tmp_path):
    """The full cross on TinyVLM and Llava: FSDP2 and replicate (DDP) x 1F1B and interleaved x no and mixed
    per-block recomputation; and a Llama with tied embedding/head split across pipeline ranks."""
    models = {  # two global steps of 4 rows: 2 per dp rank, 1 per micro-batch
        "vlm": (vlm[0], [_vlm_batch(seed) for seed in (3, 4)]),
        "llava": (tiny_llava[0], [_llava_batch(seed=seed) for seed in (5, 6)]),
        "llama": (tiny_llama[0], [_llama_batch(seed=seed) for seed in (7, 8)]),
    }
    plans = {}
    for key, (model, batches) in models.items():
        graph = oc.optimize(model, {k: v[:1] for k, v in batches[0].items()}, num_stages=1).graph
        plans[key] = {s: uniform(graph, s) for s in (2, 4)}

    def p(key: str, schedule: str, recompute: bool) -> oc.Plan:
        stages = 4 if schedule == "interleaved" else 2
        plan = plans[key][stages]
        mixed = _alternating(plan) if recompute else ()
        return dataclasses.replace(
            plan, schedule=schedule, num_microbatches=2, virtual_stages=stages // 2, recompute=mixed
        )

    cases = [  # (name, model, plan, dp_shard, apply recompute)
        (f"{key}-{shard}-{schedule}" + ("-recompute" if rc else ""), key, p(key, schedule, rc), shard, rc)
        for key in ("vlm", "llava")
        for shard in ("fsdp", "ddp")
        for schedule in ("1f1b", "interleaved")
        for rc in (False, True)
    ]
    cases.append(("llama-tied-fsdp-1f1b", "llama", p("llama", "1f1b", False), "fsdp", True))
    ranks = _spawn(4, tmp_path, {k: (m, b) for k, (m, b) in models.items()}, cases, worker=_dp_worker)
    for name, key, plan, dp_shard, _ in cases:
        assert all(r[name]["units"] >= plan.virtual_stages for r in ranks), name  # a root per stage at least
        check_dp_parity(ranks, name, dp_shard, _reference(*models[key]))


# -- balanced packs per dp rank, launch ----------------------------------------------------------
def test_each_dp_rank_gets_its_own_balanced_packs(tmp_path, lengths_file):
    config = _config(tmp_path, lengths_file, stages=1, dp=2, batch_size=4)  # 2 packs per dp rank per step
    model = build_model(config)
    whole = batch_source(config, model)
    sources = [batch_source(config, model, r) for r in range(2)]
    data = sources[0].data_plan
    packing, stats, tpt = data.first_packing, data.stats, model.config.tokens_per_tile
    assert packing.dp == 2
    for k in range(2):  # within epoch 0
        parts = [src(k) for src in sources]
        for r in range(2):
            want = [packing.pack(int(packing.steps[2 * k + i, r])).tolist() for i in range(2)]
            assert sources[r].packs(k, r) == want, (k, r)  # rank r, row i: step 2k + i of the packing, column r
            text = [int((stats.tokens[ids] - stats.tiles[ids] * tpt).sum()) for ids in want]  # images lead each sample
            assert (parts[r]["labels"] != -100).sum(dim=1).tolist() == text, (k, r)
        assert not {i for ids in sources[0].packs(k, 0) for i in ids} & {
            i for ids in sources[1].packs(k, 1) for i in ids
        }
        both = whole(k)
        for key in both:
            assert torch.equal(both[key], torch.cat([parts[0][key], parts[1][key]])), key
    random = batch_source(dataclasses.replace(config, batching="random"), model, 1)
    assert random.data_plan.first_packing.method == "random" and all(len(ids) == 1 for ids in random.packs(0, 1))
    assert random(0)["input_ids"].shape[0] == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_run_dp2_pp1_on_balanced_packs_trains_like_the_unsplit_model(tmp_path, lengths_file):
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.checkpoint import load_into_model

    config = _config(tmp_path, lengths_file, stages=1, dp=2, batch_size=4, num_microbatches=2, schedule="1f1b", steps=2,
                           optimizer="sgd", lr=0.5)
    ckpt, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    argv = ["run", "--plan", config.plan, "--model-config", json.dumps(dict(config.model_config)), "--lengths",
            *config.lengths, "--dp", "2", "--batch-size", "4", "--num-microbatches", "2", "--schedule", "1f1b",
            "--steps", "2", "--optimizer", "sgd", "--lr", "0.5", "--save", str(ckpt), "--log", str(log),
            "--timeout", "200"]
    assert main(argv) == 0
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in logged] == [0, 1] and len(logged[0]["rank_cpu_s"]) == 2
    model = build_model(config)
    source = batch_source(config, model)  # the whole step: both dp ranks' packs
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step in range(config.steps):
        opt.zero_grad()
        loss = model(**source(step))
        assert abs(float(loss.detach()) - logged[step]["loss"]) <= TOL, step
        loss.backward()
        opt.step()
    loaded = build_model(dataclasses.replace(config, seed=123))
    load_into_model(loaded, ckpt)  # FSDP shards gathered, written once
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert float((a - b).abs().max()) <= TOL, n


def test_dp_pre_launch_checks_name_the_flag(tmp_path, lengths_file, monkeypatch):
    import omnibal_compile.runtime.processes as processes_mod  # where rank processes start

    def no_process(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(processes_mod.subprocess, "Popen", no_process)
    config = _config(tmp_path, lengths_file, stages=1, batch_size=4, num_microbatches=2, schedule="1f1b")
    with pytest.raises(InputError, match=r"dp must be an integer >= 1, got 0; setting dp \(--dp\)"):
        launch(dataclasses.replace(config, dp=0))
    with pytest.raises(
        InputError, match=r"dp_shard must be one of \['fsdp', 'ddp'\], got 'zero'; setting dp_shard \(--dp-shard\)"
    ):
        launch(dataclasses.replace(config, dp=2, dp_shard="zero"))
    with pytest.raises(InputError, match=r"batching must be one of .*; setting batching \(--batching\)"):
        launch(dataclasses.replace(config, batching="sorted"))
    with pytest.raises(PlanError, match=r"batch size 6 is not divisible by dp=2 x 2 micro-batches = 4.*--batch-size"):
        launch(dataclasses.replace(config, dp=2, batch_size=6))
    with pytest.raises(PlanError, match=r"dp=2 pipelines of 1 ranks need 2 processes but world size is 3.*--nproc"):
        launch(dataclasses.replace(config, dp=2, nproc=3))


def test_the_run_takes_its_data_parallel_layout_from_the_plan(tmp_path, lengths_file):
    from omnibal_compile.runtime.settings import with_plan_layout

    config = _config(tmp_path, lengths_file, stages=1, batch_size=4, num_microbatches=2, schedule="1f1b")
    assert (with_plan_layout(config).dp, with_plan_layout(config).dp_shard) == (1, "fsdp")  # a plan without dp
    plan = oc.Plan.from_json(Path(config.plan).read_text())
    planned = dataclasses.replace(plan, data_parallel=2, data_parallel_shard="ddp", reshard_after_forward=False)
    Path(config.plan).write_text(planned.to_json())
    got = with_plan_layout(config)
    assert (got.dp, got.dp_shard, got.reshard_after_forward) == (2, "ddp", False)
    assert with_plan_layout(dataclasses.replace(config, dp=4, dp_shard="fsdp")).dp == 4  # --dp wins
    assert batch_source(config, build_model(config), 1)(0)["input_ids"].shape[0] == 2  # rank 1 of dp=2


def check_dp_parity(ranks: list[dict[str, Any]], name: str, dp_shard: str,
                    reference: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
    """Case ``name`` of a dp = 2 x pp = 2 run (:func:`_dp_worker` on 4 ranks) trained like the unsplit model
    (``reference``: :func:`_reference`'s losses, gradients and final parameters): every rank's dp place, gradients
    and parameters (dp copies and tied holders agreeing), and both replicas' logged losses."""
    ref_losses, ref_grads, ref_params = reference
    assert [r[name]["dp"] for r in ranks] == [(0, 2, dp_shard)] * 2 + [(1, 2, dp_shard)] * 2
    for field, want in (("grads", ref_grads), ("params", ref_params)):
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            for n, t in r[name][field].items():
                if n in got:  # dp copies and tied holders: all must agree
                    assert float((got[n] - t).abs().max()) <= TOL, (name, field, n)
                got[n] = t
        if field == "grads":  # only a parameter no stage uses may lack a gradient
            unused = set(want) - set(got)
            assert all(not want[n].any() for n in unused), (name, sorted(unused)[:5])
            got.update({n: torch.zeros_like(want[n]) for n in unused})
        assert set(got) == set(want), (name, field, sorted(set(got) ^ set(want))[:5])
        worst, diff = _max_diff(got, want)
        assert diff <= TOL, (name, field, worst, diff)
    losses = [r[name]["losses"] for r in ranks if r[name]["losses"][0] is not None]
    assert len(losses) == 2, name  # the last stage's rank in each of the 2 replicas
    for replica in losses:  # both replicas report the whole step's loss
        assert max(abs(a - b) for a, b in zip(replica, ref_losses)) <= TOL, (name, replica, ref_losses)
