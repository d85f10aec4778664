"""Pictures, Chrome trace, framework exports and per-micro-batch costs, on hand-built plans and cost tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from omnibal_compile.costs.mix import packing_shapes, scale_costs, shape_costs
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import BlockCost, CostTable
from omnibal_compile.ir.interop import megatron_layout, torchtitan_module_names
from omnibal_compile.ir.plan import Plan
from omnibal_compile.sim import simulate

# Named like TinyVLM's blocks: vision side, projector, LLM embedding, glue, decoder layers, head, loss glue.
NAMES = (
    "<root>:glue",
    "vision.patch_embed",
    "vision.layers.0",
    "vision.layers.1",
    "projector",
    "llm.embed_tokens",
    "<root>:glue#2",
    "llm.layers.0",
    "llm.layers.1",
    "llm.layers.2",
    "llm.layers.3",
    "llm.norm",
    "lm_head",
    "<root>:glue#3",
)
KINDS = ("glue", "module", "layer", "layer", "module", "module", "glue", "layer", "layer", "layer", "layer", "module",
         "module", "glue")


def costs_for(names=NAMES, kinds=KINDS) -> CostTable:
    blocks = [
        BlockCost(
            name=n, kind=k, flops=1e6, num_params=1000, static_bytes=4000 * (k != "glue"),
            forward_s=0.001 * (2 if k == "layer" else 0.5), backward_s=0.002 * (2 if k == "layer" else 0.5),
            activation_bytes={"none": 10_000, "selective": 6000, "full": 1000},
            recompute_s={"none": 0.0, "selective": 0.0003, "full": 0.001},
        )
        for n, k in zip(names, kinds)
    ]
    return CostTable(blocks=blocks, cut_bytes=[0] + [2000] * (len(names) - 1) + [0], link_bandwidth=1e7, device="cpu",
                     source="profiled")


def vlm_plan(**kw) -> Plan:
    rec = ["none"] * len(NAMES)
    rec[7] = rec[8] = "full"
    rec[2] = "selective"
    return Plan(block_names=NAMES, boundaries=(0, 5, 9, 14), block_kinds=KINDS, block_params=(1000,) * len(NAMES),
                recompute=tuple(rec), num_microbatches=6, **kw)


def assert_picture(path: Path, min_std: float = 0.02) -> None:
    """A decodable PNG that is not blank: pixel values vary."""
    import numpy as np
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.std(img[..., :3])) > min_std
    assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 8  # more than a couple of flat colours


def test_timeline_and_trace(tmp_path):
    from omnibal_compile.sim.draw import chrome_trace, draw_timeline, write_chrome_trace

    res = simulate(vlm_plan(), costs_for())
    assert_picture(draw_timeline(res, tmp_path / "timeline.png"))
    trace = json.loads(write_chrome_trace(res, tmp_path / "trace.json").read_text())
    assert trace == json.loads(json.dumps(chrome_trace(res)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(res.events)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"device 0", "device 1", "device 2"}
    # Microseconds; the last span ends at the iteration time; sends on their own thread.
    assert max(e["ts"] + e["dur"] for e in spans if e["tid"] == 0) == pytest.approx(res.iteration_time_s * 1e6)
    assert {e["cat"] for e in spans} == {"forward", "recompute", "backward", "send_forward", "send_backward"}
    assert all(e["tid"] == 1 for e in spans if e["cat"].startswith("send"))


def test_block_graph_png_and_svg(tmp_path):
    import networkx as nx

    from omnibal_compile.sim.draw import draw_block_graph

    dag = nx.DiGraph([(i, i + 1) for i in range(len(NAMES) - 1)] + [(0, 6), (6, 12)])
    assert_picture(draw_block_graph(vlm_plan(), tmp_path / "blocks.png", dag=dag))
    svg = draw_block_graph(vlm_plan(), tmp_path / "blocks.svg", max_per_row=3).read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    with pytest.raises(InputError, match=".png, .svg or .pdf"):
        draw_block_graph(vlm_plan(), tmp_path / "blocks.jpg")


def test_stage_bars_and_sweep(tmp_path):
    from omnibal_compile.sim.draw import draw_stage_bars, draw_sweep

    plan = vlm_plan(memory_budget_bytes=(200_000,) * 3)
    costs = costs_for()
    assert_picture(draw_stage_bars(plan, costs, tmp_path / "bars.png", result=simulate(plan, costs)))
    assert_picture(draw_stage_bars(plan, costs, tmp_path / "bars1.png"))
    assert_picture(draw_sweep([1, 2, 4, 8], [40.0, 25.0, None, 12.0], tmp_path / "sweep.png", xlabel="stages"), 0.01)


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from omnibal_compile.sim import draw

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(InputError, match="pip install matplotlib"):
        draw.draw_timeline(simulate(vlm_plan(), costs_for()), tmp_path / "t.png")


def test_torchtitan_module_names():
    names = torchtitan_module_names(vlm_plan())
    assert names == [
        ["vision.patch_embed", "vision.layers.0", "vision.layers.1", "projector"],
        ["llm.embed_tokens", "llm.layers.0", "llm.layers.1"],
        ["llm.layers.2", "llm.layers.3", "llm.norm", "lm_head"],
    ]
    # A module called twice (name#2) is listed once, on its first stage.
    twice = Plan(block_names=("a", "b", "a#2"), boundaries=(0, 1, 3))
    assert torchtitan_module_names(twice) == [["a"], ["b"]]


def test_megatron_layout():
    assert megatron_layout(vlm_plan()) == "|Et*2|t*2L"
    even = Plan(block_names=NAMES, boundaries=(0, 6, 8, 10, 14), block_kinds=KINDS)
    assert megatron_layout(even) == "E|t|t*2|tL"
    with pytest.raises(InputError, match="block_kinds"):
        megatron_layout(Plan(block_names=NAMES, boundaries=(0, 14)))
    looped = Plan(block_names=NAMES, boundaries=(0, 6, 8, 10, 14), block_kinds=KINDS, schedule="interleaved",
                  virtual_stages=2, num_microbatches=4)
    assert megatron_layout(looped) == "E|t|t*2|tL"  # the loop Megatron places virtual stages in
    with pytest.raises(InputError, match="a V.*Megatron"):  # zbv's placement is not Megatron's loop
        megatron_layout(Plan(block_names=NAMES, boundaries=(0, 6, 8, 10, 14), block_kinds=KINDS, schedule="zbv",
                             virtual_stages=2, num_microbatches=4))


def test_shape_costs_scale_linearly():
    costs = costs_for()
    doubled = scale_costs(costs, [2.0] * len(NAMES))
    assert doubled.blocks[3].forward_s == pytest.approx(2 * costs.blocks[3].forward_s)
    assert (
        doubled.blocks[3].activation_bytes["full"] == 2000
        and doubled.blocks[3].static_bytes == costs.blocks[3].static_bytes
    )
    assert doubled.cut_bytes[0] == 0 and doubled.cut_bytes[5] == 4000
    # One rule for every per-micro-batch quantity, per-block scales and one factor alike.
    import dataclasses

    block = dataclasses.replace(costs.blocks[3], workspace_bytes=100,
                                peak_bytes={"none": 300, "selective": 200, "full": 50})
    costs = dataclasses.replace(costs, blocks=(*costs.blocks[:3], block, *costs.blocks[4:]))
    for scaled in (scale_costs(costs, [2.0] * len(NAMES)), scale_costs(costs, 2.0)):
        assert scaled.blocks[3].workspace_bytes == 200
        assert scaled.blocks[3].peak_bytes == {"none": 600, "selective": 400, "full": 100}
    assert scale_costs(costs, 2.0).batch_shape == {k: 2 * v for k, v in costs.batch_shape.items()}
    assert scale_costs(costs, [2.0] * len(NAMES)).batch_shape == costs.batch_shape
    # Vision blocks follow tiles, the rest tokens; the mean shape is the reference.
    a, b = shape_costs(costs, [(1, 300), (3, 100)], vision_blocks=5)
    assert a.blocks[2].forward_s == pytest.approx(0.5 * costs.blocks[2].forward_s)
    assert b.blocks[2].forward_s == pytest.approx(1.5 * costs.blocks[2].forward_s)
    assert a.blocks[8].forward_s == pytest.approx(1.5 * costs.blocks[8].forward_s)
    with pytest.raises(InputError, match="vision_blocks"):
        shape_costs(costs, [(1, 1)], vision_blocks=99)


def test_balanced_packs_beat_random_batches_in_simulation():
    import numpy as np

    from omnibal_compile.data import balance_pack, load_lengths, random_batches

    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 6, 600)
    stats = load_lengths((tiles, tiles * 256 + rng.integers(20, 600, 600)))
    plan, costs = vlm_plan(), costs_for()
    M = plan.num_microbatches
    ref = (float(stats.tiles.mean()) * 2, float(stats.tokens.mean()) * 2)
    times = {}
    for name, packing in (("random", random_batches(stats, dp=M, batch_size=2)),
                          ("ours", balance_pack(stats, dp=M, samples_per_pack=2))):
        shapes = packing_shapes(stats, packing, step=0)
        assert len(shapes) == M
        tables = shape_costs(costs, shapes, vision_blocks=5, reference=ref)
        times[name] = simulate(plan, costs, microbatch_costs=tables).iteration_time_s
    # Padding and uneven micro-batches cost the random batches time; balanced packs do not pad.
    assert times["ours"] < times["random"]
    with pytest.raises(InputError, match="step must lie"):
        packing_shapes(stats, packing, step=10**6)
