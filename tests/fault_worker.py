"""The real rank worker with a fault planted, for tests: ``launch(config, _worker="fault_worker")``.

``_OMNIBAL_TEST_FAULT="<rank>:<step>:<how>"`` makes that rank, in that step (counted from the run's
first), ``stop`` (SIGSTOP itself: frozen, not dead), ``kill`` (SIGKILL itself), ``raise`` an error or
``hang`` (sleep an hour). The fault fires in the optimizer's ``zero_grad``, the first thing a step
does after its barrier, so the other ranks meet it inside the pipeline's exchanges. The ranks need
``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from omnibal_compile.runtime import train, worker

FAULT_ENV = "_OMNIBAL_TEST_FAULT"


def _fire(how: str, rank: int, step: int) -> None:
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "raise":
        raise RuntimeError(f"planted fault in rank {rank} at step {step}")
    elif how == "hang":
        time.sleep(3600)


def _plant(spec: str) -> None:
    where, _, how = spec.rpartition(":")
    rank, step = (int(x) for x in where.split(":"))
    if int(os.environ["RANK"]) != rank:
        return
    for name, make in list(train.OPTIMIZERS.items()):
        def planted(params, lr, make=make):
            optimizer = make(params, lr)
            zero_grad, calls = optimizer.zero_grad, [0]

            def zero_grad_with_fault(*args, **kwargs):
                if calls[0] == step:
                    _fire(how, rank, step)
                calls[0] += 1
                return zero_grad(*args, **kwargs)

            optimizer.zero_grad = zero_grad_with_fault
            return optimizer

        train.OPTIMIZERS[name] = planted


if __name__ == "__main__":
    if os.environ.get(FAULT_ENV):
        _plant(os.environ[FAULT_ENV])
    sys.exit(worker.main())
