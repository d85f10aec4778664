"""The body of every rank: build its share of the pipeline, train, log, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch

from omnibal_compile.errors import TrainingError
from omnibal_compile.runtime.batches import batch_source, build_model, eval_source, run_steps, step_batches
from omnibal_compile.runtime.recipe import build_optimizer, lr_scheduler
from omnibal_compile.runtime.settings import (
    RunConfig,
    _data_settings,
    _resume_record,
    read_plan,
    run_data_parallel,
    with_plan_layout,
)


@dataclass(frozen=True, kw_only=True)
class StepLog:
    """One training step as logged."""

    step: int
    """Step number, from 0."""
    loss: float
    """Loss of the whole batch (the unsplit model's mean loss)."""
    step_time_s: float
    """Slowest rank's wall time for forward, backward and optimizer."""
    rank_cpu_s: tuple[float, ...] = ()
    """CPU time of each rank's thread in the step: its own compute, not its waits (gloo sleeps)."""
    rank_peak_bytes: tuple[int, ...] = ()
    """With ``RunConfig.memory_steps``: each rank's peak live tensor bytes in the step (weights,
    gradients, optimizer states and every tensor the step makes; ``PeakLiveStorages``)."""
    lr: float = 0.0
    """Learning rate the step's update used (``recipe.lr_at``)."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping (every stage, rank and shard; ``RankPipeline.clip_grad_norm``)."""
    tokens: int = 0
    """Labelled tokens of the whole step, over every dp rank (rows when the batch has no labels)."""
    tokens_per_s: float = 0.0
    """``tokens / step_time_s``."""
    samples: tuple[tuple[int, ...], ...] = ()
    """With lengths or a dataset: the sample indices each dp rank trained on in the step (its packs, in order; an
    empty row past the last epoch of ``--epochs`` has none)."""
    loss_scale: float = 0.0
    """fp16: the loss scale the step ran with (``precision.LossScaler``); 0 in other precisions."""
    skipped: bool = False
    """fp16: some rank's gradients were not finite, so every rank skipped the optimizer step (the scale halves)."""
    rank_memory_bytes: tuple[int, ...] = ()
    """Each rank's peak memory: on CUDA the step's peak allocated bytes (``max_memory_allocated``); on CPU the
    process's peak resident set so far (``ru_maxrss``: it never drops)."""
    model_flops: float = 0.0
    """Model FLOPs of the step over every rank: 3 x the forward FLOPs of its micro-batches (their padded shape),
    counted when the stages were built; recomputation not counted, frozen parts counted as trained."""
    mfu: float | None = None
    """``model_flops / (step_time_s x devices x peak FLOP/s)`` (``RunConfig.peak_flops``); None without a peak."""


@dataclass(frozen=True, kw_only=True)
class EvalLog:
    """One evaluation of the held-out set (``--eval-data``) as logged; its JSON line has ``"record": "eval"``."""

    step: int
    """Training steps done before it (the weights it measured)."""
    loss: float
    """Mean loss over every labelled token of the eval set (forward only, the training plan's packs)."""
    tokens: int
    """Labelled tokens of the eval set (rows when the batch has no labels)."""
    samples: int
    """Samples of the eval set."""
    eval_time_s: float
    """Wall time of the evaluation."""


def eval_line(entry: EvalLog, *, steps: int) -> str:
    """The line a person reads after an evaluation."""
    return (f"eval after step {entry.step}/{steps}  eval loss {entry.loss:.5g}  over {entry.tokens:,} tokens of "
            f"{entry.samples} samples  {entry.eval_time_s:.3f} s")


def progress_line(entry: StepLog, *, steps: int, seconds_left: float) -> str:
    """The per-step line a person reads: step, loss (5 significant digits), lr, grad norm, tokens/s, ETA."""
    minutes, secs = divmod(round(max(0.0, seconds_left)), 60)
    eta = f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
    return (f"step {entry.step + 1}/{steps}  loss {entry.loss:.5g}  lr {entry.lr:.3e}  grad norm {entry.grad_norm:.4g}"
            f"  {entry.tokens_per_s:,.0f} tokens/s  {entry.step_time_s:.3f} s/step  ETA {eta}"
            + (f"  MFU {entry.mfu:.1%}" if entry.mfu is not None else "")
            + (f"  loss scale {entry.loss_scale:g}" + ("  skipped (inf/nan gradients)" if entry.skipped else "")
               if entry.loss_scale else ""))


def _step_samples(source: Any, step: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """Each dp rank's sample indices of ``step`` when the source packs samples (``packed_source``), else ()."""
    packs = getattr(source, "sample_ids", None)
    if packs is None:
        return ()
    return tuple(tuple(int(i) for ids in packs(step, r) for i in ids) for r in range(dp))


def _mesh_groups(device_type: str, collective_timeout: float, dims: tuple[str, ...] = ("dp", "pp")
                 ) -> dict[str | int, Any]:
    """The device mesh's process groups, with the run's collective timeout (torch gives new groups 30 min)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    # torch's stubs lack ProcessGroupGloo._Options, the options a gloo group is made with (.Options is another class)
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=collective_timeout)
    return {dim: (backend, options) for dim in dims}


def _shared_loss(loss: float | None, src: int, device: torch.device) -> float:
    """The step's loss, known on the last stage's ranks, on every rank (so that all stop together)."""
    import torch.distributed as dist

    value = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64, device=device)
    dist.broadcast(value, src=src)
    return float(value)


def _stop_if_not_finite(loss: float, step: int, config: RunConfig, what: str = "the loss is") -> None:
    if not math.isfinite(loss):
        kept = f"the checkpoints in {config.save} are kept" if config.save else "nothing was saved"
        raise TrainingError(
            f"step {step}: {what} {loss} (--lr {config.lr:g}); training stopped before saving non-finite "
            f"weights ({kept}): lower --lr (or add --warmup-steps), or look at the data of step {step}"
        )


def _peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory (:attr:`StepLog.rank_memory_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS counts bytes, Linux KiB


def peak_flops(config: RunConfig, device: torch.device) -> float | None:
    """Peak FLOP/s of one of the run's devices for the MFU: ``--peak-flops``, else a known GPU's datasheet figure."""
    if config.peak_flops is not None:
        return float(config.peak_flops)
    if device.type != "cuda":
        return None
    from omnibal_compile.costs.devices import spec_for_gpu_name

    spec = spec_for_gpu_name(torch.cuda.get_device_name(device))
    return spec.peak_flops if spec is not None else None


class _Scalars:
    """``--tensorboard``: the step figures as TensorBoard scalars (written by the rank that logs)."""

    def __init__(self, folder: str | None, first_step: int) -> None:
        self.writer = None
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run replaces what a stopped run wrote after its checkpoint
            self.writer = SummaryWriter(folder, purge_step=first_step if first_step else None)

    def write(self, entry: StepLog) -> None:
        if self.writer is None:
            return
        figures = {"loss": entry.loss, "lr": entry.lr, "grad_norm": entry.grad_norm,
                   "tokens_per_s": entry.tokens_per_s, "step_time_s": entry.step_time_s,
                   "peak_memory_gib": max(entry.rank_memory_bytes, default=0) / 2**30}
        if entry.mfu is not None:
            figures["mfu"] = entry.mfu
        if entry.loss_scale:
            figures["loss_scale"] = entry.loss_scale
        for name, value in figures.items():
            self.writer.add_scalar(f"train/{name}", value, entry.step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _weights_finite(params: list[torch.nn.Parameter], device: torch.device) -> bool:
    """Whether every rank's weights (their local shards) are finite."""
    import torch.distributed as dist

    ok = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in params)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def train(config: RunConfig) -> list[StepLog]:
    """The body of every rank (inside an initialised process group): build, train, log, save."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.costs._measure import PeakLiveStorages
    from omnibal_compile.runtime.checkpoint import load_training_state, save_training_state
    from omnibal_compile.runtime.pipeline import build_pipeline, check_pipeline, loss_terms
    from omnibal_compile.runtime.precision import (
        LossScaler,
        cast_for_capture,
        cast_inputs,
        compile_in_precision,
        compute_dtype,
        enable_tf32,
    )
    from omnibal_compile.runtime.settings import local_device
    from omnibal_compile.runtime.weights import compile_on_meta, meta_start

    config = with_plan_layout(config)
    layout = run_data_parallel(config)
    dp = layout.size
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(config.threads)
    device = torch.device(f"cuda:{local_device(os.environ)}" if config.device == "cuda" else "cpu")
    tf32 = enable_tf32(device)  # before any matmul: capture, examples and steps alike
    if rank == 0:  # what runs, said once (the precision after auto: bf16 on cuda, fp32 on cpu)
        print(f"[omnibal run] {world} rank(s) on {config.device} ({dist.get_backend()}), "
              f"precision {config.run_precision}"
              f"{', TF32 matmuls' if tf32 else ''}, kernels {config.kernels or 'none'}", flush=True)
    plan = read_plan(config)
    check_pipeline(plan, world_size=world, batch_size=config.batch_size, dp=dp, tp=config.tp, data_parallel=layout,
                   precision=config.run_precision)
    dims = ("dp", "pp", "tp") if config.tp > 1 else ("dp", "pp")
    mesh = init_device_mesh(device.type, (dp, plan.num_devices, config.tp)[:len(dims)], mesh_dim_names=dims,
                            backend_override=_mesh_groups(device.type, config.collective_timeout, dims))
    lean = meta_start(config)  # on meta: each rank makes its own stages (read from the weight files, or seeded)
    model = lean.model if lean is not None else build_model(config)
    source = batch_source(config, model, mesh["dp"].get_local_rank())
    steps = run_steps(config, source)
    held_out = eval_source(config, model, source, mesh["dp"].get_local_rank()) if config.eval_data else None
    # 16 bits: captured as a 16-bit model (its graph's casts are then bf16's), the fp32 values kept as masters
    # (a meta start reads them from the weight files instead)
    low = compute_dtype(config.run_precision)
    result, masters = None, None
    if lean is not None:
        if low is not None:
            cast_for_capture(lean.model, low)
        result = compile_on_meta(config, lean, cast_inputs(source(0), low), plan)
        if result is None:  # its stages cannot start on meta (compile_on_meta says why)
            model, lean = build_model(config), None
    if result is None:
        result, masters = compile_in_precision(model, source(0), plan, config.run_precision, kernels=config.kernels)
    pipeline = build_pipeline(
        result, mesh=mesh, device=device, data_parallel=layout,
        recompute=config.apply_recompute, weighting=config.weighting, precision=config.run_precision,
        masters=masters if lean is None else None, weights=lean.weights if lean is not None else None,
        compile=config.compile, sequence_parallel=config.sequence_parallel,
    )
    del model, result, masters  # each rank keeps only its stages' parameters
    if pipeline.tensor_parallel and mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0:
        for s, report in zip(pipeline.stage_indices, pipeline.tensor_parallel):
            print(f"[omnibal run] stage {s} {report.summary()}", flush=True)
    optimizer = build_optimizer(config, pipeline)
    scaler = LossScaler() if config.run_precision == "fp16" else None
    first = 0
    if config.resume:
        folder, meta = load_training_state(config.resume, state=pipeline.state, optimizer=optimizer)
        first = int(meta["step"])
        if scaler is not None and isinstance(meta.get("loss_scale"), dict):  # a checkpoint of an fp16 run
            scaler.load_state_dict(meta["loss_scale"])
        if rank == 0:
            print(f"[omnibal run] resumed from {folder} at step {first}", flush=True)
    # the schedule is rebuilt at the run's own step from its own settings: a changed --lr applies (launch notes it)
    scheduler = lr_scheduler(config, optimizer, first, steps=steps)
    record, last_loss = _resume_record(config, steps), None

    def save(root: str, step: int) -> None:
        if not _weights_finite(pipeline.parameters(), device):
            _stop_if_not_finite(math.nan, step - 1, config, what="the weights it made are")
        trainer = {"plan": plan.to_dict(), "layout": {"dp": dp, "pp": plan.num_devices, "tp": config.tp},
                   "data": _data_settings(config), "scheduler": scheduler.state_dict(), **record, "loss": last_loss,
                   **({"loss_scale": scaler.state_dict()} if scaler is not None else {})}
        path = save_training_state(root, step=step, state=pipeline.state, optimizer=optimizer, trainer=trainer)
        if rank == 0:
            print(f"[omnibal run] checkpoint written: {path}", flush=True)
            if config.export_hf:  # from the step folder just written; the other ranks wait in the next collective
                from omnibal_compile.runtime.export import export_hf

                print(f"[omnibal run] exported: {export_hf(path, config.export_hf)}", flush=True)

    # of dp replica 0 (and tp rank 0): global rank = pipeline rank x tp; the schedule places the last stage (rank 0
    # for the V ones)
    last_rank = plan.pipeline_schedule.device_of(plan.num_stages - 1, plan.num_stages) * config.tp
    flops = torch.tensor([pipeline.forward_flops / config.tp], dtype=torch.float64, device=device)
    dist.all_reduce(flops)  # every stage of every replica: one micro-batch each (its tp ranks share it)
    step_flops = 3 * float(flops) * cast(int, plan.num_microbatches)
    peak = peak_flops(config, device)
    scalars = _Scalars(config.tensorboard if rank == last_rank else None, first)

    def evaluate(done: int) -> None:
        """The eval set's loss after ``done`` steps, logged by ``last_rank``; no gradient, no optimizer change."""
        assert held_out is not None
        eval_batches, eval_steps = held_out
        start = time.perf_counter()
        loss_sum = tokens = 0.0
        for k in range(eval_steps):
            out = pipeline.evaluate(eval_batches(k))
            if out is not None:
                loss_sum, tokens = loss_sum + out[0], tokens + out[1]
        dist.barrier()
        if rank == last_rank:
            entry = EvalLog(step=done, loss=loss_sum / tokens if tokens else math.nan, tokens=int(tokens),
                            samples=len(eval_batches.data_plan.stats),  # type: ignore[attr-defined]
                            eval_time_s=time.perf_counter() - start)
            print(f"[omnibal run] {eval_line(entry, steps=steps)}", flush=True)
            if config.log:
                with open(config.log, "a") as f:
                    f.write(json.dumps({"record": "eval", **dataclasses.asdict(entry)}) + "\n")

    logs: list[StepLog] = []
    run_start = time.perf_counter()
    batches = step_batches(source, first, steps, workers=config.data_workers)
    for step in range(first, steps):
        batch = next(batches)
        tokens = loss_terms(pipeline.flatten(batch), pipeline.input_names, "tokens").sum().to(device)
        if pipeline.dp_group is not None:
            dist.all_reduce(tokens, group=pipeline.dp_group)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lr = float(scheduler.get_last_lr()[0])
        live = PeakLiveStorages() if step in config.memory_steps else contextlib.nullcontext()
        with live:
            if isinstance(live, PeakLiveStorages):
                live.track([list(pipeline.parameters()), list(optimizer.state.values())])
            scale = scaler.scale if scaler is not None else 0.0
            loss = pipeline.step(batch, loss_scale=scale or 1.0)
            skipped = scaler is not None and scaler.unscale(pipeline.parameters(), device)  # before clipping
            grad_norm = pipeline.clip_grad_norm(config.max_grad_norm)
            if not skipped:
                optimizer.step()
            if scaler is not None:
                scaler.update(skipped)
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        cpu = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]  # CPU s, peak bytes
        mine = [time.thread_time() - cpu_start, _peak_memory_bytes(device)]
        dist.all_gather(cpu, torch.tensor(mine, dtype=torch.float64, device=device))
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        peaks: list[torch.Tensor] = []
        if isinstance(live, PeakLiveStorages):
            peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([live.peak_bytes], dtype=torch.int64, device=device))
        if rank == last_rank:
            seconds = float(elapsed)
            entry = StepLog(
                step=step, loss=float(loss or 0.0), step_time_s=seconds, rank_cpu_s=tuple(float(c[0]) for c in cpu),
                rank_memory_bytes=tuple(int(c[1]) for c in cpu), model_flops=step_flops,
                mfu=step_flops / (seconds * world * peak) if peak and seconds > 0 else None,
                rank_peak_bytes=tuple(int(b) for b in peaks), lr=lr, grad_norm=grad_norm, tokens=int(tokens),
                tokens_per_s=float(tokens) / seconds if seconds > 0 else 0.0,
                samples=_step_samples(source, step, dp), loss_scale=scale, skipped=skipped,
            )
            logs.append(entry)
            scalars.write(entry)
            line = json.dumps(dataclasses.asdict(entry))
            # mean time per step so far (the first steps warm up, so this overestimates a little)
            per_step = (time.perf_counter() - run_start) / (step + 1 - first)
            shown = progress_line(entry, steps=steps, seconds_left=per_step * (steps - step - 1))
            print(f"[omnibal run] {shown}", flush=True)
            if config.log:
                with open(config.log, "a") as f:
                    f.write(line + "\n")
        last_loss = _shared_loss(loss, last_rank, device)
        if not skipped:  # fp16: a skipped step's loss may overflow; the scale halves and the run goes on
            _stop_if_not_finite(last_loss, step, config)
        if held_out is not None and config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < steps:
            evaluate(step + 1)
        if config.save and config.save_every and (step + 1) % config.save_every == 0 and step + 1 < steps:
            save(config.save, step + 1)
    if held_out is not None:
        evaluate(steps)
    scalars.close()
    if config.save:
        save(config.save, steps)
    dist.barrier()
    return logs


