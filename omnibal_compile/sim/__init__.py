"""Pipeline schedule simulator (torch-free), what-if sweeps, and pictures of plans and timelines.

``simulate(plan, costs)`` runs one iteration of GPipe, 1F1B or interleaved 1F1B event by event;
``draw`` turns plans and results into PNG/SVG pictures and Chrome traces (matplotlib, lazily).
"""

from omnibal_compile.sim.simulate import (
    Event,
    SimResult,
    SimulationError,
    StageCost,
    operation_order,
    schedule_time,
    simulate,
    stage_costs,
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
    "SimulationError",
    "sweep",
    "SweepPoint",
    "sweep_table",
]
