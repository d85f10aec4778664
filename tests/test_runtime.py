"""Pipeline runtime: real processes on gloo/loopback reproduce the unsplit model's loss and gradients.

The distributed tests start their ranks with ``torch.multiprocessing`` (spawn) or the launcher, bound
every wait with a timeout and kill the ranks on failure. One launch per world size runs many cases
(models x schedules x recompute) in a row, so the file stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import socket
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from conftest import SMALL_VLM

import omnibal_compile as oc
from omnibal_compile import InputError, Plan, PlanError
from omnibal_compile.api import compile_for_microbatches
from omnibal_compile.compile.capture import split_batch
from omnibal_compile.compile.codegen import generate_stages
from omnibal_compile.ir.costs import DataParallel
from omnibal_compile.planning.build import uniform
from omnibal_compile.runtime import check_pipeline, loss_weights, rank_stages
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig

TOL = 1e-5
SPAWN_TIMEOUT_S = 240


# -- helpers -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _vlm_batch(seed: int = 3) -> dict[str, torch.Tensor]:
    from omnibal_compile.models import make_example_batch

    batch = make_example_batch(SMALL_VLM, batch=4, tiles_per_sample=1, text_tokens=12, seed=seed)
    batch["labels"][0, -5:] = -100  # micro-batches with different numbers of labelled tokens
    return batch


def _llava_batch(rows: int = 4, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (rows, 24), generator=g)
    ids[:, :17] = 95  # 16 patches + CLS, as in the conftest fixture
    labels = ids.clone()
    labels[:, :17] = -100
    labels[1, -4:] = -100
    return {"pixel_values": torch.randn(rows, 3, 16, 16, generator=g), "input_ids": ids, "labels": labels}


def _llama_batch(rows: int = 4, seed: int = 7) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (rows, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _alternating(plan: Plan) -> tuple[str, ...]:
    return tuple(("full", "selective", "none")[i % 3] for i in range(plan.num_blocks))


def _cases(base: dict[str, Plan], world: int) -> list[tuple[str, str, Plan]]:
    """(case name, model key, plan) for one world size; ``base[f"{model}{S}"]`` is a uniform plan."""

    def p(model: str, stages: int, schedule: str, recompute: str | None = None) -> Plan:
        plan = base[f"{model}{stages}"]
        rec = {None: (), "full": ("full",) * plan.num_blocks, "selective": ("selective",) * plan.num_blocks,
               "mixed": _alternating(plan)}[recompute]
        return dataclasses.replace(
            plan, schedule=schedule, num_microbatches=4, virtual_stages=stages // world, recompute=rec
        )

    if world == 2:
        return [
            ("vlm-gpipe", "vlm", p("vlm", 2, "gpipe")),
            ("vlm-1f1b", "vlm", p("vlm", 2, "1f1b")),
            ("vlm-interleaved", "vlm", p("vlm", 4, "interleaved")),
            ("vlm-interleaved-1-per-rank", "vlm", p("vlm", 2, "interleaved")),
            ("vlm-1f1b-full", "vlm", p("vlm", 2, "1f1b", "full")),
            ("vlm-gpipe-selective", "vlm", p("vlm", 2, "gpipe", "selective")),
            ("vlm-interleaved-mixed", "vlm", p("vlm", 4, "interleaved", "mixed")),
            ("llava-gpipe", "llava", p("llava", 2, "gpipe")),
            ("llava-1f1b-mixed", "llava", p("llava", 2, "1f1b", "mixed")),
            ("llava-interleaved", "llava", p("llava", 4, "interleaved")),
            ("llama-tied-1f1b", "llama", p("llama", 2, "1f1b")),
        ]
    return [
        ("vlm-gpipe", "vlm", p("vlm", 4, "gpipe")),
        ("vlm-1f1b-full", "vlm", p("vlm", 4, "1f1b", "full")),
        ("llava-gpipe-selective", "llava", p("llava", 4, "gpipe", "selective")),
        ("llava-1f1b", "llava", p("llava", 4, "1f1b")),
    ]


@contextlib.contextmanager
def _rank_process(rank: int, world: int, port: int, out: str) -> Iterator[None]:
    """One spawned rank's gloo process group, one thread; a failure's traceback is left in ``out`` for the parent."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        yield
    except BaseException:
        (Path(out) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _parity_worker(rank: int, world: int, port: int, out: str, models: dict[str, Any], cases: list[Any]) -> None:
    """One rank: run every case for one step; save its loss and its parameters' gradients."""
    from omnibal_compile.runtime import build_pipeline

    with _rank_process(rank, world, port, out):
        compiled: dict[str, oc.OptimizeResult] = {}
        found: dict[str, Any] = {}
        built = {key: _rebuild(*spec) for key, spec in models.items()}
        for name, key, plan in cases:
            model, batch = built[key]
            if key not in compiled:  # capture once per model; every case uses 4 micro-batches
                compiled[key] = compile_for_microbatches(model, batch, plan)
            first = compiled[key]
            result = dataclasses.replace(first, plan=plan, stages=generate_stages(first.graph, plan, model))
            for prm in model.parameters():
                prm.grad = None
            pipe = build_pipeline(result, rank=rank, world_size=world)
            regions = _count_region_calls(pipe, result)
            loss = pipe.step(batch)
            found[name] = {
                "regions": regions,
                "loss": loss,
                "grads": {n: g.clone() for n, g in pipe.named_grads().items() if g is not None},
                "stages": pipe.stage_indices,
                "params": sorted(n for n, t in pipe.state.items() if isinstance(t, torch.nn.Parameter)),
            }
            if name == "vlm-1f1b":
                wrong = dict(batch, pixel_values=batch["pixel_values"][:2], input_ids=batch["input_ids"][:2])
                try:
                    pipe.flatten(wrong)
                    found["shape-error"] = None
                except InputError as e:
                    found["shape-error"] = str(e)
        torch.save(found, Path(out) / f"rank{rank}.pt")


def _count_region_calls(pipe: Any, result: oc.OptimizeResult) -> list[tuple[str, str, list[int]]]:
    """(block, option, [calls in forward, calls in backward]) of every checkpoint region of ``pipe``'s
    stages, in stage order; the counts fill in as the pipeline runs."""
    from omnibal_compile.compile.recompute import CheckpointedRegion

    found: list[tuple[str, str, list[int]]] = []
    option = dict(zip(result.plan.block_names, result.plan.block_recompute))
    for s, module in zip(pipe.stage_indices, pipe.modules):
        planned = [b for b in result.stage_info(s).blocks if option[b] != "none"]
        regions = [m for m in module.modules() if isinstance(m, CheckpointedRegion)]
        for m, block in zip(regions, planned):
            calls = [0, 0]
            forward = m.region.forward

            def counted(*args: Any, forward: Any = forward, calls: list[int] = calls) -> Any:
                calls[torch._C._current_graph_task_id() != -1] += 1
                return forward(*args)

            m.region.forward = counted
            found.append((block, m.option, calls))
        found += [("<unplanned region>", m.option, [0, 0]) for m in regions[len(planned):]]
    return found


def _planned_regions(plan: Plan, rank: int) -> list[tuple[str, str]]:
    """(block, option) of every block that recomputes in the stages ``rank`` runs, in stage order."""
    b = plan.boundaries
    return [(plan.block_names[i], plan.block_recompute[i]) for s in rank_stages(plan, rank)
            for i in range(b[s], b[s + 1]) if plan.block_recompute[i] != "none"]


def _rebuild(cls: type, config: Any, state: dict[str, torch.Tensor], batch: Any) -> tuple[torch.nn.Module, Any]:
    model = cls(config)
    model.load_state_dict(state)
    return model, batch


def _spawn(world: int, out: Path, models: dict[str, Any], cases: list[Any], worker: Any = None) -> list[dict[str, Any]]:
    """Run ``worker`` (default :func:`_parity_worker`) on ``world`` ranks; models travel as (class, config, weights,
    batch)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    specs = {k: (type(m), m.config, m.state_dict(), b) for k, (m, b) in models.items()}
    ctx = mp.start_processes(
        worker or _parity_worker, args=(world, _free_port(), str(out), specs, cases), nprocs=world, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as e:
        errors = "\n".join(f"rank {p.stem}: {p.read_text()}" for p in sorted(out.glob("*.error")))
        raise AssertionError(f"distributed run failed: {e}\n{errors}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]  # tied: each name
    loss = _loss(model(**batch))
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return float(loss.detach()), {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


@pytest.fixture(scope="module")
def parity_models(vlm, tiny_llava, tiny_llama):
    return {
        "vlm": (vlm[0], _vlm_batch()),
        "llava": (tiny_llava[0], _llava_batch()),
        "llama": (tiny_llama[0], _llama_batch()),
    }


@pytest.fixture(scope="module")
def base_plans(parity_models):
    plans = {}
    for key, (model, batch) in parity_models.items():
        graph = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph
        for stages in (2, 4) if key != "llama" else (2,):
            plans[f"{key}{stages}"] = uniform(graph, stages)
    return plans


# -- distributed parity --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_one_step_matches_unsplit_model(world, parity_models, base_plans, tmp_path):
    cases = _cases(base_plans, world)
    ranks = _spawn(world, tmp_path, parity_models, cases)
    check_parity(ranks, cases, parity_models, world)
    if world == 2:
        msg = ranks[0]["shape-error"]
        assert msg is not None and "'pixel_values' has shape (2, 3, 16, 16)" in msg and "(4, 3, 16, 16)" in msg


def check_parity(ranks: list[dict[str, Any]], cases: list[tuple[str, str, Plan]], parity_models: dict[str, Any],
                 world: int) -> None:
    """Each case's loss and gradients, gathered from ``ranks``, equal the unsplit model's; each rank ran the stages
    and recomputation its plan gives it."""
    references = {key: _reference(model, batch) for key, (model, batch) in parity_models.items()}
    for name, key, plan in cases:
        ref_loss, ref_grads = references[key]
        losses = [r[name]["loss"] for r in ranks if r[name]["loss"] is not None]
        assert len(losses) == 1, name  # exactly one rank holds the last stage
        assert abs(losses[0] - ref_loss) <= TOL, (name, losses[0], ref_loss)
        grads: dict[str, torch.Tensor] = {}
        for r in ranks:
            for n, g in r[name]["grads"].items():
                if n in grads:  # a tied parameter: every holder must end with the summed gradient
                    assert torch.equal(grads[n], g), (name, n)
                grads[n] = g
        assert set(grads) <= set(ref_grads), (name, sorted(set(grads) - set(ref_grads))[:5])
        unused = set(ref_grads) - set(grads)  # only a parameter no stage uses may lack a gradient
        assert all(not ref_grads[n].any() for n in unused), (name, sorted(unused)[:5])
        grads.update({n: torch.zeros_like(ref_grads[n]) for n in unused})
        held = {n for r in ranks for n in r[name]["params"]}
        assert held == set(ref_grads), (name, sorted(set(ref_grads) ^ held)[:5])  # every parameter on some rank
        worst = max(ref_grads, key=lambda n: float((grads[n] - ref_grads[n]).abs().max()))
        diff = float((grads[worst] - ref_grads[worst]).abs().max())
        assert diff <= TOL, (name, worst, diff)
        expected = [rank_stages(plan, r) for r in range(world)]
        assert [tuple(r[name]["stages"]) for r in ranks] == expected
        # The plan's recomputation reached every rank: one region per recomputed block with its option,
        # run once per micro-batch forward and (transformer layers at least) rerun once per backward.
        for rank, r in enumerate(ranks):
            assert [(b, o) for b, o, _ in r[name]["regions"]] == _planned_regions(plan, rank), (name, rank)
            for block, _, (forward, backward) in r[name]["regions"]:
                assert forward == plan.num_microbatches, (name, rank, block)
                assert backward in ((plan.num_microbatches,) if ".layers." in block else (0, plan.num_microbatches))
        if any(o != "none" for o in plan.block_recompute):
            assert any(backward for r in ranks for *_, (_, backward) in r[name]["regions"]), name


# -- launcher: training, checkpoints ---------------------------------------------------------------
def _run_config(tmp_path: Path, plan: Plan, **kw: Any) -> RunConfig:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    fields = {f.name: getattr(SMALL_VLM, f.name) for f in dataclasses.fields(SMALL_VLM)}
    base: dict[str, Any] = {
        "plan": str(path), "model": "tinyvlm", "model_config": fields, "batch_size": 4, "tiles_per_sample": 1,
        "text_tokens": 12, "steps": 2, "optimizer": "sgd", "lr": 0.5, "seed": 0, "schedule": "1f1b",
        "num_microbatches": 2,
    }
    base.update(kw)
    return RunConfig(**base)


@pytest.fixture(scope="module")
def vlm_result2(vlm):
    model, batch = vlm
    return oc.optimize(model, batch, num_stages=2, planner="parameters")


@pytest.fixture(scope="module")
def vlm_plan2(vlm_result2):
    return vlm_result2.plan


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_run_trains_like_the_unsplit_model_and_checkpoint_loads_back(tmp_path, vlm_plan2, capsys):
    from omnibal_compile.cli import main
    from omnibal_compile.runtime.checkpoint import load_into_model

    plan = dataclasses.replace(vlm_plan2, recompute=_alternating(vlm_plan2))
    config = _run_config(tmp_path, plan)
    ckpt, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    argv = [
        "run",
        "--plan",
        config.plan,
        "--model-config",
        __import__("json").dumps(dict(config.model_config)),
        "--batch-size",
        "4",
        "--tiles-per-sample",
        "1",
        "--text-tokens",
        "12",
        "--steps",
        "2",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--schedule",
        "1f1b",
        "--num-microbatches",
        "2",
        "--save",
        str(ckpt),
        "--log",
        str(log),
        "--timeout",
        "200",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "step 2/2  loss " in printed and " grad norm " in printed and "checkpoint written" in printed
    logged = [__import__("json").loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in logged] == [0, 1] and all(e["step_time_s"] > 0 for e in logged)

    # the unsplit model trained the same way
    model = build_model(config)
    source = batch_source(config, model)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step in range(config.steps):
        opt.zero_grad()
        loss = model(**source(step))
        assert abs(float(loss.detach()) - logged[step]["loss"]) <= TOL
        loss.backward()
        opt.step()
    loaded = build_model(dataclasses.replace(config, seed=123))
    load_into_model(loaded, ckpt)
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert float((a - b).abs().max()) <= TOL, n
    batch = source(7)
    with torch.no_grad():
        assert float((loaded(**batch) - model(**batch)).abs()) <= TOL
        batch.pop("labels")
        assert float((loaded(**batch) - model(**batch)).abs().max()) <= TOL

    # resuming from the checkpoint: --steps counts all steps, so one more step is step 2, on batch 2
    # (with the peak-memory accounting on: it reports every rank's bytes and changes no result)
    resumed = launch(
        dataclasses.replace(config, resume=str(ckpt), steps=3, memory_steps=(2,)), timeout_s=200
    )
    assert [e.step for e in resumed] == [2]
    assert f"resumed from {ckpt / 'step-000002'} at step 2" in capsys.readouterr().out
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(resumed[0].rank_peak_bytes) == 2 and sum(resumed[0].rank_peak_bytes) > weights
    with torch.no_grad():
        assert abs(resumed[0].loss - float(model(**source(2)))) <= TOL


def test_pre_launch_checks_fail_before_any_process_starts(tmp_path, vlm_plan2, monkeypatch, capsys):
    import omnibal_compile.runtime.processes as processes_mod  # where rank processes start
    from omnibal_compile.cli import main

    def no_process(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(processes_mod.subprocess, "Popen", no_process)
    with pytest.raises(PlanError, match="needs 2 ranks but world size is 3"):
        launch(_run_config(tmp_path, vlm_plan2, nproc=3))
    with pytest.raises(PlanError, match="1 micro-batch for 2 stages"):
        launch(_run_config(tmp_path, vlm_plan2, num_microbatches=1))
    with pytest.raises(PlanError, match="batch size 6 is not divisible by 4 micro-batches"):
        launch(_run_config(tmp_path, vlm_plan2, batch_size=6, num_microbatches=4))
    with pytest.raises(PlanError, match=r"needs 1 ranks \(2 stages / 2 virtual stages per rank\)"):
        launch(_run_config(tmp_path, vlm_plan2, schedule="interleaved", virtual_stages=2, nproc=2))
    with pytest.raises(PlanError, match="do not match"):  # a plan made for another model
        other = Plan(block_names=("a", "b", "c"), boundaries=(0, 1, 3))
        launch(_run_config(tmp_path, other))
    config = _run_config(tmp_path, vlm_plan2, nproc=4)
    assert main(["run", "--plan", config.plan, "--nproc", "4", "--num-microbatches", "4"]) == 2
    assert "world size is 4" in capsys.readouterr().err


# -- single-process pieces -----------------------------------------------------------------------
def test_check_pipeline_rules(vlm_plan2):
    check_pipeline(dataclasses.replace(vlm_plan2, num_microbatches=2), world_size=2, batch_size=4)
    with pytest.raises(PlanError, match="virtual_stages=2; use schedule 'interleaved'"):
        check_pipeline(dataclasses.replace(vlm_plan2, num_microbatches=2, virtual_stages=2), world_size=1)
    # One stage per rank under interleaved 1F1B: torch's ScheduleInterleaved1F1B takes it.
    check_pipeline(dataclasses.replace(vlm_plan2, num_microbatches=2, schedule="interleaved"), world_size=2)
    # GPipe and interleaved 1F1B take fewer micro-batches than stages; 1F1B does not.
    check_pipeline(dataclasses.replace(vlm_plan2, num_microbatches=1, schedule="gpipe"), world_size=2)
    with pytest.raises(PlanError, match="1 micro-batch for 2 stages"):
        check_pipeline(dataclasses.replace(vlm_plan2, num_microbatches=1), world_size=2)
    four = Plan(block_names=tuple("abcd"), boundaries=(0, 1, 2, 3, 4), schedule="interleaved", virtual_stages=2,
                num_microbatches=6)
    with pytest.raises(PlanError, match="multiple of 2"):
        check_pipeline(dataclasses.replace(four, num_microbatches=5), world_size=2)
    assert rank_stages(four, 0) == (0, 2) and rank_stages(four, 1) == (1, 3)
    # data parallelism: dp pipelines of plan.num_devices ranks each, dp a positive integer
    two = dataclasses.replace(vlm_plan2, num_microbatches=2)
    check_pipeline(two, world_size=4, dp=2, batch_size=8)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(PlanError, match="dp .data-parallel pipelines"):
            check_pipeline(two, world_size=2, dp=bad)
    with pytest.raises(PlanError, match="dp=2 pipelines of 2 ranks need 4 processes but world size is 2"):
        check_pipeline(two, world_size=2, dp=2)
    with pytest.raises(PlanError, match="not divisible by dp=2 x 2 micro-batches = 4"):
        check_pipeline(two, world_size=4, dp=2, batch_size=6)


def test_split_batch_and_loss_weights():
    x, labels = torch.arange(8).view(4, 2), torch.tensor([[1, 2, 3], [1, -100, -100], [0, 4, 5], [0, 6, -100]])
    parts = split_batch((x, labels), 2)
    assert [p[0].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(InputError, match="3 rows, not divisible by 2"):
        split_batch((torch.zeros(3, 1),), 2)
    w = loss_weights((x, labels), ("x", "labels"))
    assert w.tolist() == pytest.approx([2 / 5, 0, 2 / 5, 1 / 5])
    assert loss_weights((x,), ("x",)).tolist() == [0.25] * 4
    assert loss_weights((x, labels), ("x", "labels"), "rows").tolist() == [0.25] * 4
    assert loss_weights((x, torch.tensor([3, 1, 0, 2])), ("x", "labels")).tolist() == [0.25] * 4  # class labels: rows
    with pytest.raises(InputError, match="no labelled token"):
        loss_weights((x, torch.full((4, 3), -100)), ("x", "labels"))


@pytest.mark.parametrize("processors", [None, 1, 2])
def test_overhead_fit_recovers_the_model_it_fits(processors):
    from omnibal_compile.runtime import fit_overhead
    from omnibal_compile.sim import schedule_time

    h, c, ranks = 0.002, 0.005, 4
    samples = [(m, h * schedule_time("1f1b", ranks, m, processors=processors) + c) for m in (4, 8)]
    fit = fit_overhead(samples, ranks=ranks, processors=processors)
    assert fit.op_s == pytest.approx(h) and fit.step_s == pytest.approx(c) and fit.processors == processors
    if processors is None:  # closed form: an iteration is 2 (M + S - 1) actions deep
        assert samples[1][1] - samples[0][1] == pytest.approx(h * 2 * 4)
    with pytest.raises(InputError, match="M1 < M2"):
        fit_overhead(samples[::-1], ranks=ranks)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-zb", "dualpipev"])
def test_overhead_fit_counts_every_action_of_a_split_backward(schedule):
    """Under the split-backward schedules each I and W is an action, as the simulator charges them: the fit recovers
    the overhead it was given, and simulating a compute-free plan with it gives back the samples."""
    from omnibal_compile.calibrate.overhead import action_depth
    from omnibal_compile.runtime import fit_overhead
    from omnibal_compile.sim.simulate import operation_order

    h, c, ranks = 0.002, 0.005, 2
    for m in (4, 8):  # no processor sharing: every device is busy with its own actions at least
        ops = operation_order(schedule, ranks, 2, m)
        assert action_depth(schedule, ranks, m, virtual_stages=2) >= max(len(o) for o in ops)
    samples = [(m, h * action_depth(schedule, ranks, m, virtual_stages=2) + c) for m in (4, 8)]
    fit = fit_overhead(samples, ranks=ranks, schedule=schedule, virtual_stages=2)
    assert fit.virtual_stages == 2 and fit.op_s == pytest.approx(h) and fit.step_s == pytest.approx(c)


def test_peak_live_storages_counts_tracked_and_new_storages_until_freed():
    from omnibal_compile.costs._measure import PeakLiveStorages

    w = torch.ones(1000)  # 4000 bytes made before the mode
    with PeakLiveStorages() as live:
        live.track([w])
        a = w * 2  # +4000
        b = a + 1  # +4000: peak 12000
        del a
        c = b.view(10, 100) * 3  # a's 4000 freed before this op; the view adds nothing, c +4000
        assert live.peak_bytes == 12000
        del b, c
        d = torch.zeros(3000)  # b, c freed: 4000 + 12000 = 16000
    assert live.peak_bytes == 16000 and d.numel() == 3000
    config = RunConfig(plan="p.json", memory_steps=(1, 3))
    assert RunConfig.from_json(config.to_json()) == config and RunConfig(plan="p.json").memory_steps == ()


# -- one rank in this process: the plan's recomputation and AdamW through build_pipeline -------------
@pytest.fixture(scope="module")
def mixed_two_stages_one_rank() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Plan]:
    """A TinyVLM of its own (the tests train it), two interleaved stages on one rank, and full /
    selective / none recomputation by block."""
    from omnibal_compile.models import TinyVLM

    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    batch = _vlm_batch()
    graph = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph
    plan = uniform(graph, 2)
    plan = dataclasses.replace(
        plan, schedule="interleaved", num_microbatches=4, virtual_stages=2, recompute=_alternating(plan)
    )
    return model, batch, plan


def _attributed(forward: Any, block: str, current: list[str]) -> Any:
    """``forward`` that names ``block`` in ``current`` while it runs (also when a recomputation stops early)."""

    def run(*args: Any) -> Any:
        current.append(block)
        try:
            return forward(*args)
        finally:
            current.pop()

    return run


def test_build_pipeline_runs_each_blocks_planned_recomputation(one_rank_group, mixed_two_stages_one_rank):
    """Every block planned to recompute is its own checkpoint region with its option in the built
    stages, and in the backward each region reruns, once per micro-batch, all its ops (full) or all
    but the saved matmuls and attention (selective); blocks planned 'none' have no region. Both
    stages run on this one rank, so the counts are per rank and per block."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from omnibal_compile.compile.recompute import CheckpointedRegion
    from omnibal_compile.compile.recompute_policy import SAVED_OPS
    from omnibal_compile.runtime import build_pipeline

    model, batch, plan = mixed_two_stages_one_rank
    result = compile_for_microbatches(model, batch, plan)
    pipe = build_pipeline(result, rank=0, world_size=1)
    assert pipe.stage_indices == (0, 1)
    nodes = {b.name: set(b.nodes) for b in result.graph.blocks}
    option = dict(zip(plan.block_names, plan.block_recompute))
    current: list[str] = []
    ran: dict[tuple[str, bool], Counter] = {}
    planned_all = []
    for module in pipe.modules:
        planned = [b for b in oc.stage_info(module).blocks if option[b] != "none"]
        planned_all += planned
        regions = [m for m in module.modules() if isinstance(m, CheckpointedRegion)]
        assert [m.option for m in regions] == [option[b] for b in planned]
        for m, block in zip(regions, planned):
            ops = {n.name for n in m.region.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}
            assert ops and ops <= nodes[block], block  # the region is that block's code
            m.region.forward = _attributed(m.region.forward, block, current)
    assert {"full", "selective", "none"} <= set(option.values()) and len(planned_all) >= 4

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if current and func.overloadpacket is not torch.ops.aten.detach:  # autograd's bookkeeping, not the block's
                in_backward = torch._C._current_graph_task_id() != -1
                ran.setdefault((current[-1], in_backward), Counter())[func.overloadpacket] += 1
            return func(*args, **(kwargs or {}))

    # Early stop ends a recomputation once it has rebuilt what the backward needs; off, it reruns the whole region.
    with Ops(), torch.utils.checkpoint.set_checkpoint_early_stop(False):
        pipe.step(batch)
    M = plan.num_microbatches
    assert {b for b, _ in ran} == set(planned_all)
    layers = [b for b in planned_all if ".layers." in b]  # transformer layers: their outputs need gradients
    assert {option[b] for b in layers} == {"full", "selective"}
    for block in planned_all:
        forward, rerun = ran[(block, False)], ran.get((block, True), Counter())
        assert all(c % M == 0 for c in forward.values()), (block, forward, rerun)  # M forwards of the region
        if not rerun and block not in layers:
            continue  # nothing it computes needs a gradient (the mask, the rotary tables): no backward, no rerun
        if option[block] == "full":
            assert rerun == forward, block
        else:
            assert rerun == Counter({op: c for op, c in forward.items() if op not in SAVED_OPS}), block
            assert rerun != forward or not any(op in SAVED_OPS for op in forward), block


def test_adamw_steps_through_the_pipeline_match_the_unsplit_model(one_rank_group, mixed_two_stages_one_rank):
    """Three AdamW steps with weight decay on different batches: losses, weights and the optimizer's
    state (step count, both moments) equal the unsplit model's, parameter by parameter."""
    import copy

    from omnibal_compile.runtime import build_pipeline

    model, batch, plan = mixed_two_stages_one_rank
    reference = copy.deepcopy(model)
    pipe = build_pipeline(compile_for_microbatches(model, batch, plan), rank=0, world_size=1)
    # eps well above the float noise of gradients that are zero in exact arithmetic (the key bias):
    # Adam divides by the gradient's own size, so at eps=1e-8 that noise moves a weight by ~lr.
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    for step in range(3):
        b = _vlm_batch(seed=10 + step)
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(b)
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = reference(**b)
        ref_loss.backward()
        ref_opt.step()
        assert loss is not None and abs(loss - float(ref_loss.detach())) <= TOL, step
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    held = {n: t for n, t in pipe.state.items() if isinstance(t, torch.nn.Parameter)}
    assert set(held) == set(ref_params)
    for name, p in held.items():
        r = ref_params[name]
        assert float((p - r).detach().abs().max()) <= TOL, name
        mine, theirs = opt.state[p], ref_opt.state[r]
        assert float(mine["step"]) == float(theirs["step"]) == 3.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert float((mine[key] - theirs[key]).abs().max()) <= TOL, (name, key)


def _unsplit_loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    import copy

    return _reference(copy.deepcopy(model), batch)


def test_build_pipeline_on_a_one_by_one_mesh_matches_the_unsplit_model(one_rank_group, mixed_two_stages_one_rank):
    """The mesh path of build_pipeline on a (dp=1, pp=1) mesh: one replica, no data parallelism, and
    one step gives the unsplit model's loss and gradients. Wrong ways to call it are named."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.runtime import build_pipeline

    model, batch, plan = mixed_two_stages_one_rank
    model = copy.deepcopy(model)
    result = compile_for_microbatches(model, batch, plan)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    pipe = build_pipeline(result, mesh=mesh)
    assert (pipe.rank, pipe.world_size, pipe.dp_rank, pipe.dp_size) == (0, 1, 0, 1)
    assert pipe.dp_group is None and pipe.dp_shard is None and pipe.tied == ()
    assert pipe.stage_indices == (0, 1) and pipe.has_first and pipe.has_last
    text = repr(pipe)  # for a person: no modules, schedule, tensors or groups
    assert not [
        w
        for w in (
            " modules=",
            " stages=",
            " in_spec=",
            " state=",
            " tied=",
            " dp_group=",
            "Schedule",
            "TreeSpec",
            "Parameter",
            "tensor(",
        )
        if w in text
    ]
    assert len(text) < 2000 and "stage_indices=(0, 1)" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipe.rank = 1  # type: ignore[misc]
    fields = {f.name: getattr(pipe, f.name) for f in dataclasses.fields(pipe)}
    with pytest.raises(TypeError):
        type(pipe)(*fields.values())  # keyword-only
    bare = type(pipe)(**{k: v for k, v in fields.items() if not k.startswith("dp_")})
    assert (bare.dp_rank, bare.dp_size, bare.dp_group, bare.dp_shard) == (0, 1, None, None)
    ref_loss, ref_grads = _unsplit_loss_and_grads(model, batch)
    # Tied records as _tied_parameters makes them, over a group of this one rank: a held parameter (its
    # gradient summed over one rank: unchanged), one without a gradient yet (zeros), a buffer (skipped).
    import torch.distributed as dist

    from omnibal_compile.runtime import TiedParameter

    name = next(n for n, t in pipe.state.items() if isinstance(t, torch.nn.Parameter))
    spare = torch.nn.Parameter(torch.ones(3))
    pipe = dataclasses.replace(pipe, tied=(
        TiedParameter(names=(name,), ranks=(0,), group=dist.new_group([0]), param=pipe.state[name]),
        TiedParameter(names=("spare",), ranks=(0,), group=dist.new_group([0]), param=spare),
        TiedParameter(names=("buffer",), ranks=(0,), group=dist.new_group([0]), param=None),
    ))
    loss = pipe.step(batch)
    assert loss is not None and abs(loss - ref_loss) <= TOL
    assert spare.grad is not None and spare.grad.tolist() == [0.0] * 3
    grads = {n: g for n, g in pipe.named_grads().items() if g is not None}
    assert set(grads) <= set(ref_grads) and set(pipe.named_grads()) == set(ref_grads)
    for n, g in grads.items():
        assert float((g - ref_grads[n]).abs().max()) <= TOL, n
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    full = pipe.full_state()
    assert set(full) == set(model.state_dict()) and all(not t.requires_grad for t in full.values())
    with pytest.raises(InputError, match="not both"):
        build_pipeline(result, mesh=mesh, rank=0, world_size=1)
    with pytest.raises(InputError, match="not both"):
        build_pipeline(result, rank=0)
    with pytest.raises(InputError, match=r"dims \('dp', 'pp'\)"):
        build_pipeline(result, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp")))
    with pytest.raises(InputError, match="weighting"):
        build_pipeline(result, rank=0, world_size=1, weighting="mean")
    with pytest.raises(InputError, match="must be a DataParallel"):
        build_pipeline(result, rank=0, world_size=1, data_parallel="zero")
    with pytest.raises(InputError, match="2 replicas, the mesh's dp dimension 1"):
        build_pipeline(result, rank=0, world_size=1, data_parallel=DataParallel(size=2))
    with pytest.raises(InputError, match="out of range"):
        rank_stages(plan, 1)
    with pytest.raises(PlanError, match="needs 1 ranks .* but world size is 2"):
        build_pipeline(result, rank=0, world_size=2)


def test_a_tied_parameter_record_is_frozen_keyword_only_and_prints_no_group_or_tensor():
    from omnibal_compile.runtime import TiedParameter

    t = TiedParameter(
        names=("embed.weight", "head.weight"), ranks=(0, 1), group="GROUP", param=torch.nn.Parameter(torch.ones(2))
    )
    assert repr(t) == "TiedParameter(names=('embed.weight', 'head.weight'), ranks=(0, 1))"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.ranks = (0,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TiedParameter(("a",), (0, 1), None, None)  # type: ignore[misc]


def test_tied_parameters_get_a_group_of_their_holders_and_the_held_copy(one_rank_group):
    """Pipeline rank 0 of one replica holds a parameter shared under one name and a buffer shared under two."""
    from omnibal_compile.runtime.pipeline import _tied_parameters

    w, buf = torch.nn.Parameter(torch.ones(2)), torch.zeros(2)
    tied = _tied_parameters([(("w",), (0,)), (("b1", "b2"), (0,))], 0, [[0]], 0, {"w": w, "b1": buf, "b2": buf})
    assert [(t.names, t.ranks) for t in tied] == [(("w",), (0,)), (("b1", "b2"), (0,))]
    assert tied[0].param is w and tied[0].group is not None
    assert tied[1].param is None and tied[1].group is not None  # a buffer: no gradient to sum


def test_stages_on_one_rank_that_share_a_parameter_cannot_be_data_parallel():
    from omnibal_compile.runtime.pipeline import _check_stage_params_disjoint

    shared = torch.nn.Linear(2, 2)
    a, b = torch.nn.Sequential(shared), torch.nn.Sequential(torch.nn.Linear(2, 2), shared)
    _check_stage_params_disjoint([a, torch.nn.Linear(2, 2)], [0, 2])
    with pytest.raises(InputError, match="stages 0 and 2 on one rank share a parameter"):
        _check_stage_params_disjoint([a, b], [0, 2])


@pytest.mark.parametrize("dp_shard", ["fsdp", "ddp"])
def test_data_parallel_units_are_the_recompute_regions_and_sum_gradients(one_rank_group, mixed_two_stages_one_rank,
                                                                         dp_shard):
    """One stage made data-parallel over a one-rank dp mesh: the stage and each recompute region with
    parameters are units of their own, and the stage's gradients are the plain module's (a sum over
    one rank, divided by 1)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from omnibal_compile.compile.recompute import CheckpointedRegion, apply_recompute
    from omnibal_compile.runtime.pipeline import _make_data_parallel

    model, batch, plan = mixed_two_stages_one_rank
    result = compile_for_microbatches(copy.deepcopy(model), batch, plan)
    stage = apply_recompute(result.stages[1], result.graph, plan)  # the last stage: it returns the loss
    plain = copy.deepcopy(stage)
    regions = {n for n, m in stage.named_modules() if isinstance(m, CheckpointedRegion)
               and next(m.parameters(), None) is not None}
    assert len(regions) >= 2
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in result.captured.example_flat_inputs]
    with torch.no_grad():
        values = result.stages[0](*inputs)
    values = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)
    loss_index = next(i for i, v in enumerate(plain(*values)) if isinstance(v, torch.Tensor) and v.dim() == 0)

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert _make_data_parallel(stage, mesh, DataParallel(size=1, shard=dp_shard)) is stage
    assert {n for n, m in stage.named_modules() if isinstance(m, FSDPModule)} == regions | {""}
    plain(*values)[loss_index].backward()
    stage(*values)[loss_index].backward()
    want = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in stage.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0) if dp_shard == "fsdp" else Replicate(),), n
        g = p.grad.full_tensor() if want[n] is not None else p.grad
        assert (g is None) == (want[n] is None), n
        if g is not None:
            assert float((g - want[n]).abs().max()) <= TOL, n


def test_a_tied_model_in_one_stage_on_one_rank_matches_the_unsplit_model(one_rank_group, tiny_llama):
    """A Hugging Face causal LM with tied embedding and head, one stage (both names of the tied weight in
    one module, outputs holding Nones) on one rank: its loss and gradients, each tied name included."""
    import copy

    from omnibal_compile.runtime import build_pipeline

    model = copy.deepcopy(tiny_llama[0])
    batch = _llama_batch()
    graph = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph
    plan = dataclasses.replace(uniform(graph, 1), schedule="gpipe", num_microbatches=2)
    pipe = build_pipeline(compile_for_microbatches(model, batch, plan), rank=0, world_size=1)
    ref_loss, ref_grads = _unsplit_loss_and_grads(model, batch)
    tied = [n for n in ref_grads if n.endswith("embed_tokens.weight") or n == "lm_head.weight"]
    assert len(tied) == 2 and pipe.state[tied[0]] is pipe.state[tied[1]] and pipe.tied == ()
    assert (pipe.rank, pipe.world_size, pipe.dp_rank, pipe.dp_size, pipe.dp_group, pipe.dp_shard) == (
        0,
        1,
        0,
        1,
        None,
        None,
    )
    loss = pipe.step(batch)
    assert loss is not None and abs(loss - ref_loss) <= TOL
    grads = pipe.named_grads()
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        assert float((g - ref_grads[n]).abs().max()) <= TOL, n


class _OutputThenLoss(torch.nn.Module):
    """Returns (its output, the mean squared error): the loss is not the first output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


def test_the_pipeline_trains_on_the_loss_output_when_it_is_not_the_first(one_rank_group):
    """A loss that is a mean over rows, returned after a tensor output: the step's loss and gradients
    are the unsplit model's (two interleaved stages on one rank)."""
    from omnibal_compile.runtime import build_pipeline

    torch.manual_seed(0)
    model = _OutputThenLoss()
    batch = {"x": torch.randn(4, 4), "y": torch.randn(4, 4)}
    graph = oc.optimize(model, {k: v[:1] for k, v in batch.items()}, num_stages=1).graph
    plan = dataclasses.replace(uniform(graph, 2), schedule="interleaved", num_microbatches=2, virtual_stages=2)
    pipe = build_pipeline(compile_for_microbatches(model, batch, plan), rank=0, world_size=1, weighting="rows")
    ref_loss = model(**batch)[1]
    ref_grads = dict(
        zip([n for n, _ in model.named_parameters()], torch.autograd.grad(ref_loss, list(model.parameters())))
    )
    loss = pipe.step(batch)
    assert loss is not None and abs(loss - float(ref_loss)) <= TOL
    grads = pipe.named_grads()
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        assert float((g - ref_grads[n]).abs().max()) <= TOL, n
