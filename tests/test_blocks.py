import pytest
import torch
from torch import nn

from omnibal_compile import InputError
from omnibal_compile.compile.blocks import build_blocks, find_layer_stacks
from omnibal_compile.compile.capture import capture


@pytest.fixture(scope="module")
def vlm_graph(vlm):
    model, batch = vlm
    return build_blocks(capture(model, batch), model)


def test_layer_stacks_of_reference_vlm(vlm):
    assert find_layer_stacks(vlm[0]) == ("vision.layers", "llm.layers")


def test_each_layer_is_one_block_and_other_modules_have_their_own(vlm_graph):
    names = vlm_graph.names
    layers = [b.name for b in vlm_graph.blocks if b.kind == "layer"]
    assert layers == ["vision.layers.0", "vision.layers.1", "llm.layers.0", "llm.layers.1", "llm.layers.2"]
    for name in ("vision.patch_embed", "projector", "llm.embed_tokens", "llm.norm", "lm_head"):
        assert name in names
    assert any(b.kind == "glue" for b in vlm_graph.blocks)
    assert names.index("vision.layers.1") < names.index("projector") < names.index("llm.layers.0")


def test_every_node_in_exactly_one_block(vlm_graph):
    all_nodes = [n for b in vlm_graph.blocks for n in b.nodes]
    assert len(all_nodes) == len(set(all_nodes)) == len(vlm_graph.node_block)
    gm = vlm_graph.captured.graph_module
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method") ]
    assert set(compute) <= set(all_nodes)


def _is_mask(v):
    return v.shape is not None and len(v.shape) == 4 and v.dtype == "torch.bool"


def test_skip_tensors_cross_many_cuts(vlm_graph, vlm):
    names = vlm_graph.names
    first, last = names.index("llm.layers.0"), names.index("llm.layers.2")
    sent = build_blocks(vlm_graph.captured, vlm[0], rebuild=False)
    for cut in range(first + 1, last + 1):
        crossing = {v.name for v in vlm_graph.crossing(cut)}
        assert {"labels", "cos", "sin"} <= crossing, crossing  # labels, rotary tables
        # the attention mask is built once and read by every layer: rebuilt there from the ids (a batch without
        # segment_ids: the model makes them of input_ids), not sent
        assert not any(_is_mask(v) for v in vlm_graph.crossing(cut))
        (mask,) = [v for v in vlm_graph.rebuilt_across(cut) if _is_mask(v)]
        assert mask.rebuilt_from == ("input_ids",) and "input_ids" in crossing
        assert any(_is_mask(v) for v in sent.crossing(cut))
        assert sent.cut_bytes(cut) > vlm_graph.cut_bytes(cut)


def test_crossing_values_are_consistent(vlm_graph):
    n = vlm_graph.num_blocks
    for cut in range(1, n):
        sources = {r for v in vlm_graph.rebuilt_across(cut) for r in v.rebuilt_from}
        for v in vlm_graph.crossing(cut):
            # read after the cut, or a model input that a value rebuilt after the cut is made of
            assert v.producer < cut <= v.last_use <= n or (v.producer < 0 and v.name in sources)
            assert v.nbytes > 0 and v.shape is not None and not v.rebuilt
    assert vlm_graph.cut_bytes(1) == sum(v.nbytes for v in vlm_graph.crossing(1))
    with pytest.raises(InputError, match="cut must lie"):
        vlm_graph.crossing(0)


def test_dag_is_topologically_ordered(vlm_graph):
    import networkx as nx

    assert nx.is_directed_acyclic_graph(vlm_graph.dag)
    assert all(i < j for i, j in vlm_graph.dag.edges)
    assert list(nx.topological_sort(vlm_graph.dag))[0] == 0


def test_block_prefixes_override(vlm):
    model, batch = vlm
    g = build_blocks(capture(model, batch), model, block_prefixes=["vision", "projector", "llm", "lm_head"])
    kinds = {b.name: b.kind for b in g.blocks}
    assert {"vision", "projector", "llm", "lm_head"} <= set(kinds)
    with pytest.raises(InputError, match="not module paths"):
        build_blocks(capture(model, batch), model, block_prefixes=["vison"])


def test_summary_lists_every_block(vlm_graph):
    text = vlm_graph.summary()
    assert all(name in text for name in vlm_graph.names)


def test_plain_sequential_without_stacks():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    g = build_blocks(capture(model, (torch.randn(2, 4),)), model)
    assert g.names == ("0", "1", "2") and all(b.kind == "module" for b in g.blocks)
    assert [b.num_params for b in g.blocks] == [40, 0, 36]


class PickedRows(nn.Module):
    """Rows chosen by a mask (data-dependent count) run through two layers, then are scattered back."""

    def __init__(self) -> None:
        super().__init__()
        self.pick = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, keep):
        h = x[keep]  # data-dependent number of rows
        for layer in self.pick:
            h = layer(h)
        x = x.index_put((keep,), h)  # back to x's fixed shape
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_cuts_a_data_dependent_shape_would_cross_are_refused_with_the_reason():
    torch.manual_seed(0)
    model = PickedRows()
    x, keep = torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    captured = capture(model, (x, keep))
    assert captured.data_dependent
    graph = build_blocks(captured, model)
    # pick.0 / pick.1 and the glue around them cannot be split: the 3 picked rows cross those cuts
    assert [b.name for b in graph.blocks if b.kind == "layer"] == ["layers.0", "layers.1", "layers.2"]
    merged = [n for n in graph.names if ".." in n]
    assert len(merged) == 1 and "pick" not in " ".join(n for n in graph.names if ".." not in n)
    assert len(graph.refused_cuts) == 3
    cut = graph.refused_cuts[1]
    assert (cut.after, cut.before) == ("pick.0", "pick.1")
    assert cut.values[0].shape == (3, 4) and cut.values[0].data_dependent  # the example's 3 picked rows
    assert "depends on the input values" in cut.reason() and "[3, 4]" in cut.reason()
    assert "not cut between pick.0 and pick.1" in graph.summary()
    for k in range(1, graph.num_blocks):  # what remains has fixed shapes only
        assert not any(v.data_dependent for v in graph.crossing(k))
