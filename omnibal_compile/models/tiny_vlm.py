"""A small but realistic vision-language model (InternVL/LLaVA shaped) for demos, tests and benches.

Glossary:
    tile         one fixed-size image crop sent through the ViT (dynamic-resolution VLMs cut an
                 image into 1..N tiles); a batch carries a variable number of tiles.
    image token  a placeholder id in ``input_ids``; each tile becomes ``tokens_per_tile`` of them,
                 replaced by the projected tile features before the LLM runs.
    pixel shuffle  folds each 2x2 patch neighbourhood into one token (InternVL), so a tile of
                 ``(image_size / patch_size)**2`` patches becomes a quarter as many LLM tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnibal_compile._utils.labels import IGNORE_INDEX

__all__ = ["TinyVLMConfig", "TinyVLM", "make_example_batch"]



@dataclass(frozen=True, kw_only=True)
class TinyVLMConfig:
    """Sizes of the reference VLM. Defaults: ViT layers are ~4x cheaper than LLM layers."""

    image_size: int = 32
    """Tile side in pixels."""
    patch_size: int = 4
    """ViT patch side in pixels."""
    channels: int = 3
    """Image channels."""
    vit_hidden: int = 64
    """ViT width."""
    vit_layers: int = 4
    """Number of ViT blocks."""
    vit_heads: int = 4
    """ViT attention heads."""
    vit_mlp: int = 256
    """ViT MLP width."""
    shuffle: int = 2
    """Pixel-shuffle factor of the projector (2 => 4x fewer tokens per tile)."""
    llm_hidden: int = 128
    """LLM width."""
    llm_layers: int = 6
    """Number of LLM decoder layers."""
    llm_heads: int = 4
    """LLM query heads."""
    llm_kv_heads: int = 2
    """LLM key/value heads (grouped-query attention)."""
    llm_mlp: int = 384
    """LLM SwiGLU width."""
    vocab_size: int = 512
    """Vocabulary size, including the image placeholder token."""
    image_token_id: int = 511
    """Id of the image placeholder token in ``input_ids``."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-6
    """Epsilon of the norms."""

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        grid = self.image_size // self.patch_size
        if grid % self.shuffle:
            raise ValueError(f"patch grid {grid} must be a multiple of shuffle={self.shuffle}")
        if self.vit_hidden % self.vit_heads or self.llm_hidden % self.llm_heads:
            raise ValueError("vit_hidden/llm_hidden must be multiples of vit_heads/llm_heads")
        if self.llm_heads % self.llm_kv_heads:
            raise ValueError(f"llm_heads={self.llm_heads} must be a multiple of llm_kv_heads={self.llm_kv_heads}")
        if (self.llm_hidden // self.llm_heads) % 2:
            raise ValueError("LLM head dimension must be even for rotary embeddings")
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"image_token_id={self.image_token_id} must lie in [0, vocab_size={self.vocab_size})")

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens each tile becomes after pixel shuffle."""
        return self.patches_per_tile // self.shuffle**2


class ViTAttention(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.heads = cfg.vit_heads
        self.qkv = nn.Linear(cfg.vit_hidden, 3 * cfg.vit_hidden)
        self.proj = nn.Linear(cfg.vit_hidden, cfg.vit_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, c = x.shape
        q, k, v = self.qkv(x).view(n, p, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, p, c))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, LayerNorm, GELU MLP."""

    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.vit_hidden, eps=cfg.norm_eps)
        self.attn = ViTAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.vit_hidden, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.vit_hidden, cfg.vit_mlp)
        self.fc2 = nn.Linear(cfg.vit_mlp, cfg.vit_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cfg.channels, cfg.vit_hidden, cfg.patch_size, stride=cfg.patch_size)
        self.pos = nn.Parameter(torch.randn(1, cfg.patches_per_tile, cfg.vit_hidden) * 0.02)

    def reset_parameters(self) -> None:
        """Its own parameter's init (the convolution has its own): what a seeded start fills it with."""
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.conv(pixel_values).flatten(2).transpose(1, 2) + self.pos


class VisionEncoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.layers = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.vit_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    """Pixel shuffle, then LayerNorm + MLP to the LLM width (InternVL's ``mlp1``)."""

    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.shuffle = cfg.shuffle
        width = cfg.vit_hidden * cfg.shuffle**2
        self.norm = nn.LayerNorm(width, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(width, cfg.llm_hidden)
        self.fc2 = nn.Linear(cfg.llm_hidden, cfg.llm_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, c = x.shape
        g, s = math.isqrt(p), self.shuffle
        x = x.view(n, g // s, s, g // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // s) ** 2, s * s * c)
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LLMAttention(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.llm_heads, cfg.llm_kv_heads
        self.head_dim = cfg.llm_hidden // cfg.llm_heads
        self.q_proj = nn.Linear(cfg.llm_hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.llm_hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.llm_hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.llm_hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if cos.dtype != q.dtype:  # tables in fp32, applied in the model's dtype (bf16 too); no no-op cast traced
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.llm_hidden, cfg.llm_mlp, bias=False)
        self.up_proj = nn.Linear(cfg.llm_hidden, cfg.llm_mlp, bias=False)
        self.down_proj = nn.Linear(cfg.llm_mlp, cfg.llm_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.llm_hidden, cfg.norm_eps)
        self.attn = LLMAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.llm_hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.mlp(self.post_attn_norm(x))


class RotaryTable(nn.Module):
    inv_freq: torch.Tensor  # a buffer

    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        dim = cfg.llm_hidden // cfg.llm_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # [b, t, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [b, 1, t, dim]
        return emb.cos(), emb.sin()


class LanguageModel(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.llm_hidden)
        self.rotary = RotaryTable(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.llm_layers))
        self.norm = RMSNorm(cfg.llm_hidden, cfg.norm_eps)

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        t = embeds.shape[1]
        # Causal within each packed sample, never across samples: [b, 1, t, t] boolean.
        causal = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()
        same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
        mask = (causal & same).unsqueeze(1)
        cos, sin = self.rotary(position_ids)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class TinyVLM(nn.Module):
    """ViT over tiles -> pixel-shuffle projector -> decoder LLM with image tokens spliced in.

    ``forward(pixel_values [N, C, H, W], input_ids [B, T], labels [B, T] | None, position_ids,
    segment_ids)`` returns the mean next-token cross-entropy over labelled positions (labels of
    -100 are ignored), or the logits when ``labels`` is None. ``input_ids`` must hold exactly
    ``N * tokens_per_tile`` image tokens. ``position_ids``/``segment_ids`` describe packed
    sequences (defaults: one sample per row).
    """

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or TinyVLMConfig()
        self.vision = VisionEncoder(cfg)
        self.projector = Projector(cfg)
        self.llm = LanguageModel(cfg)
        self.lm_head = nn.Linear(cfg.llm_hidden, cfg.vocab_size, bias=False)

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        b, t = input_ids.shape
        image_mask = input_ids == cfg.image_token_id
        if not torch.compiler.is_exporting() and not torch.jit.is_tracing():
            expected = pixel_values.shape[0] * cfg.tokens_per_tile
            found = int(image_mask.sum())
            if found != expected:
                raise ValueError(
                    f"input_ids hold {found} image tokens (id {cfg.image_token_id}) but pixel_values has "
                    f"{pixel_values.shape[0]} tiles x {cfg.tokens_per_tile} tokens per tile = {expected}"
                )
        vision = self.projector(self.vision(pixel_values))
        embeds = self.llm.embed_tokens(input_ids)
        embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), vision.reshape(-1, cfg.llm_hidden).to(embeds.dtype))
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        logits = self.lm_head(self.llm(embeds, position_ids, segment_ids))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )


def make_example_batch(
    config: TinyVLMConfig | None = None,
    *,
    batch: int = 2,
    tiles_per_sample: int = 2,
    text_tokens: int = 32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random batch: each row holds ``tiles_per_sample`` tiles' image tokens followed by text.

    Labels are -100 on image tokens, as in LLaVA/InternVL training.
    """
    cfg = config or TinyVLMConfig()
    if batch < 1 or tiles_per_sample < 0 or text_tokens < 2:
        raise ValueError("need batch >= 1, tiles_per_sample >= 0 and text_tokens >= 2")
    g = torch.Generator().manual_seed(seed)
    n_img = tiles_per_sample * cfg.tokens_per_tile
    text = torch.randint(0, cfg.image_token_id, (batch, text_tokens), generator=g)
    image = torch.full((batch, n_img), cfg.image_token_id)
    input_ids = torch.cat([image, text], dim=1)
    labels = input_ids.clone()
    labels[:, :n_img] = IGNORE_INDEX
    pixel_values = torch.randn(batch * tiles_per_sample, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    return {"pixel_values": pixel_values, "input_ids": input_ids, "labels": labels}
