"""Planner's tp=2 costs vs a measured 2-rank tensor-parallel run on this machine (CPU, gloo, torchrun).

The reference VLM is costed here once (one thread per rank, as every rank uses), the tensor-parallel pass's
facts at tp=2 are taken from its one-stage module, and
:func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` makes one tp rank's table, its all-reduces
over the gloo collective speed and the tensor-parallel call latency (a stack of tiny DTensor column/row pairs)
measured in the same run (``calibrate.measure_links(tensor_parallel=True)``). Both
tables are simulated for a one-stage 1F1B plan (predicted), and the runtime trains the same plan at tp=1 on one
rank and at tp=2 on two (measured: median step time, first step dropped, runs alternated). Printed: predicted
and measured step times, their errors, and the tp=2 / tp=1 ratios. Each tp rank is given a core of its own in
the simulation; the machine is shared with other processes (the load average is printed): not a claim.

    python bench/tp_cpu.py
    python bench/tp_cpu.py --text 128 --microbatches 4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from omnibal_compile import optimize
from omnibal_compile.calibrate.links import measure_links
from omnibal_compile.compile.tensor_parallel import find_pairs
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
from omnibal_compile.planning.build import plan_with_costs
from omnibal_compile.runtime.launch import launch
from omnibal_compile.runtime.settings import RunConfig
from omnibal_compile.sim import simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--mb-samples", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped)")
    p.add_argument("--rounds", type=int, default=2, help="runs per tp degree, alternated")
    p.add_argument("--repeats", type=int, default=15, help="profiling repeats per block (median)")
    p.add_argument("--link-repeats", type=int, default=21, help="timed repeats of the gloo collectives (median)")
    args = p.parse_args()

    torch.manual_seed(0)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    mb = make_example_batch(cfg, batch=args.mb_samples, tiles_per_sample=args.tiles, text_tokens=args.text, seed=1)
    one = optimize(model, mb, num_stages=1, planner="parameters")
    _, report = find_pairs(one.stages[0], one.graph, 2)
    facts = report.blocks()
    print(report.summary(), flush=True)
    costs = annotate_costs(one.graph, model, device="cpu", threads=1, repeats=args.repeats, clock="wall")
    # the size of one all-reduce: a pair's output (a hidden state), the largest the model moves
    size = max(f.forward_bytes // f.pairs for f in facts.values())
    links = measure_links(send_bytes=size, collective_bytes=size, ranks=2, repeats=args.link_repeats,
                          tensor_parallel=True)
    latency = links.tensor_parallel_latency_s
    assert latency is not None  # measured: tensor_parallel=True
    tables = {1: costs, 2: tensor_parallel_table(costs, 2, sharded=facts, bandwidth=links.collective_bytes_per_s,
                                                 latency_s=latency)}
    low, high = links.collective_spread
    print(f"gloo collectives: {links.collective_bytes_per_s / 1e9:.2f} GB/s (repeats {low / 1e9:.2f}-"
          f"{high / 1e9:.2f}), "
          f"{latency * 1e6:.0f} us per tensor-parallel all-reduce call (DTensor's hooks included; FSDP2's "
          f"{links.collective_latency_s * 1e6:.0f} us), at {size:,} bytes; {len(facts)} of {len(costs.blocks)} "
          "blocks sharded", flush=True)
    plans = {tp: plan_with_costs(t, num_stages=1, num_microbatches=args.microbatches, planner="parameters")
             for tp, t in tables.items()}
    steps: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for tp, plan in plans.items():
            (Path(tmp) / f"plan_{tp}.json").write_text(plan.to_json())
        for r in range(args.rounds):
            for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
                logs = launch(RunConfig(plan=str(Path(tmp) / f"plan_{tp}.json"), tp=tp,
                                        batch_size=args.mb_samples * args.microbatches, tiles_per_sample=args.tiles,
                                        text_tokens=args.text, steps=args.steps, optimizer="sgd", threads=1,
                                        precision="fp32"),
                              timeout_s=600, quiet=True)
                steps[tp] += [s.step_time_s for s in logs[1:]]
    predicted = {tp: simulate(plans[tp], tables[tp]).iteration_time_s for tp in plans}
    measured = {tp: statistics.median(s) for tp, s in steps.items()}
    comm = sum(b.tensor_parallel_s for b in tables[2].blocks) * args.microbatches
    print(f"\n{'tp':>2}  {'predicted ms':>12}  {'measured ms':>11}  {'error':>7}  {'steps':>5}")
    for tp in plans:
        print(f"{tp:>2}  {predicted[tp] * 1e3:>12.2f}  {measured[tp] * 1e3:>11.2f}  "
              f"{predicted[tp] / measured[tp] - 1:>+7.1%}  {len(steps[tp]):>5}")
    pr, mr = predicted[2] / predicted[1], measured[2] / measured[1]
    print(f"tp=2 / tp=1 step time: predicted {pr:.3f}, measured {mr:.3f} ({pr / mr - 1:+.1%}); predicted "
          f"all-reduces {comm * 1e3:.2f} ms of the tp=2 step (simulated: no runtime overhead terms, a core per rank)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
