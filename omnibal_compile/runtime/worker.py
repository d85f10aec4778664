"""Entry point of each rank under torchrun: ``python -m omnibal_compile.runtime.worker CONFIG.json``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from omnibal_compile.runtime.launch import RunConfig, train


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omnibal_compile.runtime.worker CONFIG.json (started by torchrun)", file=sys.stderr)
        return 2
    config = RunConfig.from_json(Path(args[0]).read_text())
    if "RANK" not in os.environ:
        print("omnibal_compile.runtime.worker must be started by torchrun (RANK is not set)", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo")
    try:
        train(config)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
