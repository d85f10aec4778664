"""Example inputs for a model that came without them: what ``optimize(model)`` captures and profiles on.

Glossary:
    source   where the batch came from, in words: the caller, the reference VLM's own example, the
             model's ``example_inputs()`` method, its Hugging Face config (laid out as the family's
             processor lays it out, see :mod:`omnibal_compile.integrations.hf.inputs`), or the balanced
             pack shape of ``lengths=``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from omnibal_compile.errors import InputError

__all__ = ["ExampleInputs", "EXAMPLE_ROWS", "EXAMPLE_TEXT", "example_inputs_for", "describe_batch"]

EXAMPLE_ROWS = 2
"""Rows of a synthesized example batch."""
EXAMPLE_TEXT = 32
"""Text tokens per row of a synthesized example batch (after the row's image part)."""


@dataclass(frozen=True, kw_only=True)
class ExampleInputs:
    """The batch a model was captured with, and where it came from."""

    batch: Any = field(repr=False)
    """The batch: a tuple, a dict, or ``(args, kwargs)``."""
    source: str
    """Where it came from, as a sentence fragment (see the module glossary)."""
    synthesized: bool
    """True when optimize() built it (no ``example_inputs`` given)."""
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    """(name, shape, dtype) of every tensor in the batch, in order; other values show their type as dtype."""

    def summary(self) -> str:
        """A heading with the source, then one aligned line per input."""
        width = max((len(n) for n, _, _ in self.inputs), default=0)
        lines = [f"Example inputs: {self.source}"]
        for name, shape, dtype in self.inputs:
            lines.append(f"  {name:<{width}}  {'x'.join(map(str, shape)) or 'scalar':<14}  {dtype}")
        return "\n".join(lines)


def describe_batch(batch: Any, *, source: str, synthesized: bool) -> ExampleInputs:
    """An :class:`ExampleInputs` for ``batch``, naming each leaf by its key path (``input_ids``, ``[0]``...)."""
    leaves, _ = pytree.tree_flatten_with_path(batch)
    inputs = []
    for path, leaf in leaves:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) or "input"
        if isinstance(leaf, torch.Tensor):
            inputs.append((name, tuple(int(d) for d in leaf.shape), str(leaf.dtype).removeprefix("torch.")))
        else:
            inputs.append((name, (), type(leaf).__name__))
    return ExampleInputs(batch=batch, source=source, synthesized=synthesized, inputs=tuple(inputs))


def example_inputs_for(model: nn.Module, *, batch: int = EXAMPLE_ROWS, text: int = EXAMPLE_TEXT, seed: int = 0
                       ) -> ExampleInputs:
    """Synthesize a batch for ``model``: the reference VLM's own example, the model's ``example_inputs()``, or one
    built from a Hugging Face config; InputError saying what to pass for any other model."""
    from omnibal_compile.models.tiny_vlm import TinyVLM, make_example_batch

    name = type(model).__name__
    if isinstance(model, TinyVLM):
        made = make_example_batch(model.config, batch=batch, text_tokens=text, seed=seed)
        return describe_batch(
            made,
            source=f"the reference VLM's example ({batch} rows of 2 tiles and {text} text tokens)",
            synthesized=True,
        )
    own = getattr(model, "example_inputs", None)
    if callable(own):
        return describe_batch(own(), source=f"{name}.example_inputs()", synthesized=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        from omnibal_compile.integrations.hf.inputs import hf_example_batch, hf_family

        family = hf_family(model)
        layout = {"text": "text only", "tiled": "one tile per row"}.get(family, f"the {family} processor's layout")
        made = hf_example_batch(model, batch=batch, text=text, seed=seed)
        return describe_batch(made, source=f"built from the {name} config ({layout}; {batch} rows, {text} text tokens "
                                           "after each row's image part, labels -100 on the image part)",
                              synthesized=True)
    raise InputError(
        f"optimize() cannot build example inputs for a {name}: it is not the reference VLM, has no Hugging Face "
        "config and no example_inputs() method. Pass example_inputs= (one batch: a tuple, a dict of keyword inputs "
        "or (args, kwargs)), lengths= (dataset length statistics), or give the model an example_inputs() method"
    )
