"""run --compile (inductor) and --kernels triton (interpreted) against eager runs, on CPU ranks.

Each layout trains the same steps of the same data and seed twice, eager and with the fast path, each
run with its own plan of the same cuts (the kernel pass fuses the LM head into its loss, so a kernels run
needs a plan made with kernels). Prints each run's losses, the largest absolute loss difference and each
run's median step time after the first (the first compiles). Layouts: ``pp2`` (2 stages, 1F1B),
``dp2-fsdp`` and ``dp2-ddp`` (1 stage, 2 data-parallel ranks: FSDP2, replicate), ``pp1`` (1 rank),
``interleaved`` (4 stages on 2 ranks, interleaved 1F1B), ``pp2-bf16`` (``pp2`` with 16-bit parameters and
compute: its losses agree to bf16's precision, not to 1e-5); every block recomputed (``full``) so the checkpoint
regions run inside the compiled forward. ``--path both`` runs the Triton kernels inside the compiled stages.
``--resume`` also runs the fast path as two halves (save, then ``--resume``) and prints how far the resumed
losses are from the uninterrupted ones (0 when the resumed run continues exactly).

    python bench/fast_paths_cpu.py --path compile --layouts pp2 dp2-fsdp --steps 2
    python bench/fast_paths_cpu.py --path triton --layouts pp2          # sets TRITON_INTERPRET=1 for the ranks
    python bench/fast_paths_cpu.py --path compile --layouts interleaved pp2-bf16 --steps 4 --resume
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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

TINIEST = dataclasses.replace(SMALL_VLM, vit_layers=1, llm_layers=1)
LAYOUTS = {"pp1": (1, 1, "fsdp", "1f1b", None), "pp2": (2, 1, "fsdp", "1f1b", None),
           "dp2-fsdp": (1, 2, "fsdp", "1f1b", None), "dp2-ddp": (1, 2, "ddp", "1f1b", None),
           "interleaved": (4, 1, "fsdp", "interleaved", None), "pp2-bf16": (2, 1, "fsdp", "1f1b", "bf16")}
"""Layout -> (pipeline stages, dp, dp_shard, schedule, precision)."""
PATHS = {"compile": {"kernels": None, "compile": True}, "triton": {"kernels": "triton", "compile": False},
         "both": {"kernels": "triton", "compile": True}}
"""--path -> the fast run's settings."""


def _config(layout: str, steps: int, folder: Path, *, kernels: str | None, compile: bool) -> RunConfig:
    stages, dp, shard, schedule, precision = LAYOUTS[layout]
    model_config = dataclasses.asdict(TINIEST)
    with progress.quiet():
        plan = oc.optimize(build_model(RunConfig(plan="-", model_config=model_config)), num_stages=stages,
                           planner="uniform", num_microbatches=2 if schedule == "1f1b" else 4, recompute="full",
                           kernels=kernels, schedule=schedule, **({"precision": precision} if precision else {})).plan
    path = folder / f"plan-{layout}-{kernels}.json"
    path.write_text(plan.to_json())
    return RunConfig(plan=str(path), model_config=model_config, steps=steps, batch_size=4 * dp, lr=1e-3, dp=dp,
                     dp_shard=shard, kernels=kernels, compile=compile, precision=precision)


def run(layout: str, steps: int, folder: Path, *, kernels: str | None, compile: bool) -> tuple[list[float], float]:
    logs = launch(_config(layout, steps, folder, kernels=kernels, compile=compile), timeout_s=1200, quiet=True)
    return [e.loss for e in logs], statistics.median(e.step_time_s for e in logs[1:] or logs)


def resumed(layout: str, steps: int, folder: Path, *, kernels: str | None, compile: bool) -> list[float]:
    """The losses of the same run made as two halves: the first saves, the second resumes from it."""
    config = _config(layout, steps, folder, kernels=kernels, compile=compile)
    ckpt = folder / f"ckpt-{layout}"
    first = launch(dataclasses.replace(config, steps=steps // 2, save=str(ckpt)), timeout_s=1200, quiet=True)
    second = launch(dataclasses.replace(config, resume=str(ckpt)), timeout_s=1200, quiet=True)
    return [e.loss for e in first] + [e.loss for e in second]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=list(PATHS), default="compile")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["pp2"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="also run the fast path as two halves (save, --resume)")
    args = p.parse_args()
    if args.resume and args.steps < 2:
        p.error("--resume needs --steps 2 or more (the run is cut in half)")
    fast = PATHS[args.path]
    if fast["kernels"] == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # the ranks inherit it: the Triton kernels run in the interpreter
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            eager, t_eager = run(layout, args.steps, Path(tmp), kernels=None, compile=False)
            quick, t_fast = run(layout, args.steps, Path(tmp), **fast)
            diff = max(abs(a - b) for a, b in zip(eager, quick))
            print(f"{layout}: eager {[f'{x:.6f}' for x in eager]} ({t_eager:.3f} s/step), {args.path} "
                  f"{[f'{x:.6f}' for x in quick]} ({t_fast:.3f} s/step); max |loss difference| {diff:.2e}",
                  flush=True)
            if args.resume:
                halves = resumed(layout, args.steps, Path(tmp), **fast)
                print(f"{layout}: {args.path} resumed after step {args.steps // 2 - 1}: "
                      f"{[f'{x:.6f}' for x in halves]}; max |difference| from the uninterrupted run "
                      f"{max(abs(a - b) for a, b in zip(quick, halves)):.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
