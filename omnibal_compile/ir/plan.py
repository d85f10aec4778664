"""Plans: which blocks each pipeline stage runs. Typed, validated, printable, JSON round-trip.

A plan covers a chain of ``n`` blocks with ``S`` stages; stage ``s`` runs blocks
``boundaries[s] .. boundaries[s+1] - 1``. Stages are contiguous and non-empty by construction.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from omnibal_compile._utils.tables import counted, format_table
from omnibal_compile._utils.validate import check_int_list, check_number, read_text
from omnibal_compile.errors import PlanError
from omnibal_compile.ir.costs import DEFAULT_DP_SHARD, RECOMPUTE_OPTIONS, DataParallel
from omnibal_compile.ir.schedule import SCHEDULES, Schedule

__all__ = ["Plan", "StagePlan", "PLAN_FORMAT"]

PLAN_FORMAT = 1
"""Version of the JSON layout written by :meth:`Plan.to_json`."""

_SPLIT_BACKWARD = frozenset(k for k, r in SCHEDULES.items() if r.split_backward)
"""Schedules whose planned iteration time is the simulator's (planning.zero_bubble), not a closed form."""


def _str_list(value: Any, name: str) -> tuple[str, ...]:
    items = None if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable) else tuple(value)
    if items is None or not all(isinstance(x, str) for x in items):
        raise PlanError(f"plan field {name} must be a list of strings, got {value!r}"[:300])
    return items


def _number_list(value: Any, name: str) -> tuple[float, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise PlanError(f"plan field {name} must be a list of numbers, got {value!r}"[:300])
    return tuple(check_number(x, f"plan field {name}[{i}]", min=0, error=PlanError) for i, x in enumerate(value))


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage of a plan."""

    index: int
    """Stage number, 0 = first."""
    start: int
    """First block index."""
    stop: int
    """One past the last block index."""
    blocks: tuple[str, ...]
    """Names of its blocks."""
    recompute: tuple[str, ...]
    """Recompute option of each of its blocks."""

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Blocks that recompute anything."""
        return tuple(b for b, r in zip(self.blocks, self.recompute) if r != "none")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Pipeline cut points over a chain of blocks, and what the planner predicted for them."""

    block_names: tuple[str, ...]
    """Every block of the model, in execution order."""
    boundaries: tuple[int, ...]
    """``0 = b_0 < b_1 < ... < b_S = len(block_names)``; stage s runs blocks [b_s, b_{s+1})."""
    planner: str = "manual"
    """Name of the planner that produced it."""
    block_params: tuple[int, ...] = ()
    """Parameter count per block (for the summary; empty when unknown)."""
    block_kinds: tuple[str, ...] = ()
    """Kind per block (``layer``, ``module``, ``glue``); empty when unknown."""
    recompute: tuple[str, ...] = ()
    """Recompute option per block (``none``/``selective``/``full``); empty means none anywhere."""
    schedule: str = "1f1b"
    """Pipeline schedule the plan was made for, a name in :data:`omnibal_compile.ir.schedule.SCHEDULES` (see
    :attr:`pipeline_schedule`)."""
    num_microbatches: int | None = None
    """Micro-batches per iteration; None (the default) becomes one per stage."""
    virtual_stages: int = 1
    """Stage chunks per device; the schedule's placement says which rank runs stage s (``s % (S / v)``, or a V)."""
    stage_time_s: tuple[float, ...] = ()
    """Predicted time per micro-batch of each stage (forward + backward + recompute + send)."""
    stage_memory_bytes: tuple[int, ...] = ()
    """The planner's memory bound of each stage under the schedule: what it fitted under the budget
    (every block charged its largest workspace whatever its recompute option)."""
    stage_peak_bytes: tuple[int, ...] = ()
    """Predicted peak memory of each stage (at most the bound; see ``omnibal_compile.planning.problem``);
    empty when the blocks' peaks were not measured."""
    memory_budget_bytes: tuple[int, ...] = ()
    """Memory budget of each stage's device; empty when unconstrained."""
    stage_send_bytes: tuple[int, ...] = ()
    """Bytes each stage sends the next per micro-batch (the values crossing its last cut; 0 for the last stage);
    empty when unknown."""
    iteration_time_s: float | None = None
    """Predicted time of one iteration under the schedule (data-parallel communication included)."""
    data_parallel: int = 1
    """Data-parallel replicas of the whole pipeline (devices = pipeline devices x this); 1 = none."""
    data_parallel_shard: str = DEFAULT_DP_SHARD
    """How the replicas hold their state: ``ddp`` (replicated) or ``fsdp`` (sharded; see :class:`DataParallel`)."""
    reshard_after_forward: bool = True
    """FSDP only: weights are gathered again for the backward (True) or kept gathered all iteration."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks per pipeline stage (devices = pipeline devices x ``data_parallel`` x this; the stage
    times are one rank's, :func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table`); 1 = none."""
    notes: Mapping[str, Any] = field(default_factory=dict)
    """Free-form planner notes (objective value, solver status, binding constraint, ...), JSON-serialisable."""

    def __post_init__(self) -> None:
        # Every field is checked with its type, so a plan file's cut of 12.5 or "3" is refused, not truncated.
        for name in ("block_names", "block_kinds", "recompute"):
            object.__setattr__(self, name, _str_list(getattr(self, name), name))
        for name in ("boundaries", "block_params", "stage_memory_bytes", "stage_peak_bytes", "memory_budget_bytes",
                     "stage_send_bytes"):
            values = check_int_list(getattr(self, name), f"plan field {name}", min=0, error=PlanError)
            object.__setattr__(self, name, values)
        object.__setattr__(self, "stage_time_s", _number_list(self.stage_time_s, "stage_time_s"))
        if self.iteration_time_s is not None:
            t = check_number(self.iteration_time_s, "plan field iteration_time_s", min=0, error=PlanError)
            object.__setattr__(self, "iteration_time_s", t)
        for name in ("planner", "schedule", "data_parallel_shard"):
            if not isinstance(getattr(self, name), str):
                raise PlanError(f"plan field {name} must be a string, got {getattr(self, name)!r}")
        # num_microbatches, virtual_stages (Schedule) and data_parallel (DataParallel) are checked below.
        if not isinstance(self.tensor_parallel, int) or isinstance(self.tensor_parallel, bool) \
                or self.tensor_parallel < 1:
            raise PlanError(f"plan field tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise PlanError(
                f"plan field reshard_after_forward must be true or false, got {self.reshard_after_forward!r}"
            )
        if not isinstance(self.notes, Mapping):
            raise PlanError(f"plan field notes must be an object, got {type(self.notes).__name__}")
        object.__setattr__(self, "notes", dict(self.notes))
        n, b = len(self.block_names), self.boundaries
        if n == 0:
            raise PlanError("a plan needs at least one block")
        if len(set(self.block_names)) != n:
            dup = sorted({x for x in self.block_names if self.block_names.count(x) > 1})
            raise PlanError(f"block names must be unique; repeated: {dup}")
        if len(b) < 2 or b[0] != 0 or b[-1] != n:
            raise PlanError(f"boundaries must start at 0 and end at the number of blocks ({n}); got {list(b)}")
        for s in range(len(b) - 1):
            if b[s + 1] <= b[s]:
                raise PlanError(
                    f"stage {s} is empty (boundaries {list(b)}): every stage needs at least one block; "
                    "use fewer stages or other cut points"
                )
        lists: tuple[tuple[str, Sequence[object]], ...] = (
            ("block_params", self.block_params), ("block_kinds", self.block_kinds), ("recompute", self.recompute)
        )
        for name, entries in lists:
            if entries and len(entries) != n:
                raise PlanError(f"{name} has {len(entries)} entries for {n} blocks")
        bad = sorted({r for r in self.recompute if r not in RECOMPUTE_OPTIONS})
        if bad:
            raise PlanError(f"recompute options {bad} are unknown; use {list(RECOMPUTE_OPTIONS)}")
        schedule = Schedule.for_stages(
            self.num_stages,
            kind=self.schedule,
            num_microbatches=self.num_microbatches,
            virtual_stages=self.virtual_stages,
        )
        object.__setattr__(self, "num_microbatches", schedule.num_microbatches)
        _ = self.dp  # validates data_parallel and data_parallel_shard
        per_stage: tuple[tuple[str, Sequence[float]], ...] = (
            ("stage_time_s", self.stage_time_s),
            ("stage_memory_bytes", self.stage_memory_bytes),
            ("stage_peak_bytes", self.stage_peak_bytes),
            ("memory_budget_bytes", self.memory_budget_bytes),
            ("stage_send_bytes", self.stage_send_bytes),
        )
        for name, entries in per_stage:
            if entries and len(entries) != self.num_stages:
                raise PlanError(f"{name} has {len(entries)} entries for {self.num_stages} stages")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_assignment(cls, block_names: Sequence[str], stage_of_block: Sequence[int], **kw: Any) -> Plan:
        """Build a plan from the stage index of every block; rejects non-contiguous assignments."""
        if len(stage_of_block) != len(block_names):
            raise PlanError(f"stage_of_block has {len(stage_of_block)} entries for {len(block_names)} blocks")
        if stage_of_block and stage_of_block[0] != 0:
            raise PlanError(f"the first block '{block_names[0]}' must be on stage 0, got stage {stage_of_block[0]}")
        boundaries = [0]
        for i in range(1, len(stage_of_block)):
            prev, cur = stage_of_block[i - 1], stage_of_block[i]
            if cur == prev:
                continue
            if cur != prev + 1:
                raise PlanError(
                    f"block '{block_names[i]}' (#{i}) is on stage {cur} right after a block on stage {prev}: "
                    "stages must be contiguous and numbered in order without gaps"
                )
            boundaries.append(i)
        boundaries.append(len(block_names))
        return cls(block_names=tuple(block_names), boundaries=tuple(boundaries), **kw)

    @classmethod
    def from_stages(cls, stages: Sequence[Sequence[str]], **kw: Any) -> Plan:
        """Build a plan from the block names of each stage, in order."""
        names = [name for stage in stages for name in stage]
        stage_of = [s for s, stage in enumerate(stages) for _ in stage]
        for s, stage in enumerate(stages):
            if not stage:
                raise PlanError(f"stage {s} has no blocks: every stage needs at least one block")
        return cls.from_assignment(names, stage_of, **kw)

    # -- views ----------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        b = self.boundaries
        return tuple(
            StagePlan(
                index=s,
                start=b[s],
                stop=b[s + 1],
                blocks=self.block_names[b[s] : b[s + 1]],
                recompute=self.block_recompute[b[s] : b[s + 1]],
            )
            for s in range(self.num_stages)
        )

    @property
    def block_recompute(self) -> tuple[str, ...]:
        """Recompute option of every block (``none`` when the plan sets none)."""
        return self.recompute or ("none",) * self.num_blocks

    @property
    def pipeline_schedule(self) -> Schedule:
        """The schedule, micro-batches and chunks per device, as one checked value."""
        return Schedule(kind=self.schedule, num_microbatches=self._microbatches, virtual_stages=self.virtual_stages)

    @property
    def _microbatches(self) -> int:
        """``num_microbatches``, which ``__post_init__`` always fills in."""
        return cast(int, self.num_microbatches)

    @property
    def num_devices(self) -> int:
        """Pipeline ranks: stages / chunks per device."""
        return self.num_stages // self.virtual_stages

    @property
    def dp(self) -> DataParallel:
        """The data-parallel layout the plan was made for, as one checked value."""
        return DataParallel(
            size=self.data_parallel, shard=self.data_parallel_shard, reshard_after_forward=self.reshard_after_forward
        )

    def stage_of(self, block: str | int) -> int:
        """Stage that runs ``block`` (a name or an index)."""
        i = self.block_names.index(block) if isinstance(block, str) else block
        if not 0 <= i < self.num_blocks:
            raise PlanError(f"block index {i} is out of range [0, {self.num_blocks})")
        return next(s for s in range(self.num_stages) if self.boundaries[s] <= i < self.boundaries[s + 1])

    def summary(self) -> str:
        """A table of stages: block range, block and layer counts, parameters."""
        header = ["stage", "blocks", "first", "last", "layers", "params", "recomputed"]
        if self.stage_time_s:
            header.append("time ms")
        if self.stage_memory_bytes:
            header.append("memory MiB" + (" / budget" if self.memory_budget_bytes else ""))
        if self.stage_peak_bytes:
            header.append("peak MiB")
        if self.stage_send_bytes:
            header.append("sends KiB")
        rows: list[list[str]] = [header]
        for st in self.stages:
            layers = sum(1 for k in self.block_kinds[st.start : st.stop] if k == "layer") if self.block_kinds else "-"
            params = f"{sum(self.block_params[st.start : st.stop]):,}" if self.block_params else "-"
            counts = {o: st.recompute.count(o) for o in RECOMPUTE_OPTIONS if o != "none" and o in st.recompute}
            rec = ", ".join(f"{c} {o}" for o, c in counts.items())  # per block: plan.stages[s].recompute
            row = [
                str(st.index),
                f"{st.start}-{st.stop - 1}",
                st.blocks[0],
                st.blocks[-1],
                str(layers),
                params,
                rec or "-",
            ]
            if self.stage_time_s:
                row.append(f"{self.stage_time_s[st.index] * 1e3:.3f}")
            if self.stage_memory_bytes:
                mem = f"{self.stage_memory_bytes[st.index] / 2**20:.1f}"
                if self.memory_budget_bytes:
                    mem += f" / {self.memory_budget_bytes[st.index] / 2**20:.1f}"
                row.append(mem)
            if self.stage_peak_bytes:
                row.append(f"{self.stage_peak_bytes[st.index] / 2**20:.1f}")
            if self.stage_send_bytes:
                row.append(f"{self.stage_send_bytes[st.index] / 2**10:,.1f}" if st.index < self.num_stages - 1 else "-")
            rows.append(row)
        numeric = {0, 4, 5, 7, 8, 9, 10}
        lines = [
            f"Plan by '{self.planner}': {counted(self.num_blocks, 'block')} in {counted(self.num_stages, 'stage')}, "
            f"schedule {self.schedule}, {counted(self._microbatches, 'micro-batch')}",
            format_table(rows, "".join("r" if i in numeric else "l" for i in range(len(header)))),
        ]
        if self.block_params:
            loads = [sum(self.block_params[s.start : s.stop]) for s in self.stages]
            mean = sum(loads) / len(loads)
            if mean:
                lines.append(f"parameter imbalance (max/mean): {max(loads) / mean:.3f}")
        if self.data_parallel > 1:
            lines.append(
                f"data parallel: {self.dp.describe()}; memory is per device, time includes the gradient reduction"
            )
        if self.tensor_parallel > 1:
            lines.append(f"tensor parallel: {self.tensor_parallel} ranks per stage; time and memory are one rank's")
        if self.stage_peak_bytes:
            lines.append(
                "Memory is the bound the plan was fitted under; peak is the predicted peak, which charges each "
                "block the workspace of its own recompute option where it runs."
            )
        if self.stage_send_bytes:
            lines.append("Sends: bytes each stage sends the next per micro-batch (values rebuilt by the stages that "
                         "read them, such as attention masks, are not sent).")
        if self.iteration_time_s is not None:
            how = ("the simulator's, in the schedule's operation order" if self.schedule in _SPLIT_BACKWARD
                   else "the schedule's closed form")
            lines.append(f"Planned iteration time: {self.iteration_time_s * 1e3:.3f} ms ({how}).")
        lines.extend(_note_sentences(self.notes))
        return "\n".join(lines)

    # -- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = PLAN_FORMAT
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        data = dict(data)
        fmt = data.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise PlanError(f"plan format {fmt} is not supported (this version reads format {PLAN_FORMAT})")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"unknown plan fields {sorted(unknown)}")
        if "block_names" not in data or "boundaries" not in data:
            raise PlanError("a plan needs 'block_names' and 'boundaries'")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None) -> Plan:
        """Read a plan file (``Plan.to_json``); every error names the file."""
        text = read_text(path, "plan file", hint="write one with Plan.to_json() or `omnibal-compile demo --save-plan`")
        try:
            return cls.from_json(text, overrides=overrides)
        except PlanError as e:
            raise PlanError(f"plan file {str(path)!r}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, overrides: Mapping[str, Any] | None = None) -> Plan:
        """Read a plan; ``overrides`` replace fields before it is checked (e.g. another micro-batch count)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan JSON is malformed: {e}") from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        return cls.from_dict({**data, **(overrides or {})})


def _note_sentences(notes: Mapping[str, Any]) -> list[str]:
    """The planner's notes as sentences: what binds, how the solver finished, the largest stage."""
    notes = dict(notes)
    out = []
    if "binding" in notes:
        out.append(f"Binding constraint: the {notes.pop('binding')}.")
    if "status" in notes or "solve seconds" in notes:
        status, secs, gap = notes.pop("status", ""), notes.pop("solve seconds", None), notes.pop("gap", None)
        done = f"Solver: {status.lower() or 'finished'}" + (f" in {float(secs):.3f} s" if secs is not None else "")
        out.append(done + (f", proven gap {float(gap):.2%}." if gap is not None else "."))
    if "max_stage_params" in notes:
        out.append(f"Largest stage: {int(notes.pop('max_stage_params')):,} parameters.")
    out.extend(f"{str(k).replace('_', ' ').capitalize()}: {v}." for k, v in notes.items())
    return out
