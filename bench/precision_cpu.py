"""bf16 against fp32 through the pipeline runtime: 20 steps of the same data and seed on 2 CPU ranks.

Two layouts: 2 pipeline stages (dp = 1: FSDP2 on each rank's 1-rank dp mesh in bf16) and dp = 2 FSDP2 x 1
stage; in bf16 the parameters compute in bf16 over fp32 masters (``runtime.precision``). Prints each step's
loss in fp32 and bf16, the largest relative difference and each run's median step time (CPU bf16 is not faster
here; bf16 is the GPU setting). ``bench/precision_memory.py`` measures the parameter and gradient bytes.

    python bench/precision_cpu.py              # 20 steps per run
    python bench/precision_cpu.py --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import omnibal_compile as oc
from omnibal_compile import progress
from omnibal_compile.runtime.batches import build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import SMALL_VLM  # noqa: E402  (the tests' small VLM)


def losses(stages: int, dp: int, precision: str, steps: int, folder: Path) -> tuple[list[float], float]:
    model_config = dataclasses.asdict(SMALL_VLM)
    model = build_model(RunConfig(plan="-", model_config=model_config))
    with progress.quiet():
        plan = oc.optimize(model, num_stages=stages, planner="uniform", num_microbatches=2).plan
    path = folder / f"plan{stages}.json"
    path.write_text(plan.to_json())
    config = RunConfig(plan=str(path), model_config=model_config, steps=steps, batch_size=4 * dp, lr=1e-3, dp=dp,
                       dp_shard="fsdp", precision=precision)
    logs = launch(config, timeout_s=600, quiet=True)
    return [e.loss for e in logs], statistics.median(e.step_time_s for e in logs[1:] or logs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for label, stages, dp in (("pp=2, dp=1", 2, 1), ("pp=1, dp=2 FSDP2", 1, 2)):
            fp32, t32 = losses(stages, dp, "fp32", args.steps, Path(tmp))
            bf16, t16 = losses(stages, dp, "bf16", args.steps, Path(tmp))
            worst = max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))
            worst_all = max(worst_all, worst)
            print(f"{label}: {args.steps} steps, max |bf16 - fp32| / fp32 loss = {worst:.2e}; "
                  f"median step fp32 {t32 * 1e3:.1f} ms, bf16 {t16 * 1e3:.1f} ms")
            print("  fp32 " + " ".join(f"{x:.4f}" for x in fp32))
            print("  bf16 " + " ".join(f"{x:.4f}" for x in bf16))
    print(f"within 2%: {worst_all <= 0.02}")
    return 0 if worst_all <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
