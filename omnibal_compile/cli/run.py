"""``omnibal-compile run``: train from a saved plan on N local processes (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import argparse
import json

from omnibal_compile._utils.validate import MAX_SEED, int_option, number_option
from omnibal_compile.ir.schedule import SCHEDULE_KINDS

NAME = "run"
HELP = "train a model from a saved plan on local ranks (dp pipelines x plan devices)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan JSON (Plan.to_json, or `omnibal-compile demo --save-plan`)")
    p.add_argument("--model", default="tinyvlm",
                   help="tinyvlm (default), hf:ClassName:config.json, or package.module:factory returning a model or "
                        "(model, example_batch), as for `omnibal-compile plan`")
    p.add_argument("--model-config", default="{}", metavar="JSON", help="TinyVLMConfig fields or factory kwargs, as JSON")
    p.add_argument("--data", default=None, metavar="MODULE:FN", help="fn(step, *, batch_size, seed) -> batch")
    p.add_argument("--batch-size", type=int_option(min=1), default=8,
                   help="rows per step over all dp ranks (default 8); with --lengths, packs per step")
    p.add_argument("--lengths", nargs="+", default=(), metavar="FILE",
                   help="length statistics (OmniBal JSON, JSONL, CSV): train on balanced packs of their lengths")
    # --batching and --dp-shard are checked before launch (runtime.launch.precheck), which keeps
    # this parser free of the torch.distributed import.
    p.add_argument("--batching", default="balanced",
                   help="with --lengths: balanced packs per dp rank (default), or random padded samples (baseline)")
    p.add_argument("--samples-per-pack", type=number_option(min=1), default=4.0,
                   help="with --lengths: mean samples per pack")
    p.add_argument("--tiles", type=int_option(min=0), default=1,
                   help="built-in batches: image tiles per sample (default 1)")
    p.add_argument("--text", type=int_option(min=2), default=32,
                   help="built-in batches: text tokens per sample (default 32)")
    p.add_argument("--steps", type=int_option(min=1), default=5, help="training steps (default 5)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="default adamw")
    p.add_argument("--lr", type=number_option(above=0), default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seed", type=int_option(min=0, max=MAX_SEED), default=0,
                   help="seed of weights and built-in batches")
    p.add_argument("--nproc", type=int_option(min=1), default=None,
                   help="processes (default: dp x the plan's pipeline ranks)")
    p.add_argument("--dp", type=int_option(min=1), default=None,
                   help="data-parallel pipelines (default: the plan's, 1 unless planned with --dp); world = dp x plan devices")
    p.add_argument("--dp-shard", default=None,
                   help="with --dp > 1: fsdp (FSDP2 fully_shard) or ddp (replicate); default: the plan's, else fsdp")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP2: keep gathered parameters from forward to backward (more memory, fewer all-gathers)")
    p.add_argument("--schedule", default=None, choices=SCHEDULE_KINDS, help="override the plan's")
    p.add_argument("--microbatches", type=int_option(min=1), default=None, help="override the plan's micro-batch count")
    p.add_argument("--virtual-stages", type=int_option(min=1), default=None, help="override the plan's stages per rank")
    p.add_argument("--no-recompute", action="store_true", help="ignore the plan's recompute options")
    p.add_argument(
        "--loss-weighting", default="tokens", choices=["tokens", "rows"],
        help="the model's loss is a mean over labelled tokens (default) or over rows",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--threads", type=int_option(min=1), default=1, help="torch threads per rank (default 1)")
    p.add_argument("--save", default=None, metavar="DIR", help="write checkpoints (DIR/step-<K>) here, at the end")
    p.add_argument("--save-every", type=int_option(min=0), default=0, metavar="K", help="also save every K steps")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the newest complete checkpoint in DIR (--steps counts all steps)")
    p.add_argument("--warmup-steps", type=int_option(min=0), default=0,
                   help="linear learning-rate warm-up steps (default 0)")
    p.add_argument("--log", default=None, metavar="PATH", help="append per-step JSON lines here")
    p.add_argument("--timeout", type=number_option(above=0), default=None, metavar="SECONDS",
                   help="end every rank after this many seconds in all (default: no limit)")
    p.add_argument("--collective-timeout", type=number_option(above=0), default=600.0, metavar="SECONDS",
                   help="a rank waiting this long in one collective fails, so a frozen rank ends the run (default 600)")


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.errors import InputError
    from omnibal_compile.runtime.launch import launch
    from omnibal_compile.runtime.settings import RunConfig

    try:
        model_config = json.loads(args.model_config)
    except json.JSONDecodeError as e:
        raise InputError(f"--model-config is not valid JSON: {e}") from None
    config = RunConfig(
        plan=args.plan,
        model=args.model,
        model_config=model_config,
        data=args.data,
        lengths=tuple(str(x) for x in args.lengths),
        batching=args.batching,
        samples_per_pack=args.samples_per_pack,
        batch_size=args.batch_size,
        tiles_per_sample=args.tiles,
        text_tokens=args.text,
        steps=args.steps,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        nproc=args.nproc,
        dp=args.dp,
        dp_shard=args.dp_shard,
        reshard_after_forward=False if args.no_reshard_after_forward else None,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        recompute=not args.no_recompute,
        weighting=args.loss_weighting,
        device=args.device,
        threads=args.threads,
        save=args.save,
        save_every=args.save_every,
        resume=args.resume,
        warmup_steps=args.warmup_steps,
        log=args.log,
        collective_timeout=args.collective_timeout,
    )
    logs = launch(config, timeout_s=args.timeout)
    if logs:
        times = sorted(s.step_time_s for s in logs[1:]) or [logs[0].step_time_s]
        print(f"{len(logs)} steps: loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f}, median step {times[len(times) // 2] * 1e3:.1f} ms")
    if args.save:
        print(f"checkpoint written to {args.save}")
    return 0
