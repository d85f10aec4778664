"""Baseline planners: cut a block chain into stages without cost measurements.

Every planner has the signature ``planner(graph: BlockGraph, num_stages: int) -> Plan`` so that
cost-based planners added later can be swapped in and compared one call away.

Glossary:
    uniform      equal numbers of layer blocks per stage (Megatron/torchtitan default); other
                 blocks ride with the layer before them (or the first layer, if they lead).
    parameters   contiguous split minimising the largest stage's parameter count (DeepSpeed's
                 ``partition_method="parameters"``), solved exactly by dynamic programming.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omnibal_compile.errors import PlanError
from omnibal_compile.passes.blocks import BlockGraph
from omnibal_compile.plan import Plan

__all__ = ["uniform", "parameters", "PLANNERS", "Planner", "check_num_stages", "min_max_partition"]

Planner = Callable[[BlockGraph, int], Plan]


def check_num_stages(graph: BlockGraph, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise PlanError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > graph.num_blocks:
        raise PlanError(
            f"num_stages={num_stages} exceeds the {graph.num_blocks} blocks of {graph.captured.model_name}: "
            "use fewer stages, or finer blocks (block_prefixes=...)"
        )


def _plan(graph: BlockGraph, boundaries: Sequence[int], planner: str, **notes: object) -> Plan:
    return Plan(
        block_names=graph.names,
        boundaries=tuple(boundaries),
        planner=planner,
        block_params=tuple(b.num_params for b in graph.blocks),
        block_kinds=tuple(b.kind for b in graph.blocks),
        notes=dict(notes),
    )


def uniform(graph: BlockGraph, num_stages: int) -> Plan:
    """Equal numbers of layer blocks per stage; the first stages take the remainder."""
    check_num_stages(graph, num_stages)
    layers = [b.index for b in graph.blocks if b.kind == "layer"]
    if not layers:
        layers = list(range(graph.num_blocks))  # no layer stack: every block counts as a layer
    if len(layers) < num_stages:
        raise PlanError(
            f"uniform planner needs at least num_stages={num_stages} layer blocks, {graph.captured.model_name} has "
            f"{len(layers)}; use planner='parameters' or fewer stages"
        )
    per, extra = divmod(len(layers), num_stages)
    boundaries, first = [0], 0
    for s in range(num_stages - 1):
        first += per + (1 if s < extra else 0)
        boundaries.append(layers[first])
    boundaries.append(graph.num_blocks)
    return _plan(graph, boundaries, "uniform")


def min_max_partition(weights: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """Exact contiguous partition of ``weights`` into ``num_stages`` non-empty parts minimising the max sum.

    Returns (boundaries, max part sum). O(n^2 S) dynamic programming; ties prefer earlier cuts.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot split {n} items into {num_stages} non-empty parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[s][i]: minimal max over the first i items in s parts; arg[s][i]: start of the last part.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cand = max(best[s - 1][j], prefix[i] - prefix[j])
                if cand < best[s][i]:
                    best[s][i], arg[s][i] = cand, j
    boundaries = [n]
    for s in range(num_stages, 0, -1):
        boundaries.append(arg[s][boundaries[-1]])
    return boundaries[::-1], best[num_stages][n]


def parameters(graph: BlockGraph, num_stages: int) -> Plan:
    """Contiguous stages with the smallest possible largest parameter count."""
    check_num_stages(graph, num_stages)
    boundaries, worst = min_max_partition([b.num_params for b in graph.blocks], num_stages)
    return _plan(graph, boundaries, "parameters", max_stage_params=int(worst))


PLANNERS: dict[str, Planner] = {"uniform": uniform, "parameters": parameters}
"""Planners selectable by name in :func:`omnibal_compile.optimize`."""
