"""omnibal_compile: balanced pipeline-parallel training of vision-language models, as a compiler.

Capture a model into an FX graph, group it into blocks, plan pipeline cut points, and emit one
module per stage that together reproduce the original model exactly.

The public names load on first use (PEP 562): ``import omnibal_compile.planning``, ``.sim`` or
``.costs`` does not import torch, and the command line answers ``--help`` without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from omnibal_compile.errors import CaptureError, InputError, OmnibalError, PassError, PlanError

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "optimize": "omnibal_compile.api",
    "OptimizeResult": "omnibal_compile.api",
    "ParityReport": "omnibal_compile.api",
    "StageInfo": "omnibal_compile.compile.codegen",
    "stage_info": "omnibal_compile.compile.codegen",
    "Plan": "omnibal_compile.ir.plan",
    "StagePlan": "omnibal_compile.ir.plan",
    "simulate": "omnibal_compile.sim",
    "SimResult": "omnibal_compile.sim",
}
"""Public name -> the module that defines it."""

_SUBMODULES: dict[str, str] = {"devices": "omnibal_compile.costs.devices"}
"""Public modules reachable as attributes (``oc.devices.A100_80G``) -> where they live."""

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
    "devices",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omnibal_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from omnibal_compile.api import OptimizeResult, ParityReport, optimize
    from omnibal_compile.compile.codegen import StageInfo, stage_info
    from omnibal_compile.costs import devices
    from omnibal_compile.ir.plan import Plan, StagePlan
    from omnibal_compile.sim import SimResult, simulate
