"""Entry point of each rank: ``python -m omnibal_compile.runtime.worker CONFIG.json``, under torchrun's agent.

Started by :func:`omnibal_compile.runtime.launch.launch` (torch's elastic agent, see
:mod:`omnibal_compile.runtime.processes`) or by ``torchrun`` itself, on one node or many: it joins the
process group from torchrun's environment (``env://``). Every collective waits at most
``RunConfig.collective_timeout`` seconds; an exception ending the rank is written to its error file
(``TORCHELASTIC_ERROR_FILE``, by torch's ``@record``) and SIGUSR1 prints its Python stack.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from omnibal_compile.runtime.processes import (
    STACK_SIGNAL,
    die_with_parent,
    end_process_group,
    exit_now,
    mark_finished,
)


def init_process_group(config: Any) -> None:
    """Join the default process group (``env://``) with ``config.collective_timeout`` on every collective."""
    import torch.distributed as dist

    backend = "nccl" if config.device == "cuda" else "gloo"
    if backend == "nccl":  # one GPU per rank, by its rank on the node (not the global rank: several nodes)
        import torch

        from omnibal_compile.runtime.settings import local_device

        torch.cuda.set_device(local_device(os.environ))
    dist.init_process_group(backend, timeout=timedelta(seconds=config.collective_timeout))


def run(config_path: str) -> None:
    """Train the run ``config_path`` describes as this rank (in torchrun's environment)."""
    from omnibal_compile.runtime.settings import RunConfig
    from omnibal_compile.runtime.train import train

    config = RunConfig.from_json(Path(config_path).read_text())
    init_process_group(config)
    train(config)
    end_process_group()  # on success only; main then leaves with exit_now
    mark_finished()


def main(argv: list[str] | None = None) -> int:
    """The rank's main: :func:`run` under torch's ``@record``, then out at once (no interpreter teardown)."""
    faulthandler.register(STACK_SIGNAL, all_threads=True)  # first, so a rank stuck anywhere can say where
    # and where it was when the agent ends it (another rank failed, e.g. timed out waiting for this one); the
    # default action (termination) follows
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omnibal_compile.runtime.worker CONFIG.json "
              "(started by omnibal-compile run or torchrun)", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("omnibal_compile.runtime.worker must be started by omnibal-compile run or torchrun (RANK is not set)",
              file=sys.stderr)
        return 2
    try:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(run)(args[0])  # an exception: written to $TORCHELASTIC_ERROR_FILE, raised again
    except SystemExit as e:
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
