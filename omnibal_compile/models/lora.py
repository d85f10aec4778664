"""LoRA adapters through peft: ``lora="r=16,alpha=32,targets=q_proj,v_proj"`` (``--lora ...``) trains them only.

Glossary:
    adapted model  the model itself with peft's LoRA layers injected in place (``inject_adapter_in_model``):
                   each target ``nn.Linear`` becomes a ``lora.Linear`` holding the original as
                   ``base_layer`` and the adapter as ``lora_A.default`` / ``lora_B.default``. It is not
                   wrapped in a ``PeftModel``, so its class, ``forward``, ``config`` and every module path
                   outside the targets stay those of the base model: the blocks of a plan made on the
                   base model (module paths of layers and modules) are the blocks of the adapted one.
    trained        the adapters only: every other parameter gets ``requires_grad=False`` (then
                   ``--freeze`` may freeze adapters too). The adapters start as peft starts them
                   (``lora_B`` zero: the adapted model computes what the base model does), seeded.
    parameter names  a target's weight ``...q_proj.weight`` is ``...q_proj.base_layer.weight``; its
                   adapter ``...q_proj.lora_A.default.weight`` and ``...q_proj.lora_B.default.weight``.
                   Checkpoints hold these names; :func:`peft_model` wraps an adapted model in a
                   ``PeftModel`` whose ``save_pretrained`` writes ``adapter_config.json`` and
                   ``adapter_model.safetensors`` (what ``PeftModel.from_pretrained(base, DIR)`` loads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnibal_compile.config import LoraSpec, lora_spec
from omnibal_compile.errors import InputError

__all__ = ["LoraSpec", "lora_spec", "apply_lora", "lora_config", "peft_model", "lora_names"]


def _peft() -> Any:
    try:
        import peft
    except ModuleNotFoundError:
        raise InputError("--lora trains LoRA adapters with peft, which is not installed: pip install peft") from None
    return peft


def lora_config(spec: LoraSpec) -> Any:
    """peft's ``LoraConfig`` of ``spec``."""
    return _peft().LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                              target_modules=list(spec.targets), bias="none")


def lora_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the adapter parameters of ``model`` (``...lora_A.default.weight``), in order."""
    return tuple(n for n, _ in model.named_parameters() if ".lora_" in n)


def apply_lora(model: nn.Module, spec: LoraSpec | str, *, seed: int = 0) -> nn.Module:
    """Inject ``spec``'s adapters into ``model`` in place (see the glossary) and freeze every other parameter;
    returns ``model``. The adapters' random start is drawn from ``seed`` (the global RNG is left as it was), so
    every rank builds the same ones. A target naming no linear module is an InputError naming some module names."""
    parsed = lora_spec(spec)
    if parsed is None:
        return model
    spec = parsed
    peft = _peft()
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for target in spec.targets:
        if not any(n == target or n.endswith("." + target) for n in linear):
            shown = sorted({n.rsplit(".", 1)[-1] for n in linear})[:12]
            raise InputError(f"lora (--lora): target {target!r} names no linear module of {type(model).__name__}; "
                             f"its linear modules end in: {', '.join(shown) or '(none)'}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            adapted = peft.inject_adapter_in_model(lora_config(spec), model)
        except ValueError as e:  # peft's own refusals (a target of a kind it cannot adapt)
            raise InputError(f"lora (--lora) {spec}: peft cannot adapt {type(model).__name__}: {e}") from None
    for name, p in adapted.named_parameters():
        p.requires_grad_(".lora_" in name)
    return adapted


def peft_model(base: nn.Module, spec: LoraSpec, *, seed: int = 0) -> Any:
    """``base`` (a freshly built base model) as a ``PeftModel`` with ``spec``'s adapters (``get_peft_model``; the
    global RNG is left as it was). Its inner model (``.base_model.model``) has the parameter names of
    :func:`apply_lora`'s adapted model, so a checkpoint of a LoRA run loads into it; its ``save_pretrained`` writes
    the adapter files."""
    peft = _peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(base, lora_config(spec))
