"""``omnibal-compile demo``: the whole flow on the built-in tiny VLM, on CPU."""

from __future__ import annotations

import argparse
import time

NAME = "demo"
HELP = "cut the built-in tiny VLM into pipeline stages and check they reproduce it (CPU, ~10 s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--planner", default="parameters", help="uniform | parameters (default parameters)")
    p.add_argument("--batch", type=int, default=2, help="samples in the example batch (default 2)")
    p.add_argument("--tiles", type=int, default=2, help="image tiles per sample (default 2)")
    p.add_argument("--text", type=int, default=32, help="text tokens per sample (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    p.add_argument("--show-code", type=int, metavar="STAGE", default=None, help="print the generated code of a stage")
    p.add_argument("--save-plan", metavar="PATH", default=None, help="write the plan as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    import omnibal_compile as oc
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

    torch.manual_seed(args.seed)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    batch = make_example_batch(cfg, batch=args.batch, tiles_per_sample=args.tiles, text_tokens=args.text, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyVLM: {cfg.vit_layers} ViT layers (width {cfg.vit_hidden}) + {cfg.llm_layers} LLM layers "
        f"(width {cfg.llm_hidden}), {n_params:,} parameters"
    )
    print(
        f"batch: {batch['pixel_values'].shape[0]} tiles, input_ids {tuple(batch['input_ids'].shape)} "
        f"({cfg.tokens_per_tile} image tokens per tile)\n"
    )
    t0 = time.perf_counter()
    result = oc.optimize(model, batch, num_stages=args.stages, planner=args.planner)
    print(result.summary())
    print()
    for s in range(len(result.stages)):
        info = result.stage_info(s)
        print(f"stage {s}: {len(info.input_names)} inputs -> {len(info.output_names)} outputs, sends {list(info.output_names)}")
    report = result.check_parity(batch)
    print(f"\n{report}")
    passes = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    print(f"passes: {passes}; total {time.perf_counter() - t0:.1f}s")
    if args.show_code is not None:
        if not 0 <= args.show_code < len(result.stages):
            raise oc.InputError(f"--show-code must be a stage index in [0, {len(result.stages)})")
        print(result.stages[args.show_code].code)
    if args.save_plan:
        with open(args.save_plan, "w") as f:
            f.write(result.plan.to_json())
        print(f"plan written to {args.save_plan}")
    return 0 if report.ok else 1
