"""The model half of ``bench/gpu_check.sh``: cost pass vs roofline, calibration fit, optimize + parity.

    python -m bench.studies.gpu_check --out DIR [--dry-run]

On a CUDA GPU (the ``h200`` roofline unless ``--roofline`` names another):
    1. costs   a reference VLM at realistic widths (ViT 1024, LLM 2048, bf16) profiled on CUDA,
               block by block, next to the roofline's times for the same blocks; per block the
               ratio, then the roofline's calibration factors (achieved fraction of peak per op
               class: matmul, attention, memory) fitted to the measured forward times by
               non-negative least squares, and the error before and after;
    2. parity  ``optimize()`` (4 stages, ILP on the CUDA costs, Triton kernels substituted) on the
               reference VLM in float32, and the stage chain's loss and gradients against the
               unsplit model.
``--dry-run`` runs the same code on the CPU with the small reference VLM (float32, profiled on
CPU against the same roofline), so a machine without a GPU checks everything but CUDA itself.
Writes ``gpu_check.json`` (every figure) to ``--out`` and prints a report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "fit_calibration"]


def fit_calibration(ideal: list[dict[str, float]], measured: list[float], classes: tuple[str, ...]) -> dict[str, float]:
    """Calibration per op class (fraction of the roofline reached, in (0, 1]) that best explains ``measured``.

    ``ideal[b][c]``: block b's uncalibrated roofline seconds of its class-c ops; the model is
    ``measured[b] ~ sum_c ideal[b][c] / calibration[c]``, fitted on relative error with
    non-negative inverse factors. A class no block exercises keeps 1.0.
    """
    import numpy as np

    from omnibal_compile.costs.shapes import fit_nonnegative  # the one non-negative relative-error fit

    x = np.array([[row.get(c, 0.0) for c in classes] for row in ideal])
    inv = fit_nonnegative(x, np.array(measured))
    return {
        c: float(min(1.0, max(1e-3, 1 / v))) if v > 0 and x[:, k].any() else 1.0
        for k, (c, v) in enumerate(zip(classes, inv))
    }


def _errors(pred: list[float], meas: list[float]) -> dict[str, float]:
    import numpy as np

    rel = np.abs(np.array(pred) / np.array(meas) - 1)
    return {"median": float(np.median(rel)), "worst": float(rel.max())}


def check_costs(*, dry_run: bool, roofline: str) -> dict[str, Any]:
    import torch

    from omnibal_compile.compile.blocks import build_blocks
    from omnibal_compile.compile.capture import capture
    from omnibal_compile.costs._measure import record_ops
    from omnibal_compile.costs.annotate import annotate_costs, block_inputs, block_modules
    from omnibal_compile.costs.devices import OP_CLASSES, get_device
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

    device = "cpu" if dry_run else "cuda"
    dtype = torch.float32 if dry_run else torch.bfloat16
    if dry_run:
        cfg = TinyVLMConfig()
        shape = dict(batch=2, tiles_per_sample=2, text_tokens=48)
    else:
        cfg = TinyVLMConfig(image_size=224, patch_size=14, vit_hidden=1024, vit_layers=4, vit_heads=16, vit_mlp=4096,
                            llm_hidden=2048, llm_layers=4, llm_heads=16, llm_kv_heads=8, llm_mlp=5632, vocab_size=32000)
        shape = dict(batch=2, tiles_per_sample=4, text_tokens=512)
    torch.manual_seed(0)
    model = TinyVLM(cfg).to(device=device, dtype=dtype)
    batch = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
             for k, v in make_example_batch(cfg, **shape).items()}
    graph = build_blocks(capture(model, batch), model)
    t0 = time.perf_counter()
    measured = annotate_costs(graph, model, device=device, repeats=5, warmup=2)
    spec = get_device(roofline)
    modelled = annotate_costs(graph, model, device=spec)
    seconds = time.perf_counter() - t0
    # Per block and op class, the uncalibrated roofline time of its forward ops.
    ideal_spec = dataclasses.replace(spec, calibration={c: 1.0 for c in OP_CLASSES})
    modules = block_modules(graph, model)
    inputs = block_inputs(graph, modules)
    ideal: list[dict[str, float]] = []
    for m, x in zip(modules, inputs):
        row = {c: 0.0 for c in OP_CLASSES}
        for r in record_ops(m, x)[0]:
            row[r.op_class] += ideal_spec.op_time(r.op_class, r.flops, r.nbytes)
        ideal.append(row)
    fwd = [b.forward_s for b in measured.blocks]
    # Blocks of near-zero time (glue) would dominate relative errors with launch overheads.
    keep = [k for k, t in enumerate(fwd) if t > 0.05 * sum(fwd) / len(fwd)]
    fitted = fit_calibration([ideal[k] for k in keep], [fwd[k] for k in keep], OP_CLASSES)

    def predict(cal: dict[str, float]) -> list[float]:
        return [sum(ideal[k][c] / cal[c] for c in OP_CLASSES) for k in keep]

    rows = [
        {"block": b.name, "measured_fwd_ms": b.forward_s * 1e3, "measured_bwd_ms": m.backward_s * 1e3,
         "roofline_fwd_ms": r.forward_s * 1e3, "ratio_fwd": b.forward_s / r.forward_s if r.forward_s else None,
         "bwd_over_fwd": m.backward_s / m.forward_s if m.forward_s else None, "spread": m.time_spread,
         "times_of": m.profiled_as or "measured"}
        for b, m, r in zip(measured.blocks, measured.blocks, modelled.blocks)
    ]
    return {
        "device": device, "dtype": str(dtype), "roofline": spec.name, "config": dataclasses.asdict(cfg), "batch": shape,
        "blocks": rows, "seconds": seconds,
        "calibration_before": dict(spec.calibration), "calibration_fitted": fitted,
        "error_before": _errors(predict(dict(spec.calibration)), [fwd[k] for k in keep]),
        "error_after": _errors(predict(fitted), [fwd[k] for k in keep]),
        "fitted_on": [measured.blocks[k].name for k in keep],
    }


def check_parity(*, dry_run: bool) -> dict[str, Any]:
    import torch

    import omnibal_compile as oc
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

    device = "cpu" if dry_run else "cuda"
    cfg = TinyVLMConfig() if dry_run else TinyVLMConfig(vit_hidden=256, vit_mlp=1024, llm_hidden=512, llm_mlp=1408)
    torch.manual_seed(0)
    model = TinyVLM(cfg).to(device)
    batch = {k: v.to(device) for k, v in make_example_batch(cfg, batch=4, tiles_per_sample=2, text_tokens=64).items()}
    t0 = time.perf_counter()
    result = oc.optimize(model, batch, num_stages=4, device=device, num_microbatches=8, kernels="triton")
    report = result.check_parity(batch, tolerance=1e-4)
    return {"device": device, "ok": bool(report.ok), "report": str(report), "plan": result.plan.summary(),
            "boundaries": list(result.plan.boundaries), "seconds": time.perf_counter() - t0}


def _report(results: dict[str, Any]) -> str:
    from omnibal_compile._utils.tables import format_table

    lines = []
    costs = results.get("costs", {})
    if "blocks" in costs:
        lines.append(
            f"cost pass on {costs['device']} ({costs['dtype']}) vs the {costs['roofline']} roofline, per block "
            f"({costs['seconds']:.1f} s):"
        )
        rows = [
            (
                "block",
                "measured fwd ms",
                "bwd ms",
                "roofline fwd ms",
                "measured/roofline",
                "bwd/fwd",
                "spread",
                "times of",
            )
        ]
        for b in costs["blocks"]:
            rows.append(
                (
                    b["block"],
                    f"{b['measured_fwd_ms']:.3f}",
                    f"{b['measured_bwd_ms']:.3f}",
                    f"{b['roofline_fwd_ms']:.4f}",
                    f"{b['ratio_fwd']:.2f}" if b["ratio_fwd"] is not None else "-",
                    f"{b['bwd_over_fwd']:.2f}" if b["bwd_over_fwd"] is not None else "-",
                    f"{b['spread']:.1%}",
                    b["times_of"],
                )
            )
        lines.append(format_table(rows, "lrrrrrrl"))
        cal = " ".join(f"{c} {costs['calibration_before'][c]:.2f} -> {costs['calibration_fitted'][c]:.3f}"
                       for c in costs["calibration_fitted"])
        lines.append(f"calibration (fraction of the roofline reached) before -> fitted: {cal}")
        eb, ea = costs["error_before"], costs["error_after"]
        lines.append(
            f"forward-time error of the roofline over {len(costs['fitted_on'])} blocks: median {eb['median']:.1%}, "
            f"worst {eb['worst']:.1%} with the default calibration; median {ea['median']:.1%}, worst "
            f"{ea['worst']:.1%} with the fitted one"
        )
    parity = results.get("parity", {})
    if "report" in parity:
        lines.append(f"\noptimize() on {parity['device']} (4 stages, ILP, Triton kernels), {parity['seconds']:.1f} s:")
        lines.append(parity["plan"])
        lines.append(parity["report"])
    for name, err in results.get("errors", {}).items():
        lines.append(f"\n{name} FAILED:\n{err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="run on the CPU with the small reference VLM (no CUDA)")
    ap.add_argument(
        "--roofline", default="h200", help="roofline target the measurements are compared with (default h200)"
    )
    args = ap.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device visible; use --dry-run to check the rest on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"dry_run": args.dry_run, "torch": torch.__version__, "errors": {}}
    if torch.cuda.is_available() and not args.dry_run:
        results["gpu"] = torch.cuda.get_device_name()
    for name, fn in (("costs", lambda: check_costs(dry_run=args.dry_run, roofline=args.roofline)),
                     ("parity", lambda: check_parity(dry_run=args.dry_run))):
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - every section runs and reports; the exit status says it failed
            results["errors"][name] = traceback.format_exc()
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(_report(results))
    ok = not results["errors"] and results.get("parity", {}).get("ok", False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
