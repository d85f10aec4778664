"""A pack's attention under ``flex_attention``: a block mask each pipeline stage makes of the pack's segment ids.

A Hugging Face model built with ``attn_implementation="flex_attention"`` takes, as its ``attention_mask``, a
``torch.nn.attention.flex_attention.BlockMask`` (or one per layer type: ``{"full_attention": ...,
"sliding_attention": ...}``) and hands it to ``flex_attention`` as it is (transformers 5.25
``masking_utils._preprocess_mask_arguments`` returns any 4-D mask unchanged; ``integrations/flex_attention.py``
reads a BlockMask as the block mask, a tensor as an additive score mask). A packed row gets a
:class:`PackBlockMask`: its ``mask_mod`` is :func:`~omnibal_compile.integrations.hf.collate.segment_allows`, the
rule of the 4-D additive mask (same sample, causal, the family's bidirectional image blocks, a sliding window).

Glossary:
    pack block mask  a :class:`PackBlockMask`: a BlockMask that also keeps what it was made of, the pack's (B, L)
                     segment ids, its (B, L) bidirectional block ids (or None) and its window.
    leaves           a pack block mask flattens (``torch.utils._pytree``, as ``torch.export`` and the pipeline
                     read a batch) to its segment ids and block ids only, a few bytes per token; it unflattens by
                     making the block mask again of them (:func:`pack_block_mask`). A captured graph therefore
                     computes the block mask from those inputs, and a pipeline stage that reads it computes it
                     again from the segment ids it receives: nothing of L x L size crosses a cut.

Not every family takes it: transformers refuses ``flex_attention`` for a model whose class says
``_supports_flex_attn = False`` (Qwen2-VL, Qwen2.5-VL in 5.25); :func:`check_flex_family` names such a family and
what to use instead. ``flex_attention`` on CPU runs forward only (torch 2.13 has no CPU backward): training on CPU
needs ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from omnibal_compile.errors import InputError

__all__ = ["FLEX_ATTENTION", "PackBlockMask", "check_flex_family", "is_flex", "pack_block_mask"]

FLEX_ATTENTION = "flex_attention"
"""The attention implementation (``config._attn_implementation``) whose packs get a :class:`PackBlockMask`."""


BLOCK = 128
"""Query and key tokens per block of the block mask (flex attention's default)."""


def is_flex(attn_implementation: str) -> bool:
    return attn_implementation == FLEX_ATTENTION


class PackBlockMask(BlockMask):
    """A BlockMask of a pack that keeps its ``segment_ids``, ``blocks`` and ``window`` (module glossary: pack block
    mask); build it with :func:`pack_block_mask`."""

    segment_ids: torch.Tensor
    blocks: torch.Tensor | None
    window: int | None


def pack_block_mask(segment_ids: torch.Tensor, *, blocks: torch.Tensor | None = None,
                    window: int | None = None) -> PackBlockMask:
    """The flex block mask of a pack of (B, L) ``segment_ids``: a query attends a key where
    :func:`~omnibal_compile.integrations.hf.collate.segment_allows` says so (same ``blocks`` and ``window`` as the
    4-D mask of :func:`~omnibal_compile.integrations.hf.collate.segment_mask`)."""
    from omnibal_compile.integrations.hf.collate import segment_allows

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return segment_allows(segment_ids, b, q, kv, blocks=blocks, window=window)

    # The blocks' occupancy from the rule on index grids, not from ``create_block_mask``: its ``vmap`` over the
    # mask_mod does not trace under torch.export for every family (Llava's capture fails in torch 2.13).
    n, rows, device = int(segment_ids.shape[-1]), int(segment_ids.shape[0]), segment_ids.device
    grid = -(-n // BLOCK) * BLOCK
    b = torch.arange(rows, device=device)[:, None, None]
    q, kv = torch.arange(n, device=device)[None, :, None], torch.arange(n, device=device)[None, None, :]
    allowed = torch.nn.functional.pad(segment_allows(segment_ids, b, q, kv, blocks=blocks, window=window),
                                      (0, grid - n, 0, grid - n))
    tiles = allowed.reshape(rows, 1, grid // BLOCK, BLOCK, grid // BLOCK, BLOCK).sum((3, 5))
    full = tiles == BLOCK * BLOCK
    partial = (tiles > 0) & ~full

    def listed(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # per query block: how many, which
        ints = used.to(torch.int32)
        return ints.sum(-1).to(torch.int32), torch.argsort(ints, dim=-1, descending=True, stable=True).to(torch.int32)

    made = BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, n))
    made.__class__ = PackBlockMask  # the same object with the pack's facts kept: its leaves (module glossary)
    made.segment_ids, made.blocks, made.window = segment_ids, blocks, window  # type: ignore[attr-defined]
    return made  # type: ignore[return-value]


def _flatten(m: PackBlockMask) -> tuple[list[torch.Tensor | None], int | None]:
    return [m.segment_ids, m.blocks], m.window


def _flatten_with_keys(m: PackBlockMask) -> tuple[list[tuple[Any, torch.Tensor | None]], int | None]:
    return [(pytree.GetAttrKey("segment_ids"), m.segment_ids), (pytree.GetAttrKey("blocks"), m.blocks)], m.window


def _unflatten(leaves: Any, window: int | None) -> PackBlockMask:
    segment_ids, blocks = leaves
    if not isinstance(segment_ids, torch.Tensor):  # a spec walked with stand-in leaves (capture.input_names)
        shell = PackBlockMask.__new__(PackBlockMask)
        shell.segment_ids, shell.blocks, shell.window = segment_ids, blocks, window
        return shell
    return pack_block_mask(segment_ids, blocks=blocks, window=window)


pytree.register_pytree_node(PackBlockMask, _flatten, _unflatten,
                            serialized_type_name="omnibal_compile.PackBlockMask",
                            flatten_with_keys_fn=_flatten_with_keys)


def check_flex_family(model: nn.Module) -> None:
    """Raise InputError when ``model`` runs ``flex_attention`` but cannot take a pack block mask: a family whose
    class refuses flex attention, or trainable parameters on CPU (torch has no flex backward there)."""
    cfg = getattr(model, "config", None)
    kind = str(getattr(cfg, "model_type", type(model).__name__))
    if getattr(type(model), "_supports_flex_attn", True) is False:
        raise InputError(
            f"{type(model).__name__} ({kind!r}) does not take flex_attention (transformers says "
            "_supports_flex_attn = False); build it with attn_implementation='sdpa' (a 4-D mask that every stage "
            "makes of the pack's positions) or 'flash_attention_2' (restarting position_ids)"
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and all(p.device.type == "cpu" for p in trainable):
        raise InputError(
            f"{type(model).__name__} ({kind!r}) runs flex_attention on CPU with trainable parameters: torch has no "
            "flex_attention backward on CPU; train on CPU with attn_implementation='sdpa', or run flex_attention on "
            "a GPU (or freeze the parameters for a forward-only run)"
        )
