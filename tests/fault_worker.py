"""The real rank worker with a fault planted, for tests: ``launch(config, _worker="fault_worker")``.

``_OMNIBAL_TEST_FAULT="<rank>:<step>:<how>"`` makes that rank, in that step (counted from the run's
first), ``stop`` (SIGSTOP itself: frozen, not dead), ``kill`` (SIGKILL itself), ``raise`` an error,
``hang`` (sleep an hour) or ``exit0`` (``os._exit(0)``: gone without a word). The fault fires in the
optimizer's ``zero_grad``, the first thing a step does after its barrier, so the other ranks meet it
inside the pipeline's exchanges. The ranks need ``tests/`` on ``PYTHONPATH``.

``_OMNIBAL_TEST_KILL_IN_SAVE="<rank>:<step>"`` makes that rank die right after writing its part of
that step's checkpoint, before the save completes (a kill in the middle of a save).

``_OMNIBAL_TEST_INF_GRAD="<rank>:<step>"`` (fp16 runs) puts an inf into that rank's first local gradient in that
step (counted from the run's first) just before ``LossScaler.unscale``: the other ranks' gradients stay finite.
``_OMNIBAL_TEST_SCALER_LOG=DIR`` makes every rank append each step's ``LossScaler.update`` to
``DIR/scaler-rank<R>.jsonl``: ``{"skipped": ..., "scale": <the scale after it>, "params": <sha256 of that rank's
parameters after the step>}``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from omnibal_compile.runtime import recipe, worker

FAULT_ENV = "_OMNIBAL_TEST_FAULT"
KILL_IN_SAVE_ENV = "_OMNIBAL_TEST_KILL_IN_SAVE"
INF_GRAD_ENV = "_OMNIBAL_TEST_INF_GRAD"
SCALER_LOG_ENV = "_OMNIBAL_TEST_SCALER_LOG"


def _fire(how: str, rank: int, step: int) -> None:
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "raise":
        raise RuntimeError(f"planted fault in rank {rank} at step {step}")
    elif how == "hang":
        time.sleep(3600)
    elif how == "exit0":
        os._exit(0)


def _plant(spec: str) -> None:
    where, _, how = spec.rpartition(":")
    rank, step = (int(x) for x in where.split(":"))
    if int(os.environ["RANK"]) != rank:
        return
    for name, make in list(recipe.OPTIMIZERS.items()):
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

        recipe.OPTIMIZERS[name] = planted


def _plant_kill_in_save(spec: str) -> None:
    rank, step = (int(x) for x in spec.split(":"))
    if int(os.environ["RANK"]) != rank:
        return
    from omnibal_compile.runtime import checkpoint

    real = checkpoint.dcp

    class _DieAfterWriting:  # torch.distributed.checkpoint, but this rank dies once its part is written
        def __getattr__(self, name):
            return getattr(real, name)

        def save(self, *args, checkpoint_id, **kwargs):
            out = real.save(*args, checkpoint_id=checkpoint_id, **kwargs)
            if str(checkpoint_id).endswith(f"step-{step:06d}"):
                os._exit(17)
            return out

    checkpoint.dcp = _DieAfterWriting()


def _plant_scaler(inf_grad: str | None, log_dir: str | None) -> None:
    import hashlib
    import json

    import torch

    from omnibal_compile.runtime import precision

    rank = int(os.environ["RANK"])
    where = tuple(int(x) for x in inf_grad.split(":")) if inf_grad else None
    unscale, update, calls = precision.LossScaler.unscale, precision.LossScaler.update, [0]
    seen: list[list[torch.nn.Parameter]] = []

    def planted_unscale(self, params, device):
        params = list(params)
        seen[:] = [params]
        if where == (rank, calls[0]):
            grad = next(p.grad for p in params if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        calls[0] += 1
        return unscale(self, params, device)

    def logged_update(self, skipped):
        update(self, skipped)
        if log_dir:  # after the optimizer step (or its skip): this rank's parameters as they now are
            digest = hashlib.sha256()
            for p in seen[0]:
                digest.update((p.to_local() if hasattr(p, "to_local") else p).detach().cpu().numpy().tobytes())
            with open(os.path.join(log_dir, f"scaler-rank{rank}.jsonl"), "a") as f:
                line = {"skipped": bool(skipped), "scale": self.scale, "params": digest.hexdigest()}
                f.write(json.dumps(line) + "\n")

    precision.LossScaler.unscale = planted_unscale
    precision.LossScaler.update = logged_update


if __name__ == "__main__":
    if os.environ.get(INF_GRAD_ENV) or os.environ.get(SCALER_LOG_ENV):
        _plant_scaler(os.environ.get(INF_GRAD_ENV), os.environ.get(SCALER_LOG_ENV))
    if os.environ.get(FAULT_ENV):
        _plant(os.environ[FAULT_ENV])
    if os.environ.get(KILL_IN_SAVE_ENV):
        _plant_kill_in_save(os.environ[KILL_IN_SAVE_ENV])
    sys.exit(worker.main())
