"""Run generated stages on ``torch.distributed.pipelining``: stage construction, training, launch."""

from omnibal_compile.runtime.overhead import RuntimeOverhead, fit_overhead, measure_overhead
from omnibal_compile.runtime.pipeline import (
    RankPipeline,
    TiedParameter,
    build_pipeline,
    check_pipeline,
    get_schedule_class,
    loss_weights,
    rank_stages,
)

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
