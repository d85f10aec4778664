"""Paper-scale layout search (SIMULATED): analytic block costs per micro-batch size for
:func:`omnibal_compile.planning.layout.search_layout`.

A micro-batch of ``b`` samples is costed as a balanced pack of ``b`` samples of the mean shape of the
length statistics (tiles, LLM tokens and causal attention pairs per sample times ``b``: a pack attends
within each sample), on a roofline device (:mod:`omnibal_compile.costs.analytic`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from omnibal_compile.costs.analytic import MicroBatch, VLMSpec, cost_table
from omnibal_compile.costs.devices import A100_80G, DeviceSpec
from omnibal_compile.data.lengths import LengthStats, bundled_length_files, load_lengths
from omnibal_compile.ir.costs import BF16_ADAM, CostTable, Precision

__all__ = ["mean_sample", "sample_costs", "paper_layout_times", "PAPER_GLOBAL_BATCH", "PAPER_BUDGET_FRACTION"]

PAPER_GLOBAL_BATCH = 1024
"""Samples per optimizer step of InternVL-1.5 fine-tuning (as in :mod:`bench.studies.paper_scale`)."""
PAPER_BUDGET_FRACTION = 0.9
"""Share of a device's memory a plan may use (the rest for fragmentation, NCCL buffers, workspace)."""


def mean_sample(stats: LengthStats) -> tuple[float, float, float]:
    """(tiles, LLM tokens, causal attention pairs) of the mean sample of ``stats`` (a pack attends within each
    sample: pairs are the mean of t (t + 1) / 2)."""
    tokens = stats.tokens.astype(np.float64)
    return float(stats.tiles.mean()), float(tokens.mean()), float((tokens * (tokens + 1) / 2).mean())


def sample_costs(
    model: VLMSpec,
    stats: LengthStats | None = None,
    *,
    device: DeviceSpec = A100_80G,
    precision: Precision = BF16_ADAM,
    tensor_parallel: int = 1,
) -> Callable[[int], CostTable]:
    """``b -> CostTable`` of a micro-batch of ``b`` mean samples of ``stats`` (default: the bundled statistics), one
    device's of a Megatron tensor-parallel group of ``tensor_parallel`` (the analytic rule) when > 1."""
    per_sample = mean_sample(stats if stats is not None else load_lengths(bundled_length_files()))

    def costs(b: int) -> CostTable:
        tiles, toks, pairs = (b * x for x in per_sample)
        return cost_table(model, MicroBatch(tiles=round(tiles), tokens=max(1, round(toks)), attention_pairs=pairs),
                          device=device, precision=precision, tensor_parallel=tensor_parallel)

    return costs


def paper_layout_times(
    costs: Callable[[int], CostTable], budget: float, device: DeviceSpec = A100_80G
) -> dict[str, float]:
    """Predicted seconds per sample of the paper's layout (PP 8 x DP 16, 1F1B, 16 micro-batches of 4 samples),
    planned by the exact DP and simulated, under each data-parallel layout whose simulated peak fits ``budget``."""
    import dataclasses

    from omnibal_compile.ir.costs import DATA_PARALLEL_LAYOUTS
    from omnibal_compile.planning import problem_from_costs
    from omnibal_compile.planning.build import plan_from_solution
    from omnibal_compile.planning.dp import solve_dp
    from omnibal_compile.planning.layout import Layout
    from omnibal_compile.sim import simulate

    out = {}
    for kind in DATA_PARALLEL_LAYOUTS:
        lay = Layout(pp=8, data_parallel=kind.resized(16), microbatch_size=4, num_microbatches=16)
        t = dataclasses.replace(costs(4), link_bandwidth=device.link_bandwidth("nvlink"),
                                dp_link_bandwidth=device.link_bandwidth("infiniband"))
        problem = problem_from_costs(
            t, num_stages=8, num_microbatches=16, budget=budget, data_parallel=lay.data_parallel
        )
        sim = simulate(plan_from_solution(solve_dp(problem), t, problem), t)
        if max(sim.peak_memory_bytes) <= budget:
            out[lay.describe()] = sim.iteration_time_s / PAPER_GLOBAL_BATCH
    return out
