"""One signature for blocks that cost the same: same ops on the same shapes, whatever their names.

Glossary:
    block signature  a hash of a block module's graph with node and parameter names replaced by
                     positions, the shape, dtype and ``requires_grad`` of every parameter, buffer
                     and input it reads, and any extra key the caller adds (which inputs are
                     charged to it, say). The 80 decoder layers of a 70B LLM share one signature,
                     so a cost pass may cost one of them and copy the figures to the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["block_signature"]


def _value(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}:{x.dtype}:{x.device.type}:{int(x.requires_grad)}"
    return repr(x)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def block_signature(gm: fx.GraphModule, inputs: Sequence[Any], *extra: Any) -> str:
    """Signature of block module ``gm`` run on ``inputs`` (module glossary); ``extra`` is hashed too."""
    index: dict[fx.Node, int] = {}
    parts: list[str] = [repr(extra)]
    placeholders = iter(inputs)

    def ref(a: Any) -> Any:
        return f"%{index[a]}" if isinstance(a, fx.Node) else a

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            desc = _value(next(placeholders, None))
        elif node.op == "get_attr":
            desc = _value(_attr(gm, str(node.target)))
        else:
            target = node.target if node.op != "call_module" else type(gm.get_submodule(str(node.target))).__name__
            args = fx.map_arg(node.args, ref)
            kwargs = fx.map_arg(node.kwargs, ref)
            desc = f"{target}{args!r}{sorted(kwargs.items())!r}"
        parts.append(f"{node.op}:{desc}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
