"""End-to-end parity: the generated stages, run in turn, reproduce the unsplit model exactly."""

import pytest
import torch

import omnibal_compile as oc
from omnibal_compile import Plan, PlanError


def _assert_parity(model, batch, s, planner):
    result = oc.optimize(model, batch, num_stages=s, planner=planner)
    assert len(result.stages) == s
    report = result.check_parity(batch, tolerance=1e-5)
    assert report.ok, str(report)
    assert report.num_params == sum(1 for p in model.parameters() if p.requires_grad)
    return result


@pytest.mark.parametrize("s", [1, 2, 3, 4])
@pytest.mark.parametrize("planner", ["uniform", "parameters"])
def test_reference_vlm_parity(vlm, s, planner):
    model, batch = vlm
    _assert_parity(model, batch, s, planner)


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_tiny_llama_parity(tiny_llama, s):
    model, batch = tiny_llama
    result = _assert_parity(model, batch, s, "parameters")
    # tied embedding/head: the head's stage maps its weight back to both original names
    names = {n for st in range(s) for v in result.stage_info(st).param_map.values() if len(v) > 1 for n in v}
    assert names == {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_tiny_llava_parity(tiny_llava, s):
    model, batch = tiny_llava
    _assert_parity(model, batch, s, "uniform")


def test_stage_interfaces_chain_and_params_map_to_original_names(vlm):
    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=3)
    infos = [result.stage_info(i) for i in range(3)]
    assert infos[0].input_names == ("pixel_values", "input_ids", "labels")
    for a, b in zip(infos, infos[1:]):
        assert a.output_names == b.input_names
    original = dict(model.named_parameters())
    owned = []
    for stage, info in zip(result.stages, infos):
        for name, p in stage.named_parameters():
            assert p is original[info.param_map[name][0]]  # shared, not copied
            owned.append(name)
    assert sorted(owned) == sorted(original)  # every parameter in exactly one stage
    assert "def forward" in result.stages[1].code


def test_model_is_not_modified(vlm):
    model, batch = vlm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(**batch).detach()
    result = oc.optimize(model, batch, num_stages=2)
    result.check_parity(batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(**batch), expected)
    assert type(model).__name__ == "TinyVLM"


def test_parity_names_what_it_differentiated():
    class NoLabels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x))

    model, x = NoLabels(), torch.randn(3, 4)
    report = oc.optimize(model, (x,), num_stages=2).check_parity((x,))
    assert report.ok and report.loss_name == "sum of the outputs"
    assert str(report).startswith("Parity OK: sum of the outputs ") and "loss" not in str(report)


def test_run_gives_model_output_structure(tiny_llama):
    model, batch = tiny_llama
    result = oc.optimize(model, batch, num_stages=2)
    out = result.run(**batch)
    ref = model(**batch)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)


def test_given_plan_is_used_and_checked(vlm):
    model, batch = vlm
    first = oc.optimize(model, batch, num_stages=2)
    again = oc.optimize(model, batch, num_stages=2, plan=Plan.from_json(first.plan.to_json()))
    assert again.plan == first.plan
    wrong = Plan(block_names=("x", "y"), boundaries=(0, 1, 2))
    with pytest.raises(PlanError, match="do not match"):
        oc.optimize(model, batch, num_stages=2, plan=wrong)
    with pytest.raises(PlanError, match="has 2 stages but num_stages=3"):
        oc.optimize(model, batch, num_stages=3, plan=first.plan)


def test_bad_requests(vlm):
    model, batch = vlm
    with pytest.raises(PlanError, match="exceeds"):
        oc.optimize(model, batch, num_stages=100)
    with pytest.raises(oc.InputError, match="unknown planner"):
        oc.optimize(model, batch, num_stages=2, planner="magic")
    with pytest.raises(oc.InputError, match="do not match"):
        oc.optimize(model, {"input_ids": batch["input_ids"]}, num_stages=2)
    with pytest.raises(
        oc.InputError, match="2 positional inputs instead of 0; missing .pixel_values.*Accepted inputs: pixel_values"
    ):
        oc.optimize(model, batch, num_stages=2).run(batch["pixel_values"], batch["input_ids"])


def test_custom_planner_callable(vlm):
    model, batch = vlm

    def everything_on_last_but_first_block(graph, num_stages):
        return Plan(block_names=graph.names, boundaries=(0, 1, graph.num_blocks), planner="custom")

    result = oc.optimize(model, batch, num_stages=2, planner=everything_on_last_but_first_block)
    assert result.plan.planner == "custom" and result.check_parity(batch).ok


def test_pass_failure_names_the_pass(vlm):
    model, batch = vlm

    def broken(graph, num_stages):
        raise ZeroDivisionError("boom")

    with pytest.raises(oc.PassError, match=r"pass 'plan' failed \(passes run before it: capture, blocks\)"):
        oc.optimize(model, batch, num_stages=2, planner=broken)


@pytest.fixture(scope="module")
def vlm_result(vlm):
    model, batch = vlm
    return oc.optimize(model, batch, num_stages=1)


def test_random_valid_plans_reproduce_the_model(vlm, vlm_result):
    """Property over random cut points: every valid plan's stages reproduce loss and gradients."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from omnibal_compile.compile.codegen import generate_stages, run_stages

    model, batch = vlm
    graph = vlm_result.graph
    n = graph.num_blocks
    flat = vlm_result.flatten_inputs(**batch)
    params = list(model.parameters())
    ref = model(**batch)
    ref_grads = torch.autograd.grad(ref, params)

    @given(st.sets(st.integers(1, n - 1), max_size=n - 1))
    @settings(max_examples=25, deadline=None)
    def check(cuts):
        plan = Plan(block_names=graph.names, boundaries=(0, *sorted(cuts), n))
        stages = generate_stages(graph, plan, model)
        (loss,) = run_stages(stages, flat)
        assert float((loss - ref).detach().abs()) <= 1e-5
        for g, r in zip(torch.autograd.grad(loss, params), ref_grads):
            assert float((g - r).abs().max()) <= 1e-5

    check()


def test_every_cut_sends_contiguous_tensors(vlm, vlm_result):
    """Point-to-point sends reject non-contiguous tensors; a cut after a view must not produce one."""
    from omnibal_compile.compile.codegen import generate_stages

    model, batch = vlm
    graph = vlm_result.graph
    plan = Plan(block_names=graph.names, boundaries=tuple(range(graph.num_blocks + 1)))
    values = vlm_result.flatten_inputs(**batch)
    for stage in generate_stages(graph, plan, model)[:-1]:
        values = stage(*values)
        assert all(v.is_contiguous() for v in values if isinstance(v, torch.Tensor))


def test_stage_info_and_plan_checks_by_hand(vlm):
    import dataclasses

    from contracts import assert_frozen_keyword_only

    from omnibal_compile.compile.blocks import build_blocks
    from omnibal_compile.compile.capture import capture
    from omnibal_compile.compile.codegen import check_plan_matches, stage_info
    from omnibal_compile.planning.build import parameters

    model, batch = vlm
    result = oc.optimize(model, batch, num_stages=3)
    infos = [stage_info(s) for s in result.stages]
    assert [(i.index, i.num_stages, i.is_first, i.is_last) for i in infos] == [
        (0, 3, True, False), (1, 3, False, False), (2, 3, False, True)]
    assert_frozen_keyword_only(infos[0])
    originals = dict(model.named_buffers())
    for stage, info in zip(result.stages, infos):
        for node in stage.graph.nodes:  # inputs carry the captured example value, nothing else
            if node.op == "placeholder":
                assert "val" in node.meta and set(node.meta) <= {"val", "tensor_meta"}, node.meta
        for name, buf in stage.named_buffers():  # buffers map to their original names too
            assert buf is originals[info.param_map[name][0]]
    assert any(True for s in result.stages for _ in s.named_buffers())
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(PlanError, match="Linear is not a stage generated by omnibal_compile"):
        stage_info(plain)
    plain.meta = {"other": 1}
    with pytest.raises(PlanError, match="Linear is not a stage generated by omnibal_compile"):
        stage_info(plain)
    graph = build_blocks(capture(model, batch), model)
    plan = parameters(graph, 2)
    check_plan_matches(graph, plan)
    n = graph.num_blocks
    wrong = dataclasses.replace(plan, block_names=tuple(f"x{k}" for k in range(n)))
    with pytest.raises(PlanError, match="do not match") as err:
        check_plan_matches(graph, wrong)
    text = str(err.value)
    listed = text.split("missing from plan: ")[1].split("]")[0]
    assert n > 5 and listed.count("'") == 10  # the first five names of each side
    assert f"unknown to model: {sorted(f'x{k}' for k in range(n))[:5]}" in text
    params = list(plan.block_params)
    for k in range(4):
        params[k] += 1
    with pytest.raises(PlanError, match=r"differ from .* in 4 blocks \(([^;]*; ){2}[^;]*\): the plan was made"):
        check_plan_matches(graph, dataclasses.replace(plan, block_params=tuple(params)))
