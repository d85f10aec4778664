"""``omnibal-compile export CKPT OUT``: a saved checkpoint's model as a Hugging Face folder (``from_pretrained``)."""

from __future__ import annotations

import argparse

NAME = "export"
HELP = ("write a checkpoint's model (a step folder, or the newest under a --save folder) as a Hugging Face folder: "
        "config, safetensors, the processor and tokenizer files")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a step folder written by --save, or a --save folder (its newest)")
    p.add_argument("out", metavar="OUT", help="the folder to write (new, or an earlier export, which is replaced)")
    p.add_argument("--model", metavar="MODEL", default=None,
                   help="the model spec to build (default: the run's, saved in the checkpoint's meta.json)")
    p.add_argument("--processor", metavar="DIR", default=None,
                   help="copy processor/tokenizer files from here (default: the run's --processor, else the model "
                        "folder of an hf: spec)")


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.runtime.export import export_hf

    out = export_hf(args.checkpoint, args.out, model=args.model, processor=args.processor)
    print(f"exported {args.checkpoint} to {out}")
    return 0
