"""Run generated stages on ``torch.distributed.pipelining``: stage construction, training, launch.

The names load on first use (PEP 562), so a rank's worker (``python -m
omnibal_compile.runtime.worker``) sets up its fault handling before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnibal_compile.calibrate.overhead import RuntimeOverhead, fit_overhead, measure_overhead
    from omnibal_compile.runtime.pipeline import (
        RankPipeline,
        TiedParameter,
        build_pipeline,
        check_pipeline,
        get_schedule_class,
        loss_weights,
        rank_stages,
    )

_LAZY: dict[str, str] = {
    "RuntimeOverhead": "omnibal_compile.calibrate.overhead",
    "measure_overhead": "omnibal_compile.calibrate.overhead",
    "fit_overhead": "omnibal_compile.calibrate.overhead",
    "RankPipeline": "omnibal_compile.runtime.pipeline",
    "TiedParameter": "omnibal_compile.runtime.pipeline",
    "build_pipeline": "omnibal_compile.runtime.pipeline",
    "check_pipeline": "omnibal_compile.runtime.pipeline",
    "get_schedule_class": "omnibal_compile.runtime.pipeline",
    "loss_weights": "omnibal_compile.runtime.pipeline",
    "rank_stages": "omnibal_compile.runtime.pipeline",
}

__all__ = [
    "RuntimeOverhead",
    "measure_overhead",
    "fit_overhead",
    "RankPipeline",
    "TiedParameter",
    "build_pipeline",
    "check_pipeline",
    "get_schedule_class",
    "loss_weights",
    "rank_stages",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
