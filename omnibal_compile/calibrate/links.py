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
Pass them to a cost table as ``link_bandwidth``, ``dp_link_bandwidth`` and ``dp_link_latency_s``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
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

    def summary(self) -> str:
        """The speeds in one line, each median with the range of its repeats (the one format every report uses)."""
        def gbs(x: float) -> str:
            return f"{x / 1e9:.2f}"

        return (f"sends {gbs(self.send_bytes_per_s)} GB/s (range {gbs(self.send_spread[0])}-"
                f"{gbs(self.send_spread[1])}) at {self.send_bytes / 2**20:.1f} MiB, all-gather and reduce-scatter "
                f"{gbs(self.collective_bytes_per_s)} GB/s (range {gbs(self.collective_spread[0])}-"
                f"{gbs(self.collective_spread[1])}) at {self.collective_bytes / 2**20:.1f} MiB plus "
                f"{self.collective_latency_s * 1e3:.2f} ms per call; medians of {self.repeats} repeats")


def measure_links(
    *, send_bytes: int, collective_bytes: int, ranks: int = 2, repeats: int = 7, timeout_s: float = 120.0
) -> LinkSpeed:
    """Time sends between two local gloo ranks and FSDP's collectives over ``ranks``: the median of ``repeats``,
    with the range of the repeats (:attr:`LinkSpeed.send_spread`, :attr:`LinkSpeed.collective_spread`)."""
    import torch.multiprocessing as mp

    for name, value in (("send_bytes", send_bytes), ("collective_bytes", collective_bytes)):
        if not isinstance(value, int) or value < 4:
            raise InputError(f"{name} must be an integer of at least 4 bytes, got {value!r}")
    if not isinstance(ranks, int) or ranks < 2 or repeats < 1:
        raise InputError(f"ranks must be >= 2 and repeats >= 1, got {ranks} and {repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.start_processes(_rank, args=(ranks, tmp, out, send_bytes, collective_bytes, repeats, timeout_s),
                           nprocs=ranks, join=True, start_method="spawn")
        # per transfer: median, fastest and slowest repeat
        (send_s, gather_s, scatter_s, tiny_s), latency_s = (
            [tuple(float(x) for x in line.split()) for line in Path(out).read_text().splitlines()[:4]],
            float(Path(out).read_text().splitlines()[4]))
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
                     collective_latency_s=latency_s, repeats=repeats,
                     send_spread=(send_bytes / send_s[2], send_bytes / send_s[1]),
                     collective_spread=(collective(2), collective(1)))


def _rank(rank: int, world: int, tmp: str, out: str, send_bytes: int, collective_bytes: int, repeats: int,
          timeout_s: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    lines = _measure(rank, world, send_bytes, collective_bytes, repeats)  # its tensors and FSDP stacks freed
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    end_process_group()  # on success only (an exception ends the rank, and spawn reports it)
    exit_now(0)


def _measure(rank: int, world: int, send_bytes: int, collective_bytes: int, repeats: int) -> list[str]:
    """This rank's timings: the lines of the result file (send, all-gather, reduce-scatter, tiny, latency)."""
    import torch
    import torch.distributed as dist

    msg = torch.ones(send_bytes // 4)
    shard = torch.ones(collective_bytes // 4 // world)
    whole = torch.empty(shard.numel() * world)

    def timed_all(op) -> tuple[float, float, float]:
        """(median, fastest, slowest) seconds of ``op`` over the repeats."""
        op()  # warm-up: connections and buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        return statistics.median(times), min(times), max(times)

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
    gather = timed_all(lambda: dist.all_gather_into_tensor(whole, shard))
    scatter = timed_all(lambda: dist.reduce_scatter_tensor(shard, whole))
    dot, dots = torch.ones(1), torch.ones(world)
    tiny = (
        timed(lambda: dist.all_gather_into_tensor(dots, dot)) + timed(lambda: dist.reduce_scatter_tensor(dot, dots))
    ) / 2
    few, many = _fsdp_stack(world, 2), _fsdp_stack(world, 10)
    latency = max(0.0, (timed(many) - timed(few)) / (8 * 3))  # 8 more layers, 3 collectives each
    return [*(" ".join(map(str, t)) for t in (send, gather, scatter, (tiny, tiny, tiny))), str(latency)]


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
