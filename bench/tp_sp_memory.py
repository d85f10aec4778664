"""What sequence parallelism saves at tp=2: the bytes autograd keeps for backward, measured, against the costs.

The reference VLM (default config) is cut into one stage; two gloo ranks on this machine build its tp=2 pipeline
without and with sequence parallelism and train one 1F1B step of ``--microbatches`` micro-batches. On each rank
the tensors autograd saves for backward are summed (distinct storages, parameters left out: what a micro-batch
keeps alive), and the collectives DTensor issues are counted. The unsplit model's saved bytes (one process)
are measured the same way. The costs' prediction is the tp=1 cost table's kept activations (no recompute)
turned into one tp rank's by :func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` with the
pass's facts: without sequence parallelism it divides nothing (an upper bound), with it the sequence-sharded
share of each block by tp. Byte counts do not depend on the machine's load.

    python bench/tp_sp_memory.py
    python bench/tp_sp_memory.py --text 128 --microbatches 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from omnibal_compile import optimize
from omnibal_compile.compile.tensor_parallel import find_pairs
from omnibal_compile.costs.annotate import annotate_costs
from omnibal_compile.costs.tensor_parallel import tensor_parallel_table
from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

COLLECTIVES = {"reduce-scatters": ("reduce_scatter_single", "reduce_scatter_tensor"),
               "all-gathers": ("all_gather_single", "all_gather_tensor"), "all-reduces": ("all_reduce",)}
"""Functional collectives DTensor's redistributions call, by kind."""


@contextlib.contextmanager
def saved_bytes(exclude: set[int]) -> Iterator[list[int]]:
    """Sums the bytes of the distinct storages autograd saves for backward, leaving out ``exclude`` (data
    pointers of the parameters)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        t = x._local_tensor if isinstance(x, DTensor) else x
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in exclude:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield total


@contextlib.contextmanager
def counted() -> Iterator[dict[str, int]]:
    import torch.distributed._functional_collectives as funcol

    count = dict.fromkeys(COLLECTIVES, 0)
    real = {n: getattr(funcol, n) for names in COLLECTIVES.values() for n in names if hasattr(funcol, n)}

    def wrap(kind: str, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[kind] += 1
            return real[name](*args, **kwargs)
        return call

    for kind, names in COLLECTIVES.items():
        for n in names:
            if n in real:
                setattr(funcol, n, wrap(kind, n))
    try:
        yield count
    finally:
        for n, f in real.items():
            setattr(funcol, n, f)


def _params(module: torch.nn.Module) -> set[int]:
    from torch.distributed.tensor import DTensor

    return {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in module.parameters()}


def _rank(rank: int, port: int, out: str, cfg: TinyVLMConfig, batch: dict[str, torch.Tensor], plan_json: str,
          microbatches: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.ir.plan import Plan
    from omnibal_compile.runtime import build_pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    found: dict[str, Any] = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = TinyVLM(cfg)
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
        pipe = build_pipeline(compile_for_microbatches(model, batch, Plan.from_json(plan_json)), mesh=mesh,
                              sequence_parallel=sp)
        exclude = set().union(*(_params(m) for m in pipe.modules))
        with saved_bytes(exclude) as kept, counted() as calls:
            pipe.step(batch)
        found["sp" if sp else "plain"] = {"kept": kept[0] / microbatches, **{k: v / microbatches
                                                                               for k, v in calls.items()}}
    if rank == 0:
        (Path(out) / "ranks.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--mb-samples", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--text", type=int, default=64)
    args = p.parse_args()

    import dataclasses

    import torch.multiprocessing as mp

    from omnibal_compile.planning.build import uniform

    torch.manual_seed(0)
    cfg = TinyVLMConfig()
    model = TinyVLM(cfg)
    mb = make_example_batch(cfg, batch=args.mb_samples, tiles_per_sample=args.tiles, text_tokens=args.text, seed=1)
    batch = make_example_batch(cfg, batch=args.mb_samples * args.microbatches, tiles_per_sample=args.tiles,
                               text_tokens=args.text, seed=2)
    one = optimize(model, mb, num_stages=1, planner="parameters")
    plan = dataclasses.replace(uniform(one.graph, 1), schedule="1f1b", num_microbatches=args.microbatches)
    costs = annotate_costs(one.graph, model, device="cpu", threads=1, repeats=1, clock="wall")
    predicted = {}
    for sp in (False, True):
        _, report = find_pairs(one.stages[0], one.graph, 2, sequence_parallel=sp)
        table = tensor_parallel_table(costs, 2, sharded=report.blocks(), bandwidth=1e9)
        predicted["sp" if sp else "plain"] = sum(b.activation_bytes["none"] for b in table.blocks)
        if sp:
            text = report.summary()
            print(text[text.index("sequence parallel:"):], flush=True)
    whole_pred = sum(b.activation_bytes["none"] for b in costs.blocks)
    with saved_bytes({p.untyped_storage().data_ptr() for p in model.parameters()}) as kept:
        model(**mb)
    whole = kept[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(port, tmp, cfg, batch, plan.to_json(), args.microbatches), nprocs=2, join=True)
        ranks = json.loads((Path(tmp) / "ranks.json").read_text())
    mib = 2**20
    print(f"\nsaved for backward per micro-batch ({args.mb_samples} samples, {args.tiles} tiles, {args.text} text "
          f"tokens), rank 0 of tp=2; collectives per micro-batch (forward + backward)")
    print(f"{'layout':<18}  {'measured MiB':>12}  {'costs MiB':>9}  {'costs/meas':>10}  {'reduce-scatters':>15}  "
          f"{'all-gathers':>11}  {'all-reduces':>11}")
    print(f"{'unsplit':<18}  {whole / mib:>12.2f}  {whole_pred / mib:>9.2f}  {whole_pred / whole:>10.2f}  "
          f"{'-':>15}  {'-':>11}  {'-':>11}")
    for key, name in (("plain", "tp=2"), ("sp", "tp=2 + sequence")):
        r = ranks[key]
        print(f"{name:<18}  {r['kept'] / mib:>12.2f}  {predicted[key] / mib:>9.2f}  "
              f"{predicted[key] / r['kept']:>10.2f}  {r['reduce-scatters']:>15.0f}  {r['all-gathers']:>11.0f}  "
              f"{r['all-reduces']:>11.0f}")
    print(f"sequence / plain at tp=2: measured {ranks['sp']['kept'] / ranks['plain']['kept']:.3f}, costs "
          f"{predicted['sp'] / predicted['plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
