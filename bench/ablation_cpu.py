"""Measured ablation on real CPU ranks: random padded batches -> balanced packs -> ILP split -> planned recomputation.

The reference VLM of ``bench/pipeline_cpu.py`` (narrow ViT layers on many patches, wide LLM layers)
trains on the bundled real length statistics (ai2d + chartqa, scaled to the model's tokens per
tile; contents synthetic) under torchrun with gloo, one thread per rank, for three layouts:

    dp=2 x pp=1   the data step:               baseline -> + balanced packs
    dp=1 x pp=2   the data, partition and memory steps
    dp=2 x pp=2   all steps (FSDP2 per stage)

Steps of the ablation (each adds one thing to the one before):

    baseline     random batches, one sample per row padded to the largest sample (the runtime's
                 ``batching="random"``), uniform split, full recomputation of every block
    + packs      rows are the data balancer's packs; the same samples per step (rows x samples
                 per pack = the baseline's rows), still the uniform split with full recomputation
    + ILP        the ILP's split of the profiled blocks, full recomputation
    + recompute  the ILP chooses the split and each block's recomputation under the memory budget

Every configuration has the same model, data files, micro-batch count and samples per step. The
memory budget is one number for all: the baseline plan's predicted peak on its largest device
(so the method may use the memory the baseline uses, no more).

Throughput counts real tokens: the LLM tokens of the samples of each timed step (text plus
image tokens, padding excluded), summed, over the summed step times. Configurations run in
rotating rounds, so drift of this shared machine's speed hits all alike. Each configuration is
also simulated (``omnibal_compile.simulate``) from block costs profiled here at its micro-batch
shape plus the runtime overheads of ``runtime.measure_overhead`` and the links' speeds of
``runtime.links.measure_links`` (sends and FSDP collectives on gloo here); ranks sharing the cores are
modelled with ``processors`` = cores per pipeline replica. One step of each run (the second:
optimizer states exist) measures each rank's peak live tensor bytes (``RunConfig.memory_steps``,
the cost pass's storage accounting), compared with the plan's predicted memory of that rank's
stage; that step is not timed.

    python bench/ablation_cpu.py              # one round, 2 timed steps per configuration (~9 minutes here)
    python bench/ablation_cpu.py --quick      # 1 timed step per configuration
    python bench/ablation_cpu.py --rounds 2   # rotating rounds (the order shifts each round)
    python bench/ablation_cpu.py --plans-only # the plans and their predicted memory, nothing run
    python bench/ablation_cpu.py --layouts 2x2 --save run.json   # the 4-rank rows only; keep every figure
    python bench/ablation_cpu.py --resimulate run.json           # the table again from a saved run, simulated anew
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
from pipeline_cpu import CONFIG

import omnibal_compile as oc
from omnibal_compile.calibrate.links import LinkSpeed, effective_sizes, measure_links
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.data import bundled_length_files
from omnibal_compile.ir.costs import CostTable, DataParallel, Precision
from omnibal_compile.ir.plan import Plan
from omnibal_compile.models import TinyVLM
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.planning.problem import tie_tolerance_for
from omnibal_compile.runtime import measure_overhead
from omnibal_compile.runtime.batches import packed_source
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from omnibal_compile.sim.simulate import pipeline_processors

LAYOUTS = ((2, 1), (1, 2), (2, 2))
"""(dp, pp) rows of the table."""
STEPS = ("baseline", "+ packs", "+ ILP", "+ recompute")
FP32_ADAMW = Precision(weight_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8, compute_dtype="float32")
"""What the CPU runs hold per parameter: fp32 weights and gradients, AdamW's two fp32 moments."""


def steps_for(pp: int) -> tuple[str, ...]:
    return STEPS[:2] if pp == 1 else STEPS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 steps per run (1 timed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs per configuration, in rotating order (default 1: a round takes ~8 minutes here)")
    p.add_argument("--steps", type=int, default=None, help="steps per run; the first 2 are not timed (default 4)")
    p.add_argument("--packs", type=int, default=2, help="packs per dp rank per step (= micro-batches, one pack each)")
    p.add_argument("--samples-per-pack", type=int, default=4)
    p.add_argument(
        "--plans-only", action="store_true", help="profile and print the plans with their predicted memory, run nothing"
    )
    p.add_argument("--layouts", default=",".join(f"{d}x{q}" for d, q in LAYOUTS),
                   help="dp x pp layouts to run, comma-separated (default all: %(default)s)")
    p.add_argument("--dp-shard", choices=("fsdp", "ddp"), default="fsdp", help="data parallelism of the dp > 1 rows")
    p.add_argument(
        "--keep-gathered", action="store_true", help="FSDP keeps weights gathered (no reshard after forward)"
    )
    p.add_argument("--save", type=Path, help="write every measured and planned figure to this JSON file")
    p.add_argument("--resimulate", type=Path, help="print the table of a --save file, simulated again; run nothing")
    args = p.parse_args(argv)
    if args.resimulate:
        return report(json.loads(args.resimulate.read_text()))
    try:
        layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    except ValueError:
        raise SystemExit(f"--layouts must look like 2x1,1x2,2x2 (dp x pp), got {args.layouts!r}") from None
    if any(len(lay) != 2 or min(lay) < 1 for lay in layouts):
        raise SystemExit(f"--layouts must look like 2x1,1x2,2x2 (dp x pp), got {args.layouts!r}")
    rounds = args.rounds
    nsteps = args.steps or (3 if args.quick else 4)
    repeats = 3
    if nsteps < 3:
        raise SystemExit("--steps must be >= 3 (step 0 warms up, step 1 measures memory)")
    cores = os.cpu_count() or 1
    files = tuple(str(f) for f in bundled_length_files())
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = TinyVLM(CONFIG)
    micro = args.packs  # micro-batches per step: one pack each, or samples_per_pack random rows each

    # One RunConfig per (dp, batching); batch_size counts the whole step's rows over dp.
    def run_config(dp: int, batching: str, plan: str) -> RunConfig:
        rows = args.packs * dp * (1 if batching == "balanced" else args.samples_per_pack)
        return RunConfig(plan=plan, model="tinyvlm", model_config=dataclasses.asdict(CONFIG), lengths=files,
                         batching=batching, samples_per_pack=float(args.samples_per_pack), batch_size=rows,
                         num_microbatches=micro, steps=nsteps, optimizer="adamw", lr=1e-4, threads=1, dp=dp,
                         dp_shard=args.dp_shard, memory_steps=(1,))

    # Profile the blocks once per micro-batch shape (random rows or one pack), on one thread.
    profiles = {}
    for batching in ("random", "balanced"):
        src = packed_source(run_config(1, batching, "unused"), model, 0)
        mb = {k: v[: v.shape[0] // micro] for k, v in src(0).items()}
        graph = oc.optimize(model, mb, num_stages=1).graph
        costs = annotate_costs(graph, model, device="cpu", threads=1, repeats=repeats, precision=FP32_ADAMW)
        profiles[batching] = costs
        shape = {k: tuple(v.shape) for k, v in mb.items() if k in ("pixel_values", "input_ids")}
        print(f"profiled {batching} micro-batch {shape}: forward+backward "
              f"{sum(b.forward_s + b.backward_s for b in costs.blocks) * 1e3:.0f} ms", flush=True)

    # The links as they are here (gloo on loopback), at the sizes this model sends and gathers: the
    # planner and the simulator charge pipeline sends and FSDP's collectives at these speeds.
    base_costs = profiles["balanced"]
    sizes = effective_sizes(base_costs.cut_bytes, [b.num_params * FP32_ADAMW.weight_bytes for b in base_costs.blocks])
    links = measure_links(send_bytes=sizes[0], collective_bytes=sizes[1])
    print(f"links: {links.summary()}", flush=True)
    # The cores every rank shares are a device fact of the tables: the planner and the simulator split them
    # among a layout's pipeline replicas alike (sim.simulate.pipeline_processors).
    profiles = {k: dataclasses.replace(c, link_bandwidth=links.send_bytes_per_s,
                                       dp_link_bandwidth=links.collective_bytes_per_s,
                                       dp_link_latency_s=links.collective_latency_s, processors=cores)
                for k, c in profiles.items()}

    # Plans: (dp, pp, step) -> (plan, costs, batching).
    configs: dict[tuple[int, int, str], tuple[oc.Plan, object, str]] = {}
    budgets = {}
    for dp, pp in layouts:
        layout = (DataParallel(size=dp, shard=args.dp_shard, reshard_after_forward=not args.keep_gathered) if dp > 1
                  else DataParallel(size=1))
        kw = {"num_stages": pp, "num_microbatches": micro, "schedule": "1f1b", "data_parallel": layout}
        base = plan_with_costs(profiles["random"], planner="uniform", recompute="full", **kw)
        budget = max(base.stage_memory_bytes)
        budgets[dp, pp] = budget
        plans = {
            "baseline": (base, "random"),
            "+ packs": (plan_with_costs(profiles["balanced"], planner="uniform", recompute="full", **kw), "balanced"),
            "+ ILP": (plan_with_costs(profiles["balanced"], planner="ilp", recompute="full", **kw), "balanced"),
            "+ recompute": (plan_with_costs(profiles["balanced"], planner="ilp", recompute="auto", memory_budget=budget,
                                            **kw), "balanced"),
        }
        for step in steps_for(pp):
            plan, batching = plans[step]
            configs[dp, pp, step] = (plan, profiles[batching], batching)
            rec = {r: plan.block_recompute.count(r) for r in ("none", "selective", "full") if r in plan.block_recompute}
            print(f"dp={dp} pp={pp} {step:<11} cuts {list(plan.boundaries)} recompute {rec} predicted peak "
                  f"{[round(m / 2**20, 1) for m in plan.stage_peak_bytes]} MiB, planned bound "
                  f"{[round(m / 2**20, 1) for m in plan.stage_memory_bytes]} MiB (budget {budget / 2**20:.1f} MiB)")

    if args.plans_only:
        return 0
    # Runtime overheads (near-empty model) per pipeline depth, under the same core sharing.
    overheads = {}
    for pp in sorted({pp for _, pp in layouts}):
        procs = cores if pp > cores else None
        overheads[pp] = measure_overhead(ranks=pp, schedule="1f1b", microbatches=(max(pp, 2), max(pp, 2) + 4),
                                         steps=6, processors=procs)
        print(f"pp={pp}: runtime overhead {overheads[pp].op_s * 1e3:.2f} ms per action, "
              f"{overheads[pp].step_s * 1e3:.2f} ms per step", flush=True)

    # Real tokens of every step of a configuration: the LLM tokens of its samples.
    def real_tokens(dp: int, batching: str) -> list[int]:
        src = packed_source(run_config(dp, batching, "unused"), model, None)
        tokens = src.data_plan.stats.tokens
        rows = src.packs
        return [int(sum(tokens[ids].sum() for r in range(dp) for ids in map(np.asarray, rows(s, r))))
                for s in range(nsteps)]

    tokens = {(dp, b): real_tokens(dp, b) for dp, _ in layouts for b in ("random", "balanced")}
    samples = {(dp, b): sum(len(ids) for r in range(dp) for ids in packed_source(
        run_config(dp, b, "unused"), model, None).packs(0, r)) for dp, _ in layouts for b in ("random", "balanced")}

    timed: dict[tuple, list[tuple[int, float]]] = {k: [] for k in configs}
    peaks: dict[tuple, list[tuple[int, ...]]] = {k: [] for k in configs}
    cpu: dict[tuple, list[tuple[float, ...]]] = {k: [] for k in configs}
    order = list(configs)
    with tempfile.TemporaryDirectory() as tmp:
        for k, (plan, _, _) in configs.items():
            (Path(tmp) / f"{k[0]}_{k[1]}_{STEPS.index(k[2])}.json").write_text(plan.to_json())
        for r in range(rounds):
            shift = r * max(1, len(order) // rounds)
            for k in order[shift:] + order[:shift]:
                dp, pp, step = k
                batching = configs[k][2]
                logs = launch(run_config(dp, batching, str(Path(tmp) / f"{dp}_{pp}_{STEPS.index(step)}.json")),
                              timeout_s=600, quiet=True)
                for log in logs:
                    if log.rank_peak_bytes:
                        peaks[k].append(log.rank_peak_bytes)
                    elif log.step >= 2:
                        timed[k].append((tokens[dp, batching][log.step], log.step_time_s))
                        cpu[k].append(log.rank_cpu_s)
                tps = sum(t for t, _ in timed[k][-len(logs) + 2:]) / sum(s for _, s in timed[k][-len(logs) + 2:])
                print(f"[round {r + 1}/{rounds}] dp={dp} pp={pp} {step:<11} {tps:8.0f} real tokens/s", flush=True)

    record = {
        "date": str(dt.date.today()), "cores": cores, "load": os.getloadavg()[0], "rounds": rounds, "steps": nsteps,
        "micro": micro, "samples": {f"{d} {b}": n for (d, b), n in samples.items()},
        "budgets": {f"{d}x{q}": b for (d, q), b in budgets.items()},
        "costs": {b: json.loads(c.to_json()) for b, c in profiles.items()},
        "overheads": {str(q): {"op_s": o.op_s, "step_s": o.step_s} for q, o in overheads.items()},
        "links": dataclasses.asdict(links),
        "tokens": {f"{d} {b}": t for (d, b), t in tokens.items()},
        "configs": [{"dp": dp, "pp": pp, "step": step, "plan": json.loads(plan.to_json()), "batching": batching,
                     "timed": timed[dp, pp, step], "cpu": cpu[dp, pp, step], "peaks": peaks[dp, pp, step]}
                    for (dp, pp, step), (plan, _, batching) in configs.items()],
        "seconds": time.perf_counter() - t_start,
    }
    if args.save:
        args.save.write_text(json.dumps(record, indent=1))
        print(f"saved every figure to {args.save}")
    return report(record)


def record_profiles(record: dict) -> dict[str, CostTable]:
    """The cost tables of a run's record, with the run's cores as their processors (records saved before the
    tables carried them lack it)."""
    return {b: dataclasses.replace(CostTable.from_dict(c), processors=record["cores"])
            for b, c in record["costs"].items()}


def table_rows(record: dict) -> list[tuple]:
    """Per configuration of a run's record: ((dp, pp, step), measured tokens/s, simulated tokens/s,
    measured peak bytes per rank, predicted peak bytes per rank, fraction of the cores kept busy)."""
    cores = record["cores"]
    profiles = record_profiles(record)
    overheads = {int(q): o for q, o in record["overheads"].items()}
    tokens = {_key(k): v for k, v in record["tokens"].items()}
    configs = {(c["dp"], c["pp"], c["step"]): (Plan.from_dict(c["plan"]), profiles[c["batching"]], c["batching"])
               for c in record["configs"]}
    timed = {(c["dp"], c["pp"], c["step"]): c["timed"] for c in record["configs"]}
    peaks = {(c["dp"], c["pp"], c["step"]): c["peaks"] for c in record["configs"]}
    cpu = {(c["dp"], c["pp"], c["step"]): c["cpu"] for c in record["configs"]}

    # Simulated: per configuration, tokens of a mean step over the simulated iteration time; the tables'
    # processors (the cores) split among the layout's replicas, as the planner takes them.
    def simulated_tps(k: tuple) -> float:
        dp, pp, _ = k
        plan, costs, batching = configs[k]
        over = overheads[pp]
        res = oc.simulate(plan, costs, op_overhead_s=over["op_s"], step_overhead_s=over["step_s"])
        return float(np.mean(tokens[dp, batching][2:])) / res.iteration_time_s

    rows = []
    for k in configs:
        dp, pp, step = k
        plan = configs[k][0]
        measured = sum(t for t, _ in timed[k]) / sum(s for _, s in timed[k])
        sim = simulated_tps(k)
        peak = [max(p[r] for p in peaks[k]) for r in range(dp * pp)] if peaks[k] else []
        # rank = dp_index * pp + pipeline rank (the ("dp", "pp") mesh); its stage is the pipeline rank.
        predicted = [plan.stage_peak_bytes[r % pp] for r in range(dp * pp)]
        # Cores kept busy: the ranks' CPU seconds over the cores' wall seconds, timed steps pooled.
        busy = sum(map(sum, cpu[k])) / (min(cores, dp * pp) * sum(s for _, s in timed[k])) if cpu[k] else float("nan")
        rows.append((k, measured, sim, peak, predicted, busy))
    return rows


def report(record: dict) -> int:
    """Simulate each configuration of a run's record and print the table and the targets."""
    cores, micro, rounds, nsteps = record["cores"], record["micro"], record["rounds"], record["steps"]
    samples = {_key(k): v for k, v in record["samples"].items()}
    budgets = record["budgets"]
    rows = table_rows(record)

    def fmt_mib(xs: list[int]) -> str:
        return "/".join(f"{x / 2**20:.0f}" for x in xs)

    dp_any = min(d for d, _ in samples)
    print(f"\nAblation on real ranks ({record['date']}, {cores} cores, load average "
          f"{record['load']:.1f}); {rounds} round(s) x {nsteps - 2} timed steps per configuration; "
          f"{micro} micro-batches, 1F1B; samples per step per dp rank: "
          f"{samples[dp_any, 'random'] // dp_any} (random) / {samples[dp_any, 'balanced'] // dp_any} (packs)")
    head = (f"{'dp x pp':<7}  {'step':<11}  {'tokens/s':>8}  {'vs base':>7}  {'vs prev':>7}  {'sim tok/s':>9}  "
            f"{'sim err':>7}  {'cores busy':>10}  {'peak MiB/rank measured':>22}  {'predicted':>14}  {'mem err':>7}")
    print(head)
    print("-" * len(head))
    verdicts: list[tuple[str, bool]] = []
    sim_verdicts: list[tuple[str, bool]] = []
    by = {r[0]: r for r in rows}
    worst_sim = worst_mem = 0.0
    for (dp, pp, step), measured, sim, peak, predicted, busy in rows:
        base = by[dp, pp, "baseline"][1]
        prev_step = steps_for(pp)[max(0, steps_for(pp).index(step) - 1)]
        prev = by[dp, pp, prev_step][1]
        sim_err = sim / measured - 1
        mem_err = max((pr / m - 1 for pr, m in zip(predicted, peak)), key=abs) if peak else float("nan")
        worst_sim = max(worst_sim, abs(sim_err))
        worst_mem = max(worst_mem, abs(mem_err)) if peak else worst_mem
        print(
            f"{dp} x {pp:<3}  {step:<11}  {measured:8.0f}  {measured / base:6.2f}x  {measured / prev:6.2f}x  "
            f"{sim:9.0f}  {sim_err:+7.1%}  {busy:10.0%}  {fmt_mib(peak):>22}  {fmt_mib(predicted):>14}  {mem_err:+7.1%}"
        )
        if step != "baseline":
            verdicts.append(
                (f"dp={dp} pp={pp} {step} >= 1.0x the step before ({measured / prev:.2f}x)", measured >= prev)
            )
            sim_prev = by[dp, pp, prev_step][2]
            sim_verdicts.append((f"dp={dp} pp={pp} {step} >= 1.0x the step before, simulated ({sim / sim_prev:.3f}x)",
                                 sim >= sim_prev))
    if (2, 2, "+ recompute") in by:
        full = by[2, 2, "+ recompute"][1] / by[2, 2, "baseline"][1]
        verdicts.append((f"dp=2 x pp=2 full method >= 1.8x baseline ({full:.2f}x)", full >= 1.8))
    verdicts.append((f"simulated vs measured tokens/s within 15% (worst {worst_sim:.1%})", worst_sim <= 0.15))
    verdicts.append((f"peak memory predicted vs measured within 15% (worst {worst_mem:.1%})", worst_mem <= 0.15))
    budget_text = ", ".join(
        f"dp={k.split('x')[0]} pp={k.split('x')[1]}: {b / 2**20:.0f} MiB" for k, b in budgets.items()
    )
    print("(tokens/s: real LLM tokens, padding excluded; sim: simulator with runtime overheads; cores busy: the ranks' "
          "CPU seconds over the cores' wall seconds in the timed steps; memory: each rank's "
          "peak live tensor bytes in one step vs its stage's predicted peak (the plan's stage_peak_bytes; the bound "
          "it was fitted under, stage_memory_bytes, is printed with the plans above); mem err: the rank furthest off; "
          f"budget per layout: {budget_text})")
    if "links" in record:
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in record["links"].items()}
        print(f"links: {LinkSpeed(**saved).summary()}")
    for text, ok in verdicts + sim_verdicts:
        print(f"target {text}: {'met' if ok else 'NOT met'}")
    replanned(record)
    print(f"total {record['seconds']:.0f} s")
    return 0


def replanned(record: dict) -> None:
    """Print what this planner chooses for the "+ ILP" step of each pipelined layout from the record's costs,
    and its predicted and simulated iteration time against the uniform cuts it replaces (tie band: the
    planner's tolerance for measured costs)."""
    profiles = record_profiles(record)
    costs = profiles["balanced"]
    for c in record["configs"]:
        if c["step"] != "+ packs" or c["pp"] == 1:
            continue
        uniform = Plan.from_dict(c["plan"])
        over = record["overheads"][str(c["pp"])]
        kw = {"num_stages": c["pp"], "num_microbatches": record["micro"], "schedule": "1f1b",
              "data_parallel": uniform.dp, "recompute": "full"}
        ilp = plan_with_costs(costs, planner="ilp", **kw)
        again = plan_with_costs(costs, planner="uniform", **kw)
        sim = [oc.simulate(p, costs, op_overhead_s=over["op_s"], step_overhead_s=over["step_s"]).iteration_time_s
               for p in (again, ilp)]
        share = pipeline_processors(costs.processors, uniform.dp.size)
        print(f"replanned from the saved costs (processors per replica {share:g} for {c['pp']} stages; tie band "
              f"{tie_tolerance_for(costs):.0%}): dp={c['dp']} pp={c['pp']} + ILP cuts {list(ilp.boundaries)} vs "
              f"uniform {list(again.boundaries)}: predicted {ilp.iteration_time_s:.3f} vs "
              f"{again.iteration_time_s:.3f} s "
              f"({again.iteration_time_s / ilp.iteration_time_s:.3f}x), simulated {sim[1]:.3f} vs {sim[0]:.3f} s "
              f"({sim[0] / sim[1]:.3f}x)")


def _key(text: str) -> tuple[int, str]:
    """``"2 balanced"`` -> ``(2, "balanced")``: the (dp, batching) keys of a saved record."""
    dp, batching = text.split()
    return int(dp), batching


if __name__ == "__main__":
    sys.exit(main())
