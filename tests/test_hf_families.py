"""Hugging Face VLM families besides Llava (tests/hf_families.py): capture, blocks and exact parity.

Every family is captured once (module fixture) from processor-style inputs, with use_cache left on.
Families whose image merge has data-dependent sizes are captured with the example's values; the
cuts that a tensor of data-dependent shape would cross are refused (their blocks merged), never
those inside the LLM's layer stack.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import hf_families as H  # noqa: E402

from omnibal_compile import Plan  # noqa: E402
from omnibal_compile.api import OptimizeResult  # noqa: E402
from omnibal_compile.compile.blocks import MERGED, build_blocks  # noqa: E402
from omnibal_compile.compile.capture import capture  # noqa: E402
from omnibal_compile.compile.codegen import generate_stages  # noqa: E402
from omnibal_compile.ir.schedule import Schedule  # noqa: E402
from omnibal_compile.planning.build import plan_stages  # noqa: E402

DATA_DEPENDENT = {"qwen2_5_vl", "mistral3", "idefics3"}
"""Families whose graphs have data-dependent sizes (per-image grids or sizes, real images picked from pixels);
Qwen2-VL's are made shape-static at capture (tests/test_hf_grids.py)."""
SLOW = DATA_DEPENDENT | {"qwen2_vl"}


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in H.FAMILIES
])
def family(request):
    name = request.param
    model, batch = H.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, batch)
    return name, model, batch, captured, build_blocks(captured, model)


def _decoder_layers(graph) -> list[int]:
    """Indices of the LLM's layer blocks: the layer stack of the last layer block."""
    last = [b for b in graph.blocks if b.kind == "layer"][-1].name
    stack = last.rsplit(".", 1)[0]
    return [b.index for b in graph.blocks if b.kind == "layer" and b.name.rsplit(".", 1)[0] == stack]


def _result(model, captured, graph, plan) -> OptimizeResult:
    return OptimizeResult(
        model=model, captured=captured, graph=graph, plan=plan, stages=generate_stages(graph, plan, model)
    )


@pytest.mark.parametrize("stages", [2, 3])
def test_splits_with_exact_parity(family, stages):
    name, model, batch, captured, graph = family
    llm = _decoder_layers(graph)
    assert len(llm) == H.LAYERS, f"{name}: every LLM layer must stay a block of its own"
    manual = Plan(block_names=graph.names, boundaries=(0, *llm[1:stages], graph.num_blocks), schedule="gpipe")
    planned = plan_stages(
        graph, num_stages=stages, schedule=Schedule.for_stages(stages, kind="gpipe"), planner="parameters"
    )
    for plan in (manual, planned):
        report = _result(model, captured, graph, plan).check_parity(batch, tolerance=1e-5)
        assert report.ok, f"{name} {plan.boundaries}: {report}"
        assert report.num_params == sum(1 for p in model.parameters() if p.requires_grad)
    assert model.config.get_text_config().use_cache is True  # the user's config is left as it was


def test_data_dependent_sizes_take_the_example_values(family):
    name, _, _, captured, graph = family
    assert captured.data_dependent == (name in DATA_DEPENDENT)
    assert bool(graph.refused_cuts) == (name in DATA_DEPENDENT)
    for v in graph.values:  # sizes are the example's, never symbols
        if v.shape is not None:
            assert all(type(d) is int for d in v.shape)
            assert (
                v.nbytes
                == math.prod(v.shape) * torch.empty(0, dtype=getattr(torch, v.dtype.split(".")[1])).element_size()
            )
    llm = {graph.blocks[i].name for i in _decoder_layers(graph)}
    for cut in graph.refused_cuts:
        assert cut.values and all(v.data_dependent for v in cut.values)
        assert "depends on the input values" in cut.reason() and cut.after in cut.reason()
        assert cut.before not in llm
    # refused cuts leave merged blocks, and no value of data-dependent shape crosses a remaining cut
    assert any(MERGED in n for n in graph.names) == bool(graph.refused_cuts)
    for k in range(1, graph.num_blocks):
        assert not any(v.data_dependent for v in graph.crossing(k)), (name, k)
    if name in ("idefics3", "qwen2_vl", "qwen2_5_vl", "mistral3"):  # image features returned next to the loss
        assert captured.dropped_outputs and all(p.startswith("image_outputs") for p in captured.dropped_outputs)


def test_keyword_flags_the_forward_takes_through_kwargs_are_passed_on(family):
    """``use_cache=False``, the habit of every HF training script, reaches forward through ``**kwargs``: accepted."""
    name, model, batch, _, _ = family
    flagged = {**batch, "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, flagged)
    graph = build_blocks(captured, model)
    plan = plan_stages(graph, num_stages=2, schedule=Schedule.for_stages(2, kind="gpipe"), planner="parameters")
    report = _result(model, captured, graph, plan).check_parity(flagged, tolerance=1e-5)
    assert report.ok, f"{name}: {report}"


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name == "smolvlm" else name for name in H.KWARG_FAMILIES
])
def test_more_families_split_with_parity_given_use_cache_false(name):
    """Llava, Aya Vision, Mllama and SmolVLM: their processor-style batch plus ``use_cache=False`` (through
    ``**kwargs``), split in 2 uniform stages, give the unsplit model's loss and gradients (SmolVLM, whose real
    images are picked from the pixels, takes about 14 s: slow)."""
    import omnibal_compile

    model, batch = H.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = omnibal_compile.optimize(model, {**batch, "use_cache": False}, num_stages=2, planner="uniform")
        report = result.check_parity()
    assert report.ok, f"{name}: {report}"
    assert report.num_params == sum(1 for p in model.parameters() if p.requires_grad)
    assert result.plan.num_stages == 2
