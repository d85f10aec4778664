"""Paper-scale ablation (SIMULATED): OmniBal's Table 5 steps for InternVL-Chat 6+20B and 6+34B on A100s.

    python bench/paper_scale.py                  # 1.2M samples, main table + sensitivity + 6+34B + LLaVA-1.5-13B
    python bench/paper_scale.py --quick          # 200k samples (same configurations)

Nothing here runs a model: block costs are analytic (``omnibal_compile.models.analytic``) on the
A100-80GB roofline of ``omnibal_compile.devices``, the data are the shared real length
statistics resampled with replacement, and every epoch time comes from the vectorised pipeline
replay of ``omnibal_compile.studies.paper_scale`` (per micro-batch costs, slowest data-parallel rank per
step). Ratios are printed next to the paper's Megatron-backend figures (61.8 -> 51.9 -> 29.0 ->
21.3 GPU-days for 6+20B; 75.4 -> 30.5 for 6+34B). See bench/RESULTS.md for why they differ.

Setting: bf16 with fp32 master weights and Adam moments (16 B/parameter, the fp32 part sharded
over DP by Megatron's distributed optimizer), global batch 1024 samples, ~4 samples per
micro-batch, 1F1B, 90% of 80 GB usable. Main: PP 8 x DP 16 = 128 GPUs (a pipeline fills one
8-GPU node, so stage-to-stage sends use NVLink; 26B parameters over 8 stages leave most of the
memory for activations, and M = 16 micro-batches per rank keep the bubble at 7/23). Sensitivity:
PP 4 and 16 at 128 GPUs, PP 8 at 64 and 256 GPUs (global batch fixed, so M changes with DP;
pipelines longer than a node send over InfiniBand).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from omnibal_compile.data import INTERNVL_TOKENS_PER_TILE, LengthStats, bundled_length_files, load_lengths
from omnibal_compile.models.analytic import INTERNVL_6B_20B, INTERNVL_6B_34B, LLAVA15_13B, VLMSpec, type_costs
from omnibal_compile.studies.paper_scale import (
    PAPER_GPU_DAYS,
    MicroBatches,
    Setup,
    format_ablation,
    make_batches,
    run_ablation,
)


def step_cost(model: VLMSpec):
    """Predicted forward + backward seconds of a pack, for the balancer's grouping of packs into steps."""
    types = model.block_types()
    counts = {t: types.count(t) for t in set(types)}

    def cost(tiles: np.ndarray, tokens: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        tc = type_costs(model, tiles, tokens, pairs)
        return sum(3 * tc.forward_s[t] * c for t, c in counts.items())

    return cost


def llava_lengths(stats: LengthStats) -> LengthStats:
    """InternVL-unit statistics (256 tokens per tile) as LLaVA-1.5 sees the samples: one 576-token image at most."""
    images = (stats.image_flags > 0).astype(np.int64)
    tokens = stats.tokens - INTERNVL_TOKENS_PER_TILE * stats.image_flags + 576 * images
    return LengthStats(tiles=images, tokens=np.maximum(tokens, 1), image_flags=images, source=f"{stats.source} as LLaVA-1.5")


def explain(setup: Setup, rows: list, batches: dict[str, MicroBatches], real_tokens: int) -> str:
    """Why each step's ratio differs from the paper's, with this run's figures."""
    paper = PAPER_GPU_DAYS[setup.model.name]
    chain = [r for r in rows if r.chain]
    r = [c.gpu_days for c in chain]
    vit_first = next(x for x in rows if x.plan is not None and x.plan.planner == "vit-first")
    mean = batches["balanced"].mean_shape()
    tc = type_costs(setup.model, mean.tiles, mean.tokens, mean.attention_pairs)
    vit_ms, llm_ms = tc.forward_s["vision.layer"][0] * 1e3, tc.forward_s["llm.layer"][0] * 1e3
    pad = batches["random"].tokens.sum() / real_tokens - 1
    best = chain[-1].plan.recompute
    counts = ", ".join(f"{best.count(o)} {o}" for o in ("none", "selective", "full"))
    return "\n".join([
        f"why the ratios differ from the paper's ({setup.model.name}, PP {setup.pp} x DP {setup.dp}):",
        f"- balanced data: ours x{r[1] / r[0]:.3f}, paper x{paper[1] / paper[0]:.3f}. Random micro-batches of "
        f"{setup.samples_per_microbatch} samples are padded to their longest sample (the LLM computes {pad:.0%} more "
        "tokens than the data hold) and DP ranks wait for the slowest; balanced packs remove both. Same size of effect.",
        f"- partition: ours x{r[2] / r[1]:.3f}, paper x{paper[2] / paper[1]:.3f}. Our baseline is the issue's uniform "
        "layer split, which counts ViT and LLM layers alike; at the mean balanced pack "
        f"({mean.tiles} tiles, {mean.tokens} tokens) an InternViT-6B layer takes {vit_ms:.1f} ms forward and an "
        f"InternLM2-20B layer {llm_ms:.1f} ms, so counting layers is already close to balancing time and little is "
        "left for the ILP. The paper does not state its baseline split; a layout such as Megatron's VLM default "
        f"(whole ViT on stage 0, row above) takes x{vit_first.gpu_days / r[1]:.2f} the time of the balanced-data row"
        + ("" if vit_first.fits else f" (and needs {vit_first.peak_memory_gib:.0f} GiB, over the budget)")
        + ": against a baseline like that a partitioner gains as much as the paper reports, or more.",
        f"- recomputation: ours x{r[3] / r[2]:.3f}, paper x{paper[3] / paper[2]:.3f}: close. Full recomputation reruns "
        f"every forward (4/3 of a step without it); the ILP keeps what memory allows ({counts} blocks).",
        f"- overall: ours x{r[3] / r[0]:.3f}, paper x{paper[3] / paper[0]:.3f}; the gap is the partition step above.",
        f"- absolute GPU-days (ours {r[0]:.1f} for the baseline, paper {paper[0]:g}) are not comparable: the roofline "
        "at 70% of peak for matmuls and 50% for attention, with no gradient all-reduce, optimizer step or data "
        "loading, is optimistic, and the paper's batch size and micro-batching are not given; only ratios are compared.",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_200_000, help="samples per epoch, drawn from the shared statistics")
    ap.add_argument("--quick", action="store_true", help="200k samples instead of 1.2M")
    ap.add_argument("--ilp-time-limit", type=float, default=5.0, help="seconds per ILP solve (warm-started at the DP optimum)")
    ap.add_argument("--no-sensitivity", action="store_true", help="main configurations only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    files = bundled_length_files()
    start = time.perf_counter()
    n = 200_000 if args.quick else args.samples
    stats = load_lengths(files).resample(n, seed=args.seed)
    print(f"SIMULATED on analytic A100-80GB roofline costs; data: {n} samples drawn with replacement from "
          f"{', '.join(f.name for f in files)}; mean {stats.tiles.mean():.2f} tiles, {stats.tokens.mean():.0f} tokens per sample")
    print("epoch = sum over steps of the slowest DP rank's 1F1B iteration, each micro-batch costed at its own shape\n")
    cache: dict[tuple[str, int, int], dict[str, MicroBatches]] = {}
    failures: list[str] = []

    def ablate(setup: Setup, *, paper: tuple[float, ...] = (), show: bool = True) -> list:
        key = (setup.model.name, setup.dp * setup.microbatches, setup.samples_per_microbatch)
        if key not in cache:
            cache[key] = make_batches(stats, per_step=key[1], samples_per_microbatch=key[2], cost=step_cost(setup.model),
                                      seed=args.seed)
        rows = run_ablation(setup, cache[key])
        chain = [r.gpu_days for r in rows if r.chain]
        monotone = all(b <= a * (1 + 1e-9) for a, b in zip(chain, chain[1:]))
        if show:
            print(format_ablation(setup, rows, paper))
            ilp = "; ".join(f"{r.plan.status} in {r.plan.solve_seconds:.1f} s" for r in rows
                            if r.plan is not None and r.plan.planner == "ilp")
            print(f"monotone: {'yes' if monotone else 'NO'}; ILP solves: {ilp}; elapsed {time.perf_counter() - start:.0f} s\n")
        if not monotone:
            failures.append(f"PP {setup.pp} x DP {setup.dp} {setup.model.name}: {[round(x, 3) for x in chain]}")
        return rows

    main_setup = Setup(model=INTERNVL_6B_20B, pp=8, dp=16, ilp_time_limit=args.ilp_time_limit)
    main_rows = ablate(main_setup, paper=PAPER_GPU_DAYS[INTERNVL_6B_20B.name])
    print(explain(main_setup, main_rows, cache[(INTERNVL_6B_20B.name, 256, 4)], int(stats.tokens.sum())) + "\n")
    if not args.no_sensitivity:
        print("sensitivity (6+20B; global batch 1024 fixed, so M = 256 / DP):")
        lines = [("PP x DP = GPUs", "M", "link", "baseline GPU-days", "+data", "+ILP", "+recompute", "OmniBal heur.+rec",
                  "full GPU-days")]
        for pp, dp in ((8, 16), (4, 32), (16, 8), (8, 8), (8, 32)):
            link = "nvlink" if pp <= 8 else "infiniband"
            setup = Setup(model=INTERNVL_6B_20B, pp=pp, dp=dp, link=link, ilp_time_limit=args.ilp_time_limit)
            rows = ablate(setup, show=False)
            base = rows[0].gpu_days
            chain = [r for r in rows if r.chain]
            heuristic = next(r for r in rows if "per-stage recompute" in r.name)
            lines.append((f"{pp} x {dp} = {pp * dp}", str(setup.microbatches), link, f"{base:.2f}",
                          *(f"{r.gpu_days / base:.3f}" for r in chain[1:]), f"{heuristic.gpu_days / base:.3f}",
                          f"{chain[-1].gpu_days:.2f}"))
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        for j, line in enumerate(lines):
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
            if j == 0:
                print("  ".join("-" * w for w in widths))
        print("(ratios to each configuration's own baseline)\n")
    ablate(Setup(model=INTERNVL_6B_34B, pp=8, dp=16, ilp_time_limit=args.ilp_time_limit),
           paper=PAPER_GPU_DAYS[INTERNVL_6B_34B.name])
    # Second family: one 336 px image = 576 tokens per sample with an image (no tiling), 24 small CLIP
    # layers before 40 Vicuna-13B layers, so counting layers is far from balancing time.
    print("LLaVA-1.5-13B (no paper figures; statistics converted to one 576-token image per sample with images):")
    stats = llava_lengths(stats)
    ablate(Setup(model=LLAVA15_13B, pp=4, dp=32, ilp_time_limit=args.ilp_time_limit))
    print(f"monotone in every configuration: {'yes' if not failures else 'NO: ' + '; '.join(failures)}")
    print(f"total {time.perf_counter() - start:.0f} s wall")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
