"""Seeded weights that do not depend on which process makes them: each tensor's random init is seeded by its name.

Glossary:
    seeded spec    a model spec without weights on disk whose weights are its random init: ``tiny-vlm`` and
                   ``hf:ClassName:config.json`` (:mod:`omnibal_compile.models.load`). Factories are not: a factory may
                   set values of its own after building (its own init, weights it loads), which no rebuild of its
                   modules reproduces, so a factory's model is what the factory returns.
    per-name init  the model is built with its parameters on meta (:func:`params_on_meta`), then each parameter is
                   made (empty) and filled by its module's own init: ``reset_parameters`` for torch modules, the Hugging
                   Face model's ``_init_weights`` (dispatched per sub-model as ``initialize_weights`` does) for HF ones,
                   in HF's order (children before parents, a parent's init may overwrite its children's). Before each
                   random op on a parameter the CPU generator is seeded from (run seed, the parameter's name), so a
                   parameter's values are the same whether a process makes the whole model or one stage of it, and
                   the unsplit model (:func:`seeded_model`) has the values every rank's stages have. A tied parameter
                   is one tensor: it is initialised by the first module holding it (a tied head's own init is
                   skipped), under its first name. ``.base_layer.`` (a LoRA-wrapped layer) is left out of names, so an
                   adapted model's base weights are the plain model's.
    canonical name a parameter's first name in ``named_parameters`` order (tied ones share it), ``.base_layer.``
                   removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from omnibal_compile.errors import InputError

__all__ = ["params_on_meta", "seeded_init", "seeded_model", "materialise_seeded"]

_RANDOM_OPS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
                         "log_normal_"})
"""The in-place random ops of aten (what ``nn.init`` and HF's init functions end in)."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside is put on meta (as ``accelerate.init_empty_weights`` does); buffers stay
    real, so non-persistent ones (rotary tables, position ids) keep the values their constructors compute."""
    register = nn.Module.register_parameter

    def on_meta_register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta_register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id of each parameter of ``model`` -> its canonical name (module glossary)."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name.replace(".base_layer.", "."))
    return out


class _ReseedPerTensor(TorchDispatchMode):
    """Seeds the CPU generator from (seed, the tensor's name) before each random op on a tensor being made; ops on
    temporaries draw on from the last seed set (the module's, :func:`seeded_init`)."""

    def __init__(self, seed: int, names: dict[int, str]) -> None:
        super().__init__()
        self.seed, self.names = seed, names  # storage data pointer -> canonical name

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in _RANDOM_OPS and args and isinstance(args[0], torch.Tensor) \
                and not args[0].is_meta:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                torch.default_generator.manual_seed(_name_seed(self.seed, name))
        return func(*args, **(kwargs or {}))


def _hf_init(model: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """id of each module -> the ``_init_weights`` of its nearest Hugging Face model, itself or an ancestor (as
    ``PreTrainedModel.initialize_weights`` dispatches it); empty for a model without one."""
    if "transformers" not in sys.modules:  # no Hugging Face model was built (and importing it takes seconds)
        return {}
    from transformers import PreTrainedModel

    out: dict[int, Callable[[nn.Module], None]] = {}

    def walk(module: nn.Module, init: Callable[[nn.Module], None] | None) -> None:
        if isinstance(module, PreTrainedModel):
            init = module._init_weights
        if init is not None:
            out[id(module)] = init
        for child in module.children():
            walk(child, init)

    walk(model, None)
    return out


def _hf_guard() -> contextlib.AbstractContextManager[Any]:
    if "transformers" not in sys.modules:
        return contextlib.nullcontext()
    from transformers import initialization

    return initialization.guard_torch_init_functions()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, only: set[int] | None = None) -> int:
    """Fill the real parameters of ``model`` whose ids are in ``only`` (None: every real one) by the per-name init
    (module glossary), in place; modules holding none of them are not run, and an init's writes to meta tensors
    compute nothing. Returns how many module inits ran. A module holding such a parameter that has no init of its
    own (no ``reset_parameters``, no Hugging Face model above it) is an InputError naming it."""
    names = canonical_names(model)
    real = {id(p) for p in model.parameters() if not p.is_meta and (only is None or id(p) in only)}
    by_storage = {p.untyped_storage().data_ptr(): names[id(p)] for p in model.parameters() if id(p) in real}
    hf = _hf_init(model)
    seen: set[int] = set()  # parameters initialised by an earlier module (tied ones)
    todo: list[tuple[str, nn.Module, Callable[[], None]]] = []
    for name, module in _post_order(model):
        own = [id(p) for p in module.parameters(recurse=False)]
        below = own or [id(p) for p in module.parameters()]
        if not any(k in real for k in below):
            continue  # nothing of this rank's in it
        if own and all(k in seen for k in own):
            continue  # a tied head: its tensor is the embedding's, initialised there
        seen.update(own)
        init = hf.get(id(module))
        reset = getattr(module, "reset_parameters", None)
        if init is not None:
            todo.append((name, module, lambda m=module, f=init: f(m)))  # type: ignore[misc]
        elif callable(reset):
            todo.append((name, module, reset))
        elif own:
            raise InputError(f"module {name or '(root)'} ({type(module).__name__}) holds parameters but has no "
                             "reset_parameters: a seeded model's modules must initialise their own parameters "
                             "(give it a reset_parameters method)")
    with torch.random.fork_rng(devices=[]), _ReseedPerTensor(seed, by_storage), _hf_guard():
        for name, _, run in todo:
            torch.default_generator.manual_seed(_name_seed(seed, f"module:{name}"))
            run()
    return len(todo)


def materialise_seeded(model: nn.Module, tensors: list[nn.Parameter], seed: int, *,
                       dtype: torch.dtype | None = None) -> dict[int, nn.Parameter]:
    """New real (CPU) parameters for the meta ``tensors`` of ``model`` (floating ones in ``dtype`` when given), put in
    ``model`` in their place and filled by the per-name init; returns old id -> new parameter."""
    def kind(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    new = {id(t): nn.Parameter(torch.empty(t.shape, dtype=kind(t)), requires_grad=t.requires_grad)
           for t in tensors}
    for module in model.modules():
        for key, t in module._parameters.items():
            if t is not None and id(t) in new:
                module._parameters[key] = new[id(t)]
    seeded_init(model, seed, only={id(p) for p in new.values()})
    return new


def seeded_model(build: Callable[[], nn.Module], seed: int, *, weights: bool = True) -> nn.Module:
    """``build()`` with its parameters on meta, then (``weights``) every one made on CPU by the per-name init: the
    seeded model every process makes alike, whole here, by stage in a rank (module glossary)."""
    with params_on_meta():
        model = build()
    if weights:
        materialise_seeded(model, list({id(p): p for p in model.parameters() if p.is_meta}.values()), seed)
    return model
