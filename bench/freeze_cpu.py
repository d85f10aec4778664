"""Freezing the vision tower: planned vs measured step time, frozen and not, on 2 CPU ranks.

For each setting of ``--freeze`` (none, the vision tower) the reference VLM is planned for 2 pipeline
stages on this CPU's profiled costs (``optimize(device="cpu", freeze=...)``: frozen blocks are costed
with no weight gradients, and the vision blocks, before the first trained block, with no backward at
all), then trained for real on 2 ranks (gloo, one thread each) with that plan. The script prints the
planned iteration time and the measured median step time (the first steps left out) of each, and the
ratio frozen / not: the acceptance is that the plan predicts the frozen run faster and the measured
run confirms the direction.

    python bench/freeze_cpu.py                 # 12 steps per run
    python bench/freeze_cpu.py --steps 30 --freeze vision
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
from omnibal_compile.models import TinyVLMConfig
from omnibal_compile.runtime.batches import batch_source, build_model
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig

MODEL = TinyVLMConfig(image_size=32, patch_size=4, vit_hidden=96, vit_layers=4, vit_heads=4, vit_mlp=384,
                      llm_hidden=96, llm_layers=4, llm_heads=4, llm_kv_heads=2, llm_mlp=256, vocab_size=512)
"""A VLM whose vision tower is a good share of the step (64 patches a tile, 2 tiles a sample)."""
MICROBATCHES = 4
ROWS_PER_MICROBATCH = 2


def plan_and_run(freeze: tuple[str, ...], steps: int, folder: Path) -> tuple[float, float, list[float]]:
    """(planned iteration s, measured median step s, losses) of a 2-stage run with ``freeze``."""
    model_config = dataclasses.asdict(MODEL)
    probe = RunConfig(plan="-", model_config=model_config, batch_size=ROWS_PER_MICROBATCH, freeze=freeze)
    model = build_model(probe)  # frozen as the run freezes it
    micro = batch_source(probe, model)(0)
    with progress.quiet():
        result = oc.optimize(model, micro, num_stages=2, num_microbatches=MICROBATCHES, device="cpu",
                             freeze=freeze, recompute="none")
    plan_path = folder / f"plan-{'-'.join(freeze) or 'none'}.json"
    plan_path.write_text(result.plan.to_json())
    config = RunConfig(plan=str(plan_path), model_config=model_config, freeze=freeze, steps=steps,
                       batch_size=ROWS_PER_MICROBATCH * MICROBATCHES, optimizer="adamw", lr=1e-3)
    logs = launch(config, timeout_s=900, quiet=True)
    times = [e.step_time_s for e in logs[2:]] or [e.step_time_s for e in logs]
    assert result.plan.iteration_time_s is not None
    return result.plan.iteration_time_s, statistics.median(times), [e.loss for e in logs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (the first 2 are not timed)")
    ap.add_argument("--freeze", default="vision", help="the frozen run's --freeze (default: vision, the tower)")
    args = ap.parse_args(argv)
    cases = {"none": (), f"--freeze {args.freeze}": tuple(args.freeze.split(","))}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, freeze in cases.items():
            rows[label] = plan_and_run(freeze, args.steps, Path(tmp))
    print(f"TinyVLM {MODEL.vit_layers}+{MODEL.llm_layers} layers, 2 pipeline ranks on CPU (gloo, 1 thread each), "
          f"{MICROBATCHES} micro-batches of {ROWS_PER_MICROBATCH} rows, 1F1B, {args.steps} steps (median of steps 3+)")
    print(f"{'setting':<22}{'planned ms/iter':>16}{'measured ms/step':>18}{'first loss':>12}{'last loss':>11}")
    for label, (planned, measured, losses) in rows.items():
        print(f"{label:<22}{planned * 1e3:>16.2f}{measured * 1e3:>18.2f}{losses[0]:>12.4f}{losses[-1]:>11.4f}")
    (p0, m0, _), (p1, m1, _) = rows.values()
    print(f"frozen / not: planned {p1 / p0:.3f}, measured {m1 / m0:.3f}")
    ok = p1 < p0 and m1 < m0
    print("direction confirmed: the plan and the run both say frozen is faster" if ok
          else "direction NOT confirmed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
