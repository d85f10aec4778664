import warnings

import pytest
import torch
from torch import nn

import omnibal_compile as oc
from omnibal_compile import CaptureError, InputError
from omnibal_compile.compile.capture import capture, is_data_dependent, normalize_example_inputs, size_hint


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
    with pytest.raises(
        InputError, match="example input .images. is not an input of TinyVLM.forward; it accepts pixel_values"
    ):
        capture(model, {**batch, "images": batch["pixel_values"]})
    with pytest.raises(InputError, match="example_inputs must be"):
        capture(model, 3)


def test_shape_mismatch_inside_the_model_names_the_module(vlm):
    model, batch = vlm
    bad = dict(batch, pixel_values=torch.randn(2, 3, 8, 8))  # tiles of the wrong size
    with pytest.raises(CaptureError, match=r"TinyVLM.*module '.*'"):
        capture(model, bad)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: decided by the example, asserted in the graph
            return self.lin(x)
        return x


class ToNumpy(nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.numpy() * 2)  # leaves torch: not capturable


def test_uncapturable_model_names_model_module_and_line():
    with pytest.raises(CaptureError) as info:
        capture(Outer(ToNumpy()), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "Outer" in msg and "module 'inner' (ToNumpy)" in msg
    assert "x.numpy() * 2" in msg  # the offending source line
    assert "shape-static" in msg and "capture_method='fx'" in msg  # what to do, with a keyword that exists


def test_branch_on_a_value_follows_the_example_and_is_asserted():
    torch.manual_seed(0)
    model, x = Outer(Branchy()), torch.rand(2, 4)  # sum > 0: the linear branch
    c = capture(model, (x,))
    assert c.data_dependent
    torch.testing.assert_close(c.graph_module(x), model(x))
    # the other branch fails loudly, never computes the wrong one
    with pytest.raises(RuntimeError, match="this batch differs from the example"):
        c.graph_module(-x)


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


class Select(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, keep):
        return self.lin(x[keep]).sum()


def test_data_dependent_sizes_take_the_example_values():
    model = Select()
    x, keep = torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    c = capture(model, (x, keep))
    assert c.data_dependent
    picked = next(n for n in c.graph_module.graph.nodes if n.op == "call_function" and "index" in str(n.target))
    rows = picked.meta["val"].shape[0]
    assert isinstance(rows, torch.SymInt) and is_data_dependent(rows) and size_hint(rows) == 3
    assert not is_data_dependent(4) and size_hint(4) == 4
    torch.testing.assert_close(c.graph_module(x, keep), model(x, keep))


def test_static_models_are_captured_once_without_example_values(vlm):
    assert not capture(*vlm).data_dependent


def test_use_cache_is_turned_off_for_capture_and_said_once(capsys):
    tf = pytest.importorskip("transformers")
    import omnibal_compile.compile.capture as capture_module

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    assert cfg.use_cache  # the default a user gets
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    capture_module._TOLD_USE_CACHE.discard("LlamaForCausalLM")
    capture(model, {"input_ids": ids, "labels": ids})
    assert "LlamaForCausalLM: its config says use_cache=True; it is captured" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sentence, never a raw warning
        result = oc.optimize(model, {"input_ids": ids, "labels": ids}, num_stages=2)
    assert "use_cache" not in capsys.readouterr().err  # said once
    assert model.config.use_cache is True  # the user's config is left as it was
    assert result.check_parity().ok


def test_misspelled_keywords_list_the_accepted_ones(tiny_llava, vlm):
    model, batch = tiny_llava
    bad = {**{k: v for k, v in batch.items() if k != "pixel_values"}, "pixel_value": batch["pixel_values"]}
    with pytest.raises(
        InputError, match=r"'pixel_value' is not an input of .*did you mean 'pixel_values'.*accepts input_ids"
    ):
        capture(model, bad)  # HF forward takes **kwargs: without the check the image would be dropped silently
    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=2)
    bad = {**{k: v for k, v in batch.items() if k != "pixel_values"}, "pixel_value": batch["pixel_values"]}
    with pytest.raises(InputError, match=r"unknown input 'pixel_value' \(did you mean 'pixel_values'\?\); missing "
                                         r"'pixel_values'\. Accepted inputs: pixel_values, input_ids, labels"):
        result.run(**bad)


def test_inputs_of_another_shape_name_the_input_and_both_shapes(vlm):
    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=2)
    ids = batch["input_ids"]
    with pytest.raises(InputError, match=rf"input 'input_ids' has shape \[2, {ids.shape[1] - 1}\] but TinyVLM was "
                                         rf"captured with shape \[2, {ids.shape[1]}\]"):
        result.run(**{**batch, "input_ids": ids[:, 1:]})


class _TakesAnyKeyword(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None, **kwargs):
        y = self.proj(x)
        return y * scale if scale is not None and kwargs.get("use_scale", True) else y


def test_inputs_through_untyped_kwargs_are_accepted_unless_a_tensor_is_never_read():
    model, x = _TakesAnyKeyword(), torch.randn(2, 4)
    capture(model, {"x": x, "use_scale": False, "scale": torch.ones(4)})  # a flag through **kwargs
    with pytest.raises(InputError, match=r"'scael' is not an input of .*did you mean 'scale'.*never reads it"):
        capture(model, {"x": x, "scael": torch.ones(4)})


class _BranchOnValue(nn.Module):
    """A Python ``if`` on a tensor value: on the input's (``on="x"``), or on a value computed from the weights."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if (x if self.on == "x" else h).sum() > 0:
            h = h * 2
        return self.c(self.b(h)).mean()


def test_a_branch_on_an_input_value_holds_for_its_example_and_names_the_cause_on_another_batch(capfd):
    torch.manual_seed(0)
    result = oc.optimize(_BranchOnValue("x"), {"x": torch.ones(4, 8)}, num_stages=2, planner="uniform")
    assert result.check_parity().ok
    assert "Unable to find user code" not in capfd.readouterr().err  # torch's internal warning, not shown
    with pytest.raises(RuntimeError, match=r"_BranchOnValue: this batch differs from the example the model was "
                                           r"captured with in a value its code decided on .*torch\.where"):
        result.check_parity({"x": -torch.ones(4, 8)})


def test_a_graph_that_fails_its_own_example_is_refused_at_capture():
    """torch.export may decide a branch on a value computed from the weights without the example's value (seen: after
    another export of the same forward in the process); such a graph failed ``check_parity`` on its own example
    (issue "Trust at first sight"), so capture runs the graph once on its example and refuses it. Here the check is
    handed a batch the graph's choice does not hold for, as its example."""
    from omnibal_compile.compile.capture import _check_example_path

    torch.manual_seed(0)
    model = _BranchOnValue("x")
    captured = capture(model, {"x": torch.ones(4, 8)})
    _check_example_path(captured.graph_module, model, (), {"x": torch.ones(4, 8)})  # its example: fine
    with pytest.raises(CaptureError, match=r"_BranchOnValue: its code decides on a tensor value that torch.export "
                                           r"could not take from the example .*torch\.where"):
        _check_example_path(captured.graph_module, model, (), {"x": -torch.ones(4, 8)})


def test_a_branch_on_a_value_of_the_weights_is_refused_or_follows_the_example():
    torch.manual_seed(0)
    model = _BranchOnValue("h")
    with torch.no_grad():  # h = x @ 0.1: its sum > 0 on the example, so the model takes the branch
        model.a.weight.fill_(0.1)
        model.a.bias.zero_()
    try:
        result = oc.optimize(model, {"x": torch.ones(4, 8)}, num_stages=2, planner="uniform")
    except CaptureError as e:
        assert "could not take from the example" in str(e)
    else:  # never a graph that fails its own example
        assert result.check_parity().ok


def test_an_example_the_model_itself_refuses_is_named_as_such():
    """An inconsistent example (here: a branch the graph asserts, and a model that raises on the other value) is said
    to fail in the model, not blamed on torch.export."""
    from omnibal_compile.compile.capture import _check_example_path

    class Strict(_BranchOnValue):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() <= 0:
                raise ValueError("Image features and image tokens do not match")
            return super().forward(x)

    model = Strict("x")
    captured = capture(model, {"x": torch.ones(4, 8)})
    with pytest.raises(CaptureError, match=r"Strict fails on the example inputs itself \(ValueError: Image features "
                                           r"and image tokens do not match\); give an example batch the model runs on"):
        _check_example_path(captured.graph_module, model, (), {"x": -torch.ones(4, 8)})
