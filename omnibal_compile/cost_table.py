"""Cost types shared by the cost pass (producer) and the planners and simulator (consumers).

Torch-free on purpose: the solver modules import only this. All figures are per micro-batch of
the planned shape unless a field says otherwise.

Glossary:
    recompute option  ``none`` keeps every activation for backward; ``selective`` keeps matmul
                      outputs and recomputes cheap ops (norms, activations, softmax); ``full``
                      keeps only the block's input and reruns the whole block before backward.
    static bytes      weights + gradients + optimizer states held by the device for the block,
                      independent of the number of micro-batches in flight.
    precision         bytes per parameter for weights, gradients, fp32 master copy and optimizer
                      states, with optional sharding of the last two over data-parallel ranks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from omnibal_compile.errors import InputError
from omnibal_compile.tables import format_table

__all__ = ["RECOMPUTE_OPTIONS", "BlockCost", "CostTable", "Precision", "BF16_ADAM", "FP32_ADAM"]

RECOMPUTE_OPTIONS: tuple[str, ...] = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """What one block costs in time and memory."""

    name: str
    """Block name, as in the block graph and the plan."""
    kind: str
    """``layer``, ``module`` or ``glue``."""
    flops: float
    """Forward FLOPs per micro-batch."""
    num_params: int
    """Parameter elements."""
    static_bytes: int
    """Weights + gradients + optimizer states on the device (after any optimizer sharding)."""
    forward_s: float
    """Forward time per micro-batch, seconds."""
    backward_s: float
    """Backward time per micro-batch without recomputation, seconds."""
    activation_bytes: Mapping[str, int]
    """Bytes kept alive from forward to backward, per recompute option (keys: RECOMPUTE_OPTIONS)."""
    recompute_s: Mapping[str, float]
    """Extra time each recompute option adds per micro-batch (``none`` -> 0)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_bytes", dict(self.activation_bytes))
        object.__setattr__(self, "recompute_s", dict(self.recompute_s))
        for what, d in (("activation_bytes", self.activation_bytes), ("recompute_s", self.recompute_s)):
            missing = [o for o in RECOMPUTE_OPTIONS if o not in d]
            if missing:
                raise InputError(f"block '{self.name}': {what} lacks recompute options {missing}")
            if any(v < 0 for v in d.values()):
                raise InputError(f"block '{self.name}': {what} has a negative entry {d}")
        if self.forward_s < 0 or self.backward_s < 0 or self.static_bytes < 0:
            raise InputError(f"block '{self.name}': times and bytes must be non-negative")


@dataclass(frozen=True, kw_only=True)
class CostTable:
    """Costs of every block of a model, plus what crosses each cut, for one micro-batch shape."""

    blocks: tuple[BlockCost, ...]
    """One entry per block, in chain order."""
    cut_bytes: tuple[int, ...]
    """``cut_bytes[k]``: bytes sent across cut k (between block k-1 and k); entries 0 and n are 0."""
    link_bandwidth: float
    """Bytes per second between adjacent pipeline stages."""
    device: str
    """Device the times are for (``cpu``, ``a100-80gb``, ...)."""
    source: str
    """``profiled`` (measured here) or ``roofline`` (modelled for a target device)."""
    batch_shape: Mapping[str, int] = field(default_factory=dict)
    """Micro-batch shape the costs were taken at (e.g. tiles, tokens)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "cut_bytes", tuple(int(b) for b in self.cut_bytes))
        object.__setattr__(self, "batch_shape", dict(self.batch_shape))
        if len(self.cut_bytes) != len(self.blocks) + 1:
            raise InputError(f"cut_bytes needs {len(self.blocks) + 1} entries (one per cut incl. both ends), got {len(self.cut_bytes)}")
        if self.link_bandwidth <= 0:
            raise InputError(f"link_bandwidth must be positive, got {self.link_bandwidth}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def send_s(self, cut: int) -> float:
        """Seconds to send what crosses ``cut`` to the next stage."""
        return self.cut_bytes[cut] / self.link_bandwidth

    def summary(self) -> str:
        """Per-block table: forward/backward ms, GFLOPs, static and activation MiB per option."""
        mib = 1 / 2**20
        rows = [("#", "block", "fwd ms", "bwd ms", "GFLOP", "static MiB", "act none/sel/full MiB", "recomp ms sel/full")]
        for i, b in enumerate(self.blocks):
            a, r = b.activation_bytes, b.recompute_s
            rows.append((
                str(i), b.name, f"{b.forward_s * 1e3:.3f}", f"{b.backward_s * 1e3:.3f}", f"{b.flops / 1e9:.4f}",
                f"{b.static_bytes * mib:.2f}",
                f"{a['none'] * mib:.2f}/{a['selective'] * mib:.2f}/{a['full'] * mib:.2f}",
                f"{r['selective'] * 1e3:.3f}/{r['full'] * 1e3:.3f}",
            ))
        title = f"costs on {self.device} ({self.source}), micro-batch {dict(self.batch_shape)}"
        return title + "\n" + format_table(rows, "rl" + "r" * (len(rows[0]) - 2))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostTable:
        data = dict(data)
        data["blocks"] = tuple(BlockCost(**b) for b in data["blocks"])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per parameter of what training holds for it; the optimizer part may be sharded."""

    weight_bytes: int = 2
    """Bytes of the working weight (bf16: 2)."""
    grad_bytes: int = 2
    """Bytes of its gradient."""
    master_bytes: int = 4
    """Bytes of an fp32 master copy (0 when weights are already fp32)."""
    optimizer_bytes: int = 8
    """Bytes of optimizer states (Adam: two fp32 moments = 8)."""
    optimizer_shards: int = 1
    """Data-parallel ranks the master copy and optimizer states are sharded over (ZeRO-1); 1 = none."""

    def __post_init__(self) -> None:
        if min(self.weight_bytes, self.grad_bytes, self.master_bytes, self.optimizer_bytes) < 0:
            raise InputError(f"precision byte counts must be >= 0, got {self}")
        if self.optimizer_shards < 1:
            raise InputError(f"optimizer_shards must be >= 1 (data-parallel ranks), got {self.optimizer_shards}")

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + (self.master_bytes + self.optimizer_bytes) / self.optimizer_shards


BF16_ADAM = Precision()
"""bf16 weights and gradients, fp32 master weights and Adam moments: 16 bytes/parameter."""
FP32_ADAM = Precision(weight_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8)
"""fp32 weights, gradients and Adam moments: 16 bytes/parameter."""
