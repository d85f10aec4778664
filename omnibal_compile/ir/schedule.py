"""The pipeline schedules a plan can be made for: each one's rules, defined once (torch-free).

The rules are those of ``torch.distributed.pipelining`` (torch 2.13, ``schedules.py``), so a
schedule accepted here is one torch can run. ``S`` stages run on ``D = S / v`` devices (v stages per
device); :data:`SCHEDULES` holds one :class:`ScheduleRule` per schedule:

    gpipe           ``ScheduleGPipe``: one stage per device (v = 1); any M >= 1.
    1f1b            ``Schedule1F1B``: one stage per device (v = 1) and M >= S (its ``__init__``
                    raises "Number of microbatches ... must be greater than or equal to the number
                    of stages").
    interleaved     ``ScheduleInterleaved1F1B``: v >= 1 stages per device, looped (stage s on device
                    ``s % D``); micro-batches run in ``rounds = max(1, M // D)`` rounds of
                    ``M // rounds`` and M must be a multiple of ``rounds``. M may be below S.
    interleaved-zb  ``ScheduleInterleavedZeroBubble`` (ZB-H1 at v = 1): as interleaved, with each
                    backward split into its input-gradient (B) and weight-gradient (W) parts.
    zbv             ``ScheduleZBVZeroBubble`` (ZB-V): exactly two stages per device in a V (stages
                    s and 2D - 1 - s on device s), backward split; any M >= 1.
    dualpipev       ``ScheduleDualPipeV`` (DeepSeek's DualPipe-V): the same V placement, backward
                    split, and M >= S.

Each part of the compiler says which schedules it handles (:meth:`ScheduleRule.require`); the
others are refused with an error naming those it handles, never replaced by another.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from omnibal_compile._utils.tables import counted
from omnibal_compile.errors import PlanError

__all__ = [
    "SCHEDULES", "SCHEDULE_KINDS", "CLASSIC_SCHEDULES", "MAX_MICROBATCHES", "Schedule", "ScheduleRule", "schedule_rule",
]

Placement = Literal["loop", "v"]


@dataclass(frozen=True, kw_only=True)
class ScheduleRule:
    """The fixed rules of one pipeline schedule."""

    name: str
    """The schedule's name in plans, configs and the CLI."""
    torch_class: str
    """Name of the class in ``torch.distributed.pipelining`` that runs it."""
    stages_per_device: int | None
    """v it needs (1, or 2 for the V schedules); None: any v >= 1."""
    placement: Placement
    """``loop``: stage s on device ``s % D``; ``v``: stages s and 2D - 1 - s on device s (v = 2)."""
    split_backward: bool
    """Whether each backward runs as an input-gradient part (B) and a weight-gradient part (W)."""
    microbatches: Literal["any", "stages", "rounds"]
    """The micro-batch rule: ``any`` M >= 1; ``stages`` M >= S; ``rounds`` M a multiple of max(1, M // D)."""

    @property
    def fsdp_may_reshard(self) -> bool:
        """Whether FSDP may free a stage's gathered weights after each forward (``reshard_after_forward``). Not under a
        split backward: torch's input-gradient pass finds the weights in the autograd graph through the stage's
        ``parameters()``, which FSDP has swapped for their shards after the forward, so every weight gradient of the
        stage would be lost (measured on the reference VLM, dp = 2: 11 parameters without one)."""
        return not self.split_backward

    @property
    def runs_recomputation(self) -> bool:
        """Whether the pipeline runtime runs recomputed blocks under this schedule. Not under a split backward:
        torch's weight-gradient pass makes one autograd call per parameter group and checkpointing recomputes per
        call (measured: an LLM layer of the reference VLM reruns 10 times per micro-batch where the costs count 1)."""
        return not self.split_backward

    @property
    def runs_tensor_parallel(self) -> bool:
        """Whether the pipeline runtime runs tp > 1 under this schedule (a split backward over DTensor-sharded
        stages is not built yet)."""
        return not self.split_backward

    def runtime_gaps(self, *, tp: int = 1, recomputes: bool = False) -> tuple[str, ...]:
        """What of a plan under this schedule the pipeline runtime does not run yet, in short phrases (empty: it
        runs): the one rule behind ``run``'s refusals and the layout search's notes."""
        return tuple(
            gap for gap, missing in (
                ("recomputation with a split-backward schedule", recomputes and not self.runs_recomputation),
                ("tp with a split-backward schedule", tp > 1 and not self.runs_tensor_parallel),
            ) if missing
        )

    def require(self, supported: Collection[str], part: str) -> None:
        """Raise a :class:`PlanError` unless ``part`` (e.g. ``the planner``) handles this schedule."""
        if self.name not in supported:
            raise PlanError(
                f"{part} does not handle schedule {self.name!r} yet; it handles {sorted(supported)}: "
                "choose one of those"
            )

    def device_of(self, stage: int, num_devices: int) -> int:
        """The device stage ``stage`` runs on."""
        if self.placement == "v":
            return stage if stage < num_devices else 2 * num_devices - 1 - stage
        return stage % num_devices

    def stages_of(self, device: int, num_stages: int, num_devices: int) -> tuple[int, ...]:
        """The stages device ``device`` runs, in chunk order (the first is its earliest stage)."""
        if self.placement == "v":
            return (device, 2 * num_devices - 1 - device)
        return tuple(range(device, num_stages, num_devices))


SCHEDULES: dict[str, ScheduleRule] = {
    r.name: r
    for r in (
        ScheduleRule(name="gpipe", torch_class="ScheduleGPipe", stages_per_device=1, placement="loop",
                     split_backward=False, microbatches="any"),
        ScheduleRule(name="1f1b", torch_class="Schedule1F1B", stages_per_device=1, placement="loop",
                     split_backward=False, microbatches="stages"),
        ScheduleRule(name="interleaved", torch_class="ScheduleInterleaved1F1B", stages_per_device=None,
                     placement="loop", split_backward=False, microbatches="rounds"),
        ScheduleRule(name="interleaved-zb", torch_class="ScheduleInterleavedZeroBubble", stages_per_device=None,
                     placement="loop", split_backward=True, microbatches="rounds"),
        ScheduleRule(name="zbv", torch_class="ScheduleZBVZeroBubble", stages_per_device=2, placement="v",
                     split_backward=True, microbatches="any"),
        ScheduleRule(name="dualpipev", torch_class="ScheduleDualPipeV", stages_per_device=2, placement="v",
                     split_backward=True, microbatches="stages"),
    )
}
"""Every schedule, by name (see the module docstring)."""

SCHEDULE_KINDS: tuple[str, ...] = tuple(SCHEDULES)
"""Pipeline schedules a plan can be made for."""

CLASSIC_SCHEDULES: frozenset[str] = frozenset({"gpipe", "1f1b", "interleaved"})
"""The schedules with a whole backward, which the planner's closed forms cover."""

MAX_MICROBATCHES = 2**16
"""Most micro-batches per iteration: far above any real pipeline's, low enough that the simulator
(events in proportion to M x S) and the solvers finish."""


def schedule_rule(kind: str) -> ScheduleRule:
    """The rule of schedule ``kind``; a :class:`PlanError` naming the known ones otherwise."""
    if kind not in SCHEDULES:
        raise PlanError(f"schedule {kind!r} is unknown; use one of {list(SCHEDULE_KINDS)}")
    return SCHEDULES[kind]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Which pipeline schedule runs an iteration, with how many micro-batches and stages per device."""

    kind: str = "1f1b"
    """A name in :data:`SCHEDULES` (see the module docstring)."""
    num_microbatches: int
    """M, micro-batches per iteration."""
    virtual_stages: int = 1
    """v, stages per device: 1 for gpipe and 1f1b, 2 for zbv and dualpipev, any v >= 1 for the interleaved ones."""

    def __post_init__(self) -> None:
        rule = schedule_rule(self.kind)
        for name in ("num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_microbatches > MAX_MICROBATCHES:
            raise PlanError(f"num_microbatches must be <= {MAX_MICROBATCHES:,}, got {self.num_microbatches:,}; "
                            "use fewer, larger micro-batches")
        need = rule.stages_per_device
        if need == 1 and self.virtual_stages != 1:
            raise PlanError(
                f"schedule {self.kind!r} runs one stage per device but virtual_stages={self.virtual_stages}; "
                f"use schedule 'interleaved' for {self.virtual_stages} stages per device, or virtual_stages=1"
            )
        if need is not None and self.virtual_stages != need:
            raise PlanError(
                f"schedule {self.kind!r} runs exactly {need} stages per device (stages s and 2D-1-s in a V) but "
                f"virtual_stages={self.virtual_stages}; set virtual_stages={need}"
            )

    @property
    def rule(self) -> ScheduleRule:
        """The schedule's fixed rules."""
        return SCHEDULES[self.kind]

    @classmethod
    def for_stages(
        cls, num_stages: int, *, kind: str = "1f1b", num_microbatches: int | None = None, virtual_stages: int = 1
    ) -> Schedule:
        """The schedule for ``num_stages`` stages, checked; ``num_microbatches=None`` means one per stage."""
        schedule = cls(
            kind=kind,
            num_microbatches=num_stages if num_microbatches is None else num_microbatches,
            virtual_stages=virtual_stages,
        )
        schedule.check(num_stages)
        return schedule

    def num_devices(self, num_stages: int) -> int:
        """D = S / v, the pipeline devices (ranks)."""
        return num_stages // self.virtual_stages

    def device_of(self, stage: int, num_stages: int) -> int:
        """The device (pipeline rank) stage ``stage`` runs on."""
        return self.rule.device_of(stage, self.num_devices(num_stages))

    def stages_of(self, device: int, num_stages: int) -> tuple[int, ...]:
        """The stages device ``device`` runs, in chunk order."""
        return self.rule.stages_of(device, num_stages, self.num_devices(num_stages))

    def microbatches_per_round(self, num_devices: int) -> int:
        """Micro-batches per round of the interleaved schedules (torch's ``microbatches_per_round``)."""
        return self.num_microbatches // max(1, self.num_microbatches // num_devices)

    def check(self, num_stages: int) -> None:
        """Raise a :class:`PlanError` naming the fix unless torch can run this schedule over ``num_stages`` stages."""
        S, M, v = num_stages, self.num_microbatches, self.virtual_stages
        if not isinstance(S, int) or isinstance(S, bool) or S < 1:
            raise PlanError(f"num_stages must be an integer >= 1, got {S!r}")
        if S % v:
            raise PlanError(
                f"{S} stages cannot be spread as {v} stages per device: num_stages must be a multiple of virtual_stages"
            )
        rule = self.rule
        if rule.microbatches == "stages" and M < S:
            raise PlanError(
                f"{counted(M, 'micro-batch')} for {counted(S, 'stage')}: schedule {self.kind!r} needs at least one "
                "micro-batch per stage; "
                f"set num_microbatches >= {S}, or use schedule {'gpipe' if rule.stages_per_device == 1 else 'zbv'!r}"
            )
        if rule.microbatches == "rounds":
            D = self.num_devices(S)
            rounds = max(1, M // D)
            if M % rounds:
                raise PlanError(
                    f"schedule {self.kind!r} on {D} devices runs max(1, num_microbatches // {D}) = {rounds} rounds, "
                    f"so it needs num_microbatches to be a multiple of {rounds}; got {M}; use a multiple of {D}"
                )
