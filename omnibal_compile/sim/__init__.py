"""Pipeline schedule simulator (torch-free), what-if sweeps, and pictures of plans and timelines.

``simulate(plan, costs)`` runs one iteration of GPipe, 1F1B or interleaved 1F1B event by event;
``replay.pipeline_times`` is its batch form, many iterations at once with numpy (same times);
``draw`` turns plans and results into PNG/SVG pictures and Chrome traces (matplotlib, lazily).
"""

from omnibal_compile.sim.replay import pipeline_times, replay
from omnibal_compile.sim.simulate import (
    Event,
    SimResult,
    SimulationError,
    StageCost,
    operation_order,
    schedule_time,
    simulate,
    stage_costs,
    stage_schedule_time,
)
from omnibal_compile.sim.whatif import SweepPoint, sweep, sweep_table

__all__ = [
    "simulate",
    "SimResult",
    "Event",
    "StageCost",
    "stage_costs",
    "operation_order",
    "schedule_time",
    "stage_schedule_time",
    "pipeline_times",
    "replay",
    "SimulationError",
    "sweep",
    "SweepPoint",
    "sweep_table",
]
