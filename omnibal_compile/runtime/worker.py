"""Entry point of each rank: ``python -m omnibal_compile.runtime.worker CONFIG.json``.

Started by :func:`omnibal_compile.runtime.launch.launch` (which hosts the process group's store and
sets ``OMNIBAL_STORE``), or by torchrun (``env://``). Every collective waits at most
``RunConfig.collective_timeout`` seconds; an exception ending the rank is written to its error file
and SIGUSR1 prints its Python stack (see :mod:`omnibal_compile.runtime.processes`).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from omnibal_compile.runtime.processes import STACK_SIGNAL, write_error_file

STORE_ENV = "OMNIBAL_STORE"
"""``host:port`` of the TCP store the launcher hosts for the ranks' process group."""


def init_process_group(config: Any) -> None:
    """Join the default process group with ``config.collective_timeout`` on every collective."""
    import torch.distributed as dist

    backend = "nccl" if config.device == "cuda" else "gloo"
    timeout = timedelta(seconds=config.collective_timeout)
    store = os.environ.get(STORE_ENV)
    if not store:
        dist.init_process_group(backend, timeout=timeout)  # torchrun: env://
        return
    host, _, port = store.rpartition(":")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=client, rank=rank, world_size=world, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(STACK_SIGNAL, all_threads=True)  # first, so a rank stuck anywhere can say where
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omnibal_compile.runtime.worker CONFIG.json (started by omnibal-compile run)", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("omnibal_compile.runtime.worker must be started by the launcher or torchrun (RANK is not set)", file=sys.stderr)
        return 2
    try:
        import torch.distributed as dist

        from omnibal_compile.runtime.settings import RunConfig

        from omnibal_compile.runtime.train import train

        config = RunConfig.from_json(Path(args[0]).read_text())
        init_process_group(config)
        train(config)
        # On success only (after a failure it may wait on the others): every rank past its last
        # collective and the stages' DDP/FSDP state freed before the groups go, then out without the
        # interpreter's teardown, where a gloo thread still joinable aborted a finished DDP rank
        # ("terminate called without an active exception", SIGABRT; seen once in a README run).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        _exit_now(0)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        write_error_file(e)
        _exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        write_error_file(e)
        traceback.print_exc()
        _exit_now(1)
    return 0


def _exit_now(code: int) -> None:
    """Exit without tearing down the process group, which can wait on the other ranks after a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
