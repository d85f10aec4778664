import pytest
import torch
from torch import nn

from omnibal_compile import CaptureError, InputError
from omnibal_compile.passes.capture import capture, normalize_example_inputs


def test_capture_reference_vlm_shares_parameters(vlm):
    model, batch = vlm
    c = capture(model, batch)
    assert c.method == "export" and c.model_name == "TinyVLM"
    gm = c.graph_module
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert "llm.layers.0.attn.q_proj.weight" in attrs
    assert gm.get_parameter("llm.layers.0.attn.q_proj.weight") is model.llm.layers[0].attn.q_proj.weight
    assert len(c.flatten_inputs(**batch)) == 3
    torch.testing.assert_close(gm(**batch), model(**batch))


def test_capture_does_not_modify_the_model(vlm):
    model, batch = vlm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = len(model._forward_hooks) + len(model._forward_pre_hooks)
    capture(model, batch)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert len(model._forward_hooks) + len(model._forward_pre_hooks) == hooks


def test_example_inputs_that_do_not_match_the_model(vlm):
    model, batch = vlm
    with pytest.raises(InputError, match="do not match TinyVLM.forward"):
        capture(model, {"pixel_values": batch["pixel_values"]})
    with pytest.raises(InputError, match="unexpected keyword"):
        capture(model, {**batch, "images": batch["pixel_values"]})
    with pytest.raises(InputError, match="example_inputs must be"):
        capture(model, 3)


def test_shape_mismatch_inside_the_model_names_the_module(vlm):
    model, batch = vlm
    bad = dict(batch, pixel_values=torch.randn(2, 3, 8, 8))  # tiles of the wrong size
    with pytest.raises(CaptureError, match=r"TinyVLM.*module '.*'"):
        capture(model, bad)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Branchy()

    def forward(self, x):
        return self.inner(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: not capturable
            return self.lin(x)
        return x


def test_uncapturable_model_names_model_module_and_line():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "DataDependent" in msg and "module 'inner' (Branchy)" in msg
    assert "x.sum() > 0" in msg  # the offending source line
    assert "shape-static" in msg  # what to do


def test_fx_capture_for_plain_modules():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    c = capture(model, (x,), method="fx")
    assert c.method == "fx"
    torch.testing.assert_close(c.graph_module(*c.flatten_inputs(x)), model(x))


def test_unknown_method_and_non_module():
    with pytest.raises(InputError, match="capture method"):
        capture(nn.Linear(2, 2), (torch.randn(1, 2),), method="jit")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]


def test_normalize_example_inputs_forms():
    t = torch.zeros(1)
    assert normalize_example_inputs(t) == ((t,), {})
    assert normalize_example_inputs([t]) == ((t,), {})
    assert normalize_example_inputs({"x": t}) == ((), {"x": t})
    assert normalize_example_inputs(((t,), {"y": t})) == ((t,), {"y": t})


class WithDefaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, y=None, scale=2.0):
        out = self.lin(x) * scale
        return out if y is None else out + y


def test_fx_capture_bakes_in_defaults():
    model, x = WithDefaults(), torch.randn(3, 2)
    c = capture(model, (x,), method="fx")
    assert [n.op for n in c.graph_module.graph.nodes].count("placeholder") == 1
    torch.testing.assert_close(c.graph_module(x), model(x))


def test_fx_capture_rejects_keyword_inputs():
    with pytest.raises(InputError, match="positional"):
        capture(WithDefaults(), {"x": torch.randn(1, 2)}, method="fx")
