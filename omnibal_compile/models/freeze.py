"""Freezing parameters by name: ``freeze=("vision_tower",)`` (``--freeze vision_tower``) trains the rest.

A pattern is a regular expression searched in every parameter's name (``re.search``): ``vision`` freezes
``vision.layers.0.fc1.weight``; ``^model\\.vision_tower\\.`` anchors it. A frozen parameter gets
``requires_grad=False`` before the model is captured, so its stages compute no gradient for it, the
optimizer holds no state for it, data parallelism reduces nothing for it, and the cost pass charges it its
weights only (no gradient, master copy or optimizer states). A pattern that matches no parameter is an
error naming the pattern and some of the names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn

from omnibal_compile.config import freeze_patterns
from omnibal_compile.errors import InputError

__all__ = ["freeze_patterns", "freeze_parameters", "frozen_names"]


def frozen_names(names: Sequence[str], patterns: Iterable[str]) -> tuple[str, ...]:
    """The names that ``patterns`` match (:func:`freeze_patterns`), in their order; an InputError for a pattern
    matching none, naming it and a few of ``names``."""
    pats = freeze_patterns(patterns)
    hit: set[str] = set()
    for p in pats:
        rx = re.compile(p)
        found = [n for n in names if rx.search(n)]
        if not found:
            shown = ", ".join(_examples(names))
            raise InputError(
                f"freeze pattern {p!r} (--freeze) matches no parameter of the model; its parameter names look like: "
                f"{shown} (a pattern is a regular expression searched in each name)"
            )
        hit.update(found)
    return tuple(n for n in names if n in hit)


def _examples(names: Sequence[str], limit: int = 6) -> list[str]:
    """A few names from different parts of the model: the first of each top-level module, then the rest."""
    firsts: dict[str, str] = {}
    for n in names:
        firsts.setdefault(n.split(".")[0] if "." in n else n, n)
    picked = list(firsts.values())[:limit]
    picked += [n for n in names if n not in picked][: max(0, limit - len(picked))]
    return picked + (["..."] if len(names) > len(picked) else [])


def freeze_parameters(model: nn.Module, patterns: Iterable[str]) -> tuple[str, ...]:
    """Set ``requires_grad=False`` on every parameter of ``model`` a pattern matches (in place); returns their
    names. No patterns: nothing is changed."""
    pats = freeze_patterns(patterns)
    if not pats:
        return ()
    named = list(model.named_parameters(remove_duplicate=False))  # a tied parameter: frozen by any of its names
    names = frozen_names([n for n, _ in named], pats)
    chosen = set(names)
    for n, p in named:
        if n in chosen:
            p.requires_grad_(False)
    return names
