"""Tensor parallelism at paper scale (SIMULATED): InternVL-Chat 6+20B, the planner's TP costs vs the analytic Megatron
rule, and the layout search over (dp, pp, tp) on 64 A100s.

    python bench/tp_paper_scale.py            # micro-batches of 1, 2 and 4 samples in the search
    python bench/tp_paper_scale.py --quick    # micro-batches of 4 samples only

Nothing here runs a model (``bench.studies.tp_paper_scale``): analytic block costs on the A100-80GB roofline,
the bundled length statistics re-tiled to InternVL-1.5's limits as ``bench/paper_scale.py`` assumes. Part 1: per
block type at tp = 2, 4, 8, one rank's costs of the study's micro-batch (4 mean samples) under the planner's rule
(``costs.tensor_parallel.tensor_parallel_table`` with the pass's facts derived from the model's shapes) and under
the analytic Megatron rule with sequence parallelism, and why they differ. Part 2: ``search_layout`` over pipeline
depth, data parallelism and tp (TP groups inside 8-GPU nodes) with those facts; the chosen layout and the best tp=1
layout with their predicted GPU-days of the paper's 1.2M samples, each tp's own best (the search with tp fixed) under
the planner's rule and under the analytic rule, next to OmniBal's Table 5 rows.
"""

from __future__ import annotations

import argparse
import sys as _sys
import time
from pathlib import Path as _Path

from omnibal_compile.costs.analytic import INTERNVL_6B_20B, MicroBatch
from omnibal_compile.costs.devices import A100_80G
from omnibal_compile.data.lengths import bundled_length_files, load_lengths
from omnibal_compile.planning.layout import SEARCHED_SCHEDULES

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # bench.studies lives in the checkout, not the wheel

from bench.studies.paper_layout import mean_sample
from bench.studies.paper_scale import PAPER_GPU_DAYS, retile_internvl15
from bench.studies.tp_paper_scale import (
    RULES,
    best_at_degree,
    compare_block_costs,
    format_comparison,
    format_search_verdict,
    tp_search,
)

SAMPLES = 1_200_000
"""Samples of the paper's data (InternVL-1.2's fine-tuning set, as bench/paper_scale.py)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="search micro-batches of 4 samples only")
    ap.add_argument("--devices", type=int, default=64, help="devices of the layout search (default 64)")
    ap.add_argument("--rows", type=int, default=12, help="candidate rows printed (default 12)")
    ap.add_argument("--schedules", nargs="+", default=list(SEARCHED_SCHEDULES),
                    help=f"schedules searched (default: {' '.join(SEARCHED_SCHEDULES)})")
    args = ap.parse_args(argv)
    model = INTERNVL_6B_20B
    files = bundled_length_files()
    stats = retile_internvl15(load_lengths(files))
    tiles, tokens, pairs = (4 * x for x in mean_sample(stats))
    shape = MicroBatch(tiles=round(tiles), tokens=round(tokens), attention_pairs=pairs)
    print(f"SIMULATED: {model.name}, analytic costs on the {A100_80G.name} roofline, collectives over NVLink "
          f"({A100_80G.link_bandwidth('nvlink') / 1e9:.0f} GB/s); data: {' + '.join(f.name for f in files)}"
          " re-tiled to InternVL-1.5's limits (<= 12 crops + thumbnail, <= 4096 tokens) as bench/paper_scale.py "
          "assumes\n")
    print(f"== tensor-parallel costs per rank, one micro-batch of 4 mean samples ({shape.tiles} tiles, {shape.tokens} "
          "LLM tokens), per block of each type (SIMULATED)")
    print("planner: tensor_parallel_table (Megatron pairs, all-reduces, no sequence parallelism), facts from the "
          "model's shapes; analytic: Megatron with sequence parallelism (the paper-scale study's rule)")
    print(format_comparison(compare_block_costs(model, shape)))
    print()
    sizes = (4,) if args.quick else (1, 2, 4)
    print(f"== layout search over (dp, pp, tp): {args.devices} A100s in nodes of 8, micro-batches of {sizes} mean "
          "samples (SIMULATED)")
    start = time.perf_counter()
    result = tp_search(model, stats, devices=args.devices, microbatch_sizes=sizes, schedules=args.schedules)
    print(result.summary(limit=args.rows))
    print(f"search time: {time.perf_counter() - start:.1f} s wall\n")
    start = time.perf_counter()
    fixed = {rule: {tp: best_at_degree(model, stats, tp, rule=rule, devices=args.devices, microbatch_sizes=sizes,
                                       schedules=args.schedules) for tp in (2, 4, 8)} for rule in RULES}
    print(f"each tp's own best: the same search with tp fixed (its layouts pruned against that tp's best only), under "
          f"the planner's rule and, for contrast, the analytic Megatron rule with sequence parallelism "
          f"(cost_table(tensor_parallel=tp)); {time.perf_counter() - start:.1f} s wall")
    print(format_search_verdict(result, SAMPLES, PAPER_GPU_DAYS[model.name], fixed["planner"], fixed["analytic"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
