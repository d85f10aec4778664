"""Train from a saved plan on N local processes (one per rank, gloo or NCCL over loopback).

Glossary:
    run config    :class:`RunConfig`: plan file, model, data, optimizer and launch settings. It is
                  written to JSON and read back by every rank.
    model spec    ``tinyvlm`` (the built-in reference VLM, ``model_config`` = TinyVLMConfig
                  fields), ``hf:ClassName:config.json`` (a ``transformers`` class from a config file)
                  or ``package.module:factory`` (``factory(**model_config)`` -> a model or ``(model,
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
                  resume from (missing, unfinished or truncated is an error here).
    failures      the ranks run under :func:`~omnibal_compile.runtime.processes.run_ranks`: each
                  collective waits at most ``collective_timeout`` s, the whole run at most
                  ``timeout_s``; on any failure or time-out every rank and what it started is ended
                  and the :class:`LaunchError` names the rank at fault and its first error line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnibal_compile.ir.costs import DEFAULT_DP_SHARD
from omnibal_compile.errors import InputError, LaunchError
from omnibal_compile.models.load import TINY_VLM
from omnibal_compile.ir.plan import Plan
from omnibal_compile._utils.validate import MAX_SEED, check_int, check_int_list, check_number

__all__ = [
    "BATCHINGS",
    "LaunchError",
    "RunConfig",
    "StepLog",
    "batch_source",
    "build_model",
    "launch",
    "packed_source",
    "precheck",
    "read_plan",
    "train",
]

BatchSource = Callable[[int], Any]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a training run needs; every rank reads the same one."""

    plan: str
    """Path of the plan JSON (``Plan.to_json``)."""
    model: str = "tinyvlm"
    """``tinyvlm``, ``hf:ClassName:config.json`` or ``package.module:factory``."""
    model_config: Mapping[str, Any] = field(default_factory=dict)
    """TinyVLMConfig fields, or keyword arguments of the factory."""
    data: str | None = None
    """``package.module:fn`` with ``fn(step, *, batch_size, seed) -> batch``; None: built-in random batches."""
    lengths: tuple[str, ...] = ()
    """Length-statistics files: feed rows made from these lengths (see ``batching``) instead of random batches."""
    batching: str = "balanced"
    """With ``lengths``: ``balanced`` (one balanced pack per row) or ``random`` (one random sample per row, padded)."""
    samples_per_pack: float = 4.0
    """With ``lengths``: target mean samples per pack."""
    batch_size: int = 8
    """Rows per step over all dp ranks and micro-batches; with ``lengths``, packs per step."""
    tiles_per_sample: int = 1
    """Built-in batches: image tiles per sample."""
    text_tokens: int = 32
    """Built-in batches: text tokens per sample."""
    steps: int = 5
    """Training steps."""
    optimizer: str = "adamw"
    """``sgd`` or ``adamw``."""
    lr: float = 1e-3
    """Learning rate."""
    seed: int = 0
    """Seed of the weights (same on every rank) and of the built-in batches."""
    nproc: int | None = None
    """Processes; default: ``dp`` x the plan's pipeline ranks."""
    dp: int | None = None
    """Data-parallel pipelines (replicas); None: the plan's (``Plan.data_parallel``, 1 unless planned with dp)."""
    dp_shard: str | None = None
    """With ``dp > 1``: ``fsdp`` (FSDP2 ``fully_shard``) or ``ddp`` (``replicate``); None: the plan's."""
    reshard_after_forward: bool | None = None
    """FSDP2: free the gathered parameters after each forward (ZeRO-3) instead of keeping them to
    backward; None: the plan's."""
    schedule: str | None = None
    """Override the plan's schedule (``gpipe``, ``1f1b``, ``interleaved``)."""
    num_microbatches: int | None = None
    """Override the plan's micro-batch count."""
    virtual_stages: int | None = None
    """Override the plan's stages per rank."""
    recompute: bool = True
    """Apply the plan's recompute options."""
    weighting: str = "tokens"
    """How micro-batch losses combine: ``tokens`` (mean over labelled tokens) or ``rows``."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank)."""
    threads: int = 1
    """torch threads per rank."""
    save: str | None = None
    """Checkpoint root: ``step-<K>`` folders are written here after the last step (and every ``save_every``)."""
    save_every: int = 0
    """Also save every this many steps (0: only at the end)."""
    resume: str | None = None
    """Checkpoint root (its newest complete step folder) or step folder to continue from: model,
    optimizer, LR schedule, step and RNG; ``steps`` counts all steps, the resumed run does the rest."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps (0: constant learning rate)."""
    memory_steps: tuple[int, ...] = ()
    """Steps in which every rank measures its peak live tensor bytes (``StepLog.rank_peak_bytes``);
    empty (default): no accounting, which costs Python work on every op."""
    log: str | None = None
    """JSON-lines file for per-step loss and time (written by the rank holding the last stage)."""
    collective_timeout: float = 600.0
    """Seconds a rank waits in one collective (start-up included) before it fails: a frozen or lost
    rank ends the run instead of hanging it."""

    def __post_init__(self) -> None:
        # Numbers are checked where the config is made (the command line, Python, a run.json), named
        # by field and flag, so a NaN or 0 never reaches the ranks.
        counts = {"batch_size": ("--batch-size", 1), "tiles_per_sample": ("--tiles", 0), "text_tokens": ("--text", 2),
                  "steps": ("--steps", 1), "threads": ("--threads", 1), "save_every": ("--save-every", 0),
                  "warmup_steps": ("--warmup-steps", 0), "nproc": ("--nproc", 1),
                  "dp": ("--dp, data-parallel pipelines", 1), "num_microbatches": ("--microbatches", 1),
                  "virtual_stages": ("--virtual-stages", 1)}
        for name, (flag, low) in counts.items():
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f"{name} ({flag})", min=low)
        if not isinstance(self.plan, str) or not isinstance(self.model_config, Mapping):
            raise InputError(
                f"plan must be a file path and model_config a mapping, got {self.plan!r}, {self.model_config!r}"
            )
        check_int(self.seed, "seed (--seed)", min=0, max=MAX_SEED)
        check_number(self.samples_per_pack, "samples_per_pack (--samples-per-pack)", min=1)
        check_number(self.lr, "lr (--lr)", above=0)
        check_int_list(self.memory_steps, "memory_steps", min=0)
        if not isinstance(self.lengths, (tuple, list)) or not all(isinstance(x, str) for x in self.lengths):
            raise InputError(f"lengths (--lengths) must be a list of file paths, got {self.lengths!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"run config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InputError(f"run config must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"run config has unknown fields {unknown}; write it with RunConfig(...).to_json()")
        if "plan" not in data:
            raise InputError("run config needs 'plan' (the plan file)")
        for key in ("lengths", "memory_steps"):  # JSON lists back to tuples; anything else is refused as it is
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        return cls(**data)


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


def with_plan_layout(config: RunConfig) -> RunConfig:
    """``config`` with the data-parallel settings it leaves open (None) taken from its plan file.

    The plan records the layout it was made for (``optimize(dp=..., dp_shard=...)``); a run uses it
    unless ``--dp`` / ``--dp-shard`` say otherwise.
    """
    if config.dp is not None and config.dp_shard is not None and config.reshard_after_forward is not None:
        return config
    path = Path(config.plan)
    planned = Plan.from_file(path).dp if path.is_file() else None
    if planned is not None and planned.size == 1:
        planned = None  # made without data parallelism: nothing to inherit, the runtime's defaults apply
    return dataclasses.replace(
        config,
        dp=config.dp if config.dp is not None else (planned.size if planned else 1),
        dp_shard=config.dp_shard if config.dp_shard is not None else (planned.shard if planned else DEFAULT_DP_SHARD),
        reshard_after_forward=(
            config.reshard_after_forward if config.reshard_after_forward is not None
            else (planned.reshard_after_forward if planned else True)
        ),
    )


def read_plan(config: RunConfig) -> Plan:
    """The plan file with the config's schedule/micro-batch/virtual-stage overrides applied."""
    changes = {
        k: v
        for k, v in (
            ("schedule", config.schedule),
            ("num_microbatches", config.num_microbatches),
            ("virtual_stages", config.virtual_stages),
        )
        if v is not None
    }
    return Plan.from_file(config.plan, overrides=changes)  # a file's schedule may fit only with them


def _import(spec: str, what: str) -> Any:
    from omnibal_compile.models.load import import_from_spec

    return import_from_spec(spec, what)


def _load(config: RunConfig) -> Any:
    from omnibal_compile.models.load import load_model

    return load_model(config.model, config=config.model_config, seed=config.seed, batch=config.batch_size,
                      tiles=config.tiles_per_sample, text=config.text_tokens)


def build_model(config: RunConfig) -> nn.Module:
    """The model, seeded with ``config.seed`` so every rank builds the same weights."""
    return _load(config).model


BATCHINGS: tuple[str, ...] = ("balanced", "random")
"""How rows are made from length statistics (``RunConfig.batching``)."""


def batch_source(config: RunConfig, model: nn.Module, dp_rank: int | None = None) -> BatchSource:
    """``step -> batch``: data-parallel rank ``dp_rank``'s rows, or the whole step's (see the module glossary)."""
    config = with_plan_layout(config)
    if config.data is not None and config.lengths:
        raise InputError("give either data='module:fn' or lengths=..., not both")
    if config.batching not in BATCHINGS:
        raise InputError(f"batching (--batching) must be one of {list(BATCHINGS)}, got {config.batching!r}")
    if dp_rank is not None and not 0 <= dp_rank < config.dp:
        raise InputError(f"dp rank {dp_rank} is out of range for dp={config.dp}")
    if config.lengths:
        return packed_source(config, model, dp_rank)
    if config.data is not None:
        fn = _import(config.data, "data function")
        whole: BatchSource = lambda step: fn(step, batch_size=config.batch_size, seed=config.seed)
    elif config.model in TINY_VLM:
        from omnibal_compile.models import make_example_batch

        cfg = model.config  # type: ignore[attr-defined]
        whole = lambda step: make_example_batch(
            cfg,
            batch=config.batch_size,
            tiles_per_sample=config.tiles_per_sample,
            text_tokens=config.text_tokens,
            seed=config.seed + 1 + step,
        )
    elif config.model.startswith("hf:"):
        from omnibal_compile.models.load import hf_example_batch

        whole = lambda step: hf_example_batch(model, batch=config.batch_size, text=config.text_tokens,
                                              seed=config.seed + 1 + step)
    else:
        example = _load(config).example_batch
        if example is None:
            raise InputError(
                f"model {config.model!r} needs data: set data='package.module:fn' (--data), lengths (--lengths), "
                "or return (model, example_batch) from the factory"
            )
        whole = lambda step: example
    if dp_rank is None or config.dp == 1:
        return whole
    return lambda step: _dp_part(whole(step), config.dp, dp_rank)


def _dp_part(batch: Any, dp: int, dp_rank: int) -> Any:
    """Data-parallel rank ``dp_rank``'s slice of a whole-step batch: the dp_rank-th of ``dp`` equal parts (dim 0)."""
    from torch.utils import _pytree as pytree

    from omnibal_compile.compile.capture import split_batch

    leaves, spec = pytree.tree_flatten(batch)
    return pytree.tree_unflatten(list(split_batch(leaves, dp)[dp_rank]), spec)


def packed_source(config: RunConfig, model: nn.Module, dp_rank: int | None = None) -> BatchSource:
    """Steps of packs from the data balancer, ``batch_size / dp`` per data-parallel rank, one per row.

    Data-parallel rank r draws from its own sampler (``rank=r, world_size=dp``): its row i of step k
    is pack ``j = k * rows + i`` of its sequence, pack ``j % P`` of epoch ``j // P`` (P steps per
    epoch), so each sample is used once per epoch and the dp packs of one (k, i) are one step of
    the packing, of near-equal cost. Deterministic in (seed, step): every rank builds the same
    batches. ``source.packs(step, r)`` gives rank r's sample ids; ``dp_rank=None``: every rank's rows.
    """
    from torch.utils import _pytree as pytree

    from omnibal_compile.data.data_plan import DataOptions, plan_data
    from omnibal_compile.models.load import hf_data_facts

    from omnibal_compile.integrations.hf.inputs import stacked_positions

    rows_per_rank = config.batch_size // config.dp
    if stacked_positions(model) and Path(config.plan).is_file() and read_plan(config).num_microbatches != rows_per_rank:
        raise InputError(
            f"{type(model).__name__} packs carry position_ids of shape (4, 1, L) per row, which split into "
            f"micro-batches of one row only: set batch_size (--batch-size) to dp x micro-batches "
            f"({config.dp * read_plan(config).num_microbatches}), got {config.batch_size}"
        )
    method = "ours" if config.batching == "balanced" else "random"
    options = DataOptions(dp=config.dp, samples_per_pack=config.samples_per_pack, seed=config.seed, method=method,
                          **hf_data_facts(model))
    data = plan_data(list(config.lengths), options, model=model)
    samplers = [data.sampler(r) for r in range(config.dp)]
    per_epoch = len(samplers[0])
    rows = config.batch_size // config.dp
    epochs: dict[tuple[int, int], list[list[int]]] = {}

    def pack(r: int, j: int) -> list[int]:
        epoch = j // per_epoch
        if (r, epoch) not in epochs:
            samplers[r].set_epoch(epoch)
            epochs[r, epoch] = list(samplers[r])
        return epochs[r, epoch][j % per_epoch]

    def packs(step: int, r: int) -> list[list[int]]:
        return [pack(r, step * rows + i) for i in range(rows)]

    def source(step: int) -> dict[str, Any]:
        out = []
        for r in range(config.dp) if dp_rank is None else (dp_rank,):
            for i, ids in enumerate(packs(step, r)):
                j = step * rows + i
                g = torch.Generator().manual_seed(config.seed * 1_000_003 + j * config.dp + r)
                out.append(model_inputs(model, data.synthetic_batch(ids, generator=g)))
        return pytree.tree_map(lambda *rows: torch.cat(rows), *out)  # a mask per layer type is a dict

    source.data_plan = data  # type: ignore[attr-defined]  # for inspection: shape, metrics
    source.packs = packs  # type: ignore[attr-defined]
    return source


def model_inputs(model: nn.Module, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated pack -> the inputs ``model`` takes: the one place where a model's packing layout is chosen.

    The packing collator (``data.collate``) lays a pack out for the reference VLM: ``pixel_values``
    (tiles), ``input_ids``, ``labels``, ``position_ids`` restarting per sample, ``segment_ids``. A
    Hugging Face model gets its family's own keys, with the pack's samples kept apart
    (:func:`omnibal_compile.integrations.hf.inputs.hf_pack_inputs`).
    """
    import inspect

    if "segment_ids" in inspect.signature(model.forward).parameters:  # the reference layout
        return row
    from omnibal_compile.integrations.hf.inputs import hf_pack_inputs

    return hf_pack_inputs(model, row)


def precheck(config: RunConfig) -> Plan:
    """Every check that can fail before a process starts; returns the plan the ranks will run.

    Checks dp and dp_shard, world size vs dp and stages (and virtual stages), micro-batches vs
    stages, batch size vs dp and micro-batches, and that the plan was made for this model
    (captures it once, here).
    """
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.ir.costs import DP_SHARDS
    from omnibal_compile.runtime.pipeline import check_pipeline

    config = with_plan_layout(config)
    if not isinstance(config.dp, int) or isinstance(config.dp, bool) or config.dp < 1:
        raise InputError(f"dp (--dp, data-parallel pipelines) must be an integer >= 1, got {config.dp!r}")
    if config.dp_shard not in DP_SHARDS:
        raise InputError(f"dp_shard (--dp-shard) must be one of {list(DP_SHARDS)}, got {config.dp_shard!r}")
    if config.batching not in BATCHINGS:
        raise InputError(f"batching (--batching) must be one of {list(BATCHINGS)}, got {config.batching!r}")
    plan = read_plan(config)
    nproc = config.nproc if config.nproc is not None else config.dp * plan.num_devices
    check_pipeline(plan, world_size=nproc, batch_size=config.batch_size, dp=config.dp)
    if config.device not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', got {config.device!r}")
    if config.device == "cuda" and torch.cuda.device_count() < nproc:
        raise InputError(f"{nproc} ranks need {nproc} GPUs, found {torch.cuda.device_count()}; use device='cpu'")
    if config.optimizer not in _OPTIMIZERS:
        raise InputError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, got {config.optimizer!r}")
    if config.weighting not in ("tokens", "rows"):
        raise InputError(f"weighting must be 'tokens' or 'rows', got {config.weighting!r}")
    if config.steps < 1:
        raise InputError(f"steps must be >= 1, got {config.steps}")
    _check_seconds("collective_timeout (--collective-timeout)", config.collective_timeout)
    if config.save_every < 0 or config.warmup_steps < 0:
        raise InputError("save_every (--save-every) and warmup_steps (--warmup-steps) must be >= 0")
    if config.save_every and not config.save:
        raise InputError("--save-every needs --save DIR (where to write the checkpoints)")
    if config.resume:
        _check_resume(config)
    model = build_model(config)
    compile_for_microbatches(model, batch_source(config, model, 0)(0), plan)  # PlanError when the plan does not fit
    return plan


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a number of seconds > 0, got {value!r}")


_DATA_SETTINGS = ("model", "model_config", "data", "lengths", "batching", "samples_per_pack", "batch_size",
                  "tiles_per_sample", "text_tokens", "seed")
"""RunConfig fields the batches of a step depend on (with the step and dp): a resumed run must keep them."""


def _data_settings(config: RunConfig) -> dict[str, Any]:
    return {k: json.loads(json.dumps(getattr(config, k))) for k in _DATA_SETTINGS}


def _warmup(steps: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / steps) if steps > 0 else 1.0


def _check_resume(config: RunConfig) -> None:
    """The checkpoint is complete, is behind ``steps`` and was saved with this run's data settings."""
    from omnibal_compile.runtime.checkpoint import find_checkpoint

    folder, meta = find_checkpoint(config.resume)  # type: ignore[arg-type]  # InputError when incomplete or truncated
    if int(meta["step"]) >= config.steps:
        raise InputError(
            f"checkpoint {folder} is at step {meta['step']} and --steps is {config.steps}: nothing left to run; "
            "--steps counts all steps, so raise it to continue"
        )
    saved, now = meta.get("data", {}), _data_settings(config)
    differ = sorted(k for k in _DATA_SETTINGS if saved.get(k) != now[k])
    if differ:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in differ)
        raise InputError(
            f"resuming from {folder} with other data settings would change what the model sees ({detail}); "
            "use the settings of the saved run"
        )


_FAULT = "_OMNIBAL_FAULT"
"""Testing hook: ``"<rank>:<step>:<how>"`` makes that rank, in that step, ``stop`` (SIGSTOP
itself: frozen, not dead), ``kill`` (SIGKILL itself), ``raise`` an error or ``hang`` (sleep an hour)."""


def _planted_fault(rank: int, step: int) -> None:
    spec = os.environ.get(_FAULT)
    if not spec:
        return
    where, _, how = spec.rpartition(":")
    if where != f"{rank}:{step}":
        return
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "raise":
        raise RuntimeError(f"planted fault in rank {rank} at step {step}")
    elif how == "hang":
        time.sleep(3600)


def _mesh_groups(device_type: str, collective_timeout: float) -> dict[str | int, Any]:
    """The device mesh's process groups, with the run's collective timeout (torch gives new groups 30 min)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=collective_timeout)
    return {"dp": (backend, options), "pp": (backend, options)}


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}


def train(config: RunConfig) -> list[StepLog]:
    """The body of every rank (inside an initialised process group): build, train, log, save."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.costs._measure import PeakLiveStorages
    from omnibal_compile.runtime.checkpoint import load_training_state, save_training_state
    from omnibal_compile.runtime.pipeline import build_pipeline, check_pipeline

    config = with_plan_layout(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(config.threads)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if config.device == "cuda" else "cpu")
    plan = read_plan(config)
    check_pipeline(plan, world_size=world, batch_size=config.batch_size, dp=config.dp)
    mesh = init_device_mesh(device.type, (config.dp, plan.num_devices), mesh_dim_names=("dp", "pp"),
                            backend_override=_mesh_groups(device.type, config.collective_timeout))
    model = build_model(config)
    source = batch_source(config, model, mesh["dp"].get_local_rank())
    result = compile_for_microbatches(model, source(0), plan)
    pipeline = build_pipeline(
        result, mesh=mesh, device=device, dp_shard=config.dp_shard, reshard_after_forward=config.reshard_after_forward,
        recompute=config.recompute, weighting=config.weighting,
    )
    del model, result  # each rank keeps only its stages' parameters
    optimizer = _OPTIMIZERS[config.optimizer](pipeline.parameters(), config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(config.warmup_steps))
    first = 0
    if config.resume:
        meta = load_training_state(config.resume, state=pipeline.state, optimizer=optimizer)
        scheduler.load_state_dict(meta["scheduler"])
        first = int(meta["step"])

    def save(step: int) -> None:
        trainer = {"plan": plan.to_dict(), "layout": {"dp": config.dp, "pp": plan.num_devices},
                   "data": _data_settings(config), "scheduler": scheduler.state_dict()}
        path = save_training_state(config.save, step=step, state=pipeline.state, optimizer=optimizer, trainer=trainer)
        if rank == 0:
            print(f"[omnibal run] checkpoint written: {path}", flush=True)

    last_rank = (plan.num_stages - 1) % plan.num_devices  # of dp replica 0: global rank = pipeline rank
    logs: list[StepLog] = []
    for step in range(first, config.steps):
        batch = source(step)
        dist.barrier()
        _planted_fault(rank, step)  # after the barrier: the others meet it inside the pipeline's exchanges
        start, cpu_start = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        live = PeakLiveStorages() if step in config.memory_steps else contextlib.nullcontext()
        with live:
            if isinstance(live, PeakLiveStorages):
                live.track([list(pipeline.parameters()), list(optimizer.state.values())])
            loss = pipeline.step(batch)
            optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        cpu = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(cpu, torch.tensor([time.thread_time() - cpu_start], dtype=torch.float64, device=device))
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        peaks: list[torch.Tensor] = []
        if isinstance(live, PeakLiveStorages):
            peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([live.peak_bytes], dtype=torch.int64, device=device))
        if rank == last_rank:
            entry = StepLog(
                step=step, loss=float(loss or 0.0), step_time_s=float(elapsed), rank_cpu_s=tuple(float(c) for c in cpu),
                rank_peak_bytes=tuple(int(b) for b in peaks),
            )
            logs.append(entry)
            line = json.dumps(dataclasses.asdict(entry))
            print(f"[omnibal run] {line}", flush=True)
            if config.log:
                with open(config.log, "a") as f:
                    f.write(line + "\n")
        if config.save and config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            save(step + 1)
    if config.save:
        save(config.steps)
    dist.barrier()
    return logs


def launch(config: RunConfig, *, timeout_s: float | None = None, quiet: bool = False) -> list[StepLog]:
    """Check, then run ``config`` on ``nproc`` local processes; returns the step logs.

    The ranks talk over loopback only (gloo on CPU, NCCL on GPU), through a store this process
    hosts. When a rank fails or the run exceeds ``timeout_s``, every rank (and anything it started)
    is ended and :class:`LaunchError` names the rank at fault and its first error line; nothing is
    left running in any case.
    """
    import torch.distributed as dist

    from omnibal_compile.runtime.processes import run_ranks
    from omnibal_compile.runtime.worker import STORE_ENV

    if timeout_s is not None:
        _check_seconds("timeout (--timeout)", timeout_s)
    config = with_plan_layout(config)
    plan = precheck(config)
    nproc = config.nproc if config.nproc is not None else config.dp * plan.num_devices
    with tempfile.TemporaryDirectory(prefix="omnibal-run-") as tmp:
        log = config.log or str(Path(tmp) / "steps.jsonl")
        Path(log).unlink(missing_ok=True)
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(dataclasses.replace(config, log=log, nproc=nproc).to_json())
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=config.collective_timeout))
        env = dict(os.environ)
        env[STORE_ENV] = f"127.0.0.1:{store.port}"
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(config.threads))

        def echo(rank: int, line: str) -> None:
            if not quiet and line.startswith("[omnibal run]"):
                print(line, end="", flush=True)

        try:
            run_ranks([sys.executable, "-m", "omnibal_compile.runtime.worker", str(cfg_path)], nproc=nproc, env=env,
                      workdir=tmp, timeout_s=timeout_s, on_line=echo)
        finally:
            del store
        with open(log) as f:
            return [_step_log(json.loads(line)) for line in f if line.strip()]


def _step_log(data: dict[str, Any]) -> StepLog:
    return StepLog(**{**data, "rank_cpu_s": tuple(data.get("rank_cpu_s", ())),
                      "rank_peak_bytes": tuple(data.get("rank_peak_bytes", ()))})

