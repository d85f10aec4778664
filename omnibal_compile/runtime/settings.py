"""What a training run is: :class:`RunConfig`, the plan it runs with its overrides, the settings its data depend on."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

from omnibal_compile.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RuntimeConfig,
    ScheduleConfig,
    Section,
    precision_for,
)
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import DEFAULT_DP_SHARD, DataParallel
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import ScheduleRule, schedule_rule


@dataclass(frozen=True, kw_only=True)
class RunConfig(RuntimeConfig, CheckpointConfig, OptimizerConfig, ScheduleConfig, ParallelConfig, DataConfig,
                ModelConfig):
    """Everything a training run needs; every rank reads the same one.

    Its fields are those of the sections it composes (:mod:`omnibal_compile.config`), with their
    defaults, descriptions and checks; ``run``'s flags are generated from them.
    """

    plan: str
    """Path of the plan JSON (``Plan.to_json``)."""

    sections: ClassVar[tuple[type[Section], ...]] = (
        ModelConfig, DataConfig, ParallelConfig, ScheduleConfig, OptimizerConfig, CheckpointConfig, RuntimeConfig,
    )

    def _check(self) -> None:
        if not isinstance(self.plan, str):
            raise InputError(f"plan (--plan) must be a file path, got {self.plan!r}")
        if self.device is None:  # a run without a device trains where the plan command costs by default
            object.__setattr__(self, "device", "cpu")

    @property
    def run_precision(self) -> str:
        """The precision this run trains in: ``precision``, or auto's choice for ``device``
        (:func:`~omnibal_compile.config.precision_for`). Resolved where read, not stored, so that a config copied
        with another device (``dataclasses.replace(config, device="cuda")``) resolves auto for that device."""
        return precision_for(self.precision, self.device)

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
        for key in ("lengths", "memory_steps", "block_prefixes", "freeze"):  # JSON lists back to tuples
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        return cls(**data)


def with_plan_layout(config: RunConfig) -> RunConfig:
    """``config`` with the data-parallel settings it leaves open (None) taken from its plan file.

    The plan records the layout it was made for (``optimize(dp=..., dp_shard=...)``); a run uses it
    unless ``--dp`` / ``--dp-shard`` say otherwise. Without either, FSDP reshards after forward unless the schedule
    splits the backward (:attr:`~omnibal_compile.ir.schedule.ScheduleRule.fsdp_may_reshard`).
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
            else (planned.reshard_after_forward if planned else _schedule_rule(config, path).fsdp_may_reshard)
        ),
    )


def _schedule_rule(config: RunConfig, path: Path) -> ScheduleRule:
    """The rule of the schedule the run uses: ``config.schedule``, else its plan file's (1f1b without one)."""
    if config.schedule is not None:
        return schedule_rule(config.schedule)
    return schedule_rule(Plan.from_file(path).schedule if path.is_file() else "1f1b")


def run_data_parallel(config: RunConfig) -> DataParallel:
    """The run's data parallelism (:func:`with_plan_layout`'s settings), validated once by :class:`DataParallel`."""
    config = with_plan_layout(config)
    return DataParallel(size=cast(int, config.dp), shard=cast(str, config.dp_shard),
                        reshard_after_forward=cast(bool, config.reshard_after_forward))


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


_DATA_SETTINGS = ("model", "model_config", "batches", "lengths", "dataset", "image_root", "processor",
                  "skip_bad_records", "batching", "oversized",
                  "samples_per_pack", "batch_size", "tiles_per_sample", "text_tokens", "seed")
"""RunConfig fields the batches of a step depend on (with the step and dp): a resumed run must keep them."""


def _data_settings(config: RunConfig) -> dict[str, Any]:
    return {k: json.loads(json.dumps(getattr(config, k))) for k in _DATA_SETTINGS}




_RESUMABLE_SETTINGS = ("optimizer", "lr", "warmup_steps", "steps", "epochs", "save_every")
"""RunConfig fields saved with a checkpoint that a resumed run may change (with a note), the optimizer excepted;
``steps`` is saved as the run's steps in all (``batches.run_steps``: those of ``epochs`` too)."""


def _file_sha256(path: str) -> str | None:
    from omnibal_compile._utils.files import file_sha256

    return file_sha256(path)


def _resume_record(config: RunConfig, steps: int) -> dict[str, Any]:
    """What a checkpoint records besides the data settings, for the checks of a resumed run: the optimizer and
    schedule settings (``steps``: the run's steps in all), and the sha256 of each lengths file and of the dataset
    file (an edited file is not the data that was trained on)."""
    return {"optimizer": config.optimizer, "freeze": list(config.freeze),
            "lora": None if config.lora is None else str(config.lora),
            "settings": {**{k: getattr(config, k) for k in _RESUMABLE_SETTINGS}, "steps": steps},
            "lengths_sha256": [_file_sha256(p) for p in config.lengths],
            "dataset_sha256": _file_sha256(config.dataset) if config.dataset else None}


def local_device(env: Any) -> int:
    """The CUDA device index of this rank, where ``train`` places it too: torchrun's ``LOCAL_RANK`` (without it, the
    global ``RANK``: one node)."""
    return int(env.get("LOCAL_RANK", env.get("RANK", 0)))
