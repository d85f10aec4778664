"""Speed of the links between local ranks on this machine, for the simulator.

Glossary:
    link speed   effective bytes/s of one kind of transfer at a given size, measured on gloo
                 ranks of this machine: ``bytes / seconds`` for a point-to-point send (what a
                 pipeline stage sends across a cut), and ``r * bytes / seconds`` for FSDP's
                 all-gather and reduce-scatter of ``bytes`` over ``n`` ranks, ``r = (n - 1) / n``
                 (the volume :meth:`omnibal_compile.ir.costs.DataParallel.block_cost` charges).
                 Measured at the sizes the model moves; for the collectives, less a one-float
                 collective's time, which the call latency below charges instead.
    call latency the fixed seconds of one FSDP2 collective beyond its bytes, hooks included: the
                 slope of a stack of tiny ``fully_shard`` layers' forward and backward time over
                 their count, per collective (each layer all-gathers twice and reduce-scatters once).
                 Small blocks pay little else; it matters where a stage holds many of them.
    tensor-parallel call latency
                 the same for a tensor-parallel all-reduce (``measure_links(tensor_parallel=True)``): the
                 slope of a stack of tiny ``ColwiseParallel`` + ``RowwiseParallel`` pairs' forward and
                 backward time over their count, per all-reduce (each pair all-reduces its output in the
                 forward and its input's gradient in the backward), DTensor's hooks included.
Pass them to a cost table as ``link_bandwidth``, ``dp_link_bandwidth`` and ``dp_link_latency_s``, and the last to
:func:`omnibal_compile.costs.tensor_parallel.tensor_parallel_table` as ``latency_s``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omnibal_compile.errors import InputError
from omnibal_compile.runtime.processes import end_process_group, exit_now

__all__ = ["LinkSpeed", "measure_links", "effective_sizes"]


@dataclass(frozen=True, kw_only=True)
class LinkSpeed:
    """Measured effective bandwidths of local gloo ranks."""

    send_bytes_per_s: float
    """Point-to-point send and receive between two ranks, at ``send_bytes``."""
    send_bytes: int
    """Bytes per send it was measured at."""
    collective_bytes_per_s: float
    """All-gather and reduce-scatter over ``ranks`` ranks (mean of the two), at ``collective_bytes``, less a
    one-float collective's time (the fixed part, charged as ``collective_latency_s``)."""
    collective_bytes: int
    """Bytes per collective (the whole gathered tensor) it was measured at."""
    ranks: int
    """Ranks of the collectives."""
    collective_latency_s: float = 0.0
    """Seconds of one FSDP2 collective call beyond its bytes (the call latency of the glossary)."""
    repeats: int = 1
    """Timed repeats of each transfer; the speeds are their medians."""
    send_spread: tuple[float, float] = (0.0, 0.0)
    """(slowest, fastest) send bytes/s over the repeats."""
    collective_spread: tuple[float, float] = (0.0, 0.0)
    """(slowest, fastest) collective bytes/s over the repeats, by the same rule as the median."""
    tensor_parallel_latency_s: float | None = None
    """Seconds of one tensor-parallel all-reduce call beyond its bytes (glossary); None when not measured."""

    def summary(self) -> str:
        """The speeds in one line, each median with the range of its repeats (the one format every report uses)."""
        def gbs(x: float) -> str:
            return f"{x / 1e9:.2f}"

        return (f"sends {gbs(self.send_bytes_per_s)} GB/s (range {gbs(self.send_spread[0])}-"
                f"{gbs(self.send_spread[1])}) at {self.send_bytes / 2**20:.1f} MiB, all-gather and reduce-scatter "
                f"{gbs(self.collective_bytes_per_s)} GB/s (range {gbs(self.collective_spread[0])}-"
                f"{gbs(self.collective_spread[1])}) at {self.collective_bytes / 2**20:.1f} MiB plus "
                f"{self.collective_latency_s * 1e3:.2f} ms per call"
                + ("" if self.tensor_parallel_latency_s is None else
                   f", tensor-parallel all-reduces {self.tensor_parallel_latency_s * 1e3:.2f} ms per call")
                + f"; medians of {self.repeats} repeats")


def measure_links(
    *, send_bytes: int, collective_bytes: int, ranks: int = 2, repeats: int = 7, timeout_s: float = 120.0,
    tensor_parallel: bool = False,
) -> LinkSpeed:
    """Time sends between two local gloo ranks and FSDP's collectives over ``ranks``: the median of ``repeats``,
    with the range of the repeats (:attr:`LinkSpeed.send_spread`, :attr:`LinkSpeed.collective_spread`); with
    ``tensor_parallel`` also the tensor-parallel call latency (glossary) over the ``ranks``."""
    import torch.multiprocessing as mp

    for name, value in (("send_bytes", send_bytes), ("collective_bytes", collective_bytes)):
        if not isinstance(value, int) or value < 4:
            raise InputError(f"{name} must be an integer of at least 4 bytes, got {value!r}")
    if not isinstance(ranks, int) or ranks < 2 or repeats < 1:
        raise InputError(f"ranks must be >= 2 and repeats >= 1, got {ranks} and {repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.start_processes(_rank, args=(ranks, tmp, out, send_bytes, collective_bytes, repeats, timeout_s,
                                        tensor_parallel), nprocs=ranks, join=True, start_method="spawn")
        lines = Path(out).read_text().splitlines()
        # per transfer: median, fastest and slowest repeat
        (send_s, gather_s, scatter_s, tiny_s), latency_s = (
            [tuple(float(x) for x in line.split()) for line in lines[:4]], float(lines[4]))
        tp_latency_s = float(lines[5]) if tensor_parallel else None
    r = (ranks - 1) / ranks

    big_s = [(gather_s[k] + scatter_s[k]) / 2 for k in range(3)]  # median, fastest, slowest
    # Alpha-beta: the big collectives' time less a tiny one's is their bytes' time (if noise leaves any). Whether the
    # tiny one is taken off is decided once, on the median, and each repeat keeps at least half its time, so the
    # fastest and slowest repeats bound the median's speed (one rule for all three, monotone in the time).
    tiny = tiny_s[0] if big_s[0] > 2 * tiny_s[0] else 0.0

    def collective(k: int) -> float:
        return r * collective_bytes / max(big_s[k] - tiny, big_s[k] / 2)

    return LinkSpeed(send_bytes_per_s=send_bytes / send_s[0], send_bytes=send_bytes,
                     collective_bytes_per_s=collective(0), collective_bytes=collective_bytes, ranks=ranks,
                     collective_latency_s=latency_s, repeats=repeats, tensor_parallel_latency_s=tp_latency_s,
                     send_spread=(send_bytes / send_s[2], send_bytes / send_s[1]),
                     collective_spread=(collective(2), collective(1)))


def _rank(rank: int, world: int, tmp: str, out: str, send_bytes: int, collective_bytes: int, repeats: int,
          timeout_s: float, tensor_parallel: bool = False) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    lines = _measure(rank, world, send_bytes, collective_bytes, repeats)  # its tensors and FSDP stacks freed
    if tensor_parallel:
        lines.append(str(_tensor_parallel_latency(world, repeats)))
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    end_process_group()  # on success only (an exception ends the rank, and spawn reports it)
    exit_now(0)


def _measure(rank: int, world: int, send_bytes: int, collective_bytes: int, repeats: int) -> list[str]:
    """This rank's timings: the lines of the result file (send, all-gather, reduce-scatter, tiny, latency)."""
    import torch
    import torch.distributed as dist

    # newer torch names them *_single (its *_tensor names warn); older releases have only the *_tensor ones
    gather_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    msg = torch.ones(send_bytes // 4)
    shard = torch.ones(collective_bytes // 4 // world)
    whole = torch.empty(shard.numel() * world)

    def timed_all(op) -> tuple[float, float, float]:
        return _timed_all(op, repeats)

    def timed(op) -> float:
        return timed_all(op)[0]

    def ping() -> None:  # rank 0 -> 1 and back: two sends, so half the round trip is one
        if rank == 0:
            dist.send(msg, 1)
            dist.recv(msg, 1)
        elif rank == 1:
            dist.recv(msg, 0)
            dist.send(msg, 0)

    send = [t / 2 for t in timed_all(ping)]
    gather = timed_all(lambda: gather_op(whole, shard))
    scatter = timed_all(lambda: scatter_op(shard, whole))
    dot, dots = torch.ones(1), torch.ones(world)
    tiny = (
        timed(lambda: gather_op(dots, dot)) + timed(lambda: scatter_op(dot, dots))
    ) / 2
    few, many = _fsdp_stack(world, 2), _fsdp_stack(world, 10)
    latency = max(0.0, (timed(many) - timed(few)) / (8 * 3))  # 8 more layers, 3 collectives each
    return [*(" ".join(map(str, t)) for t in (send, gather, scatter, (tiny, tiny, tiny))), str(latency)]


def _timed_all(op: Callable[[], None], repeats: int) -> tuple[float, float, float]:
    """(median, fastest, slowest) seconds of ``op`` over ``repeats``, every rank starting each at a barrier, after
    one warm-up (connections and buffers)."""
    import torch.distributed as dist

    op()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def _tensor_parallel_latency(world: int, repeats: int) -> float:
    """The tensor-parallel call latency (glossary): stacks of 2 and 10 tiny pairs, 8 more pairs of 2 all-reduces
    each (the first pair's input needs no gradient, in both stacks)."""
    few, many = _tensor_parallel_stack(world, 2), _tensor_parallel_stack(world, 10)
    return max(0.0, (_timed_all(many, repeats)[0] - _timed_all(few, repeats)[0]) / (8 * 2))


def _tensor_parallel_stack(world: int, pairs: int):
    """One forward and backward of ``pairs`` tiny column-wise + row-wise Linear pairs sharded over all ranks."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*[nn.Linear(8, 8 * world) if i % 2 == 0 else nn.Linear(8 * world, 8)
                            for i in range(2 * pairs)])
    parallelize_module(model, mesh, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                     for i in range(2 * pairs)})
    x = torch.ones(2, 8)

    def step() -> None:
        model(x).sum().backward()

    return step


def _fsdp_stack(world: int, layers: int):
    """One forward and backward of ``layers`` tiny Linear layers, each its own FSDP2 unit over all ranks."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.ones(2, 8)

    def step() -> None:
        model(x).sum().backward()

    return step


def effective_sizes(cut_bytes: Sequence[int], block_weight_bytes: Sequence[float]) -> tuple[int, int]:
    """(send, collective) sizes to measure at for a model: its median non-zero cut, and the weights of
    the block holding the median weight byte (the blocks that carry most of the collective volume)."""
    sends = sorted(c for c in cut_bytes if c > 0) or [1 << 20]
    weights = sorted(int(w) for w in block_weight_bytes if w > 0) or [1 << 20]
    half, seen = sum(weights) / 2, 0
    for w in weights:
        seen += w
        if seen >= half:
            break
    return max(4, sends[len(sends) // 2]), max(4, w)
