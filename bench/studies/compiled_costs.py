"""Paper-scale cost tables the compiler produced from Hugging Face model code, for the paper-scale study.

The analytic models of :mod:`omnibal_compile.costs.analytic` are closed formulas. This module
gives the study a second cost path: the model's Hugging Face class is built at the analytic
spec's real widths on the ``meta`` device in bf16 (no weights allocated), captured, cut into
blocks and costed by the cost pass for a roofline GPU at several micro-batch shapes; the study
then runs on those tables instead of the formulas.

Glossary:
    family          ``internvl``: ``InternVLForConditionalGeneration`` (InternViT with QK-norm, RMSNorm
                    and layer scale as InternViT-6B has them, pixel shuffle 0.5, LayerNorm + MLP
                    projector) with a Llama-architecture LLM (InternLM2 and Yi are Llama-shaped);
                    ``llava``: ``LlavaForConditionalGeneration`` (CLIP ViT, penultimate-layer features,
                    GELU MLP projector, Llama LLM). Chosen from the spec's name.
    reduced model   the family's class at the spec's widths but few layers per stack: 3 ViT layers (4 for
                    LLaVA, whose last layer's output is unused) and 3 LLM layers. The second layer of
                    each stack is the stack's representative: its input needs a gradient, as every later
                    layer's does, it is not the last reader of a skip tensor, and every layer of a stack
                    has the same block signature, so the cost pass gives them all its figures; it stands
                    for each of the spec's layers. What the first and last layer keep beyond it is
                    charged once to the type before or after the stack.
    block type      every compiled block is mapped to an analytic block type by its module path; glue
                    (nameless blocks between modules, such as pixel shuffle or splicing the image features
                    into the text) and untyped modules (the vision tower's final norm) join the next typed
                    block, those at the end the last one. Nothing is dropped.
    fit             per type and quantity, non-negative coefficients on (1, tiles, text tokens, sum of
                    squared sequence lengths) (:func:`~omnibal_compile.costs.shapes.fit_shape_model`)
                    fitted to the tables at :data:`FIT_SHAPES` and checked against tables at
                    :data:`CHECK_SHAPES` the fit has not seen. A study micro-batch of ``tiles``, ``tokens``
                    computed and causal ``pairs`` has text tokens ``tokens - tiles x tokens per tile`` and
                    squared lengths ``2 pairs - tokens``: packed samples are costed as separate sequences
                    (varlen attention), as the analytic path does.
    tensor parallel the analytic path's Megatron rule (:func:`~omnibal_compile.costs.analytic.tensor_parallel_costs`)
                    applied to the compiled one-GPU costs: the compiler has no tensor-parallel pass.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnibal_compile._utils.tables import format_table
from omnibal_compile.costs.analytic import (
    BLOCK_TYPES,
    MicroBatch,
    TypeCosts,
    VLMSpec,
    table_from_type_costs,
    tensor_parallel_costs,
    type_costs,
)
from omnibal_compile.costs.devices import DeviceSpec, get_device
from omnibal_compile.costs.shapes import FEATURES, BatchShape
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, CostTable, Precision

__all__ = ["FAMILIES", "FIT_SHAPES", "CHECK_SHAPES", "DIFFERENCES", "CompiledCosts", "family_of", "hf_config",
           "block_types", "compile_costs", "format_difference"]

FAMILIES: tuple[str, ...] = ("internvl", "llava")
"""Hugging Face families the compiled path builds (module glossary)."""

FIT_SHAPES: tuple[BatchShape, ...] = tuple(
    BatchShape(tiles=a, text_tokens=b, sequences=c)
    for a, b, c in ((1, 256, 1), (4, 512, 1), (8, 1024, 2), (2, 4096, 1), (16, 3072, 4), (12, 512, 1), (24, 6144, 4),
                    (4, 8192, 2))
)
"""Micro-batch shapes the compiler costs to fit each type's costs (tiles and text tokens split evenly over rows)."""
CHECK_SHAPES: tuple[BatchShape, ...] = (BatchShape(tiles=6, text_tokens=1500, sequences=2),
                                        BatchShape(tiles=32, text_tokens=4000, sequences=4))
"""Shapes costed only to check the fit (not fitted on)."""

QUANTITIES: tuple[str, ...] = ("flops", "forward_s", "backward_s", "recompute:selective",
                               *(f"activation:{o}" for o in RECOMPUTE_OPTIONS), "out_bytes")

_TYPE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("vision.layer", r"vision_tower\..*\.layers?\.\d+$"),
    ("vision.embed", r"vision_tower\..*(embeddings|pre_layrnorm)$"),
    ("projector", r"multi_modal_projector$"),
    ("llm.layer", r"language_model\.layers\.\d+$"),
    ("llm.embed", r"(embed_tokens|rotary_emb)$"),
    ("llm.head", r"(language_model\.norm|lm_head)$"),
)
STACKS = ("vision.layer", "llm.layer")


def family_of(spec: VLMSpec) -> str:
    """The Hugging Face family of an analytic spec, from its name."""
    for family in FAMILIES:
        if spec.name.lower().startswith(family):
            return family
    raise InputError(
        f"no Hugging Face family for model {spec.name!r}: its name must start with one of {list(FAMILIES)}"
    )


def _tokens_per_tile(spec: VLMSpec) -> int:
    return spec.image_tokens_per_tile


def hf_config(spec: VLMSpec, *, vision_layers: int, llm_layers: int) -> tuple[str, Any]:
    """(class name, config) of the spec's Hugging Face family at its widths with the given layer counts."""
    try:
        import transformers as tf
    except ImportError:
        raise InputError("compiled cost tables need transformers: pip install 'omnibal-compile[hf]'") from None
    v, p, m = spec.vision, spec.projector, spec.llm
    family = family_of(spec)
    image = int(round((v.tokens_per_tile - 1) ** 0.5)) * v.patch_size
    vocab = m.vocab  # the last id is the image placeholder
    text = tf.LlamaConfig(hidden_size=m.width, intermediate_size=m.mlp, num_hidden_layers=llm_layers,
                          num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, vocab_size=vocab,
                          max_position_embeddings=32768, use_cache=False, tie_word_embeddings=False)
    if family == "internvl":
        if not p.norm or 4 * v.width != p.in_width:
            raise InputError(
                f"{spec.name}: an InternVL projector has a LayerNorm over 4 x the ViT width (pixel shuffle 0.5)"
            )
        vision = tf.InternVLVisionConfig(hidden_size=v.width, intermediate_size=v.mlp, num_hidden_layers=vision_layers,
                                         num_attention_heads=v.heads, use_qk_norm=True, norm_type="rms_norm",
                                         image_size=image, patch_size=v.patch_size, use_mean_pooling=False,
                                         hidden_act=v.activation)
        config = tf.InternVLConfig(vision_config=vision, text_config=text, image_token_id=vocab - 1,
                                   image_seq_length=spec.image_tokens_per_tile, downsample_ratio=0.5,
                                   vision_feature_layer=-1, tie_word_embeddings=False)
        return "InternVLForConditionalGeneration", config
    vision = tf.CLIPVisionConfig(hidden_size=v.width, intermediate_size=v.mlp, num_hidden_layers=vision_layers,
                                 num_attention_heads=v.heads, image_size=image, patch_size=v.patch_size,
                                 hidden_act=v.activation)
    config = tf.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=vocab - 1,
        vision_feature_layer=-1,
        image_seq_length=spec.image_tokens_per_tile,
        tie_word_embeddings=False,
    )
    return "LlavaForConditionalGeneration", config


def block_types(names: Sequence[str]) -> tuple[str, ...]:
    """The analytic block type of each compiled block (module glossary: glue joins the next typed block)."""
    typed: list[str | None] = []
    for name in names:
        typed.append(next((t for t, pattern in _TYPE_PATTERNS if re.search(pattern, name)), None))
    if not any(typed):
        raise InputError(f"no compiled block has a module path of a known type: {list(names)[:6]}...")
    out: list[str] = []
    for i, t in enumerate(typed):
        nxt = next((u for u in typed[i:] if u is not None), None) or next(u for u in reversed(typed) if u is not None)
        out.append(t or nxt)
    missing = [t for t in BLOCK_TYPES if t not in out]
    if missing:
        raise InputError(f"the compiled blocks have no {missing} (blocks: {list(names)})")
    return tuple(out)


def _stack_layers(names: Sequence[str], types: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """Each stack's (first, representative, last) layer: the representative is the second of at least three."""
    out = {}
    for stack in STACKS:
        layers = [i for i, t in enumerate(types) if t == stack and re.search(r"\.\d+$", names[i])]
        if len(layers) < 3:
            raise InputError(f"the reduced model needs at least 3 {stack} blocks, it has {len(layers)}")
        out[stack] = (layers[0], layers[1], layers[-1])
    return out


_BEFORE = {"vision.layer": "vision.embed", "llm.layer": "llm.embed"}
_AFTER = {"vision.layer": "projector", "llm.layer": "llm.head"}


@dataclass(frozen=True, kw_only=True, eq=False)
class CompiledCosts:
    """Per-type costs measured by the cost pass on Hugging Face model code, as functions of the micro-batch shape."""

    model: VLMSpec
    """The analytic spec with the same shapes: its block chain and layer counts are the study's."""
    hf_class: str
    """The Hugging Face class that was compiled."""
    device: str
    """Roofline target the tables were costed for."""
    coefficients: Mapping[str, Mapping[str, tuple[float, ...]]]
    """Block type -> quantity (:data:`QUANTITIES`) -> coefficients over the fit features."""
    params: Mapping[str, int]
    """Parameters of one block of each type (a stack's representative layer; the sum of a type's other blocks)."""
    blocks: Mapping[str, tuple[str, ...]]
    """Block type -> the compiled blocks it sums (a stack: its representative; ``a - b``: a's excess over b)."""
    shapes: int
    """Micro-batch shapes the fit was made on."""
    layers: int
    """Layers per stack of the reduced model that was compiled."""
    fit_error: float
    """Largest relative error of a type's forward + backward time or kept bytes (no recompute) on the fitted shapes."""
    check_error: float
    """The same on :data:`CHECK_SHAPES`, which the fit has not seen."""
    seconds: float
    """Wall time to build, capture, cost and fit."""
    notes: str = ""
    """What the tables say about themselves (activation dtype, attention kernel)."""

    def features(self, tiles: np.ndarray, tokens: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """``[micro-batches, features]`` of study micro-batches (module glossary: fit)."""
        tiles, tokens, pairs = (np.atleast_1d(np.asarray(a, dtype=np.float64)) for a in (tiles, tokens, pairs))
        text = tokens - _tokens_per_tile(self.model) * tiles
        return np.stack([np.ones_like(tiles), tiles, text, 2 * pairs - tokens], axis=1)

    def type_costs(self, tiles: np.ndarray, tokens: np.ndarray, attention_pairs: np.ndarray, *, device: DeviceSpec,
                   tensor_parallel: int = 1) -> TypeCosts:
        """As :func:`omnibal_compile.costs.analytic.type_costs`, from the compiled tables."""
        if device.name != self.device:
            raise InputError(
                f"these compiled costs are for {self.device}; the study asks for {device.name}: compile for it"
            )
        x = self.features(tiles, tokens, attention_pairs)

        def q(t: str, name: str) -> np.ndarray:
            return np.maximum(x @ np.asarray(self.coefficients[t][name]), 0.0)

        one = TypeCosts(
            flops={t: q(t, "flops") for t in BLOCK_TYPES},
            forward_s={t: q(t, "forward_s") for t in BLOCK_TYPES},
            backward_s={t: q(t, "backward_s") for t in BLOCK_TYPES},
            selective_s={t: q(t, "recompute:selective") for t in BLOCK_TYPES},
            activation_bytes={t: {o: q(t, f"activation:{o}") for o in RECOMPUTE_OPTIONS} for t in BLOCK_TYPES},
            out_bytes={t: q(t, "out_bytes") for t in BLOCK_TYPES},
        )
        return tensor_parallel_costs(one, self.model, x[:, 1], np.atleast_1d(np.asarray(tokens, dtype=np.float64)),
                                     tensor_parallel=tensor_parallel, device=device)

    def cost_table(self, shape: MicroBatch, *, device: DeviceSpec, precision: Precision, link: str,
                   tensor_parallel: int = 1) -> CostTable:
        """As :func:`omnibal_compile.costs.analytic.cost_table`, from the compiled tables."""
        tc = self.type_costs(np.array([shape.tiles]), np.array([shape.tokens]), np.array([shape.attention_pairs]),
                             device=device, tensor_parallel=tensor_parallel)
        return table_from_type_costs(
            self.model,
            tc,
            self.params,
            shape,
            device=device,
            precision=precision,
            link=link,
            tensor_parallel=tensor_parallel,
            source="roofline, compiled from Hugging Face code",
        )


def _example(spec: VLMSpec, shape: BatchShape, image_token: int) -> dict[str, Any]:
    """A meta-device batch of ``shape``: tiles and text tokens split evenly over its rows, image placeholders first."""
    import torch

    rows = shape.sequences
    if shape.tiles % rows or shape.text_tokens % rows:
        raise InputError(f"shape {shape}: tiles and text tokens must split evenly over its {rows} rows")
    n_image = shape.tiles // rows * _tokens_per_tile(spec)
    length = n_image + shape.text_tokens // rows
    ids = torch.zeros(rows, length, dtype=torch.long)
    ids[:, :n_image] = image_token
    labels = ids.clone()
    labels[:, :n_image] = -100
    side = int(round((spec.vision.tokens_per_tile - 1) ** 0.5)) * spec.vision.patch_size
    return {"input_ids": ids.to("meta"), "labels": labels.to("meta"),
            "pixel_values": torch.empty(shape.tiles, 3, side, side, dtype=torch.bfloat16, device="meta")}


def _per_type(table: CostTable, types: Sequence[str], stacks: Mapping[str, tuple[int, int, int]]
              ) -> tuple[dict[str, dict[str, float]], dict[str, int], dict[str, list[str]]]:
    """Per type: each quantity, the parameters and the compiled blocks behind them (module glossary).

    A stack's figures are its representative's. What its first and last layer keep beyond the
    representative (e.g. skip tensors such as the causal mask and rotary tables, charged to their last
    reader) is charged once to the type before (first) or after (last) the stack, so that a chain of
    the spec's layer counts keeps every byte the compiled chain keeps.
    """

    def values(i: int) -> dict[str, float]:
        b = table.blocks[i]
        return {"flops": b.flops, "forward_s": b.forward_s, "backward_s": b.backward_s,
                "recompute:selective": b.recompute_s["selective"],
                **{f"activation:{o}": float(b.activation_bytes[o]) for o in RECOMPUTE_OPTIONS}, "params": b.num_params}

    out: dict[str, dict[str, float]] = {t: dict.fromkeys((*QUANTITIES, "params"), 0.0) for t in BLOCK_TYPES}
    names: dict[str, list[str]] = {t: [] for t in BLOCK_TYPES}
    last: dict[str, int] = {}
    for i, t in enumerate(types):
        first_rep_last = stacks.get(t)
        if first_rep_last is not None and i != first_rep_last[1]:
            if i in (first_rep_last[0], first_rep_last[2]):  # the excess over the representative, charged once
                other = _BEFORE[t] if i == first_rep_last[0] else _AFTER[t]
                rep = values(first_rep_last[1])
                for k, v in values(i).items():
                    out[other][k] += v - rep[k]
                names[other].append(f"{table.blocks[i].name} - {table.blocks[first_rep_last[1]].name}")
            continue
        for k, v in values(i).items():
            out[t][k] += v
        names[t].append(table.blocks[i].name)
        last[t] = i
    for t, i in last.items():
        out[t]["out_bytes"] = float(table.cut_bytes[i + 1])  # what the HF code sends after the type's last block
    params = {t: round(out[t].pop("params")) for t in BLOCK_TYPES}
    return out, params, names


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    from omnibal_compile.costs.shapes import fit_nonnegative

    return tuple(float(c) for c in fit_nonnegative(x, y))


def _error(coefficients: Mapping[str, Mapping[str, tuple[float, ...]]], tokens_per_tile: int,
           measured: Sequence[Mapping[str, Mapping[str, float]]], shapes: Sequence[BatchShape]) -> float:
    """Largest relative error of a type's forward + backward seconds or kept bytes (no recompute) at ``shapes``."""
    worst = 0.0
    for m, s in zip(measured, shapes):
        x = np.array(s.features(tokens_per_tile))  # its attention feature: the sum of squared row lengths
        for t in BLOCK_TYPES:
            for parts in (("forward_s", "backward_s"), ("activation:none",)):
                got = sum(max(0.0, float(x @ np.asarray(coefficients[t][p]))) for p in parts)
                want = sum(m[t][p] for p in parts)
                if want > 0:
                    worst = max(worst, abs(got / want - 1))
    return worst


def compile_costs(spec: VLMSpec, *, device: str | DeviceSpec = "a100-80gb", shapes: Sequence[BatchShape] = FIT_SHAPES,
                  check: Sequence[BatchShape] = CHECK_SHAPES, folder: str | Path | None = None) -> CompiledCosts:
    """Build ``spec``'s reduced Hugging Face model on ``meta`` from a config written to ``folder`` (a temporary
    one by default), cost it at ``shapes`` (and ``check``) for ``device`` and fit per-type costs (module glossary)."""
    from omnibal_compile.costs.annotate import profile_costs
    from omnibal_compile.models.load import load_model

    start = time.perf_counter()
    target = get_device(device)
    if len(set(shapes)) < len(FEATURES):
        raise InputError(
            f"fitting {len(FEATURES)} features needs at least {len(FEATURES)} distinct shapes, got {len(set(shapes))}"
        )
    layers = 3
    cls, config = hf_config(spec, vision_layers=layers, llm_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(folder or tmp) / f"{spec.name}-reduced.json"
        config.to_json_file(str(path))
        model = load_model(f"hf:{cls}:{path}", batch=1, text=8, meta=True).model
    image_token = int(getattr(config, "image_token_id", None) or config.image_token_index)
    tables = [profile_costs(model, _example(spec, s, image_token), device=target, batch_shape=s.as_dict())
              for s in (*shapes, *check)]
    names = tables[0].names
    types = block_types(names)
    stacks = _stack_layers(names, types)
    per = [_per_type(t, types, stacks) for t in tables]
    measured = [m for m, _, _ in per]
    _, params, blocks = per[0]
    tpt = _tokens_per_tile(spec)
    x = np.array([s.features(tpt) for s in shapes])
    coefficients = {
        t: {q: _fit(x, np.array([m[t][q] for m in measured[:len(shapes)]])) for q in QUANTITIES} for t in BLOCK_TYPES
    }
    return CompiledCosts(
        model=spec, hf_class=cls, device=target.name, coefficients=coefficients, params=params,
        blocks={t: tuple(v) for t, v in blocks.items()}, shapes=len(shapes), layers=layers,
        fit_error=_error(coefficients, tpt, measured[:len(shapes)], shapes),
        check_error=_error(coefficients, tpt, measured[len(shapes):], check), seconds=time.perf_counter() - start,
        notes=f"activations in {tables[0].activation_dtype}; attention: {tables[0].attention}",
    )


_LLM_DIFFERENCES = {
    "llm.embed": "the compiled type holds glue the formulas have no op for: splicing the image features into the "
                 "text (masked_scatter keeps its mask), building the 4-D causal mask and rotary tables",
    "llm.layer": "eager code (as the 'eager' formulas count): RMSNorm keeps fp32 copies and its output, SwiGLU keeps "
                 "silu(gate), the masked attention computes every (query, key) pair of a row (FLOPs x 2 on "
                 "attention); the send also carries the 4-D causal mask and rotary tables",
    "llm.head": "the final RMSNorm's fp32 copy; the compiler has three blocks here (norm, lm_head, loss), each "
                "keeping its own input under full recompute",
}
DIFFERENCES: dict[str, dict[str, str]] = {
    "internvl": {
        "vision.embed": "the patch embedding keeps its bf16 pixels; HF InternVL embeds the text before the ViT, so "
                        "every ViT-stage send carries the text embeddings too",
        "vision.layer": "InternViT-6B as HF runs it: QK-norm (two more RMSNorms), RMSNorm with fp32 copies, layer "
                        "scale products kept; the formulas have LayerNorm-GELU layers with fused norms",
        "projector": "the send after it also carries the text embeddings and the 4-D causal mask",
        **_LLM_DIFFERENCES,
    },
    "llava": {
        "vision.embed": "CLIP's pre-LayerNorm keeps its input; the text embeddings ride through the ViT stages' sends",
        "vision.layer": "QuickGELU keeps its sigmoid and product (the 'eager' formulas count it)",
        "projector": "the send after it also carries the text embeddings",
        **_LLM_DIFFERENCES,
    },
}
"""Per family and block type: the difference between the compiled table and the analytic formulas, named."""


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else ("=" if a == 0 else "new")


def format_difference(compiled: CompiledCosts, shape: MicroBatch, *, device: DeviceSpec) -> str:
    """Per block type at one micro-batch: the compiled table over the analytic formulas (``fused``, the study's
    analytic path; ``eager``, the formulas for Hugging Face's unfused code), and the difference named."""
    args = (np.array([shape.tiles]), np.array([shape.tokens]), np.array([shape.attention_pairs]))
    c = compiled.type_costs(*args, device=device)
    fused = type_costs(compiled.model, *args, device=device)
    eager = type_costs(dataclasses.replace(compiled.model, kernels="eager"), *args, device=device)
    params = compiled.model.type_params()
    named = DIFFERENCES[family_of(compiled.model)]
    lines = [("type", "params", "FLOPs", "fwd+bwd s", "/eager", "kept: none", "/eager", "selective", "full", "send",
              "named difference (compiled / analytic formulas)")]
    for t in BLOCK_TYPES:
        def time(x: TypeCosts, t: str = t) -> float:
            return float(x.forward_s[t][0] + x.backward_s[t][0])

        def kept(x: TypeCosts, o: str, t: str = t) -> float:
            return float(x.activation_bytes[t][o][0])

        lines.append(
            (
                t,
                _ratio(compiled.params[t], params[t]),
                _ratio(float(c.flops[t][0]), float(fused.flops[t][0])),
                _ratio(time(c), time(fused)),
                _ratio(time(c), time(eager)),
                _ratio(kept(c, "none"), kept(fused, "none")),
                _ratio(kept(c, "none"), kept(eager, "none")),
                _ratio(kept(c, "selective"), kept(fused, "selective")),
                _ratio(kept(c, "full"), kept(fused, "full")),
                _ratio(float(c.out_bytes[t][0]), float(fused.out_bytes[t][0])),
                named.get(t, ""),
            )
        )
    head = (f"{compiled.model.name}: {compiled.hf_class} at the spec's widths, {compiled.layers} layers per stack, on "
            f"meta in bf16, costed for {compiled.device} at {compiled.shapes} shapes in {compiled.seconds:.0f} s; fit "
            f"error {compiled.fit_error:.1%}, {compiled.check_error:.1%} on unseen shapes; {compiled.notes}\n"
            f"compiled / analytic per block type at the mean micro-batch ({shape.tiles} tiles, {shape.tokens} tokens; "
            "'=': both zero, 'new': the formulas have none):")
    return head + "\n" + format_table(lines, "lrrrrrrrrrl")
