"""Tensor parallelism at paper scale (SIMULATED): the planner's TP costs next to the analytic Megatron rule, and the
layout search over (dp, pp, tp).

Nothing runs a model. Block costs are analytic (:mod:`omnibal_compile.costs.analytic`) on the A100-80GB roofline.
The planner's TP costs are :func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` (what the runtime runs:
Megatron pairs, whole-activation all-reduces, no sequence parallelism) with the pass's facts derived from the model's
shapes (:func:`omnibal_compile.costs.analytic.tensor_parallel_blocks`); the analytic rule is
:func:`omnibal_compile.costs.analytic.tensor_parallel_costs` (Megatron with sequence parallelism).

Glossary:
    compute     forward + backward seconds of one block on one rank, collectives left out.
    collective  the block's tensor-parallel collective seconds, forward and backward (not overlapped).
                Planner: ``BlockCost.tensor_parallel_s``; analytic: its table's forward + backward minus
                the tp=1 compute / tp (the rule adds its collectives to the divided compute).
    activations bytes one rank keeps for the backward without recomputation (``none``).
    static      bytes of one rank's weights, gradients and optimizer states (16 B per parameter, no
                data-parallel sharding).
    GPU-days    predicted seconds per sample x samples x devices / 86400: every micro-batch of the mean
                shape (perfectly balanced data), no optimizer step, data loading or launch overheads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.studies.paper_layout import PAPER_BUDGET_FRACTION, PAPER_GLOBAL_BATCH, mean_sample, sample_costs
from omnibal_compile._utils.tables import format_table
from omnibal_compile._utils.units import format_size
from omnibal_compile.costs.analytic import (
    BLOCK_TYPES,
    MicroBatch,
    VLMSpec,
    cost_table,
    tensor_parallel_blocks,
    tensor_parallel_replicated,
)
from omnibal_compile.costs.devices import A100_80G, DeviceSpec
from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import CostTable, TensorParallelBlock
from omnibal_compile.planning.layout import PRUNE_MARGIN, SEARCHED_SCHEDULES, Candidate, LayoutSearch, search_layout

__all__ = ["BlockComparison", "compare_block_costs", "format_comparison", "planner_tables", "tp_search",
           "RULES", "best_at_degree", "best_pp_only", "gpu_days", "format_search_verdict", "PAPER_ROWS"]

PAPER_ROWS: tuple[str, ...] = ("baseline", "+ data (ISF)", "+ model (search partition)", "+ memory (per stage)")
"""The steps of OmniBal Table 5, in the order of ``PAPER_GPU_DAYS``."""


@dataclass(frozen=True, kw_only=True)
class BlockComparison:
    """One block type at one tp: the planner's rule and the analytic rule side by side (module glossary)."""

    block_type: str
    tp: int
    planner_compute_s: float
    analytic_compute_s: float
    planner_collective_s: float
    analytic_collective_s: float
    planner_activation_bytes: int
    analytic_activation_bytes: int
    planner_static_bytes: int
    analytic_static_bytes: int
    why: str
    """The difference and its reason, in words."""


def planner_tables(model: VLMSpec, shape: MicroBatch, degrees: Sequence[int], *, device: DeviceSpec = A100_80G
                   ) -> tuple[CostTable, dict[int, dict[str, TensorParallelBlock]], dict[int, CostTable]]:
    """(tp=1 table, facts per tp, the planner's table per tp) of ``model`` at one micro-batch ``shape``, the
    collectives over NVLink."""
    base = cost_table(model, shape, device=device)
    facts = {tp: tensor_parallel_blocks(model, tiles=shape.tiles, tokens=shape.tokens,
                                        attention_pairs=shape.attention_pairs, tp=tp) for tp in degrees}
    tables = {tp: tensor_parallel_table(base, tp, sharded=facts[tp], bandwidth=device.link_bandwidth("nvlink"))
              for tp in degrees}
    return base, facts, tables


def _why(model: VLMSpec, kind: str, tp: int, facts: TensorParallelBlock | None, base_flops: float,
         base_params: int, comm_ratio: float) -> str:
    """The reasons the planner's figures differ from the analytic rule's for one block type."""
    if facts is None:
        what = {"vision.embed": "the patch embedding is a convolution, no pair",
                "llm.embed": f"the vocabulary does not split over tp={tp}",
                "llm.head": f"the vocabulary does not split over tp={tp}"}.get(kind, "no pair")
        return f"{what}: whole on every rank, where the analytic rule divides it by {tp}"
    if kind in ("llm.embed", "llm.head"):
        what = ("the embedding's output all-reduced" if kind == "llm.embed" else
                "the loss's 3 floats per token all-reduced (max, sum of exponentials, target logit) and the "
                "head's input gradient")
        return (f"vocabulary-parallel in both: its weight / tp; collective {comm_ratio:.2f}x: {what}, against the "
                "analytic rule's sequence-parallel all-gathers and reduce-scatters")
    out = []
    share = min(1.0, facts.flops / base_flops)
    refused = tensor_parallel_replicated(model, tp).get(kind, "")
    if refused:
        out.append(f"{refused} (the analytic rule assumes an even split): {1 - share:.0%} of its FLOPs and "
                   f"{1 - facts.params / base_params:.0%} of its parameters whole")
    else:
        out.append("compute equal: both divide the whole block time by tp, norms and residual adds included "
                   "(replicated in the runtime: optimistic)")
    out.append("activations not divided (no sequence parallelism)")
    if facts.backward_reduces > facts.pairs:
        out.append(f"backward all-reduces {facts.backward_reduces} column inputs (q, k, v apart) where Megatron "
                   "reduce-scatters one per pair")
    out.append(f"collective {comm_ratio:.2f}x: {facts.pairs} forward and {facts.backward_reduces} backward all-reduces "
               "of whole activations, each a reduce-scatter + an all-gather, against the analytic rule's "
               "all-gathers and reduce-scatters of 1 / tp of them")
    return "; ".join(out)


def compare_block_costs(model: VLMSpec, shape: MicroBatch, degrees: Sequence[int] = (2, 4, 8), *,
                        device: DeviceSpec = A100_80G) -> list[BlockComparison]:
    """Per block type and tp, the planner's per-rank costs (tensor_parallel_table with the derived facts) next to
    the analytic Megatron rule's (cost_table at that tp)."""
    base, facts, planner = planner_tables(model, shape, degrees, device=device)
    first = {kind: model.block_types().index(kind) for kind in BLOCK_TYPES}
    rows = []
    for tp in degrees:
        analytic = cost_table(model, shape, device=device, tensor_parallel=tp)
        for kind, i in first.items():
            b, p, a = base.blocks[i], planner[tp].blocks[i], analytic.blocks[i]
            a_compute = (b.forward_s + b.backward_s) / tp  # the analytic rule: compute / tp, plus its collectives
            a_comm = a.forward_s + a.backward_s - a_compute
            p_comm = p.tensor_parallel_s
            ratio = p_comm / a_comm if a_comm > 0 else float("nan")
            rows.append(BlockComparison(
                block_type=kind, tp=tp, planner_compute_s=p.forward_s + p.backward_s - p_comm,
                analytic_compute_s=a_compute, planner_collective_s=p_comm, analytic_collective_s=a_comm,
                planner_activation_bytes=p.activation_bytes["none"],
                analytic_activation_bytes=a.activation_bytes["none"], planner_static_bytes=p.static_bytes,
                analytic_static_bytes=a.static_bytes,
                why=_why(model, kind, tp, facts[tp].get(b.name), b.flops, b.num_params, ratio)))
    return rows


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def format_comparison(rows: Sequence[BlockComparison]) -> str:
    """The comparison as an aligned table (planner | analytic per figure), then each row's reason."""
    head = ("block type", "tp", "compute ms: planner", "analytic", "collective ms: planner", "analytic",
            "activations: planner", "analytic", "static: planner", "analytic")
    lines = [head]
    for r in rows:
        lines.append((r.block_type, str(r.tp), _ms(r.planner_compute_s), _ms(r.analytic_compute_s),
                      _ms(r.planner_collective_s), _ms(r.analytic_collective_s),
                      format_size(r.planner_activation_bytes), format_size(r.analytic_activation_bytes),
                      format_size(r.planner_static_bytes), format_size(r.analytic_static_bytes)))
    why = [f"  {r.block_type} (tp={r.tp}): {r.why}" for r in rows if r.tp == rows[0].tp]
    return "\n".join([format_table(lines, "lrrrrrrrrr"), f"why they differ (the same at every tp, tp={rows[0].tp} "
                      "figures):", *why])


def _facts(model: VLMSpec, stats: LengthStats, degrees: Sequence[int]) -> dict[int, dict[str, TensorParallelBlock]]:
    """The pass's facts of one mean sample of ``stats`` at each tp (the search scales them with the micro-batch)."""
    tiles, tokens, pairs = mean_sample(stats)
    return {tp: tensor_parallel_blocks(model, tiles=tiles, tokens=tokens, attention_pairs=pairs, tp=tp)
            for tp in degrees}


def tp_search(model: VLMSpec, stats: LengthStats, *, devices: int = 64, devices_per_node: int = 8,
              degrees: Sequence[int] = (2, 4, 8), microbatch_sizes: Sequence[int] = (1, 2, 4),
              global_batch: int = PAPER_GLOBAL_BATCH, schedules: Sequence[str] = SEARCHED_SCHEDULES,
              pipeline: Sequence[int] | None = None, prune: float | None = PRUNE_MARGIN,
              device: DeviceSpec = A100_80G) -> LayoutSearch:
    """The layout search over (dp, pp, tp) with the planner's TP rule: costs of micro-batches of b mean samples of
    ``stats``, the facts of one mean sample, a budget of 90% of the device's memory (``pipeline``, ``prune``: as
    :func:`search_layout`'s)."""
    return search_layout(sample_costs(model, stats, device=device), devices=devices, global_batch=global_batch,
                         memory_budget=PAPER_BUDGET_FRACTION * device.memory_bytes,
                         microbatch_sizes=microbatch_sizes, device=device, devices_per_node=devices_per_node,
                         schedules=schedules, pipeline=pipeline, prune=prune,
                         tensor_parallel=_facts(model, stats, degrees))


RULES: tuple[str, ...] = ("planner", "analytic")
"""TP cost rules :func:`best_at_degree` costs a rank by: the planner's (``tensor_parallel_table``, what the runtime
runs) or the analytic Megatron rule with sequence parallelism (``cost_table(tensor_parallel=tp)``)."""


def best_at_degree(model: VLMSpec, stats: LengthStats, tp: int, *, rule: str = "planner", devices: int = 64,
                   devices_per_node: int = 8, microbatch_sizes: Sequence[int] = (1, 2, 4),
                   global_batch: int = PAPER_GLOBAL_BATCH, schedules: Sequence[str] = SEARCHED_SCHEDULES,
                   device: DeviceSpec = A100_80G) -> Candidate:
    """The best layout with tp fixed, planned and simulated: the same search over ``devices / tp`` tensor-parallel
    groups of ``tp`` ranks (``devices_per_node / tp`` per node), each group costed as one rank by ``rule`` (one of
    :data:`RULES`; ``planner``: the full search's tables at that tp, the same links, facts and budget), so its
    layouts are pruned against their own tp's best only, not against tp=1's."""
    if devices % tp or devices_per_node % tp:
        raise InputError(f"tp={tp} must divide the devices ({devices}) and the node ({devices_per_node})")
    if rule not in RULES:
        raise InputError(f"rule must be one of {list(RULES)}, got {rule!r}")
    facts = _facts(model, stats, (tp,))[tp]
    costs = sample_costs(model, stats, device=device)

    def rank_costs(b: int) -> CostTable:
        sharded = {k: f.scaled(b) for k, f in facts.items()}
        return tensor_parallel_table(costs(b), tp, sharded=sharded, bandwidth=device.link_bandwidth("nvlink"))

    per_rank = rank_costs if rule == "planner" else sample_costs(model, stats, device=device, tensor_parallel=tp)
    result = search_layout(per_rank, devices=devices // tp, global_batch=global_batch,
                           memory_budget=PAPER_BUDGET_FRACTION * device.memory_bytes,
                           microbatch_sizes=microbatch_sizes, device=device, devices_per_node=devices_per_node // tp,
                           schedules=schedules)
    best = result.best
    plan = None if best.plan is None else dataclasses.replace(best.plan, tensor_parallel=tp)
    return dataclasses.replace(best, layout=dataclasses.replace(best.layout, tp=tp), plan=plan)


def best_pp_only(result: LayoutSearch) -> Candidate | None:
    """The fastest planned layout without tensor parallelism (tp = 1), None when none was planned."""
    return min((c for c in result.candidates if c.planned and c.layout.tp == 1), key=lambda c: c.time_per_unit_s,
               default=None)


def gpu_days(candidate: Candidate, samples: int, devices: int) -> float:
    """Predicted GPU-days of ``samples`` samples on ``devices`` devices (module glossary)."""
    return candidate.time_per_unit_s * samples * devices / 86400


def format_search_verdict(result: LayoutSearch, samples: int, paper: Sequence[float],
                          per_degree: Mapping[int, Candidate] | None = None,
                          analytic: Mapping[int, Candidate] | None = None) -> str:
    """The chosen layout, the best tp=1 (pp-only) layout, ``per_degree``'s best layouts with tp fixed
    (:func:`best_at_degree`) and ``analytic``'s (the same under the analytic rule) with their predicted GPU-days, and
    the paper's rows."""
    n = result.devices
    days = gpu_days(result.best, samples, n)
    lines = [("row", "layout", "GPU-days", "vs chosen", "note")]
    rows = [("SIMULATED: chosen", result.best)]
    pp_only = best_pp_only(result)
    if pp_only is not None:
        rows.append(("SIMULATED: best tp=1 (pp-only)", pp_only))
    rows += [(f"SIMULATED: best with tp={tp} fixed", c) for tp, c in sorted((per_degree or {}).items())]
    rows += [(f"SIMULATED: best with tp={tp} fixed, analytic rule", c) for tp, c in sorted((analytic or {}).items())]
    for label, c in rows:
        d = gpu_days(c, samples, n)
        lines.append((label, c.layout.describe(), f"{d:.1f}", f"{d / days:.3f}", c.runtime_note or "-"))
    for name, p in zip(PAPER_ROWS, paper):
        lines.append((f"paper: {name}", "OmniBal Table 5, its own layout", f"{p:g}", f"{p / days:.3f}",
                      "measured by its authors"))
    return "\n".join([
        f"predicted GPU-days of {samples:,} samples on {n} devices (SIMULATED: mean-shape micro-batches, i.e. "
        "perfectly balanced data, no optimizer step or overheads), next to the paper's rows:",
        format_table(lines, "llrrl")])
