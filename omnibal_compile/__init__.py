"""omnibal_compile: balanced pipeline-parallel training of vision-language models, as a compiler.

Capture a model into an FX graph, group it into blocks, plan pipeline cut points, and emit one
module per stage that together reproduce the original model exactly.
"""

from omnibal_compile.api import OptimizeResult, ParityReport, PassError, optimize
from omnibal_compile.errors import CaptureError, InputError, OmnibalError, PlanError
from omnibal_compile.passes.codegen import StageInfo, stage_info
from omnibal_compile.plan import Plan, StagePlan
from omnibal_compile.sim import SimResult, simulate

__version__ = "0.1.0"

__all__ = [
    "optimize",
    "OptimizeResult",
    "ParityReport",
    "Plan",
    "StagePlan",
    "StageInfo",
    "stage_info",
    "OmnibalError",
    "CaptureError",
    "PlanError",
    "InputError",
    "PassError",
    "simulate",
    "SimResult",
]
