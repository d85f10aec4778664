"""Bytes sent across pipeline cuts per micro-batch, with the pack's attention mask sent (before) and rebuilt by every
stage from the positions (now), for one pack of 4 samples and 2048 tokens of tiny Hugging Face VLMs (random
weights, built offline from the configs of tests/hf_families.py).

Before: the (1, 1, L, L) float mask is a model input that every stage reads, so it crosses every cut up to the
last decoder layer. Now: the graph makes the mask of ``position_ids`` (and ``input_ids`` where images attend
bidirectionally) and every stage makes it again (``compile/blocks.py``: rebuilt values); those (1, L) ids cross
instead. Per family: the mask's bytes, then the bytes across the cut of a 2-stage split in the middle of the
decoder layers, and the largest over all cuts.

    python bench/cut_bytes.py
    python bench/cut_bytes.py --tokens 4096 --families gemma3
    python bench/cut_bytes.py --families llava --plan    # and the 2-stage uniform plans' summaries (sends KiB)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from omnibal_compile import progress
from omnibal_compile._utils.tables import format_table
from omnibal_compile.compile.blocks import BlockGraph, build_blocks
from omnibal_compile.compile.capture import capture
from omnibal_compile.data.collate import PackingCollator, synthetic_sample
from omnibal_compile.data.packing import PackShape
from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_pack_inputs
from omnibal_compile.planning.build import uniform

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_families import build  # noqa: E402  (the tests' tiny families)

FAMILIES = ("llava", "qwen2_vl", "gemma3", "paligemma")
TILES = (1, 2, 1, 1)
"""Tiles of the pack's 4 samples; each sample gets a quarter of the tokens."""


def pack(model: torch.nn.Module, tokens: int) -> dict[str, object]:
    """One pack of len(TILES) samples, ``tokens`` in all, in the model's own inputs (``hf_pack_inputs``)."""
    facts = hf_data_facts(model)
    per = tokens // len(TILES)
    lengths = [per] * (len(TILES) - 1) + [tokens - per * (len(TILES) - 1)]
    g = torch.Generator().manual_seed(0)
    samples = [synthetic_sample(t, n, tokens_per_tile=facts["tokens_per_tile"], image_token_id=facts["image_token_id"],
                                vocab_size=facts["image_token_id"], image_shape=facts["image_shape"], generator=g)
               for t, n in zip(TILES, lengths)]
    collator = PackingCollator(shape=PackShape(tiles=sum(TILES), tokens=tokens), seq_len=tokens,
                               tokens_per_tile=facts["tokens_per_tile"],
                               image_token_id=facts["image_token_id"], image_shape=facts["image_shape"])
    return dict(hf_pack_inputs(model, collator(samples)))


def middle_cut(graph: BlockGraph) -> int:
    """The cut of a 2-stage split in the middle of the decoder layers (the last layer stack)."""
    stack = [b for b in graph.blocks if b.kind == "layer"][-1].name.rsplit(".", 1)[0]
    layers = [b.index for b in graph.blocks if b.kind == "layer" and b.name.rsplit(".", 1)[0] == stack]
    return layers[len(layers) // 2]


def measure(name: str, tokens: int, *, plans: bool = False) -> list[str]:
    model, _ = build(name)
    batch = pack(model, tokens)
    mask = batch["attention_mask"]
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    with warnings.catch_warnings(), progress.quiet():
        warnings.simplefilter("ignore")
        before = build_blocks(capture(model, batch, masks_from_positions=False), model, rebuild=False)
        now = build_blocks(capture(model, batch), model)
    assert before.names == now.names
    cut = middle_cut(now)
    cuts = range(1, now.num_blocks)
    leaked = [v.name for k in cuts for v in now.crossing(k) if v.shape and len(v.shape) == 4 and v.shape[-1] == tokens]
    assert not leaked, f"{name}: an L x L value still crosses a cut: {leaked}"
    if plans:
        for label, graph in (("before", before), ("now", now)):
            print(f"{name}, {label}: {uniform(graph, 2).summary()}\n")
    mib = 2**20
    return [
        name,
        f"{sum(m.numel() * m.element_size() for m in masks) / mib:.2f}",
        f"{before.cut_bytes(cut) / mib:.2f}",
        f"{now.cut_bytes(cut) / mib:.3f}",
        f"{before.cut_bytes(cut) / now.cut_bytes(cut):.0f}x",
        f"{max(before.cut_bytes(k) for k in cuts) / mib:.2f}",
        f"{max(now.cut_bytes(k) for k in cuts) / mib:.3f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the pack (default 2048)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--plan", action="store_true", help="print each family's 2-stage uniform plan, before and now")
    args = ap.parse_args()
    rows = [["family", "mask MiB", "mid cut before", "mid cut now", "less", "max cut before", "max cut now"]]
    rows += [measure(name, args.tokens, plans=args.plan) for name in args.families]
    print(f"MiB sent per micro-batch (one pack: {len(TILES)} samples, {args.tokens} tokens, fp32), mask sent (before) "
          "and rebuilt by the stages (now):")
    print(format_table(rows, "lrrrrrr"))


if __name__ == "__main__":
    main()
