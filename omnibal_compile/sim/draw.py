"""Pictures of plans and simulated iterations: timeline, Chrome trace, block graph, per-stage bars.

matplotlib is imported only when a picture is drawn (``pip install 'omnibal-compile[viz]'``); the
Chrome trace needs nothing beyond the standard library. Figures are built with matplotlib's
object-oriented API (no pyplot state, no backend switch), written as PNG, SVG or PDF by suffix.

Glossary:
    timeline      a Gantt chart: one row per device, a bar per forward, recompute and backward,
                  labelled with its micro-batch; grey where the device idles.
    Chrome trace  the JSON event format of ``chrome://tracing`` and https://ui.perfetto.dev: one
                  process per device, thread 0 computes, thread 1 sends; times in microseconds.
    block graph   the model's blocks, one row per stage, coloured by stage; recomputed blocks carry
                  a thick red outline; arrows for the chain and for values that skip blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile._utils.tables import counted
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.sim.simulate import SimResult, stage_costs

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "chrome_trace", "write_chrome_trace", "draw_timeline", "draw_block_graph", "draw_stage_bars", "draw_sweep",
]

COLOURS = {
    "forward": "#4C72B0", "recompute": "#DD8452", "backward": "#55A868", "backward_weight": "#8DCB9B",
    "idle": "#E5E5E5",
    "send_forward": "#8172B3", "send_backward": "#937860", "dp_gather": "#DA8BC3", "dp_reduce": "#C44E52",
}
STAGE_COLOURS = ("#1F77B4", "#FF7F0E", "#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#7F7F7F", "#BCBD22", "#17BECF")
"""Stage colours (tab10 without red, which marks recomputation)."""


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError(
            "drawing pictures needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'omnibal-compile[viz]')"
        ) from None
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise InputError(f"cannot write a picture to {path}: use a .png, .svg or .pdf file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def _ms(seconds: float) -> float:
    return seconds * 1e3


# -- Chrome trace ---------------------------------------------------------------------------------
def chrome_trace(result: SimResult) -> dict[str, Any]:
    """The simulated iteration as a Chrome/Perfetto trace object (``{"traceEvents": [...]}``)."""
    events: list[dict[str, Any]] = []
    for d in range(result.num_devices):
        events.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": f"device {d}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "send"}})
    for e in result.events:
        short = {"forward": "F", "recompute": "R", "backward": "B", "backward_weight": "W", "send_forward": "send F",
                 "send_backward": "send B", "dp_gather": "gather", "dp_reduce": "reduce"}
        events.append({
            "name": f"{short[e.kind]}{e.microbatch} s{e.stage}",
            "cat": e.kind,
            "ph": "X",
            "pid": e.device,
            "tid": 1 if e.kind.startswith("send") else 0,
            "ts": e.start_s * 1e6,
            "dur": e.duration_s * 1e6,
            "args": {"stage": e.stage, "microbatch": e.microbatch, "kind": e.kind},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": result.schedule,
            "iteration_time_s": result.iteration_time_s,
            "bubble_fraction": result.bubble_fraction,
        },
    }


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON; open it in chrome://tracing or ui.perfetto.dev."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(chrome_trace(result)))
    return path


# -- timeline -------------------------------------------------------------------------------------
def draw_timeline(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Gantt chart of the simulated iteration, one row per device."""
    D = result.num_devices
    fig = _figure(min(4 + result.num_microbatches * 0.5, 22), 1.2 + 0.55 * D)
    ax = fig.add_subplot(1, 1, 1)
    T = _ms(result.iteration_time_s)
    for d in range(D):
        ax.barh(d, T, left=0, height=0.8, color=COLOURS["idle"], edgecolor="none")
    for e in result.events:
        if e.kind.startswith("send"):
            continue
        w = _ms(e.duration_s)
        ax.barh(e.device, w, left=_ms(e.start_s), height=0.8, color=COLOURS[e.kind], edgecolor="white", linewidth=0.4)
        if T and w / T > 0.012:
            ax.text(
                _ms(e.start_s) + w / 2, e.device, str(e.microbatch), ha="center", va="center", fontsize=6, color="white"
            )
    ax.set_yticks(range(D), [f"device {d}" for d in range(D)])
    ax.invert_yaxis()
    ax.set_xlim(0, T * 1.01 if T else 1)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or (
        f"{result.schedule}: {result.num_stages} stages, {counted(result.num_microbatches, 'micro-batch')} - "
        f"iteration {T:.2f} ms, bubble {result.bubble_fraction:.1%}"
    ), fontsize=9)
    from matplotlib.patches import Patch

    kinds = [k for k in ("forward", "recompute", "backward", "backward_weight", "dp_gather", "dp_reduce", "idle")
             if k == "idle" or any(e.kind == k for e in result.events)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if D < 4 else -0.12), ncol=len(kinds), fontsize=7, frameon=False)
    return _save(fig, path)


# -- block graph ----------------------------------------------------------------------------------
def _short(name: str, width: int = 18) -> str:
    parts = name.replace(":glue", ".glue").split(".")
    keep = 3 if parts[-1].isdigit() else 2  # vision.layers.0 and llm.layers.0 stay apart
    text = ".".join(parts[-keep:])
    return text if len(text) <= width else text[: width - 1] + "~"


def draw_block_graph(plan: Plan, path: str | Path, *, dag: nx.DiGraph | None = None, max_per_row: int = 16) -> Path:
    """Blocks in rows by stage (wrapped after ``max_per_row``), coloured by stage, recomputed ones outlined in red.

    ``dag`` (``BlockGraph.dag``: nodes are block indices) adds arrows for values that skip blocks;
    without it only the chain is drawn.
    """
    def colour(stage: int) -> str:
        return STAGE_COLOURS[stage % len(STAGE_COLOURS)]

    pos: dict[int, tuple[float, float]] = {}
    row = 0
    for st in plan.stages:
        for j, i in enumerate(range(st.start, st.stop)):
            pos[i] = (j % max_per_row, -(row + j // max_per_row))
        row += (st.stop - st.start - 1) // max_per_row + 1
    ncols = min(max_per_row, max(st.stop - st.start for st in plan.stages))
    fig = _figure(2 + 1.25 * ncols, 1 + 0.9 * row)
    ax = fig.add_subplot(1, 1, 1)
    edges = [(i, i + 1) for i in range(plan.num_blocks - 1)]
    skip = [] if dag is None else [(a, b) for a, b in dag.edges if b > a + 1 and a in pos and b in pos]
    for a, b in edges + skip:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        is_skip = (a, b) in skip
        ax.annotate(
            "", xy=(x1, y1), xytext=(x0, y0),
            arrowprops=dict(arrowstyle="-|>", color="#999999" if is_skip else "#444444", lw=0.5 if is_skip else 0.9,
                            alpha=0.5 if is_skip else 0.9, shrinkA=9, shrinkB=9,
                            connectionstyle="arc3,rad=0.25" if is_skip else "arc3,rad=0"),
        )
    rec = plan.block_recompute
    for st in plan.stages:
        for i in range(st.start, st.stop):
            x, y = pos[i]
            recomputed = rec[i] != "none"
            ax.scatter([x], [y], s=420, color=colour(st.index), edgecolors="#D62728" if recomputed else "white",
                       linewidths=3 if recomputed else 1, zorder=3)
            label = _short(plan.block_names[i]) + (f"\n[{rec[i]}]" if recomputed else "")
            ax.text(x, y - 0.3, label, ha="center", va="top", fontsize=6, zorder=4)
    for st in plan.stages:
        x, y = pos[st.start]
        device = plan.pipeline_schedule.device_of(st.index, plan.num_stages)
        where = f" (device {device})" if plan.virtual_stages > 1 else ""
        ax.text(
            -0.8,
            y,
            f"stage {st.index}{where}",
            ha="right",
            va="center",
            fontsize=8,
            color=colour(st.index),
            weight="bold",
        )
    ax.set_xlim(-2.2, ncols)
    ax.set_ylim(-row + 0.3, 0.6)
    ax.axis("off")
    n_rec = sum(1 for r in rec if r != "none")
    ax.set_title(
        f"{plan.num_blocks} blocks in {plan.num_stages} stages (planner '{plan.planner}'); "
        f"{n_rec} recomputed (red outline)", fontsize=9,
    )
    return _save(fig, path)


# -- per-stage bars -------------------------------------------------------------------------------
def draw_stage_bars(
    plan: Plan, costs: CostTable, path: str | Path, *, result: SimResult | None = None
) -> Path:
    """Left: per-stage time per micro-batch (forward, recompute, backward, send). Right: per-device memory vs budget.

    Memory is static bytes plus the simulated peak activations when ``result`` is given, else plus
    the activations of a single micro-batch (a lower bound; simulate for the schedule's real peak).
    """
    sc = stage_costs(plan, costs)
    S = plan.num_stages
    fig = _figure(max(8, 2 + 1.2 * S), 3.6)
    ax, mx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    xs = list(range(S))
    bottom = [0.0] * S
    for key, label in (
        ("forward_s", "forward"),
        ("recompute_s", "recompute"),
        ("backward_s", "backward"),
        ("send_s", "send"),
    ):
        vals = [_ms(getattr(c, key)) for c in sc]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottom, color=COLOURS["send_forward" if label == "send" else label], label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(xs, [str(s) for s in xs])
    ax.set_xlabel("stage")
    ax.set_ylabel("ms per micro-batch")
    ax.set_title("time per stage", fontsize=9)
    ax.legend(fontsize=7)

    D = plan.num_devices
    on = [plan.pipeline_schedule.stages_of(d, S) for d in range(D)]  # each device's stages, as the schedule places
    top = max([sum(plan.memory_budget_bytes), *(result.peak_memory_bytes if result else [0]),
               *(sc[s].static_bytes + sc[s].activation_bytes for s in range(S))])
    unit, gib = ("GiB", 1 / 2**30) if top >= 2**30 else ("MiB", 1 / 2**20)
    static = [sum(sc[s].static_bytes for s in on[d]) * gib for d in range(D)]
    if result is not None:
        act = [a * gib for a in result.peak_activation_bytes]
        act_label = "peak activations (simulated)"
    else:
        act = [sum(sc[s].activation_bytes for s in on[d]) * gib for d in range(D)]
        act_label = "activations of one micro-batch"
    dx = list(range(D))
    mx.bar(dx, static, color="#8C8C8C", label="static (weights, grads, optimizer)")
    mx.bar(dx, act, bottom=static, color=COLOURS["forward"], label=act_label)
    if plan.memory_budget_bytes:
        # A device's budget: the sum of its stages' shares.
        budget = [sum(plan.memory_budget_bytes[s] for s in on[d]) * gib for d in range(D)]
        mx.hlines(
            budget, [d - 0.45 for d in dx], [d + 0.45 for d in dx], colors="#D62728", linestyles="--", label="budget"
        )
    mx.set_xticks(dx, [str(d) for d in dx])
    mx.set_xlabel("device")
    mx.set_ylabel(unit)
    mx.set_title("memory per device", fontsize=9)
    mx.legend(fontsize=7)
    return _save(fig, path)


# -- what-if sweeps -------------------------------------------------------------------------------
def draw_sweep(
    xs: Sequence[float],
    ys: Sequence[float | None],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str = "iteration time (ms)",
    title: str = "",
) -> Path:
    """A line plot of a what-if sweep; ``None`` values (infeasible points) are marked with an x on the axis."""
    fig = _figure(6, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    ok = [(x, y) for x, y in zip(xs, ys) if y is not None]
    bad = [x for x, y in zip(xs, ys) if y is None]
    if ok:
        ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", color=COLOURS["forward"])
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="x", color="#D62728", label="infeasible")
        ax.legend(fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)
