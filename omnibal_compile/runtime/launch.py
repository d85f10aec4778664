"""Train from a saved plan on N local processes (one per rank, gloo or NCCL over loopback).

Glossary:
    run config    :class:`RunConfig`: plan file, model, data, optimizer and launch settings. It is
                  written to JSON and read back by every rank.
    model spec    ``tinyvlm`` (the built-in reference VLM, ``model_config`` = TinyVLMConfig
                  fields), ``hf:DIR`` (a ``save_pretrained`` folder, its weights loaded),
                  ``hf:ClassName:config.json`` (a ``transformers`` class from a config file) or
                  ``package.module:factory`` (``factory(**model_config)`` -> a model or ``(model,
                  example_batch)``), as for ``omnibal-compile plan`` (:mod:`omnibal_compile.models.load`).
    batch source  ``source(step) -> batch``: one data-parallel rank's part of a training step
                  (``batch_size / dp`` rows), or the whole step (every dp rank's rows, in dp order).
                  Built-in TinyVLM and Hugging Face batches: random fixed-shape batches; a factory's
                  example batch every step; otherwise ``data =
                  "package.module:fn"`` with ``fn(step, *, batch_size, seed) -> batch``; dp rank r
                  takes the r-th of dp equal slices (dim 0) of each input. With ``lengths`` (dataset
                  length statistics) and ``batching="balanced"``, every row is one balanced pack
                  drawn by dp rank r's own sampler (rank r of dp), collated to the fixed (Q_v
                  tiles, row length) shape, so the ranks of one micro-batch get packs of near-equal
                  cost; ``batching="random"`` is the baseline: one random sample per row, padded to
                  the largest sample. Sample contents are synthetic (random pixels and tokens), the
                  lengths real.
    data parallel ``dp`` pipelines on ``dp x plan devices`` processes, a ``("dp", "pp")`` device mesh;
                  each stage is data-parallel by ``dp_shard`` (FSDP2 or replicate, see
                  :mod:`omnibal_compile.runtime.pipeline`).
    pre-launch checks  :func:`precheck` runs in the launching process, before any rank starts:
                  world size vs dp and stages, micro-batches vs stages, batch size vs dp and
                  micro-batches, dp_shard and batching names, plan vs model, the checkpoint to
                  resume from (missing, unfinished or truncated is an error here; so are another
                  optimizer, another dp with --lengths, an edited lengths file; other lr, warm-up,
                  steps or save_every apply with a note), the outputs (--save a folder that can be
                  written, --log a file that can be appended to, neither an input of the run).
    outputs       ``--log`` is appended to (a resumed run continues its file); ``launch`` returns
                  this run's lines only: its step lines, and its eval lines (``"record": "eval"``,
                  ``--eval-data``) in ``.evals``. ``--save``'s folder is locked for the run (``.lock``, see
                  :func:`~omnibal_compile.runtime.checkpoint.lock_checkpoint_root`).
    launching     :func:`launch` starts the ranks with torch's elastic agent (``elastic_launch``, the
                  engine of ``torchrun``; one node, c10d rendezvous on loopback, no restarts), each rank
                  running ``python -m omnibal_compile.runtime.worker CONFIG.json``.
    failures      the ranks run under :func:`~omnibal_compile.runtime.processes.run_ranks`: each
                  collective waits at most ``collective_timeout`` s, the ranks at most ``timeout_s``
                  (counted from their start); on any failure or time-out every rank and what it
                  started is ended and the :class:`LaunchError` names the rank at fault and its first
                  error line.
    torchrun      the same worker runs under ``torchrun`` directly, on one node or many. Write the run
                  config (``RunConfig(...).to_json()``, with ``log`` set to keep the step logs) to
                  ``run.json``; then, on one machine (checked on CPU, gloo)::

                      torchrun --nproc-per-node 2 -m omnibal_compile.runtime.worker run.json

                  and on each of N machines, with the plan and ``run.json`` at the same paths on all::

                      torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d \\
                          --rdzv-endpoint HOST:29400 --rdzv-id JOB -m omnibal_compile.runtime.worker run.json

                  The world size (nodes x processes per node) must be ``dp x`` the plan's devices;
                  the pre-launch checks do not run there (run :func:`precheck` first), nor the time
                  limit or the report above: torchrun's own ``ChildFailedError`` says which rank failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from omnibal_compile import progress
from omnibal_compile._utils.files import same_file, writable_folder
from omnibal_compile.errors import InputError, MissingBackendError, PlanError
from omnibal_compile.ir.costs import PRECISION_NAMES, Precision, precision_named
from omnibal_compile.ir.plan import Plan
from omnibal_compile.runtime.batches import BATCHINGS, batch_source, build_model, eval_source, run_steps
from omnibal_compile.runtime.recipe import OPTIMIZERS
from omnibal_compile.runtime.settings import (
    _DATA_SETTINGS,
    RunConfig,
    _data_settings,
    _resume_record,
    read_plan,
    run_data_parallel,
    with_plan_layout,
)
from omnibal_compile.runtime.train import EvalLog, StepLog


class RunLogs(list[StepLog]):
    """A run's step logs (a list), with its evaluations of ``--eval-data`` in ``evals``."""

    def __init__(self, steps: list[StepLog] = (), evals: list[EvalLog] = ()) -> None:  # type: ignore[assignment]
        super().__init__(steps)
        self.evals: list[EvalLog] = list(evals)


def precheck(config: RunConfig) -> Plan:
    """Every check that can fail before a process starts; returns the plan the ranks will run.

    Checks dp and dp_shard, world size vs dp and stages (and virtual stages), micro-batches vs
    stages, batch size vs dp and micro-batches, and that the plan was made for this model
    (captures it once, here).
    """
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.runtime.pipeline import check_pipeline
    from omnibal_compile.runtime.tensor_parallel import check_tensor_parallel

    config = with_plan_layout(config)
    dp = run_data_parallel(config).size
    if config.batching not in BATCHINGS:
        raise InputError(f"batching (--batching) must be one of {list(BATCHINGS)}, got {config.batching!r}")
    plan = read_plan(config)
    _note_plan_settings(config, plan)
    _check_fast_paths(config)
    nproc = config.nproc if config.nproc is not None else dp * config.tp * plan.num_devices
    check_pipeline(plan, world_size=nproc, batch_size=config.batch_size, dp=dp, tp=config.tp,
                   data_parallel=run_data_parallel(config), precision=config.run_precision)
    check_tensor_parallel(plan, tp=config.tp, compile=config.compile, sequence_parallel=config.sequence_parallel)
    if config.device not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', got {config.device!r}")
    if config.device == "cuda" and torch.cuda.device_count() < nproc:
        raise InputError(f"{nproc} ranks need {nproc} GPUs, found {torch.cuda.device_count()}; use device='cpu'")
    if config.optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {config.optimizer!r}")
    if config.weighting not in ("tokens", "rows"):
        raise InputError(f"weighting must be 'tokens' or 'rows', got {config.weighting!r}")
    if config.steps is not None and config.steps < 1:
        raise InputError(f"steps must be >= 1, got {config.steps}")
    _check_seconds("collective_timeout (--collective-timeout)", config.collective_timeout)
    if config.save_every < 0 or config.warmup_steps < 0:
        raise InputError("save_every (--save-every) and warmup_steps (--warmup-steps) must be >= 0")
    if config.save_every and not config.save:
        raise InputError("--save-every needs --save DIR (where to write the checkpoints)")
    if config.eval_every and not config.eval_data:
        raise InputError("--eval-every needs --eval-data FILE (the held-out set to evaluate)")
    from omnibal_compile.runtime.weights import cut_on_meta, meta_model

    meta = meta_model(config)  # the plan is checked against the model's structure: no weights made
    model = meta if meta is not None else build_model(config)
    source = batch_source(config, model, 0)
    steps = run_steps(config, source)
    _check_outputs(config, steps)
    if config.resume:
        _check_resume(config, steps)
    if config.resume:  # a config edited since the save: said here, not as a CheckpointException in every rank
        from omnibal_compile.runtime.checkpoint import check_fits, find_checkpoint

        check_fits(find_checkpoint(config.resume)[0], model)
    if config.export_hf:
        _check_export(config, model, config.export_hf)
    planned = plan.notes.get("lora") if "compute dtype" in plan.notes else "?"  # older plans did not record it
    now = None if config.lora is None else str(config.lora)
    try:
        # PlanError when the plan does not fit; a model whose capture on meta fails is built whole and checked
        if meta is None or cut_on_meta(model, source(0), plan, kernels=config.kernels)[0] is None:
            compile_for_microbatches(model if meta is None else build_model(config), source(0), plan,
                                     kernels=config.kernels)
    except PlanError as e:
        _check_plan_kernels(e, config, plan)
        if planned in ("?", now):  # not a LoRA mismatch (or a plan that cannot tell)
            raise
        said = "without --lora" if planned is None else f"with --lora {planned}"
        raise PlanError(f"{e}. The plan was made {said}, this run trains "
                        f"{'--lora ' + now if now else 'without --lora'}: a LoRA run's blocks hold its "
                        "adapters, so make the plan with the run's --lora (omnibal-compile plan ... --lora "
                        f"{now or '...'})") from None
    if planned not in ("?", now):  # the same blocks and parameter counts (another alpha or dropout): costs alike
        progress.info(f"note: the plan was made with --lora {planned or '(none)'}, this run trains --lora "
                      f"{now or '(none)'}")
    if config.eval_data:
        eval_source(config, model, source, 0)[0](0)  # an eval set that does not fit the training packs, named here
    return plan


def _note_plan_settings(config: RunConfig, plan: Plan) -> None:
    """A note when the run computes in another dtype, holds parameters of other bytes (a plan made with another
    ``--precision``), or freezes other parameters, than the plan's costs were measured with (its step times and
    memory may then differ from the plan's predictions)."""
    from omnibal_compile.runtime.precision import compute_dtype

    planned_precision, run_precision = plan.notes.get("precision"), config.run_precision
    if isinstance(planned_precision, str) and planned_precision in PRECISION_NAMES:
        costed, held = precision_named(planned_precision), precision_named(run_precision)
        if (costed.weight_bytes, costed.grad_bytes, costed.master_bytes) != (held.weight_bytes, held.grad_bytes,
                                                                             held.master_bytes):
            def described(p: Precision) -> str:
                return (f"{p.weight_bytes}-byte weights and gradients in compute"
                        + (f" over a {p.master_bytes}-byte master copy" if p.master_bytes else ""))

            progress.info(f"note: the plan costed the parameters of --precision {planned_precision} "
                          f"({described(costed)}), this run holds those of --precision {run_precision} "
                          f"({described(held)}): its memory and data-parallel traffic may differ from the plan's; "
                          f"plan with --precision {run_precision} to cost what it holds")

    low = compute_dtype(config.run_precision)
    run_dtype = str(low or torch.float32).removeprefix("torch.")
    planned = plan.notes.get("compute dtype")
    if isinstance(planned, str) and planned and planned != run_dtype:
        progress.info(f"note: the plan's costs were measured in {planned}, this run computes in {run_dtype} "
                      f"(--precision {config.run_precision}): its step times may differ from the plan's")
    planned_freeze = plan.notes.get("freeze", [])
    if "compute dtype" in plan.notes and list(planned_freeze) != list(config.freeze):
        progress.info(f"note: the plan was made with --freeze {','.join(planned_freeze) or '(none)'}, this run "
                      f"freezes {','.join(config.freeze) or 'nothing'}: the plan's costs are of other trained "
                      "parameters")
    if "kernels" in plan.notes:  # the fast paths the costs were measured (or modelled) with; older plans: unknown
        planned_paths = (plan.notes["kernels"], plan.notes.get("compiled", "no"))
        run_paths = (config.kernels or "none", "inductor" if config.compile else "no")
        if planned_paths != run_paths:
            progress.info(f"note: the plan's costs were measured with kernels {planned_paths[0]}, torch.compile "
                          f"{planned_paths[1]}; this run uses --kernels {run_paths[0]}, torch.compile {run_paths[1]}: "
                          "its step times may differ from the plan's")


def _check_plan_kernels(error: PlanError, config: RunConfig, plan: Plan) -> None:
    """A PlanError naming --kernels when the plan was made with kernels and the run without, or the other way: the
    kernel pass merges blocks (the LM head into its fused loss), so the plan's blocks are not the run's."""
    planned = plan.notes.get("kernels")  # plans before this note: unknown
    if planned is None or (planned == "none") == (config.kernels is None):
        return
    made = "without --kernels" if planned == "none" else f"with --kernels {planned}"
    runs = f"--kernels {config.kernels}" if config.kernels else "without --kernels"
    raise PlanError(f"{error}. The plan was made {made}, this run trains {runs}: the kernel pass fuses the LM head "
                    f"into its loss, so make the plan with the run's kernels (omnibal-compile plan ... "
                    f"{runs if config.kernels else 'without --kernels'})") from None


def _check_fast_paths(config: RunConfig) -> None:
    """``--kernels triton`` needs Triton installed (the kernels' own rule, named with the flag here) and says when it
    falls back to the eager implementations; ``--compile`` needs a usable inductor."""
    from omnibal_compile.kernels.ops import check_triton_installed, triton_runs_on
    from omnibal_compile.runtime.compiled import check_compile

    if config.kernels == "triton":
        try:
            check_triton_installed()
        except MissingBackendError as e:
            raise MissingBackendError(f"--kernels triton: {e}; or run with --kernels eager") from None
        if not triton_runs_on(str(config.device)):
            progress.info(f"note: --kernels triton on {config.device} without TRITON_INTERPRET=1 runs the kernels' "
                          "eager implementations")
    if config.compile:
        check_compile(str(config.device))


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a number of seconds > 0, got {value!r}")


def _check_resume(config: RunConfig, steps: int) -> None:
    """The checkpoint is complete, is behind ``steps`` (the run's in all) and was saved with this run's data
    settings."""
    from omnibal_compile.runtime.checkpoint import find_checkpoint

    folder, meta = find_checkpoint(config.resume)  # type: ignore[arg-type]  # InputError when incomplete or truncated
    if int(meta["step"]) >= steps:
        given = f"--epochs {config.epochs} makes {steps} steps" if config.epochs else f"--steps is {steps}"
        raise InputError(
            f"checkpoint {folder} is at step {meta['step']} and {given}: nothing left to run; "
            f"{'--epochs' if config.epochs else '--steps'} counts all steps, so raise it to continue"
        )
    saved, now = meta.get("data", {}), _data_settings(config)
    differ = sorted(k for k in _DATA_SETTINGS if saved.get(k) != now[k])
    if differ:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in differ)
        raise InputError(
            f"resuming from {folder} with other data settings would change what the model sees ({detail}); "
            "use the settings of the saved run"
        )
    _check_resumed_settings(config, folder, meta, steps)


def _saved_optimizer(meta: dict[str, Any]) -> str | None:
    """The optimizer a checkpoint's state is of (older checkpoints: told by its hyper-parameters)."""
    if isinstance(meta.get("optimizer"), str):
        return str(meta["optimizer"])
    groups = meta.get("param_groups") or [{}]
    return "adamw" if "betas" in groups[0] else "sgd" if "momentum" in groups[0] else None


def _check_resumed_settings(config: RunConfig, folder: Path, meta: dict[str, Any], steps: int) -> None:
    """What a resumed run may change: the optimizer no (its saved state is of that optimizer), dp with --lengths no
    (each dp rank's sampler draws its own share of the epoch's packs), the lengths files' content no; lr, warm-up,
    steps and save_every yes, with a note."""
    optimizer = _saved_optimizer(meta)
    if optimizer is not None and optimizer != config.optimizer:
        raise InputError(
            f"checkpoint {folder} holds {optimizer} optimizer state; --optimizer {config.optimizer} would drop it "
            f"and train on with a fresh optimizer: resume with --optimizer {optimizer}, or start a new run "
            "(without --resume) to change optimizers"
        )
    saved_dp, dp = meta.get("layout", {}).get("dp", 1), run_data_parallel(config).size
    if (config.lengths or config.dataset) and saved_dp != dp:
        raise InputError(
            f"checkpoint {folder} was trained with dp {saved_dp} on balanced packs; with --dp {dp} each rank's "
            "sampler would split the epoch's packs another way, so the rest of the epoch would see some samples "
            f"twice and others never: resume with --dp {saved_dp}, or start a new run"
        )
    record = _resume_record(config, steps)
    saved_sha, now_sha = meta.get("lengths_sha256"), record["lengths_sha256"]
    pairs = list(zip(config.lengths, saved_sha, now_sha)) if isinstance(saved_sha, list) and len(saved_sha) == len(
        now_sha) else []
    if config.dataset:
        pairs.append((config.dataset, meta.get("dataset_sha256"), record["dataset_sha256"]))
    for path, old, new in pairs:
        if old is not None and new != old:
            raise InputError(
                f"data file {path} has changed since checkpoint {folder} was saved (sha256 {str(old)[:12]}... "
                f"then, {str(new)[:12]}... now): the remaining steps would not continue the run's data; "
                "restore the file, or start a new run"
            )
    settings = meta.get("settings", {})
    base_lrs = meta.get("scheduler", {}).get("base_lrs") or [None]
    saved_values = {"lr": base_lrs[0], **settings}
    if "lora" in meta and meta["lora"] != (None if config.lora is None else str(config.lora)):
        then = f"with --lora {meta['lora']}" if meta["lora"] else "without --lora"
        now = f"--lora {config.lora}" if config.lora else "no --lora"
        raise InputError(f"checkpoint {folder} was trained {then}; this run has {now}, so its parameters are other "
                         f"ones: resume {then}, or start a new run")
    saved_freeze = meta.get("freeze")
    if isinstance(saved_freeze, list) and saved_freeze != list(config.freeze):
        now, then = ",".join(config.freeze) or "(none)", ",".join(saved_freeze) or "(none)"
        progress.info(f"note: resuming {folder} (step {meta['step']}) with --freeze {now} instead of the saved run's "
                      f"{then}; parameters it unfreezes start with fresh optimizer state")
    for key in ("lr", "warmup_steps", "steps", "epochs", "save_every"):
        old, new = saved_values.get(key), steps if key == "steps" else getattr(config, key)
        if key == "epochs" and "epochs" not in settings:  # saved before --epochs existed
            continue
        if old is not None and old != new:
            progress.info(f"note: resuming {folder} (step {meta['step']}) with --{key.replace('_', '-')} {new} "
                          f"instead of the saved run's {old}; it applies from step {meta['step']} on")


def _check_outputs(config: RunConfig, steps: int) -> None:
    """``--save`` is a folder that can be written (made here) where no step folder of another program is in the
    way; ``--log`` a file that can be appended to; neither is an input of the run (the plan, a lengths file)."""
    from omnibal_compile.runtime.checkpoint import is_ours

    inputs = [("--plan", config.plan), *(("--lengths", p) for p in config.lengths),
              *((("--eval-data", config.eval_data),) if config.eval_data else ())]
    if config.save:
        root = writable_folder(config.save, "--save", "checkpoints (step-<K> folders)")
        every = config.save_every
        for k in sorted({steps, *(range(every, steps, every) if every else ())}):
            final = root / f"step-{k:06d}"
            if final.exists() and not is_ours(final):
                raise InputError(f"--save {root}: {final.name} exists and was not written by --save; saving step {k} "
                                 "would replace it: move it, or give another folder")
        for flag, path in inputs:
            if same_file(root, path):
                raise InputError(f"--save {root} is also {flag}; give another folder")
    if config.tensorboard:
        writable_folder(config.tensorboard, "--tensorboard", "TensorBoard event files")
        if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard needs it
            raise InputError("--tensorboard needs the tensorboard package: pip install tensorboard "
                             "(or pip install 'omnibal-compile[tensorboard]')")
    if config.log:
        log = Path(config.log)
        if log.is_dir():
            raise InputError(f"--log {log} is a folder; give a file (the step lines are appended to it)")
        if not log.resolve().parent.is_dir():
            raise InputError(f"--log {log}: folder {log.parent} does not exist; create it first")
        writable = os.access(log, os.W_OK) if log.exists() else os.access(log.resolve().parent, os.W_OK | os.X_OK)
        if not writable:
            raise InputError(f"--log {log} cannot be written; give a file you can write")
        for flag, path in inputs:
            if same_file(log, path):
                raise InputError(f"--log {log} is also {flag}: the step lines would be written into it; "
                                 "give another file")


def _check_export(config: RunConfig, model: torch.nn.Module, out: str) -> None:
    """``--export-hf``: with ``--save`` (it exports the step folders saved), a Hugging Face model, a new folder or an
    earlier export, not the checkpoint folder."""
    from omnibal_compile.runtime.export import check_export_target

    if not config.save:
        raise InputError("--export-hf needs --save DIR: the export is made from each checkpoint the run saves")
    if same_file(out, config.save):
        raise InputError(f"--export-hf {out} is also --save; give another folder")
    if not callable(getattr(model, "save_pretrained", None)):
        raise InputError(f"--export-hf writes a Hugging Face folder; model {config.model!r} ({type(model).__name__}) "
                         "has no save_pretrained")
    check_export_target(out, "--export-hf")


def _save_lock(config: RunConfig) -> contextlib.AbstractContextManager[Any]:
    from omnibal_compile.runtime.checkpoint import lock_checkpoint_root

    return lock_checkpoint_root(config.save) if config.save else contextlib.nullcontext()


def _log_start(log: str) -> int:
    """Where this run's lines of ``log`` begin: its end (a partial last line is ended first)."""
    path = Path(log)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
                size += 1
    return size


WORKER = "omnibal_compile.runtime.worker"
"""The module every rank runs (``python -m WORKER CONFIG.json``)."""


def launch(config: RunConfig, *, timeout_s: float | None = None, quiet: bool = False,
           _worker: str = WORKER) -> RunLogs:
    """Check, then run ``config`` on ``nproc`` local processes; returns the step logs (and ``.evals``).

    The ranks are started by torch's elastic agent (as ``torchrun --standalone`` would) and talk over
    loopback only (gloo on CPU, NCCL on GPU). When a rank fails or the run exceeds ``timeout_s``,
    every rank (and anything it started) is ended and :class:`LaunchError` names the rank at fault
    and its first error line; nothing is left running in any case. ``_worker``: the rank's module
    (tests plant faults with their own).
    """
    from omnibal_compile.runtime.processes import python_module, run_ranks

    if timeout_s is not None:
        _check_seconds("timeout (--timeout)", timeout_s)
    config = with_plan_layout(config)
    plan = precheck(config)
    dp = run_data_parallel(config).size
    nproc = config.nproc if config.nproc is not None else dp * config.tp * plan.num_devices
    with tempfile.TemporaryDirectory(prefix="omnibal-run-") as tmp, _save_lock(config):
        log = config.log or str(Path(tmp) / "steps.jsonl")
        start = _log_start(log)  # --log is appended to: the lines of earlier runs stay
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(dataclasses.replace(config, log=log, nproc=nproc).to_json())
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(config.threads))

        def echo(rank: int, line: str) -> None:
            if not quiet and line.startswith("[omnibal run]"):
                print(line, end="", flush=True)

        run_ranks(python_module(_worker, str(cfg_path)), nproc=nproc, env=env, workdir=tmp,
                  timeout_s=timeout_s, on_line=echo, finish_marker=True)
        with open(log) as f:
            f.seek(start)
            records = [json.loads(line) for line in f if line.strip()]
        return RunLogs([_step_log(r) for r in records if r.get("record", "step") == "step"],
                       [EvalLog(**{k: v for k, v in r.items() if k != "record"}) for r in records
                        if r.get("record") == "eval"])


def _step_log(data: dict[str, Any]) -> StepLog:
    return StepLog(**{**data, "rank_cpu_s": tuple(data.get("rank_cpu_s", ())),
                      "rank_peak_bytes": tuple(data.get("rank_peak_bytes", ())),
                      "rank_memory_bytes": tuple(data.get("rank_memory_bytes", ())),
                      "samples": tuple(tuple(ids) for ids in data.get("samples", ()))})

