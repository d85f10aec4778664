"""Tensor parallelism in the runtime: the ``("dp", "pp", "tp")`` mesh and the combinations that run with ``tp > 1``.

The pass itself (which layers are sharded, and how) is :mod:`omnibal_compile.compile.tensor_parallel`;
:func:`~omnibal_compile.runtime.pipeline.build_pipeline` applies it to each stage of a rank.

Glossary:
    mesh        ``("dp", "pp")``, or ``("dp", "pp", "tp")`` with ``tp`` innermost: the ``tp`` ranks of one
                stage hold neighbouring global ranks (one node's fast links in a real job).
    replica     for tied parameters: the pipeline ranks that share one ``dp`` and one ``tp`` index; a
                tied weight is never sharded, so its copies sum their gradients within each replica.
"""

from __future__ import annotations

from typing import Any

from omnibal_compile.errors import InputError, PlanError
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import CLASSIC_SCHEDULES

__all__ = ["MESH_DIMS", "check_tensor_parallel", "mesh_layout"]

MESH_DIMS: tuple[tuple[str, ...], ...] = (("dp", "pp"), ("dp", "pp", "tp"))
"""Mesh dim names the runtime builds on."""


def check_tensor_parallel(plan: Plan, *, tp: int, compile: bool = False, sequence_parallel: bool = False) -> None:
    """Raise a clear :class:`PlanError` / :class:`InputError` for a ``tp`` setting this runtime does not run yet."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise PlanError(f"tp (tensor-parallel ranks per stage, --tp) must be an integer >= 1, got {tp!r}")
    if sequence_parallel and tp == 1:
        raise InputError("sequence_parallel (--sequence-parallel) splits the tensor-parallel ranks' sequence: it needs "
                         "tp > 1 (--tp 2 or more), or leave it off")
    if tp == 1:
        return
    refused = []
    if not plan.pipeline_schedule.rule.runs_tensor_parallel:
        refused.append(f"schedule {plan.schedule!r} (it splits each backward; use one among "
                       f"{sorted(CLASSIC_SCHEDULES)})")
    if compile:
        refused.append("--compile (torch.compile of DTensor-sharded stages is not tested yet)")
    if refused:
        raise PlanError(f"tp={tp} does not run with " + "; nor with ".join(refused))


def mesh_layout(mesh: Any) -> tuple[list[list[int]], int, int]:
    """(replicas, this rank's replica, tp size) of a ``("dp", "pp"[, "tp"])`` DeviceMesh; ``replicas[k][r]`` is the
    global rank of pipeline rank ``r`` in replica ``k`` (module glossary)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in MESH_DIMS:
        raise InputError(f"the mesh must have dims {' or '.join(map(str, MESH_DIMS))}, got {mesh.mesh_dim_names}")
    if names == ("dp", "pp"):
        return mesh.mesh.tolist(), mesh["dp"].get_local_rank(), 1
    dp, pp, tp = mesh.mesh.shape
    replicas = mesh.mesh.permute(0, 2, 1).reshape(dp * tp, pp).tolist()
    return replicas, mesh["dp"].get_local_rank() * tp + mesh["tp"].get_local_rank(), int(tp)
