"""What a training run is: :class:`RunConfig`, the plan it runs with its overrides, the settings its data depend on."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnibal_compile._utils.validate import MAX_SEED, check_int, check_int_list, check_number
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import DEFAULT_DP_SHARD
from omnibal_compile.ir.plan import Plan


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


_DATA_SETTINGS = ("model", "model_config", "data", "lengths", "batching", "samples_per_pack", "batch_size",
                  "tiles_per_sample", "text_tokens", "seed")
"""RunConfig fields the batches of a step depend on (with the step and dp): a resumed run must keep them."""


def _data_settings(config: RunConfig) -> dict[str, Any]:
    return {k: json.loads(json.dumps(getattr(config, k))) for k in _DATA_SETTINGS}


