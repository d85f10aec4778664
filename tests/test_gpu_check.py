"""bench/gpu_check.sh --dry-run: every part of the GPU check runs on the CPU and writes its results; without
--dry-run and without a GPU it says so and measures nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_writes_its_results(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] and not results["errors"] and results["parity"]["ok"]
    costs = results["costs"]
    assert len(costs["blocks"]) > 10 and set(costs["calibration_fitted"]) == {"matmul", "attention", "memory"}
    assert costs["error_after"]["median"] <= costs["error_before"]["median"]  # the fit can only help its own data
    assert json.loads((tmp_path / "kernels.json").read_text())
    train = json.loads((tmp_path / "gpu_train.json").read_text())
    assert train["ok"] and not train["errors"] and train["precision"] == ["bf16"]
    assert max(train["loss_rel_diff"]) <= train["loss_rtol"]
    assert train["runs"]["triton"]["losses"] != train["runs"]["eager"]["losses"]  # the Triton kernels ran indeed
    assert all(r["mfu"] is not None and r["model_flops"] > 0 for r in train["runs"].values())
    log = (tmp_path / "gpu_check.txt").read_text()
    assert "kernels exit 0, model checks exit 0, training exit 0" in log and "Parity OK" in log
    assert "triton vs eager: worst relative loss difference" in log
    section = (tmp_path / "RESULTS_section.md").read_text()
    assert section.startswith("## GPU check (bench/gpu_check.sh)\n") and "DRY RUN on the CPU" in section
    assert "exit: kernels 0, model checks 0, training 0" in section


def test_the_results_page_keeps_the_gpu_section_when_generated_again(tmp_path):
    import datetime as dt

    from bench.studies.bench_all import GPU_SECTION_TEMPLATE, kept_gpu_section, write_results

    page = tmp_path / "RESULTS.md"
    assert kept_gpu_section(page) == GPU_SECTION_TEMPLATE and "Not yet run on a GPU" in GPU_SECTION_TEMPLATE
    measured = "## GPU check (bench/gpu_check.sh)\n\n- figures: measured on a GPU\n\nMFU 41.0%"
    page.write_text(f"# Benchmark results\n\n## a.py\n\nold\n\n{measured}\n\n## later.py\n\nx\n")
    write_results([], page, command="bench all", commit="abc", started=dt.datetime.now(dt.timezone.utc))
    assert page.read_text().rstrip().endswith(measured) and "old" not in page.read_text()


@pytest.mark.slow
def test_gpu_check_says_plainly_when_no_gpu_is_present(tmp_path):
    if _cuda():
        pytest.skip("a GPU is present")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no GPU present" in proc.stdout and "nothing measured" in proc.stdout
    assert "no GPU present" in (tmp_path / "gpu_check.txt").read_text()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
