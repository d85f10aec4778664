"""Shared tiny models and batches. Hugging Face fixtures skip cleanly without transformers."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from hypothesis import settings

from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

warnings.filterwarnings("ignore")

# Property tests draw the same cases on every run (seeded by each test's name), so a CI run and a
# local rerun see the same examples; HYPOTHESIS_PROFILE=explore draws new ones each run.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SLOW_TESTS: dict[str, int] = {
    "tests/test_ilp.py::test_cold_ilp_matches_brute_force_when_memory_decides": 99,
    "tests/test_probes_data_loss.py::test_log_is_appended_to_and_a_resumed_run_continues_it": 29,
    "tests/test_examples.py::test_hugging_face_models_get_their_family_batch": 23,
    "tests/test_probes_data_loss.py::test_a_nan_loss_stops_the_run_at_its_step_and_keeps_the_good_checkpoints": 23,
    "tests/test_gpu_check.py::test_gpu_check_dry_run_passes_and_writes_its_results": 22,
    "tests/test_export.py::test_a_pipeline_run_exports_the_trained_model": 21,
    "tests/test_paper_scale.py::test_compiled_tables_are_the_compilers_and_fit_study_shapes": 17,
    "tests/test_codegen.py::test_random_valid_plans_reproduce_the_model": 17,
    "tests/test_kernels.py::test_triton_cases_in_interpreter": 14,
    "tests/test_kernel_pass.py::test_triton_cases_in_interpreter": 11,
    "tests/test_runtime_data.py::test_two_ranks_train_on_balanced_packs_like_the_unsplit_model": 11,
    "tests/test_recompute.py::test_predicted_memory_bounds_the_measured_peak": 10,
    "tests/test_examples.py::test_bare_optimize_on_hugging_face_models": 10,
    "tests/test_solver.py::test_strategies_draw_memory_bound_multi_stage_problems": 9,
    "tests/test_hf_trainer.py::test_two_ranks_each_train_on_their_own_packs_of_each_step": 9,
    "tests/test_runtime_data.py::test_qwen2_vl_packs_need_one_row_per_microbatch": 9,
    "tests/test_plan_command.py::test_plan_tiny_vlm": 8,
    "tests/test_freeze.py::test_the_plan_of_a_frozen_vision_tower_is_costed_as_such_and_predicts_a_faster_iteration": 9,
    "tests/test_cost.py::test_shape_model_on_reference_vlm": 8,
    "tests/test_faults_process.py::test_a_frozen_rank_is_named_when_the_time_limit_ends_the_run": 8,
    "tests/test_cost.py::test_hf_models": 8,
    "tests/test_faults_process.py::test_a_failing_rank_is_named_with_its_first_error_line": 7,
    "tests/test_cli.py::test_console_script_entry_point": 7,
    "tests/test_config.py::test_optimize_prints_nothing_and_quiet_silences_its_notes": 7,
    "tests/test_faults_process.py::test_the_time_limit_says_where_each_rank_was": 6,
}
"""Tests (all their parameter cases) that take several seconds each -> seconds measured for all cases on
this 2-core machine (full suite, 2026-12-02). They run under the ``slow`` marker, with the tests that
start processes (``distributed``), in CI's second phase; the README's test command leaves them out."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)

SMALL_VLM = TinyVLMConfig(
    image_size=16, patch_size=4, vit_hidden=32, vit_layers=2, vit_heads=2, vit_mlp=64,
    llm_hidden=32, llm_layers=3, llm_heads=4, llm_kv_heads=2, llm_mlp=64, vocab_size=64, image_token_id=63,
)


@pytest.fixture(scope="session")
def vlm() -> tuple[TinyVLM, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyVLM(SMALL_VLM)
    return model, make_example_batch(SMALL_VLM, batch=2, tiles_per_sample=1, text_tokens=12)


def _hf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_llama():
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="session")
def tiny_llava():
    tf = _hf()
    torch.manual_seed(0)
    vc = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        projection_dim=32,
    )
    tc = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    cfg = tf.LlavaConfig(
        vision_config=vc, text_config=tc, image_token_index=95, image_seq_length=17, vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    model = tf.LlavaForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (2, 24), generator=g)
    ids[:, :17] = 95  # 16 patches + CLS ("full" strategy keeps it)
    labels = ids.clone()
    labels[:, :17] = -100
    return model, {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "input_ids": ids, "labels": labels}


@pytest.fixture(scope="session")
def lengths_file(tmp_path_factory):
    # OmniBal's format in InternVL units (256 tokens per tile); scaled to the small model on load.
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(40):
        tiles = int(torch.randint(1, 4, (1,), generator=g))
        records.append({"vit_num": tiles, "token_num": tiles * 256 + int(torch.randint(64, 700, (1,), generator=g)),
                        "image_flags": tiles})
    path = tmp_path_factory.mktemp("lengths") / "lengths.json"
    path.write_text(json.dumps(records))
    return str(path)


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank in this process (pipelining and checkpoints need one), destroyed after."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_tiny_llava(out):
    """``examples/make_tiny_llava.py`` run into ``out`` (a pretrained tiny Llava folder, a dataset with real images):
    the documented training path's stand-in, shared by the tests that walk it."""
    return _run_example("make_tiny_llava", out)


def make_tiny_qwen2vl(out):
    """``examples/make_tiny_qwen2vl.py`` run into ``out``: a pretrained tiny Qwen2-VL folder (tokenizer with a chat
    template, image processor) and the same dataset as :func:`make_tiny_llava`."""
    return _run_example("make_tiny_qwen2vl", out)


def make_tiny_internvl(out):
    """``examples/make_tiny_internvl.py`` run into ``out``: a pretrained tiny InternVL folder (tokenizer with its image
    tokens and a chat template, GotOcr2's image processor with 16-pixel tiles) and the same dataset as
    :func:`make_tiny_llava`."""
    return _run_example("make_tiny_internvl", out)


def _run_example(name, out):
    import importlib.util
    from pathlib import Path

    pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(Path(out))
    return Path(out)

