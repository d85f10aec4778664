"""The training recipe's rules: the learning rate of each step and which parameters get weight decay.

Glossary:
    lr schedule    ``lr_at(k)``, the learning rate of step k (from 0): warm-up ``lr x (k + 1) / W``
                   for k < W (``warmup_steps``), then ``constant`` lr, or ``linear`` / ``cosine``
                   decay from lr to ``min_lr`` by progress ``(k - W) / (steps - W)``, so the decay
                   ends one step past the last (the last step's lr is just above ``min_lr``, as in
                   Hugging Face's schedules). The training loop runs it through ``LambdaLR``; a
                   resumed run starts it at its first step (no scheduler state is saved).
    no decay       biases and norm weights (parameters of fewer than 2 dimensions) and embeddings
                   (a name part containing ``embed``, or GPT-2's ``wte`` / ``wpe``, of at most 3
                   dimensions: token and position tables): weight decay pulls them to zero for no
                   gain in regularisation. A patch embedding's convolution kernel (4-D) is a
                   projection like any other and decays. A tied parameter (several names) is an
                   embedding when any of its names is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from omnibal_compile.config import DEFAULT_STEPS, LR_SCHEDULES, OptimizerConfig
from omnibal_compile.errors import InputError

if TYPE_CHECKING:
    from omnibal_compile.runtime.pipeline import RankPipeline

__all__ = ["OPTIMIZERS", "build_optimizer", "lr_at", "lr_scheduler", "no_weight_decay", "weight_decay_groups"]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}
"""``optimizer`` setting -> ``(param groups, lr) -> optimizer`` (each group carries its weight decay)."""


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, steps: int = 1,
          min_lr: float = 0.0) -> float:
    """The learning rate of step ``step`` (from 0) of a run of ``steps`` steps (module glossary)."""
    if schedule not in LR_SCHEDULES:
        raise InputError(f"lr_schedule (--lr-schedule) must be one of {list(LR_SCHEDULES)}, got {schedule!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    left = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * left


_EMBEDDING = re.compile(r"(^|\.)(\w*embed\w*|wte|wpe)(\.|$)")


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Whether parameter ``name`` gets no weight decay: a bias, a norm weight or an embedding (module glossary)."""
    return param.dim() < 2 or (param.dim() <= 3 and bool(_EMBEDDING.search(name)))


def weight_decay_groups(named: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups: ``[decayed, not decayed]`` (:func:`no_weight_decay`), each parameter once.

    ``named`` may give a parameter under several names (tied weights); it is not decayed when any
    of them says so. Both groups are always there (maybe empty), so a checkpoint's groups line up
    with any run's whatever ``weight_decay`` is.
    """
    params: dict[int, torch.Tensor] = {}
    skip: dict[int, bool] = {}
    for name, p in named:
        params.setdefault(id(p), p)
        skip[id(p)] = skip.get(id(p), False) or no_weight_decay(name, p)
    return [
        {"params": [p for k, p in params.items() if not skip[k]], "weight_decay": weight_decay},
        {"params": [p for k, p in params.items() if skip[k]], "weight_decay": 0.0},
    ]


def build_optimizer(config: OptimizerConfig, pipeline: RankPipeline) -> torch.optim.Optimizer:
    """The optimizer of this rank's trainable parameters in :func:`weight_decay_groups` (frozen ones are not in it,
    so they get no state)."""
    trainable = {id(p) for p in pipeline.parameters()}
    named = ((n, t) for n, t in pipeline.state.items() if id(t) in trainable)
    return OPTIMIZERS[config.optimizer](weight_decay_groups(named, config.weight_decay), config.lr)


def lr_scheduler(config: OptimizerConfig, optimizer: torch.optim.Optimizer,
                 first_step: int = 0, *, steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` running :func:`lr_at`, set to step ``first_step`` (a resumed run's): the learning rate is a
    function of the step alone, so a resumed run recomputes it, with its own ``steps``. ``steps``: the run's
    steps in all (``batches.run_steps``; default ``config.steps``, else ``DEFAULT_STEPS``)."""
    total = steps if steps is not None else config.steps if config.steps is not None else DEFAULT_STEPS

    def factor(step: int) -> float:
        return lr_at(step, lr=config.lr, schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
                     steps=total, min_lr=config.min_lr) / config.lr

    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr  # what LambdaLR scales; it needs it given to start past step 0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=first_step - 1)
