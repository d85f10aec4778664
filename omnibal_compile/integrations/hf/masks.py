"""Pack masks made in the graph: a captured Hugging Face model reads its pack's 4-D attention mask from the
pack's positions (and image tokens) instead of from the mask input, so that pipeline stages make the mask
again instead of receiving an L x L tensor across every cut (``compile/blocks.py``: rebuilt values).

Glossary:
    pack mask     the 4-D additive ``attention_mask`` (or one per layer type, ``attention_mask['full_attention']``
                  ...) that :func:`~omnibal_compile.integrations.hf.inputs.hf_pack_inputs` gives a pack under
                  ``sdpa``/``eager``: :func:`~omnibal_compile.integrations.hf.inputs.pack_mask` of its segments,
                  with the family's bidirectional image blocks and sliding window.
    segments of positions  a pack's samples read off its text ``position_ids``: a sample starts wherever a
                  position does not follow the one before it (they restart at 0 per sample and for the padding
                  tail), which gives back the pack's segment ids.
    mask recipe   :func:`pack_mask` of the segments of positions and the ``input_ids``, traced into ATen ops and
                  put into the captured graph in front of the mask's first reader; every reader of the mask input
                  then reads the recipe's mask. The input stays (the batch still holds it) but is read by nothing.
                  The recipe must give the example's own mask bit for bit (shape and dtype for a ``meta``
                  example, which has no values), else the graph is left as it was.

Not the model's own masking of packed positions (transformers builds block-causal masks from restarting
``position_ids`` when it gets no mask and keeps no cache): in transformers 5.24 Gemma 3's sliding-window mask
reads its image blocks at the positions within the sample instead of the row's, so samples after the first
lose their bidirectional image attention (tests/test_rebuilt_masks.py shows it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from omnibal_compile import progress

__all__ = ["segments_of_positions", "mask_from_positions"]

MASK_INPUT = "attention_mask"


def segments_of_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) segment ids of (B, L) positions that restart per sample: 0 for the first sample, then one more at every
    position that does not follow the one before it."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).long().cumsum(-1) - 1


def _text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    # Qwen2-VL's packs stack (text, temporal, height, width) positions along dim 0: (4, B, L); the text row counts.
    return position_ids[0] if position_ids.dim() == 3 else position_ids


def _mask_key(name: str) -> str | None:
    """``attention_mask`` -> "", ``attention_mask['sliding_attention']`` -> "sliding_attention"; None otherwise."""
    if name == MASK_INPUT:
        return ""
    prefix = f"{MASK_INPUT}['"
    return name[len(prefix):-2] if name.startswith(prefix) and name.endswith("']") else None


def mask_from_positions(gm: fx.GraphModule, model: nn.Module, names: Sequence[str], leaves: Sequence[Any]) -> bool:
    """Rewrite ``gm`` (a capture of ``model`` on the flat example ``leaves``, named ``names`` as
    ``compile.capture.input_names`` names them) so that its readers of the pack mask
    read the mask recipe instead (module glossary); returns whether it did. A graph without a 4-D mask input or
    ``position_ids``, or whose example mask the recipe does not reproduce exactly, is left as it is."""
    from omnibal_compile.integrations.hf.inputs import pack_mask

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    named = dict(zip(names, zip(placeholders, leaves)))
    masks = [(key, ph, x) for name, (ph, x) in named.items() if (key := _mask_key(name)) is not None]
    if not masks or "position_ids" not in named or not all(isinstance(x, torch.Tensor) and x.dim() == 4
                                                          for _, _, x in masks):
        return False
    keys = [k for k, _, _ in masks]
    sources = [named["position_ids"]] + ([named["input_ids"]] if "input_ids" in named else [])
    if not all(isinstance(x, torch.Tensor) for _, x in sources):
        return False

    def recipe(positions: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        made = pack_mask(model, segments_of_positions(_text_positions(positions)), input_ids)
        if isinstance(made, dict):
            return tuple(made[k] for k in keys)
        return (made,) if keys == [""] else tuple(made for _ in keys)

    examples = [x for _, x in sources]
    with torch.no_grad():
        got = recipe(*examples)
    # meta examples (planning a model too large to build) hold no values to compare: shapes and dtypes only
    values = not any(x.is_meta for x in examples + [x for _, _, x in masks])
    if not all(g.shape == x.shape and g.dtype == x.dtype and (not values or torch.equal(g, x))
               for g, (_, _, x) in zip(got, masks)):
        progress.info(f"{type(model).__name__}: its attention mask is not the pack mask of its positions; every "
                      "pipeline stage receives it")
        return False
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(torch.func.functionalize(recipe, remove="mutations_and_views"))(*examples)
    if any(n.op == "get_attr" for n in traced.graph.nodes):  # a tensor constant: not worth carrying over
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    readers = [u for _, ph, _ in masks for u in ph.users if u.op != "call_module"]  # not the input checks
    if not readers:
        return False
    first = min(readers, key=order.__getitem__)
    env: dict[fx.Node, fx.Node] = {}
    traced_inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for t, (ph, _) in zip(traced_inputs, sources):
        env[t] = ph
    outs: tuple[fx.Node, ...] = ()
    with gm.graph.inserting_before(first):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = tuple(n.args[0])
                continue
            new = gm.graph.node_copy(n, lambda a: env[a])
            new.meta = {"nn_module_stack": dict(first.meta.get("nn_module_stack") or {})}
            env[n] = new
    for o, v in zip(outs, got):
        env[o].meta["val"] = v  # the example's mask: its shape and dtype, as capture's values give them
    position = order[first]

    def after(u: fx.Node) -> bool:  # not the input checks, nor an assert placed before the recipe
        return u.op != "call_module" and order.get(u, -1) >= position

    for (_, ph, _), out in zip(masks, outs):
        ph.replace_all_uses_with(env[out], delete_user_cb=after)
    gm.graph.lint()
    gm.recompile()
    return True
