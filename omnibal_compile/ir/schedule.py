"""The pipeline schedule a plan is made for, and the one check of its rules (torch-free).

The rules are those of ``torch.distributed.pipelining`` (torch 2.13, ``schedules.py``), so a
schedule the planner accepts is one the runtime can run. ``S`` stages run on ``D = S / v`` devices,
stage ``s`` on device ``s % D``:

    gpipe        ``ScheduleGPipe``, a ``PipelineScheduleSingle``: one stage per device (v = 1); any M >= 1.
    1f1b         ``Schedule1F1B``, a ``PipelineScheduleSingle``: one stage per device (v = 1), and
                 M >= S (its ``__init__`` raises "Number of microbatches ... must be greater than or
                 equal to the number of stages").
    interleaved  ``ScheduleInterleaved1F1B``, a multi-stage schedule: v >= 1 stages per device;
                 micro-batches run in ``rounds = max(1, M // D)`` rounds of ``M // rounds`` and M must
                 be a multiple of ``rounds`` (its ``__init__`` raises otherwise). M may be below S.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnibal_compile._utils.tables import counted
from omnibal_compile.errors import PlanError

__all__ = ["SCHEDULE_KINDS", "MAX_MICROBATCHES", "Schedule"]

SCHEDULE_KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules a plan can be made for."""

MAX_MICROBATCHES = 2**16
"""Most micro-batches per iteration: far above any real pipeline's, low enough that the simulator
(events in proportion to M x S) and the solvers finish."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Which pipeline schedule runs an iteration, with how many micro-batches and stages per device."""

    kind: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved`` (see the module docstring)."""
    num_microbatches: int
    """M, micro-batches per iteration."""
    virtual_stages: int = 1
    """v, stages per device: 1 for gpipe and 1f1b, any v >= 1 for interleaved."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise PlanError(f"schedule {self.kind!r} is unknown; use one of {list(SCHEDULE_KINDS)}")
        for name in ("num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_microbatches > MAX_MICROBATCHES:
            raise PlanError(f"num_microbatches must be <= {MAX_MICROBATCHES:,}, got {self.num_microbatches:,}; "
                            "use fewer, larger micro-batches")
        if self.kind != "interleaved" and self.virtual_stages != 1:
            raise PlanError(
                f"schedule {self.kind!r} runs one stage per device but virtual_stages={self.virtual_stages}; "
                f"use schedule 'interleaved' for {self.virtual_stages} stages per device, or virtual_stages=1"
            )

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

    def microbatches_per_round(self, num_devices: int) -> int:
        """Micro-batches per round of interleaved 1F1B (torch's ``microbatches_per_round``)."""
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
        if self.kind == "1f1b" and M < S:
            raise PlanError(
                f"{counted(M, 'micro-batch')} for {counted(S, 'stage')}: schedule '1f1b' needs at least one "
                "micro-batch per stage; "
                f"set num_microbatches >= {S}, or use schedule 'gpipe'"
            )
        if self.kind == "interleaved":
            D = self.num_devices(S)
            rounds = max(1, M // D)
            if M % rounds:
                raise PlanError(
                    f"interleaved 1F1B on {D} devices runs max(1, num_microbatches // {D}) = {rounds} rounds, so it "
                    f"needs num_microbatches to be a multiple of {rounds}; got {M}; use a multiple of {D}"
                )
