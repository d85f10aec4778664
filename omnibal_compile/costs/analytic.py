"""Paper-scale vision-language models as analytic block lists: costs without weights or tracing.

InternVL-Chat-1.5-class models (InternViT-6B + MLP projector + InternLM2-20B or a Yi-34B-shaped
LLM) and LLaVA-1.5 (CLIP ViT-L/14-336 + Vicuna-7B/13B) are described by their shapes only. Every
block's forward FLOPs, parameters, activation bytes per recompute option and roofline times on a
target GPU (:mod:`omnibal_compile.costs.devices`, its peak, bandwidth and calibration) are computed from
closed formulas, vectorised over micro-batch shapes, and returned as a :class:`CostTable` for
one shape (:func:`cost_table`) or as arrays over many (:func:`type_costs`).

Glossary:
    block type      ``vision.embed``, ``vision.layer``, ``projector``, ``llm.embed``, ``llm.layer``,
                    ``llm.head``; every layer of a stack costs the same, so costs are computed once
                    per type. Chain: vision.embed, vision.layers.0..L-1, projector, llm.embed,
                    llm.layers.0..L-1, llm.head.
    micro-batch     :class:`MicroBatch`: image tiles through the ViT, LLM tokens computed (text plus
                    image tokens, padding included for padded batches) and causal attention pairs.
    t, w, f, kvd    tokens through the block, width, MLP width, key/value width (kv_heads x head dim).
    FLOPs           2 x tokens x in x out per linear layer; attention 4 x w x pairs (QK^T and AV);
                    ViT attention is bidirectional per tile (P^2 pairs), LLM attention causal.
    activation bytes  16-bit activations kept for backward, counted tensor by tensor as in
                    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
                    Models" (MLSys 2023, Sec. 4.1), generalised to GQA, any MLP width and SwiGLU:
                    ``none`` per layer t x [2w norm-1 in + 2w QKV in + 2(w + 2 kvd) Q,K,V + 2w
                    out-proj in + 2w norm-2 in + 2w MLP in + MLP (GELU 4f, SwiGLU 6f)] + attention
                    scores + dropout masks. For their GPT layer (MHA, GELU f = 4w, dropout, no flash
                    attention) this is their s b h (34 + 5 a s / h). With flash attention (the
                    default here, as Megatron and InternVL train) the 5 a s^2 b score term becomes
                    a 4 a s b fp32 log-sum-exp. ``selective`` (this library's convention, as in the
                    cost pass): matmul and attention outputs kept, norms, activation functions,
                    residual adds and softmax rerun: drops the norm outputs (4w), the residual sum
                    feeding norm 2 (2w), the MLP activation output (2f) and any score term, and
                    adds the two matmul outputs only a residual add reads (out-proj, MLP down: 4w),
                    which the policy keeps too. ``full``: the block input, 2 t w.
                    ``VLMSpec.kernels="eager"`` counts what Hugging Face's unfused PyTorch code
                    keeps instead (see :func:`layer_activation_bytes`); the cost pass measures the
                    same on the model's code (``bench/plan_at_scale.py`` compares the two).
    time            per op the roofline ``max(FLOPs / peak, bytes / bandwidth) / calibration`` of its
                    class (matmul, attention, memory); backward = 2 x forward and selective
                    recompute = the memory-class ops, as the cost pass's roofline does.
    static bytes    parameters x ``Precision.bytes_per_param`` (bf16 weights and gradients, fp32
                    master weights and Adam moments: 16 B, the last 12 optionally sharded, ZeRO-1).
    tensor parallel ``tensor_parallel = k`` > 1: Megatron tensor parallelism with sequence
                    parallelism over k GPUs of one node. Per device, FLOPs, op times, parameters,
                    activation bytes (Korthikanti et al.'s s b h (34 / k + 5 a s / (h k))) and the
                    bytes sent to the next stage are 1/k of the whole; each transformer layer adds
                    4 collectives per forward (all-gather before and reduce-scatter after attention
                    and MLP) and as many in the backward, the other blocks 1 (projector 2), each
                    moving ``(k - 1) / k`` of its 16-bit activation over NVLink, not overlapped with
                    compute. Head counts are not checked against k (InternViT-6B's 25 heads do not
                    split evenly in 2 or 4; the study assumes an even split). Collective time is
                    :func:`~omnibal_compile.ir.costs.ring_collective_s`, the rule the compiler's tables
                    use too (:mod:`omnibal_compile.costs.tensor_parallel`, which models the runtime:
                    no sequence parallelism, so 2 all-reduces per layer and direction, the same 4 ring
                    passes, and activations not divided).
    planner's facts :func:`tensor_parallel_blocks`: what the tensor-parallel pass would report
                    (``TensorParallelReport.blocks()``) for these shapes, for the planner's rule: per layer
                    an attention pair (q, k, v column-wise, out row-wise) and an MLP pair (fc1, or gate
                    and up, column-wise; fc2 / down row-wise), the projector's MLP pair; a pair whose
                    heads (or key/value heads, or MLP width) ``tp`` does not divide stays replicated, as
                    the pass refuses to cut across a head. q, k and v are taken as separate layers (as
                    Llama-style code has them); InternViT's and InternLM2's own code fuses them into one
                    weight, which the pass leaves replicated today. Embeddings, the head and the patch
                    embedding carry no pair (vocabulary-parallel parts are not in the pass's cost facts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from omnibal_compile.costs.devices import A100_80G, DeviceSpec
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import (
    BF16_ADAM,
    RECOMPUTE_OPTIONS,
    BlockCost,
    CostTable,
    Precision,
    TensorParallelBlock,
    ring_collective_s,
)

__all__ = [
    "VisionSpec",
    "LLMSpec",
    "ProjectorSpec",
    "VLMSpec",
    "MicroBatch",
    "TypeCosts",
    "BLOCK_TYPES",
    "INTERNVIT_6B",
    "INTERNLM2_20B",
    "YI_34B",
    "CLIP_VIT_L_336",
    "VICUNA_7B",
    "VICUNA_13B",
    "INTERNVL_6B_20B",
    "INTERNVL_6B_34B",
    "LLAVA15_7B",
    "LLAVA15_13B",
    "SCALE_MODELS",
    "layer_activation_bytes",
    "type_costs",
    "tensor_parallel_costs",
    "tensor_parallel_blocks",
    "tensor_parallel_replicated",
    "cost_table",
    "table_from_type_costs",
]

BLOCK_TYPES: tuple[str, ...] = ("vision.embed", "vision.layer", "projector", "llm.embed", "llm.layer", "llm.head")


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """A ViT encoder, tile by tile."""

    name: str
    """Model name."""
    layers: int
    """Transformer layers."""
    width: int
    """Hidden size."""
    mlp: int
    """MLP hidden size (GELU MLP: two matmuls)."""
    heads: int
    """Attention heads (MHA)."""
    patch_size: int
    """Patch side in pixels (the patch embedding is a conv with this kernel and stride)."""
    tokens_per_tile: int
    """Tokens per tile through the layers (patches + class token)."""
    activation: str = "gelu"
    """MLP activation: ``gelu`` or ``quick_gelu`` (``x * sigmoid(1.702 x)``, CLIP's)."""


@dataclass(frozen=True, kw_only=True)
class LLMSpec:
    """A decoder-only language model with SwiGLU MLP, RMSNorm, rotary embeddings and GQA."""

    name: str
    """Model name."""
    layers: int
    """Decoder layers."""
    width: int
    """Hidden size."""
    mlp: int
    """SwiGLU intermediate size (three matmuls)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (= heads for MHA)."""
    vocab: int
    """Vocabulary size (untied embedding and output head)."""


@dataclass(frozen=True, kw_only=True)
class ProjectorSpec:
    """Vision-to-language MLP: (LayerNorm) -> Linear(in, hidden) -> GELU -> Linear(hidden, out)."""

    in_width: int
    """Input width per image token (ViT width x 4 after InternVL's 0.5 pixel shuffle)."""
    hidden: int
    """Hidden width."""
    out_width: int
    """Output width (the LLM's hidden size)."""
    norm: bool
    """Whether a LayerNorm precedes the first linear layer (InternVL: yes; LLaVA-1.5: no)."""


@dataclass(frozen=True, kw_only=True)
class VLMSpec:
    """ViT -> projector -> LLM, as one chain of blocks."""

    name: str
    """Model name, e.g. ``internvl-6b-20b``."""
    vision: VisionSpec
    """The vision encoder."""
    projector: ProjectorSpec
    """The projector."""
    llm: LLMSpec
    """The language model."""
    image_tokens_per_tile: int
    """LLM tokens one tile becomes (InternVL: 256 after pixel shuffle; LLaVA-1.5: 576)."""
    flash_attention: bool = True
    """Fused attention that keeps no score matrix (Megatron's and InternVL's training setting)."""
    dropout: bool = False
    """Whether dropout masks are kept (1 byte per element, Korthikanti's count); none in these models."""
    kernels: str = "fused"
    """``fused``: norms and activation functions as single kernels that keep only their inputs
    (Megatron, InternVL training); ``eager``: as Hugging Face's PyTorch code runs them (RMSNorm's
    fp32 copy and normalised output kept, unfused SwiGLU and QuickGELU keep their intermediate
    outputs, attention computed over every (query, key) pair under an explicit causal mask)."""

    def __post_init__(self) -> None:
        if self.kernels not in ("fused", "eager"):
            raise InputError(f"kernels must be 'fused' or 'eager', got {self.kernels!r}")

    @property
    def num_blocks(self) -> int:
        return self.vision.layers + self.llm.layers + 4

    def block_types(self) -> tuple[str, ...]:
        """Type of each block, in chain order."""
        return (
            ("vision.embed",) + ("vision.layer",) * self.vision.layers + ("projector", "llm.embed")
            + ("llm.layer",) * self.llm.layers + ("llm.head",)
        )

    def block_names(self) -> tuple[str, ...]:
        return (
            ("vision.embed",) + tuple(f"vision.layers.{i}" for i in range(self.vision.layers))
            + ("projector", "llm.embed") + tuple(f"llm.layers.{i}" for i in range(self.llm.layers)) + ("llm.head",)
        )

    def type_params(self) -> dict[str, int]:
        """Parameters of one block of each type (weights; biases and norm scales included where they exist)."""
        v, p, m = self.vision, self.projector, self.llm
        kvd = m.width // m.heads * m.kv_heads
        return {
            "vision.embed": 3 * v.patch_size**2 * v.width + v.width + v.tokens_per_tile * v.width,
            "vision.layer": 4 * v.width**2 + 2 * v.width * v.mlp + 9 * v.width + v.mlp,
            "projector": (2 * p.in_width if p.norm else 0) + p.in_width * p.hidden + p.hidden
            + p.hidden * p.out_width + p.out_width,
            "llm.embed": m.vocab * m.width,
            "llm.layer": 2 * m.width**2 + 2 * m.width * kvd + 3 * m.width * m.mlp + 2 * m.width,
            "llm.head": m.vocab * m.width + m.width,
        }

    def num_params(self) -> int:
        per = self.type_params()
        return sum(per[t] for t in self.block_types())


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One micro-batch's shape: what the ViT and the LLM compute."""

    tiles: int
    """Image tiles through the vision encoder."""
    tokens: int
    """LLM tokens computed (image tokens included; padding included for padded batches)."""
    attention_pairs: float
    """Causal (query, key) pairs the LLM attends over, summed over sequences (t(t+1)/2 per sequence)."""

    def __post_init__(self) -> None:
        if self.tiles < 0 or self.tokens < 1 or self.attention_pairs < 0:
            raise InputError(f"micro-batch needs tiles >= 0, tokens >= 1, pairs >= 0; got {self}")


@dataclass(frozen=True, kw_only=True)
class TypeCosts:
    """Per block type, arrays over micro-batches (one entry per shape)."""

    flops: dict[str, np.ndarray]
    """Forward FLOPs (per device under tensor parallelism)."""
    forward_s: dict[str, np.ndarray]
    """Forward seconds on the device (tensor-parallel collectives included)."""
    backward_s: dict[str, np.ndarray]
    """Backward seconds: twice the forward's compute plus its tensor-parallel collectives once more."""
    selective_s: dict[str, np.ndarray]
    """Extra seconds of selective recomputation (the memory-class ops rerun)."""
    activation_bytes: dict[str, dict[str, np.ndarray]]
    """Bytes kept for backward, per recompute option."""
    out_bytes: dict[str, np.ndarray]
    """Bytes the block sends on (its output, 16-bit)."""
    weight_s: dict[str, np.ndarray] | None = None
    """W, the weight-gradient part of ``backward_s``: the forward time of the block's weight matmuls (a matmul's
    backward FLOPs split 1:1 between the input's and the weight's gradient); None when not modelled."""

    def time(self, block_type: str, option: str) -> np.ndarray:
        """Forward + backward + recompute seconds of one block of ``block_type`` under ``option``."""
        f = self.forward_s[block_type]
        extra = {"none": 0.0, "selective": self.selective_s[block_type], "full": f}[option]
        return f + self.backward_s[block_type] + extra


def layer_activation_bytes(
    tokens: np.ndarray, sq_tokens: np.ndarray, *, width: int, kv_width: int, mlp: int, heads: int, swiglu: bool,
    flash: bool, dropout: bool, eager: bool = False, rms_norm: bool = False, quick_gelu: bool = False,
) -> dict[str, np.ndarray]:
    """Activation bytes of one transformer layer per recompute option (module glossary).

    ``tokens``: t, tokens through the layer; ``sq_tokens``: sum over sequences of s^2 (for the
    score term without flash attention). ``eager``: unfused kernels as Hugging Face's code runs
    them (``VLMSpec.kernels``): each RMSNorm (``rms_norm``) also keeps its fp32 copy of the input
    and its normalised output (4w + 2w); SwiGLU also keeps ``silu(gate)`` (2f); QuickGELU
    (``quick_gelu``) keeps its sigmoid and product (4f instead of GELU's 2f); k and v are kept
    repeated to every query head.
    """
    t = np.asarray(tokens, dtype=np.float64)
    act = 6 * mlp if swiglu else 4 * mlp  # SwiGLU keeps gate and up outputs and their product
    act_dropped = 2 * mlp  # the activation function's output, rerun by selective recomputation
    norms = 0
    if eager:
        if swiglu or quick_gelu:
            act += 2 * mlp  # silu(gate), or QuickGELU's sigmoid, kept beside the product
            act_dropped += 2 * mlp
        if rms_norm:
            # Each norm keeps an fp32 copy of its input and its normalised output (4w + 2w); the
            # second's bf16 input (the residual sum, 2w above) is then not kept: 12w - 2w.
            norms = 2 * (4 + 2) * width - 2 * width
    # Eager code under an explicit mask repeats k and v to every head before attention (SDPA's own
    # grouped-query path takes no mask), and attention keeps the copies.
    kv_kept = width if eager else kv_width
    per_token = 2 * width + 2 * width + 2 * (width + 2 * kv_kept) + 2 * width + 2 * width + 2 * width + act + norms
    if dropout:
        per_token += 2 * width  # attention-output and MLP-output dropout masks, 1 byte each
    scores = 4.0 * heads * t if flash else (5.0 if dropout else 4.0) * heads * np.asarray(sq_tokens, dtype=np.float64)
    none = t * per_token + scores
    # Rerun: norm outputs (QKV and MLP inputs), the residual sum feeding norm 2, the activation's output.
    dropped = 4 * width + 2 * width + act_dropped + norms + 4 * (kv_kept - kv_width)  # (repeated k, v rerun too)
    # The policy keeps every matmul output, also the two only a residual add reads (out-proj, MLP down).
    cached = 4 * width
    selective = none - t * (dropped - cached) - (0.0 if flash else scores)
    return {"none": none, "selective": selective, "full": 2.0 * width * t}


class _Ops:
    """Accumulates a block's ops as (class, FLOPs, bytes) arrays and costs them on a device (one GPU, no
    tensor parallelism: :func:`tensor_parallel_costs` splits the totals)."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.flops: np.ndarray | float = 0.0
        self.forward: np.ndarray | float = 0.0
        self.memory: np.ndarray | float = 0.0
        self.weight: np.ndarray | float = 0.0  # forward time of the matmuls with weights: their W

    def _time(self, op_class: str, flops: np.ndarray | float, nbytes: np.ndarray | float) -> np.ndarray:
        # The roofline of DeviceSpec.op_time, on arrays.
        ideal = np.maximum(np.asarray(flops) / self.spec.peak_flops, np.asarray(nbytes) / self.spec.memory_bandwidth)
        return ideal / self.spec.calibration[op_class]

    def linear(self, t: np.ndarray, n_in: int, n_out: int) -> None:
        f = 2.0 * t * n_in * n_out
        self.flops = self.flops + f
        dt = self._time("matmul", f, 2.0 * (t * n_in + n_in * n_out + t * n_out))
        self.forward = self.forward + dt
        self.weight = self.weight + dt

    def attention(self, t: np.ndarray, pairs: np.ndarray, width: int, kv_width: int) -> None:
        f = 4.0 * width * pairs
        self.flops = self.flops + f
        self.forward = self.forward + self._time("attention", f, 2.0 * t * (2 * width + 2 * kv_width))

    def elementwise(self, nbytes: np.ndarray, *, rerun: bool) -> None:
        dt = self._time("memory", 0.0, nbytes)
        self.forward = self.forward + dt
        if rerun:
            self.memory = self.memory + dt


def _zeros(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x, dtype=np.float64)


def _check_shapes(tiles: np.ndarray, tokens: np.ndarray, attention_pairs: np.ndarray) -> tuple[np.ndarray, ...]:
    tiles = np.atleast_1d(np.asarray(tiles, dtype=np.float64))
    tokens = np.atleast_1d(np.asarray(tokens, dtype=np.float64))
    pairs = np.atleast_1d(np.asarray(attention_pairs, dtype=np.float64))
    if not tiles.shape == tokens.shape == pairs.shape:
        raise InputError(f"tiles, tokens and pairs differ in shape: {tiles.shape}, {tokens.shape}, {pairs.shape}")
    return tiles, tokens, pairs


def type_costs(
    model: VLMSpec,
    tiles: np.ndarray,
    tokens: np.ndarray,
    attention_pairs: np.ndarray,
    *,
    device: DeviceSpec = A100_80G,
    tensor_parallel: int = 1,
) -> TypeCosts:
    """Costs of one block of every type for each micro-batch shape (arrays of equal length), per device of
    ``tensor_parallel`` (module glossary)."""
    tiles, tokens, pairs = _check_shapes(tiles, tokens, attention_pairs)
    v, p, m = model.vision, model.projector, model.llm
    eager = model.kernels == "eager"
    flops: dict[str, np.ndarray] = {}
    fwd: dict[str, np.ndarray] = {}
    bwd: dict[str, np.ndarray] = {}
    sel: dict[str, np.ndarray] = {}
    wgt: dict[str, np.ndarray] = {}
    act: dict[str, dict[str, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}

    def store(name: str, ops: _Ops, activation: dict[str, np.ndarray], out_bytes: np.ndarray) -> None:
        flops[name] = ops.flops + _zeros(tiles)
        fwd[name] = ops.forward + _zeros(tiles)
        bwd[name] = 2 * ops.forward + _zeros(tiles)
        sel[name] = ops.memory + _zeros(tiles)
        wgt[name] = ops.weight + _zeros(tiles)
        act[name] = {o: np.maximum(activation[o], 0.0) + _zeros(tiles) for o in RECOMPUTE_OPTIONS}
        out[name] = out_bytes + _zeros(tiles)

    # Vision: every tile is its own sequence of P tokens, attended bidirectionally.
    P = v.tokens_per_tile
    tv = tiles * P
    ops = _Ops(device)
    ops.linear(tiles * (P - 1), 3 * v.patch_size**2, v.width)  # patch conv as a matmul
    ops.elementwise(tv * 6 * v.width, rerun=False)  # class token, position embedding add
    nothing = {o: _zeros(tiles) for o in RECOMPUTE_OPTIONS}  # pixels are a model input, not charged
    store("vision.embed", ops, nothing, 2.0 * tv * v.width)

    ops = _Ops(device)
    ops.linear(tv, v.width, 3 * v.width)
    ops.attention(tv, tiles * P * P, v.width, v.width)
    ops.linear(tv, v.width, v.width)
    ops.linear(tv, v.width, v.mlp)
    ops.linear(tv, v.mlp, v.width)
    ops.elementwise(tv * 2 * 4 * v.width, rerun=True)  # two norms: read and write 2w bytes each
    ops.elementwise(tv * 4 * v.mlp, rerun=True)  # GELU
    ops.elementwise(tv * 2 * 6 * v.width, rerun=False)  # two residual adds (layer scale folded in)
    layer = layer_activation_bytes(tv, tiles * P * P, width=v.width, kv_width=v.width, mlp=v.mlp, heads=v.heads,
                                   swiglu=False, flash=model.flash_attention, dropout=model.dropout, eager=eager,
                                   quick_gelu=v.activation == "quick_gelu")
    store("vision.layer", ops, layer, 2.0 * tv * v.width)

    # Projector on the image tokens after pixel shuffle.
    ti = tiles * model.image_tokens_per_tile
    ops = _Ops(device)
    ops.elementwise(ti * 4 * p.in_width, rerun=False)  # pixel shuffle copy
    if p.norm:
        ops.elementwise(ti * 4 * p.in_width, rerun=True)
    ops.linear(ti, p.in_width, p.hidden)
    ops.elementwise(ti * 4 * p.hidden, rerun=True)
    ops.linear(ti, p.hidden, p.out_width)
    none = ti * (2 * p.in_width * (2 if p.norm else 1) + 4 * p.hidden)
    dropped = ti * (2 * p.in_width * (1 if p.norm else 0) + 2 * p.hidden)
    cached = 2.0 * ti * p.out_width  # the second linear's output: a matmul output, kept by the policy
    store("projector", ops, {"none": none, "selective": none - dropped + cached, "full": 2.0 * ti * p.in_width},
          2.0 * ti * p.out_width)

    # LLM.
    kvd = m.width // m.heads * m.kv_heads
    ops = _Ops(device)
    ops.elementwise(tokens * 2 * m.width * 2, rerun=False)  # gather + image-feature scatter
    store("llm.embed", ops, {o: _zeros(tiles) for o in RECOMPUTE_OPTIONS}, 2.0 * tokens * m.width)

    ops = _Ops(device)
    ops.linear(tokens, m.width, m.width + 2 * kvd)
    ops.elementwise(tokens * 4 * (m.width + kvd), rerun=True)  # rotary on q and k
    # Eager code attends under an explicit causal mask: the kernel computes every pair, s^2 per sequence.
    ops.attention(tokens, 2 * pairs - tokens if eager else pairs, m.width, kvd)
    ops.linear(tokens, m.width, m.width)
    ops.linear(tokens, m.width, 2 * m.mlp)
    ops.linear(tokens, m.mlp, m.width)
    ops.elementwise(tokens * 2 * 4 * m.width, rerun=True)  # two RMSNorms
    ops.elementwise(tokens * 6 * m.mlp, rerun=True)  # silu(gate) * up
    ops.elementwise(tokens * 2 * 6 * m.width, rerun=False)  # two residual adds
    # sum of s^2 over sequences from causal pairs sum s(s+1)/2: 2 pairs - tokens
    layer = layer_activation_bytes(tokens, 2 * pairs - tokens, width=m.width, kv_width=kvd, mlp=m.mlp, heads=m.heads,
                                   swiglu=True, flash=model.flash_attention, dropout=model.dropout, eager=eager,
                                   rms_norm=True)
    store("llm.layer", ops, layer, 2.0 * tokens * m.width)

    ops = _Ops(device)
    ops.elementwise(tokens * 4 * m.width, rerun=True)  # final RMSNorm
    ops.linear(tokens, m.width, m.vocab)
    ops.elementwise(tokens * m.vocab * 10.0, rerun=False)  # logits to fp32, softmax cross-entropy
    none = tokens * (4 * m.width + 4 * m.vocab + (6 * m.width if eager else 0))  # norm in, head in, fp32 logits
    # (eager: the final RMSNorm's fp32 copy and normalised output too)
    # selective: norm in, head in and the 16-bit logits (a matmul output) kept; the fp32 logits rerun.
    store(
        "llm.head",
        ops,
        {"none": none, "selective": tokens * (4.0 * m.width + 2.0 * m.vocab), "full": 2.0 * tokens * m.width},
        _zeros(tiles),
    )
    one_gpu = TypeCosts(
        flops=flops, forward_s=fwd, backward_s=bwd, selective_s=sel, activation_bytes=act, out_bytes=out,
        weight_s=wgt,
    )
    return tensor_parallel_costs(one_gpu, model, tiles, tokens, tensor_parallel=tensor_parallel, device=device)


def tensor_parallel_costs(
    costs: TypeCosts, model: VLMSpec, tiles: np.ndarray, tokens: np.ndarray, *, tensor_parallel: int,
    device: DeviceSpec = A100_80G,
) -> TypeCosts:
    """One GPU's ``costs`` (of micro-batches of ``tiles`` and ``tokens``) as one device of a Megatron
    tensor-parallel group of ``tensor_parallel`` with sequence parallelism (module glossary): work, memory
    and sends / k, plus the group's collectives in the forward and again in the backward. The one rule
    for the analytic costs and for tables the compiler produced (:mod:`bench.studies.compiled_costs`)."""
    tp = tensor_parallel
    if not isinstance(tp, int) or tp < 1:
        raise InputError(f"tensor_parallel must be a positive integer, got {tp!r}")
    if tp == 1:
        return costs
    tiles = np.atleast_1d(np.asarray(tiles, dtype=np.float64))
    tokens = np.atleast_1d(np.asarray(tokens, dtype=np.float64))
    v, p, m = model.vision, model.projector, model.llm
    tv, ti = tiles * v.tokens_per_tile, tiles * model.image_tokens_per_tile
    # 16-bit activation bytes each block all-gathers or reduce-scatters per forward: a layer 4 times
    # (before and after attention and MLP), the embeddings once (into or out of the sequence-parallel
    # layout), the projector twice (its input gathered, its output scattered), the head once.
    moved = {
        "vision.embed": 2.0 * tv * v.width, "vision.layer": 4 * 2.0 * tv * v.width,
        "projector": 2.0 * ti * p.in_width + 2.0 * ti * p.out_width, "llm.embed": 2.0 * tokens * m.width,
        "llm.layer": 4 * 2.0 * tokens * m.width, "llm.head": 2.0 * tokens * m.width,
    }
    comm = {t: ring_collective_s(b, tp, device.link_bandwidth("nvlink")) for t, b in moved.items()}
    return TypeCosts(
        flops={t: f / tp for t, f in costs.flops.items()},
        forward_s={t: f / tp + comm[t] for t, f in costs.forward_s.items()},
        backward_s={t: b / tp + comm[t] for t, b in costs.backward_s.items()},
        weight_s=None if costs.weight_s is None else {t: w / tp for t, w in costs.weight_s.items()},
        selective_s={t: s / tp for t, s in costs.selective_s.items()},
        activation_bytes={t: {o: a / tp for o, a in per.items()} for t, per in costs.activation_bytes.items()},
        out_bytes={t: o / tp for t, o in costs.out_bytes.items()},
    )


@dataclass(frozen=True, kw_only=True)
class _Pair:
    """A Megatron pair of a block type as the analytic shapes lay it out (module glossary, planner's facts)."""

    name: str
    columns: tuple[tuple[int, int], ...]
    """(in, out) features of each column-wise linear layer."""
    row: tuple[int, int]
    """(in, out) features of the row-wise linear layer."""
    heads: int = 0
    """Attention heads between the layers (0: an MLP pair)."""
    kv_heads: int = 0
    """Key/value heads (GQA)."""


def _pairs(model: VLMSpec) -> dict[str, tuple[_Pair, ...]]:
    """The candidate pairs of each block type (types not named have none)."""
    v, p, m = model.vision, model.projector, model.llm
    kvd = m.width // m.heads * m.kv_heads
    return {
        "vision.layer": (
            _Pair(name="attention", columns=((v.width, v.width),) * 3, row=(v.width, v.width), heads=v.heads,
                  kv_heads=v.heads),
            _Pair(name="MLP", columns=((v.width, v.mlp),), row=(v.mlp, v.width)),
        ),
        "projector": (_Pair(name="MLP", columns=((p.in_width, p.hidden),), row=(p.hidden, p.out_width)),),
        "llm.layer": (
            _Pair(name="attention", columns=((m.width, m.width), (m.width, kvd), (m.width, kvd)),
                  row=(m.width, m.width), heads=m.heads, kv_heads=m.kv_heads),
            _Pair(name="MLP", columns=((m.width, m.mlp),) * 2, row=(m.mlp, m.width)),
        ),
    }


def _refusal(pair: _Pair, tp: int) -> str:
    """Why the pass would leave ``pair`` replicated at ``tp`` (empty: it shards it)."""
    if pair.heads and (pair.heads % tp or pair.kv_heads % tp):
        kv = f" ({pair.kv_heads} key/value heads)" if pair.kv_heads != pair.heads else ""
        return f"its {pair.heads} heads{kv} do not split over tp={tp}"
    if pair.row[0] % tp:
        return f"its hidden width {pair.row[0]} does not split over tp={tp}"
    return ""


def tensor_parallel_replicated(model: VLMSpec, tp: int) -> dict[str, str]:
    """Per block type, the pairs the pass would leave replicated at ``tp`` and why, in words (module glossary)."""
    out = {}
    for kind, pairs in _pairs(model).items():
        why = [f"{p.name} pair replicated: {_refusal(p, tp)}" for p in pairs if _refusal(p, tp)]
        if why:
            out[kind] = "; ".join(why)
    return out


def tensor_parallel_blocks(model: VLMSpec, *, tiles: float, tokens: float, attention_pairs: float,
                           tp: int) -> dict[str, TensorParallelBlock]:
    """The tensor-parallel pass's facts at ``tp`` for every block of ``model`` with a sharded pair, by block name,
    from the shapes alone (module glossary, planner's facts), for one micro-batch of ``tiles`` tiles, ``tokens``
    LLM tokens and ``attention_pairs`` causal pairs (means may be fractional: the facts are linear in them).
    The same FLOP formulas as :func:`type_costs`, so a fully sharded block's share is 1; 16-bit activations."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 2:
        raise InputError(f"tp (tensor-parallel degree) must be an integer >= 2, got {tp!r}")
    if min(tiles, attention_pairs) < 0 or tokens < 1:
        raise InputError(f"the micro-batch needs tiles >= 0, tokens >= 1, pairs >= 0; got {tiles}, {tokens}, "
                         f"{attention_pairs}")
    v = model.vision
    pairs_llm = 2 * attention_pairs - tokens if model.kernels == "eager" else attention_pairs  # as type_costs
    through = {"vision.layer": tiles * v.tokens_per_tile, "projector": tiles * model.image_tokens_per_tile,
               "llm.layer": float(tokens)}
    attention = {"vision.layer": tiles * v.tokens_per_tile**2, "llm.layer": pairs_llm}  # (query, key) pairs
    facts: dict[str, TensorParallelBlock] = {}
    for kind, candidates in _pairs(model).items():
        t = through[kind]
        sharded = [p for p in candidates if not _refusal(p, tp)]
        if not sharded:
            continue
        flops = sum(2.0 * t * i * o for p in sharded for i, o in (*p.columns, p.row))
        flops += sum(4.0 * p.row[0] * attention[kind] for p in sharded if p.heads)  # QK^T and AV on its heads
        facts[kind] = TensorParallelBlock(
            pairs=len(sharded), backward_reduces=sum(len(p.columns) for p in sharded),
            params=sum(i * o for p in sharded for i, o in (*p.columns, p.row)),  # weights; biases stay whole
            flops=flops, forward_bytes=round(sum(2.0 * t * p.row[1] for p in sharded)),
            backward_bytes=round(sum(2.0 * t * i for p in sharded for i, _ in p.columns)))
    m = model.llm
    if m.vocab % tp == 0:  # the vocabulary-parallel parts (untied here), as the pass shards them
        facts["llm.embed"] = TensorParallelBlock(  # a lookup in its rows; the output all-reduced
            pairs=1, backward_reduces=0, params=m.vocab * m.width, flops=0.0,
            forward_bytes=round(2.0 * tokens * m.width), backward_bytes=0)
        facts["llm.head"] = TensorParallelBlock(  # the loss on the logits' shards: 3 fp32 all-reduces per token
            pairs=3, backward_reduces=1, params=m.vocab * m.width, flops=2.0 * tokens * m.width * m.vocab,
            forward_bytes=round(3 * 4.0 * tokens), backward_bytes=round(2.0 * tokens * m.width))
    return {name: facts[kind] for name, kind in zip(model.block_names(), model.block_types()) if kind in facts}


_TABLES: dict[tuple, CostTable] = {}


def cost_table(
    model: VLMSpec, shape: MicroBatch, *, device: DeviceSpec = A100_80G, precision: Precision = BF16_ADAM,
    link: str = "nvlink", tensor_parallel: int = 1,
) -> CostTable:
    """The model's :class:`CostTable` for one micro-batch shape on ``device`` (roofline; cached per shape);
    under ``tensor_parallel`` > 1, what one device of a tensor-parallel group holds and computes."""
    key = (model, shape, repr(device), precision, link, tensor_parallel)  # DeviceSpec holds a dict: key on its repr
    if key not in _TABLES:
        _TABLES[key] = _cost_table(model, shape, device=device, precision=precision, link=link, tp=tensor_parallel)
    return _TABLES[key]


def _cost_table(model: VLMSpec, shape: MicroBatch, *, device: DeviceSpec, precision: Precision, link: str,
                tp: int) -> CostTable:
    tc = type_costs(model, np.array([shape.tiles]), np.array([shape.tokens]), np.array([shape.attention_pairs]),
                    device=device, tensor_parallel=tp)
    return table_from_type_costs(model, tc, model.type_params(), shape, device=device, precision=precision, link=link,
                                 tensor_parallel=tp, source="roofline")


def table_from_type_costs(
    model: VLMSpec, costs: TypeCosts, params: Mapping[str, int], shape: MicroBatch, *, device: DeviceSpec,
    precision: Precision, link: str, tensor_parallel: int, source: str,
) -> CostTable:
    """The :class:`CostTable` of ``model``'s block chain from per-type ``costs`` of the one micro-batch ``shape``
    (already per device of ``tensor_parallel``) and per-type parameter counts of the whole model."""
    params = {k: round(v / tensor_parallel) for k, v in params.items()}
    blocks = []
    for name, kind in zip(model.block_names(), model.block_types()):
        f = float(costs.forward_s[kind][0])
        blocks.append(BlockCost(
            name=name,
            kind="layer" if kind.endswith(".layer") else "module",
            flops=float(costs.flops[kind][0]),
            num_params=params[kind],
            static_bytes=round(params[kind] * precision.bytes_per_param),
            forward_s=f,
            backward_s=float(costs.backward_s[kind][0]),
            weight_grad_s=None if costs.weight_s is None else float(costs.weight_s[kind][0]),
            activation_bytes={o: int(costs.activation_bytes[kind][o][0]) for o in RECOMPUTE_OPTIONS},
            recompute_s={"none": 0.0, "selective": float(costs.selective_s[kind][0]), "full": f},
        ))
    types = model.block_types()
    cuts = [0] + [int(costs.out_bytes[types[k - 1]][0]) for k in range(1, len(types))] + [0]
    return CostTable(
        blocks=tuple(blocks), cut_bytes=tuple(cuts), link_bandwidth=device.link_bandwidth(link), device=device.name,
        source=source,
        batch_shape={"tiles": shape.tiles, "tokens": shape.tokens, "attention_pairs": int(shape.attention_pairs)},
        precision=precision, tensor_parallel=tensor_parallel,
    )


# -- the models ---------------------------------------------------------------------------------
# Shapes from the models' published configs (Hugging Face config.json of each checkpoint).

INTERNVIT_6B = VisionSpec(name="InternViT-6B-448px", layers=45, width=3200, mlp=12800, heads=25, patch_size=14,
                          tokens_per_tile=1025)
"""InternViT-6B at 448 px: 32 x 32 patches of 14 px + a class token."""
INTERNLM2_20B = LLMSpec(name="InternLM2-20B", layers=48, width=6144, mlp=16384, heads=48, kv_heads=8, vocab=92544)
YI_34B = LLMSpec(name="Yi-34B", layers=60, width=7168, mlp=20480, heads=56, kv_heads=8, vocab=64000)
"""The 34B LLM of InternVL-Chat 6+34B (Nous-Hermes-2-Yi-34B), Yi-34B's shape."""
CLIP_VIT_L_336 = VisionSpec(name="CLIP-ViT-L/14-336", layers=24, width=1024, mlp=4096, heads=16, patch_size=14,
                            tokens_per_tile=577, activation="quick_gelu")
"""LLaVA-1.5's encoder: 24 x 24 patches + class token (LLaVA takes the penultimate layer; all 24 are costed)."""
VICUNA_7B = LLMSpec(name="Vicuna-7B", layers=32, width=4096, mlp=11008, heads=32, kv_heads=32, vocab=32000)
VICUNA_13B = LLMSpec(name="Vicuna-13B", layers=40, width=5120, mlp=13824, heads=40, kv_heads=40, vocab=32000)


def _internvl(name: str, llm: LLMSpec) -> VLMSpec:
    proj = ProjectorSpec(in_width=4 * INTERNVIT_6B.width, hidden=llm.width, out_width=llm.width, norm=True)
    return VLMSpec(name=name, vision=INTERNVIT_6B, projector=proj, llm=llm, image_tokens_per_tile=256)


def _llava(name: str, llm: LLMSpec) -> VLMSpec:
    proj = ProjectorSpec(in_width=CLIP_VIT_L_336.width, hidden=llm.width, out_width=llm.width, norm=False)
    return VLMSpec(name=name, vision=CLIP_VIT_L_336, projector=proj, llm=llm, image_tokens_per_tile=576)


INTERNVL_6B_20B = _internvl("internvl-6b-20b", INTERNLM2_20B)
"""InternVL-Chat-1.5 (6+20B): pixel shuffle 0.5 gives 256 tokens of width 4 x 3200 per tile."""
INTERNVL_6B_34B = _internvl("internvl-6b-34b", YI_34B)
LLAVA15_7B = _llava("llava-1.5-7b", VICUNA_7B)
"""LLaVA-1.5-7B: one 336 px image = 576 tokens; its projector has no norm (mlp2x_gelu)."""
LLAVA15_13B = _llava("llava-1.5-13b", VICUNA_13B)

SCALE_MODELS: dict[str, VLMSpec] = {m.name: m for m in (INTERNVL_6B_20B, INTERNVL_6B_34B, LLAVA15_7B, LLAVA15_13B)}
"""Paper-scale models by name."""
