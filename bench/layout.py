"""Layout search at paper scale (SIMULATED): InternVL-Chat 6+20B on 64, 128 and 256 A100s.

    python bench/layout.py                 # 64, 128 and 256 devices, micro-batches of 1, 2, 4 and 8 samples
    python bench/layout.py --quick         # micro-batches of 1 and 4 samples
    python bench/layout.py --devices 128 --rows 40

Nothing here runs a model: block costs are analytic (``omnibal_compile.costs.analytic``) on the
A100-80GB roofline for micro-batches of b mean samples of the bundled length statistics
(``bench.studies.paper_layout``). For each device count, ``omnibal_compile.planning.layout.search_layout``
lists every layout (pipeline depth PP x data parallelism DP, 1F1B or interleaved with 2 chunks,
FSDP / FSDP kept gathered / DDP, micro-batch size), plans the promising ones and simulates them;
stages talk over NVLink inside 8-GPU nodes and replicas over InfiniBand across them. Global batch
1024 samples, 90% of 80 GB per GPU, bf16 + fp32 Adam (16 B/parameter before sharding). The paper's
layout (PP 8 x DP 16, 1F1B, 16 micro-batches of ~4 samples) is planned and simulated the same way
for comparison, as is the best layout with the paper's micro-batch size kept. Micro-batches are
costed at b mean samples: the spread of real packs around the mean (larger for packs of few samples,
which the data balancer can even out less) is not modelled, so small micro-batches look better here
than they may be. Each search prints its wall time and the CPU time of this process (the wall time
is noisy on a shared machine; the target is under 30 s for 256 devices).
"""

from __future__ import annotations

import argparse
import sys as _sys
import time
from pathlib import Path as _Path

from omnibal_compile.costs.analytic import INTERNVL_6B_20B
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.planning.layout import search_layout

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # bench.studies lives in the checkout, not the wheel

from bench.studies.paper_layout import PAPER_BUDGET_FRACTION, PAPER_GLOBAL_BATCH, paper_layout_times, sample_costs


def paper_layout(costs, budget: float) -> tuple[float, str]:
    """Best predicted seconds per sample of PP 8 x DP 16, 1F1B, M 16 x b 4 over the data-parallel layouts, and which."""
    times = paper_layout_times(costs, budget)
    return min(((t, how) for how, t in times.items()), default=(float("inf"), "none fits"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 128, 256], help="device counts (default 64 128 256)")
    ap.add_argument("--quick", action="store_true", help="micro-batches of 1 and 4 samples only")
    ap.add_argument("--rows", type=int, default=12, help="candidate rows printed per search (default 12)")
    args = ap.parse_args()
    costs = sample_costs(INTERNVL_6B_20B, device=A100_80G)
    budget = PAPER_BUDGET_FRACTION * A100_80G.memory_bytes
    sizes = (1, 4) if args.quick else (1, 2, 4, 8)
    print(f"SIMULATED: {INTERNVL_6B_20B.name} on A100-80GB roofline costs, global batch {PAPER_GLOBAL_BATCH} samples, "
          f"budget {budget / 1e9:.0f} GB per GPU, micro-batches of {sizes} samples\n")
    for n in args.devices:
        wall, cpu = time.perf_counter(), time.process_time()
        result = search_layout(costs, devices=n, global_batch=PAPER_GLOBAL_BATCH, memory_budget=budget,
                               microbatch_sizes=sizes, device=A100_80G)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(result.summary(limit=args.rows))
        print(f"search time: {wall:.1f} s wall, {cpu:.1f} s CPU ({n} devices)")
        if n == 128:
            paper, how = paper_layout(costs, budget)
            best = result.best.time_per_unit_s
            print(f"the paper's layout, planned and simulated the same way: {how}: {paper * 1e3:.3f} ms per sample; "
                  f"the chosen layout takes {best / paper:.3f}x its time per sample")
            four = search_layout(costs, devices=n, global_batch=PAPER_GLOBAL_BATCH, memory_budget=budget,
                                 microbatch_sizes=(4,), device=A100_80G).best
            print(
                f"with the paper's micro-batches of 4 samples kept: {four.layout.describe()}: "
                f"{four.time_per_unit_s * 1e3:.3f} ms per sample, {four.time_per_unit_s / paper:.3f}x the paper's "
                "layout"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
