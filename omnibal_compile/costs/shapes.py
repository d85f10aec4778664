"""Shape-aware costs: cost tables at several batch shapes -> a per-block model for any shape.

Glossary:
    batch shape    what varies between VLM micro-batches: image ``tiles`` and ``text_tokens`` in
                   the micro-batch, spread over ``sequences`` rows.
    features       ``1, tiles, text_tokens, attention`` with ``attention = L**2 / sequences`` and
                   ``L = tiles * tokens_per_tile + text_tokens`` the LLM tokens: the linear work of
                   every layer plus the quadratic work of causal attention over each row.
    shape model    per block and per quantity (forward/backward/recompute time, FLOPs, activation
                   bytes) non-negative coefficients on the features, fitted by least squares on
                   relative error; cut bytes likewise per cut.
    fit error      largest relative error of the fitted step time (sum of forward + backward over
                   blocks) on the fitted shapes; :meth:`ShapeCostModel.errors` measures it on
                   held-back shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import RECOMPUTE_OPTIONS, BlockCost, CostTable

__all__ = ["BatchShape", "ShapeCostModel", "fit_nonnegative", "fit_shape_model", "fit_shape_costs"]

FEATURES: tuple[str, ...] = ("1", "tiles", "text_tokens", "attention")


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    """Load of one micro-batch."""

    tiles: int
    """Image tiles in the micro-batch."""
    text_tokens: int
    """Text tokens in the micro-batch."""
    sequences: int = 1
    """Rows (packed sequences) the tokens are spread over."""

    def __post_init__(self) -> None:
        if self.tiles < 0 or self.text_tokens <= 0 or self.sequences <= 0:
            raise InputError(
                f"batch shape {self} has a zero-size or negative dimension: need tiles >= 0, text_tokens >= 1 "
                "and sequences >= 1"
            )

    def features(self, tokens_per_tile: int) -> tuple[float, float, float, float]:
        tokens = self.tiles * tokens_per_tile + self.text_tokens
        return (1.0, float(self.tiles), float(self.text_tokens), tokens**2 / self.sequences)

    def as_dict(self) -> dict[str, int]:
        return {"tiles": self.tiles, "text_tokens": self.text_tokens, "sequences": self.sequences}


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error with coefficients >= 0 (drop the most negative, refit)."""
    w = 1.0 / np.maximum(np.abs(y), max(float(np.abs(y).max()), 1e-30) * 1e-6)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # column scaling for conditioning
    xs = x / scale * w[:, None]
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale


def _quantities(table: CostTable) -> dict[str, list[float]]:
    q: dict[str, list[float]] = {
        "forward_s": [b.forward_s for b in table.blocks],
        "backward_s": [b.backward_s for b in table.blocks],
        "flops": [b.flops for b in table.blocks],
        "cut_bytes": [float(c) for c in table.cut_bytes],
    }
    for opt in RECOMPUTE_OPTIONS:
        q[f"activation:{opt}"] = [float(b.activation_bytes[opt]) for b in table.blocks]
        q[f"recompute:{opt}"] = [b.recompute_s[opt] for b in table.blocks]
    return q


def _step(table: CostTable) -> float:
    return sum(b.forward_s + b.backward_s for b in table.blocks)


@dataclass(frozen=True, kw_only=True)
class ShapeCostModel:
    """Per-block costs as functions of the batch shape; :meth:`table` gives a CostTable for any shape."""

    template: CostTable
    """A measured table: names, kinds, parameters, static bytes, device and link come from it."""
    tokens_per_tile: int
    """LLM tokens each tile becomes (for the attention feature)."""
    coefficients: Mapping[str, tuple[tuple[float, ...], ...]]
    """Quantity -> one coefficient vector (over FEATURES) per block, or per cut for ``cut_bytes``."""
    shapes: tuple[BatchShape, ...]
    """Shapes the model was fitted on."""
    fit_error: float
    """Largest relative error of the predicted step time (forward + backward) on the fitted shapes."""
    block_fit_error: Mapping[str, float] = field(default_factory=dict)
    """Per block: largest relative error of its forward + backward time on the fitted shapes."""

    def _predict(self, quantity: str, shape: BatchShape) -> list[float]:
        f = np.array(shape.features(self.tokens_per_tile))
        return [max(0.0, float(np.dot(c, f))) for c in self.coefficients[quantity]]

    def table(self, shape: BatchShape) -> CostTable:
        """Predicted costs of one micro-batch of ``shape``."""
        p = {q: self._predict(q, shape) for q in self.coefficients}
        blocks = tuple(
            BlockCost(
                name=b.name,
                kind=b.kind,
                flops=p["flops"][i],
                num_params=b.num_params,
                static_bytes=b.static_bytes,
                forward_s=p["forward_s"][i],
                backward_s=p["backward_s"][i],
                # W keeps its measured share of the backward
                weight_grad_s=None if b.weight_grad_s is None else p["backward_s"][i] * (
                    b.weight_grad_s / b.backward_s if b.backward_s > 0 else 0.0),
                activation_bytes={o: round(p[f"activation:{o}"][i]) for o in RECOMPUTE_OPTIONS},
                recompute_s={o: p[f"recompute:{o}"][i] for o in RECOMPUTE_OPTIONS},
                signature=b.signature,
                profiled_as=b.profiled_as,
            )
            for i, b in enumerate(self.template.blocks)
        )
        cuts = [round(c) for c in p["cut_bytes"]]
        cuts[0] = cuts[-1] = 0
        return CostTable(
            blocks=blocks,
            cut_bytes=tuple(cuts),
            link_bandwidth=self.template.link_bandwidth,
            device=self.template.device,
            source=self.template.source,
            batch_shape=shape.as_dict(),
            precision=self.template.precision,
        )

    def errors(self, tables: Sequence[CostTable], shapes: Sequence[BatchShape]) -> dict[str, float]:
        """Relative errors against tables measured at (held-back) ``shapes``: step time and worst block."""
        if len(tables) != len(shapes) or not tables:
            raise InputError("errors() needs one measured table per shape, and at least one")
        step, worst = 0.0, 0.0
        for t, s in zip(tables, shapes):
            pred = self.table(s)
            step = max(step, abs(_step(pred) / _step(t) - 1))
            for a, b in zip(pred.blocks, t.blocks):
                ta, tb = a.forward_s + a.backward_s, b.forward_s + b.backward_s
                if tb > 0.05 * _step(t) / len(t.blocks):  # relative error of near-empty blocks is noise
                    worst = max(worst, abs(ta / tb - 1))
        return {"step_time": step, "worst_block_time": worst}

    def summary(self) -> str:
        lines = [
            f"shape model on {self.template.device} ({self.template.source}) fitted on {len(self.shapes)} shapes; "
            f"features {list(FEATURES)}; step-time fit error {self.fit_error:.1%}",
            "block                 fwd+bwd coefficients (s per feature)          fit error",
        ]
        for i, b in enumerate(self.template.blocks):
            c = np.add(self.coefficients["forward_s"][i], self.coefficients["backward_s"][i])
            coefs = " ".join(f"{v:9.2e}" for v in c)
            lines.append(f"{b.name:<20}  {coefs}   {self.block_fit_error.get(b.name, 0.0):7.1%}")
        return "\n".join(lines)


def fit_shape_model(
    tables: Sequence[CostTable], shapes: Sequence[BatchShape], *, tokens_per_tile: int = 0
) -> ShapeCostModel:
    """Fit a :class:`ShapeCostModel` to tables measured at ``shapes`` (at least 4 distinct ones)."""
    if len(tables) != len(shapes):
        raise InputError(f"got {len(tables)} tables for {len(shapes)} shapes; give one table per shape")
    if len(set(shapes)) < len(FEATURES):
        raise InputError(
            f"fitting {len(FEATURES)} features needs at least {len(FEATURES)} distinct shapes, got {len(set(shapes))}"
        )
    names = tables[0].names
    for t, s in zip(tables, shapes):
        if t.names != names:
            raise InputError(
                f"the blocks at shape {s} differ from those at {shapes[0]}; the model must keep its structure"
            )
    x = np.array([s.features(tokens_per_tile) for s in shapes])
    per_table = [_quantities(t) for t in tables]
    coefficients: dict[str, tuple[tuple[float, ...], ...]] = {}
    for q in per_table[0]:
        y = np.array([pt[q] for pt in per_table])  # shapes x items
        coefficients[q] = tuple(tuple(float(v) for v in fit_nonnegative(x, y[:, i])) for i in range(y.shape[1]))
    model = ShapeCostModel(
        template=tables[0],
        tokens_per_tile=tokens_per_tile,
        coefficients=coefficients,
        shapes=tuple(shapes),
        fit_error=0.0,
    )
    err = max(abs(_step(model.table(s)) / _step(t) - 1) for t, s in zip(tables, shapes))
    block_err = {}
    for i, name in enumerate(names):
        rel = []
        for t, s in zip(tables, shapes):
            measured = t.blocks[i].forward_s + t.blocks[i].backward_s
            pred = model.table(s).blocks[i]
            if measured > 0:
                rel.append(abs((pred.forward_s + pred.backward_s) / measured - 1))
        block_err[name] = max(rel, default=0.0)
    return ShapeCostModel(
        template=tables[0], tokens_per_tile=tokens_per_tile, coefficients=coefficients, shapes=tuple(shapes),
        fit_error=err, block_fit_error=block_err,
    )


def fit_shape_costs(
    model: Any,
    make_inputs: Callable[[BatchShape], Any],
    shapes: Sequence[BatchShape],
    *,
    tokens_per_tile: int = 0,
    block_prefixes: Sequence[str] | None = None,
    progress: bool = False,
    **annotate_kwargs: Any,
) -> tuple[ShapeCostModel, tuple[CostTable, ...]]:
    """Cost ``model`` at every shape (``make_inputs(shape)`` -> example inputs) and fit a shape model.

    ``annotate_kwargs`` go to :func:`annotate_costs` (device, precision, repeats, cache, ...).
    Returns the model and the measured tables.
    """
    from omnibal_compile.costs.annotate import profile_costs  # torch lives there
    from omnibal_compile.progress import track

    shapes = tuple(shapes)
    if not callable(make_inputs):
        raise InputError("make_inputs must be a callable BatchShape -> example inputs")
    tables = tuple(
        profile_costs(model, make_inputs(s), block_prefixes=block_prefixes, batch_shape=s.as_dict(), **annotate_kwargs)
        for s in track(shapes, "costing shapes", enabled=progress)
    )
    return fit_shape_model(tables, shapes, tokens_per_tile=tokens_per_tile), tables
