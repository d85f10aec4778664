"""Measured on real CPU ranks: the jointly planned zero-bubble plans against the best 1F1B plan, same memory budget.

The reference VLM of ``bench/pipeline_cpu.py`` trains on the bundled real length statistics (ai2d + chartqa, the
balanced packs of ``bench/ablation_cpu.py``: one pack of ``--samples-per-pack`` samples per micro-batch) under
torchrun with gloo, one thread per rank, dp = 1. Per pipeline depth (``--pp``, default 2 and 4):

    1f1b            the ILP's cut points and per-block recomputation under the memory budget
    zbv, interleaved-zb, dualpipev
                    the zero-bubble planner's cut points (``plan_with_costs(schedule=..., virtual_stages=2)``,
                    :mod:`omnibal_compile.planning.zero_bubble`: the simulator's iteration time in torch's own
                    operation order, two stages per rank) under the same budget, without recomputation (the
                    runtime runs the split-backward schedules without it); dualpipev only where M >= 2 pp

The memory budget per pp is one number for all schedules: by default the largest device bound of 1F1B's fastest
plan with no budget (so the zero-bubble plans may use the memory 1F1B's best plan uses, no more); ``--budget-mib``
sets it. Every configuration runs in the same invocation, in rotating rounds (``--rounds``), so drift of this shared
machine's speed hits all alike. Throughput counts real tokens (the LLM tokens of each timed step's samples, padding
excluded) over the summed step times; the first step of each run warms up and is not timed.

Simulated (labelled so): ``omnibal_compile.simulate`` of each plan on the block costs profiled here at the pack's
shape, with the runtime overheads of ``runtime.measure_overhead`` fitted per (pp, schedule) (each F, B, I and W an
action) and the send speed of ``calibrate.links.measure_links``; at pp = 4 the 4 ranks share this machine's cores
(``processors`` = cores). At pp = 2 each rank has a core of its own, so a bubble is idle time, as the planner assumes.

Targets: the zbv plan >= 1.10x the 1F1B plan's measured tokens/s at pp = 2; every pp = 4 row within 15% of the
simulator; and the planner's choice among the schedules at pp = 2 (the least predicted iteration time) is the
measured best, or within the planner's tie tolerance (2%) of it.

    python bench/zero_bubble_cpu.py                     # pp 2 and 4, M = 4, 3 rounds (~10 minutes here)
    python bench/zero_bubble_cpu.py --dry               # plans and simulated figures only, nothing launched (seconds)
    python bench/zero_bubble_cpu.py --pp 2 --rounds 1 --save run.json   # keep every figure
    python bench/zero_bubble_cpu.py --resimulate run.json               # the table again, simulated anew
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation_cpu import FP32_ADAMW
from pipeline_cpu import CONFIG

import omnibal_compile as oc
from omnibal_compile.calibrate.links import effective_sizes, measure_links
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.data import bundled_length_files
from omnibal_compile.ir.costs import CostTable
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import Schedule, schedule_rule
from omnibal_compile.models import TinyVLM
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.planning.problem import PROFILED_TIE_TOLERANCE
from omnibal_compile.runtime import measure_overhead
from omnibal_compile.runtime.batches import packed_source
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig

SCHEDULES = ("1f1b", "zbv", "interleaved-zb", "dualpipev")
"""Rows per pipeline depth: the 1F1B baseline, then the zero-bubble schedules."""
ZERO_BUBBLE = "zbv"
"""The zero-bubble schedule of the speed-up target."""
SPEEDUP_TARGET = 1.10
SIM_TARGET = 0.15
SHARED_PP = 4
"""The pipeline depth whose ranks share the cores (its rows have the simulator target)."""


def chunks(kind: str) -> int:
    """Stages per rank: 2 for every split-backward schedule here (the V's, and interleaved-zb's two loops), else 1."""
    rule = schedule_rule(kind)
    return rule.stages_per_device or (2 if rule.split_backward else 1)


def runnable(kind: str, pp: int, micro: int) -> bool:
    """Whether torch's schedule runs ``micro`` micro-batches over ``pp`` ranks (dualpipev needs M >= stages)."""
    try:
        Schedule.for_stages(pp * chunks(kind), kind=kind, num_microbatches=micro, virtual_stages=chunks(kind))
    except oc.PlanError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, SHARED_PP], help="pipeline depths (default: 2 4)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step, one pack each")
    p.add_argument("--samples-per-pack", type=int, default=4)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--rounds", type=int, default=3, help="runs per configuration, in rotating order")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    p.add_argument("--repeats", type=int, default=3, help="profiling repeats per block (median)")
    p.add_argument("--budget-mib", type=float, help="memory budget per device (default: 1F1B's fastest plan's need)")
    p.add_argument("--dry", action="store_true",
                   help="pp=2 only, one profiling repeat: plans and simulated figures, nothing launched (seconds)")
    p.add_argument("--save", type=Path, help="write every measured and planned figure to this JSON file")
    p.add_argument("--resimulate", type=Path, help="print the table of a --save file, simulated again; run nothing")
    args = p.parse_args(argv)
    if args.resimulate:
        return report(json.loads(args.resimulate.read_text()))
    if args.steps < 2 or args.rounds < 1:
        raise SystemExit("--steps must be >= 2 (the first warms up) and --rounds >= 1")
    if "1f1b" not in args.schedules:
        raise SystemExit("--schedules must include 1f1b (the baseline)")
    record = collect(args)
    if args.save:
        args.save.write_text(json.dumps(record, indent=1))
        print(f"saved every figure to {args.save}")
    return report(record)


def collect(args: argparse.Namespace) -> dict:
    """Profile, plan, calibrate and (unless ``--dry``) run every configuration; every figure in one record."""
    t_start = time.perf_counter()
    load_start = os.getloadavg()  # before this run's own ranks add to it: the other processes' load
    cores = os.cpu_count() or 1
    pps = [2] if args.dry else args.pp
    micro = args.microbatches
    files = tuple(str(f) for f in bundled_length_files())
    torch.manual_seed(0)
    model = TinyVLM(CONFIG)

    def run_config(plan: str) -> RunConfig:
        return RunConfig(plan=plan, model="tinyvlm", model_config=dataclasses.asdict(CONFIG), lengths=files,
                         batching="balanced", samples_per_pack=float(args.samples_per_pack), batch_size=micro,
                         num_microbatches=micro, steps=args.steps, optimizer="adamw", lr=1e-4, threads=1)

    # One profile at the pack's shape, on one thread: every plan and simulation uses it.
    src = packed_source(run_config("unused"), model, 0)
    mb = {k: v[: v.shape[0] // micro] for k, v in src(0).items()}
    graph = oc.optimize(model, mb, num_stages=1).graph
    costs = annotate_costs(graph, model, device="cpu", threads=1, repeats=1 if args.dry else args.repeats,
                           precision=FP32_ADAMW)
    w = sum(b.weight_grad_s or 0.0 for b in costs.blocks)
    bwd = sum(b.backward_s for b in costs.blocks)
    shape = {k: tuple(v.shape) for k, v in mb.items() if k in ("pixel_values", "input_ids")}
    print(f"profiled micro-batch {shape}: forward {sum(b.forward_s for b in costs.blocks) * 1e3:.0f} ms, backward "
          f"{bwd * 1e3:.0f} ms of which W {w * 1e3:.0f} ms ({w / bwd:.0%})", flush=True)
    if not args.dry:
        sizes = effective_sizes(costs.cut_bytes, [b.num_params * FP32_ADAMW.weight_bytes for b in costs.blocks])
        links = measure_links(send_bytes=sizes[0], collective_bytes=sizes[1])
        costs = dataclasses.replace(costs, link_bandwidth=links.send_bytes_per_s)
        print(f"links: sends {links.send_bytes_per_s / 1e9:.2f} GB/s at {sizes[0] / 2**20:.1f} MiB", flush=True)

    # Plans: one budget per pp, every schedule planned under it.
    configs: dict[tuple[int, str], Plan] = {}
    budgets: dict[int, float] = {}
    for pp in pps:
        free = plan_with_costs(costs, num_stages=pp, num_microbatches=micro, planner="ilp", schedule="1f1b")
        budget = args.budget_mib * 2**20 if args.budget_mib else max(device_bounds(free))
        budgets[pp] = budget
        for kind in args.schedules:
            if not runnable(kind, pp, micro):
                print(f"pp={pp} {kind}: not run (torch's {schedule_rule(kind).torch_class} needs M >= "
                      f"{2 * pp} stages, M = {micro})")
                continue
            split = schedule_rule(kind).split_backward
            t0 = time.perf_counter()
            try:
                plan = plan_with_costs(costs, num_stages=pp * chunks(kind), num_microbatches=micro, planner="ilp",
                                       schedule=kind, virtual_stages=chunks(kind), memory_budget=budget,
                                       recompute="none" if split else "auto")
            except oc.PlanError as e:
                print(f"pp={pp} {kind}: no plan within the budget ({e})")
                continue
            configs[pp, kind] = plan
            rec = {r: plan.block_recompute.count(r) for r in ("none", "selective", "full") if r in plan.block_recompute}
            print(f"pp={pp} {kind:<14} cuts {list(plan.boundaries)} recompute {rec} planned "
                  f"{plan.iteration_time_s * 1e3:.0f} ms, device bounds "
                  f"{[round(m / 2**20) for m in device_bounds(plan)]} MiB (budget {budget / 2**20:.0f} MiB), "
                  f"planned in {time.perf_counter() - t0:.1f} s", flush=True)

    # Runtime overheads (near-empty model) per (pp, schedule), under the same core sharing.
    overheads: dict[tuple[int, str], tuple[float, float]] = {}
    timed: dict[tuple[int, str], list[tuple[int, float]]] = {k: [] for k in configs}
    steps_tokens: list[int] = []
    if not args.dry:
        for pp, kind in configs:
            counts = (2 * pp, 2 * pp + 4) if kind == "dualpipev" else (max(pp, 2), max(pp, 2) + 4)
            o = measure_overhead(ranks=pp, schedule=kind, virtual_stages=chunks(kind), microbatches=counts, steps=6,
                                 processors=cores if pp > cores else None)
            overheads[pp, kind] = (o.op_s, o.step_s)
            print(f"pp={pp} {kind}: runtime overhead {o.op_s * 1e3:.2f} ms per action, {o.step_s * 1e3:.2f} ms per "
                  "step", flush=True)
        every = packed_source(run_config("unused"), model, None)
        stats = every.data_plan.stats.tokens
        steps_tokens = [int(sum(stats[np.asarray(ids)].sum() for ids in every.packs(s, 0))) for s in range(args.steps)]
        order = list(configs)
        with tempfile.TemporaryDirectory() as tmp:
            for k, plan in configs.items():
                (Path(tmp) / f"{k[0]}_{k[1]}.json").write_text(plan.to_json())
            for r in range(args.rounds):
                shift = r * max(1, len(order) // args.rounds)
                for k in order[shift:] + order[:shift]:
                    logs = launch(run_config(str(Path(tmp) / f"{k[0]}_{k[1]}.json")), timeout_s=600, quiet=True)
                    got = [(steps_tokens[log.step], log.step_time_s) for log in logs if log.step >= 1]
                    timed[k] += got
                    tps = sum(t for t, _ in got) / sum(s for _, s in got)
                    print(f"[round {r + 1}/{args.rounds}] pp={k[0]} {k[1]:<14} {tps:8.0f} real tokens/s", flush=True)
    return {
        "date": str(dt.date.today()), "cores": cores, "load_start": load_start, "load": os.getloadavg(),
        "rounds": 0 if args.dry else args.rounds,
        "steps": args.steps, "micro": micro, "dry": bool(args.dry), "costs": json.loads(costs.to_json()),
        "budgets": {str(q): b for q, b in budgets.items()}, "tokens": steps_tokens,
        "configs": [{"pp": pp, "schedule": kind, "plan": json.loads(plan.to_json()), "timed": timed[pp, kind],
                     "overhead": overheads.get((pp, kind))} for (pp, kind), plan in configs.items()],
        "seconds": time.perf_counter() - t_start,
    }


def device_bounds(plan: Plan) -> list[float]:
    """The planned memory bound of each device: its stages' ``stage_memory_bytes`` summed (two under the V)."""
    placed = plan.pipeline_schedule
    return [sum(plan.stage_memory_bytes[s] for s in placed.stages_of(d, plan.num_stages))
            for d in range(plan.num_devices)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One configuration of a run's record, measured and simulated."""

    pp: int
    schedule: str
    plan: Plan
    planned_s: float
    """The planner's predicted iteration time (what it chose the plan, and the schedule, by)."""
    simulated_s: float
    """The simulator's iteration time with the runtime overheads and core sharing (nan without overheads)."""
    measured_s: float
    """Summed timed step seconds over their count (nan when nothing ran)."""
    measured_tps: float
    """Real tokens per second, measured (nan when nothing ran)."""
    simulated_tps: float
    """A mean timed step's real tokens over the simulated iteration time (nan when nothing ran)."""


def table_rows(record: dict) -> list[Row]:
    """Each configuration of a record, simulated anew from its costs and overheads."""
    costs = CostTable.from_dict(record["costs"])
    cores = record["cores"]
    tokens = record["tokens"]
    mean_tokens = float(np.mean(tokens[1:])) if tokens else float("nan")
    rows = []
    for c in record["configs"]:
        plan = Plan.from_dict(c["plan"])
        op_s, step_s = c["overhead"] or (0.0, 0.0)
        res = oc.simulate(plan, costs, op_overhead_s=op_s, step_overhead_s=step_s,
                          processors=cores if plan.num_devices > cores else None)
        sim = res.iteration_time_s if c["overhead"] else float("nan")
        timed = c["timed"]
        measured = sum(s for _, s in timed) / len(timed) if timed else float("nan")
        tps = sum(t for t, _ in timed) / sum(s for _, s in timed) if timed else float("nan")
        rows.append(Row(pp=c["pp"], schedule=c["schedule"], plan=plan, planned_s=float(plan.iteration_time_s),
                        simulated_s=sim, measured_s=measured, measured_tps=tps, simulated_tps=mean_tokens / sim))
    return rows


def verdicts(rows: list[Row]) -> list[tuple[str, bool | None]]:
    """The targets, each (sentence, met; None where the run did not measure it)."""
    by = {(r.pp, r.schedule): r for r in rows}
    out: list[tuple[str, bool | None]] = []
    base, zb = by.get((2, "1f1b")), by.get((2, ZERO_BUBBLE))
    if base and zb:
        ratio = zb.measured_tps / base.measured_tps
        out.append((f"pp=2 {ZERO_BUBBLE} >= {SPEEDUP_TARGET:.2f}x the best 1F1B plan's measured tokens/s "
                    f"({ratio:.2f}x)", bool(ratio >= SPEEDUP_TARGET) if np.isfinite(ratio) else None))
    shared = [r for r in rows if r.pp == SHARED_PP]
    if shared:
        errs = [abs(r.simulated_s / r.measured_s - 1) for r in shared]
        worst = max(errs)
        out.append((f"pp={SHARED_PP} simulated vs measured iteration time within {SIM_TARGET:.0%} "
                    f"(worst {worst:.1%})", bool(worst <= SIM_TARGET) if np.isfinite(worst) else None))
    at2 = [r for r in rows if r.pp == 2]
    if len(at2) > 1:
        chosen = min(at2, key=lambda r: r.planned_s)
        best = max(at2, key=lambda r: r.measured_tps)
        gap = 1 - chosen.measured_tps / best.measured_tps
        out.append((f"pp=2 the planner's choice ({chosen.schedule}) is the measured best ({best.schedule}) or within "
                    f"{PROFILED_TIE_TOLERANCE:.0%} of it ({gap:.1%} slower)",
                    bool(gap <= PROFILED_TIE_TOLERANCE) if np.isfinite(gap) else None))
    return out


def report(record: dict) -> int:
    """Simulate each configuration of a run's record and print the table and the targets."""
    rows = table_rows(record)
    load, before = record["load"], record["load_start"]
    print(f"\nZero-bubble vs 1F1B on real ranks ({record['date']}, {record['cores']} cores, load average "
          f"{before[0]:.1f} before the run, {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at its end); "
          f"{record['rounds']} round(s) x {record['steps'] - 1} timed "
          f"steps per configuration; {record['micro']} micro-batches (one pack each), dp=1"
          + ("; DRY: nothing run, simulated only" if record["dry"] else ""))
    head = (f"{'pp':>2}  {'schedule':<14}  {'planned ms':>10}  {'sim ms':>8}  {'measured ms':>11}  {'sim err':>7}  "
            f"{'measured tok/s':>14}  {'sim tok/s':>9}  {'vs 1f1b measured':>16}  {'vs 1f1b planned':>15}  cut points")
    print(head)
    print("-" * len(head))
    by = {(r.pp, r.schedule): r for r in rows}
    for r in rows:
        base = by.get((r.pp, "1f1b"))
        vs_m = r.measured_tps / base.measured_tps if base else float("nan")
        vs_p = base.planned_s / r.planned_s if base else float("nan")
        print(f"{r.pp:>2}  {r.schedule:<14}  {r.planned_s * 1e3:>10.0f}  {_num(r.simulated_s * 1e3, '8.0f')}  "
              f"{_num(r.measured_s * 1e3, '11.0f')}  {_num(r.simulated_s / r.measured_s - 1, '+7.1%')}  "
              f"{_num(r.measured_tps, '14.0f')}  {_num(r.simulated_tps, '9.0f')}  {_num(vs_m, '15.2f', 'x')}  "
              f"{vs_p:>14.2f}x  {list(r.plan.boundaries)}")
    budgets = ", ".join(f"pp={q}: {b / 2**20:.0f} MiB" for q, b in record["budgets"].items())
    print("(planned: the planner's predicted iteration time, one processor per rank, no runtime overheads; sim: "
          "SIMULATED with the fitted runtime overheads, the ranks sharing the "
          f"{record['cores']} cores at pp > {record['cores']}; measured: mean timed step on the real ranks; tokens: "
          f"real LLM tokens, padding excluded; memory budget per device: {budgets})")
    for text, ok in verdicts(rows):
        print(f"target {text}: {'not measured' if ok is None else 'met' if ok else 'NOT met'}")
    if before[0] > 0.5 and not record["dry"]:
        print(f"load average {before[0]:.1f} before the run on {record['cores']} cores: other processes shared the "
              "cores, so its measured figures (and the targets met or not) do not stand for a quiet machine")
    print(f"total {record['seconds']:.0f} s")
    return 0


def _num(x: float, spec: str, unit: str = "") -> str:
    """``x`` formatted by ``spec`` and followed by ``unit``, or a dash of the same width where it was not measured
    (nan)."""
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0) + len(unit)
    return format(x, spec) + unit if np.isfinite(x) else "-".rjust(width)


if __name__ == "__main__":
    sys.exit(main())
