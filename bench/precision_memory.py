"""Parameter + gradient bytes per rank, fp32 against bf16, on the same plan and data; and 20-step losses.

Two CPU ranks (gloo), the tests' small TinyVLM, three layouts: pp=2 (dp=1: FSDP2 on each rank's 1-rank dp
mesh in bf16, plain modules in fp32), dp=2 FSDP2 x pp=1, dp=2 DDP (composable ``replicate``) x pp=1. One
training step per layout and precision, built with ``build_pipeline`` as ``omnibal-compile run`` builds it.
What is counted, per rank (``runtime.precision.ComputeParams``):

    compute params   every parameter tensor the rank's stage modules compute with, once, at its size: under
                     FSDP2 / replicate the unsharded ones gathered for forward and backward (bf16 in bf16),
                     without data parallelism in fp32 the modules' own parameters
    compute grads    the gradients accumulated into those tensors (their dtype)
    fp32 master      the parameters the optimizer steps and checkpoints save when they are other tensors than
                     the compute ones, on other storage (the FSDP2 shard or the DDP replica, fp32), plus their
                     fp32 gradients; 0 when the compute parameters are the masters (fp32 without data parallelism)

The ratio column is bf16's compute params + grads over fp32's (target 0.5). Each tensor counts once, at its
size, however often FSDP2 gathers it: what a step holds when every unit is unsharded at once (pipelining keeps
them so, with their gradients, until the last micro-batch's backward). Then 20 steps of ``omnibal-compile run``
(``bench/precision_cpu.py``'s runs: pp=2 and dp=2 FSDP2) give the largest relative loss difference.

    python bench/precision_memory.py              # 20 steps per loss run
    python bench/precision_memory.py --steps 5
    python bench/precision_memory.py --steps 0    # the bytes only
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.conftest import SMALL_VLM  # noqa: E402  (the tests' small VLM)

LAYOUTS = {"pp=2": ((1, 2), "fsdp"), "dp=2 FSDP2": ((2, 1), "fsdp"), "dp=2 DDP": ((2, 1), "ddp")}
"""Label -> ((dp, pp) mesh, dp shard)."""


def _batch() -> dict[str, torch.Tensor]:
    from omnibal_compile.models import make_example_batch

    return make_example_batch(SMALL_VLM, batch=4, tiles_per_sample=1, text_tokens=12, seed=3)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One of 2 ranks: one step of every layout x precision; saves this rank's byte counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import omnibal_compile as oc
    from omnibal_compile import progress
    from omnibal_compile.ir.costs import DataParallel
    from omnibal_compile.models import TinyVLM
    from omnibal_compile.runtime import build_pipeline
    from omnibal_compile.runtime.batches import _dp_part
    from omnibal_compile.runtime.precision import ComputeParams, compile_in_precision

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    found: dict[tuple[str, str], dict[str, int]] = {}
    try:
        batch = _batch()
        for label, ((dp, pp), shard) in LAYOUTS.items():
            for precision in ("fp32", "bf16"):
                torch.manual_seed(0)
                model = TinyVLM(SMALL_VLM)
                mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
                part = _dp_part(batch, dp, mesh["dp"].get_local_rank())
                with progress.quiet():  # the same plan for both precisions
                    plan = oc.optimize(model, {k: v[:1] for k, v in part.items()}, num_stages=pp, planner="uniform",
                                       num_microbatches=2).plan
                result, masters = compile_in_precision(model, part, plan, precision)
                pipe = build_pipeline(result, mesh=mesh,
                                      precision=precision, masters=masters,
                                      data_parallel=DataParallel(size=dp, shard=shard))
                optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
                recorder = ComputeParams(pipe.modules)
                optimizer.zero_grad(set_to_none=True)
                pipe.step(part)
                recorder.close()

                def local(t: torch.Tensor) -> torch.Tensor:
                    return t.to_local() if isinstance(t, DTensor) else t

                def local_bytes(t: torch.Tensor) -> int:
                    return local(t).numel() * local(t).element_size()

                # the masters: not a compute tensor itself, nor one on a compute tensor's storage
                separate = [p for p in pipe.parameters() if id(p) not in recorder.params
                            and local(p).untyped_storage().data_ptr() not in recorder.storages]
                found[(label, precision)] = {
                    "params": recorder.param_bytes, "grads": recorder.grad_bytes,
                    "master": sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
                                  for p in separate),
                    "dtypes": ",".join(sorted(str(d).removeprefix("torch.") for d in recorder.dtypes())),
                }
                del pipe, optimizer, model
        torch.save(found, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_table() -> list[str]:
    """The byte counts of every layout, precision and rank, as aligned lines."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(2, _free_port(), out), nprocs=2, join=True, start_method="spawn")
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    head = ("layout", "precision", "rank", "compute dtype", "compute params B", "compute grads B", "params+grads B",
            "ratio", "fp32 master+grad B")
    rows = [head]
    for label in LAYOUTS:
        for precision in ("fp32", "bf16"):
            for r, found in enumerate(ranks):
                got, base = found[(label, precision)], found[(label, "fp32")]
                both = got["params"] + got["grads"]
                rows.append((label, precision, str(r), got["dtypes"], f"{got['params']:,}", f"{got['grads']:,}",
                             f"{both:,}", f"{both / (base['params'] + base['grads']):.3f}", f"{got['master']:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps of each loss run (0: the bytes only)")
    args = ap.parse_args(argv)
    for line in memory_table():
        print(line)
    if args.steps == 0:
        return 0
    from precision_cpu import losses

    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for label, stages, dp in (("pp=2", 2, 1), ("dp=2 FSDP2", 1, 2)):
            fp32, _ = losses(stages, dp, "fp32", args.steps, Path(tmp))
            bf16, _ = losses(stages, dp, "bf16", args.steps, Path(tmp))
            worst = max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))
            worst_all = max(worst_all, worst)
            print(f"{label}: {args.steps} steps of omnibal-compile run, max |bf16 - fp32| / fp32 loss = {worst:.2e}")
    print(f"within 2%: {worst_all <= 0.02}")
    return 0 if worst_all <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
