"""Operation orders of the zero-bubble schedules, by the rules of torch's own classes (torch-free).

Each device's list of ``(kind, stage, micro-batch)`` operations in the order torch 2.13's
``torch.distributed.pipelining`` runs them (``schedules.py``: ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, their ``_calculate_single_rank_operations``),
with the empty time steps (``None``) left out: the simulator waits on dependencies instead.
``tests/test_sim_zero_bubble.py`` checks every order against the classes' ``pipeline_order``.

Glossary:
    F, B     forward; whole backward (input and weight gradients in one call, torch's ``FULL_BACKWARD``).
    I, W     the input-gradient part of a backward (torch's ``BACKWARD_INPUT``; the zero-bubble paper's B),
             which the previous stage waits for, and the weight-gradient part, which nothing waits for
             and the schedules move into what would be bubbles.
    D, v, M  devices, stages per device, micro-batches.
    overlap  DualPipe-V's ``OVERLAP_F_B`` (a forward of one chunk and a whole backward of the other
             issued together) runs here as the forward, then the backward: torch's runtime runs its
             sub-actions one after the other.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["interleaved_zero_bubble_order", "zbv_order", "dualpipev_order"]

Op = tuple[str, int, int]
"""(``F``, ``B``, ``I`` or ``W``; stage; micro-batch)."""


def interleaved_zero_bubble_order(D: int, v: int, M: int) -> list[list[Op]]:
    """``ScheduleInterleavedZeroBubble`` (ZB-H1 at v = 1): interleaved 1F1B with I in the 1F1B steps and device d's
    W deferred by d steps, the rest of the W after the last I."""
    rounds = max(1, M // D)
    R = M // rounds  # micro-batches per round
    orders = []
    for rank in range(D):
        warmup = min((v - 1) * R + (D - 1 - rank), M * v)
        steady = M * v - warmup

        def fwd_stage(step: int) -> int:
            return ((step // R) % v) * D + rank  # noqa: B023

        def bwd_stage(step: int) -> int:
            return (v - 1 - ((step - warmup) // R) % v) * D + rank  # noqa: B023

        count: dict[tuple[str, int], int] = defaultdict(int)
        ops: list[Op] = []
        backward_steps: list[int] = []
        weights_done = 0

        def add(kind: str, stage: int) -> None:
            ops.append((kind, stage, count[(kind, stage)]))  # noqa: B023
            count[(kind, stage)] += 1  # noqa: B023

        for step in range(warmup + steady + warmup):
            if step < warmup:
                add("F", fwd_stage(step))
                continue
            if step < warmup + steady:
                add("F", fwd_stage(step))
            add("I", bwd_stage(step))
            backward_steps.append(step)
            if step - warmup >= rank:  # device d holds d weight gradients back
                add("W", bwd_stage(backward_steps[weights_done]))
                weights_done += 1
        for step in backward_steps[weights_done:]:
            add("W", bwd_stage(step))
        orders.append(ops)
    return orders


def zbv_order(D: int, M: int) -> list[list[Op]]:
    """``ScheduleZBVZeroBubble``: device d runs stages d (chunk 0) and 2D - 1 - d (chunk 1)."""
    n_micro = max(2 * D - 1, M)  # torch plans at least this many, then drops the ones beyond M
    orders = []
    for rank in range(D):
        c0, c1 = rank, 2 * D - 1 - rank
        ops: list[Op] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (D - rank) - 1):
            ops.append(("F", c0, f0))
            f0 += 1
        for _ in range(rank):
            ops += [("F", c1, f1), ("F", c0, f0)]
            f1 += 1
            f0 += 1
        for _ in range(D - rank):
            ops += [("F", c1, f1), ("I", c1, b1), ("W", c1, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                ops.append(("F", c0, f0))
                f0 += 1
            ops += [("I", c0, b0), ("W", c0, b0), ("F", c1, f1), ("I", c1, b1), ("W", c1, b1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            ops += [("I", c0, b0), ("I", c1, b1)]
            b0 += 1
            b1 += 1
        for _ in range(D - rank):
            ops += [("I", c0, b0), ("W", c0, w0)]
            b0 += 1
            w0 += 1
        ops += [("W", c1, m) for m in range(w1, b1)]
        ops += [("W", c0, m) for m in range(w0, b0)]
        orders.append([op for op in ops if op[2] < M])
    return orders


def dualpipev_order(D: int, M: int) -> list[list[Op]]:
    """``ScheduleDualPipeV`` (M >= 2D): device d runs stages d and 2D - 1 - d; overlapped pairs run in turn."""
    orders = []
    for rank in range(D):
        s0, s1 = rank, 2 * D - 1 - rank
        count: dict[tuple[str, int], int] = defaultdict(int)  # (F or I, stage) -> next micro-batch
        weights: list[tuple[int, int]] = []  # (stage, micro-batch) of the I whose W is still to run
        ops: list[Op] = []

        def add(kind: str, stage: int) -> None:
            """One action; a whole backward (B) takes the next micro-batch of the stage's I counter."""
            key = ("F" if kind == "F" else "I", stage)
            ops.append((kind, stage, count[key]))  # noqa: B023
            if kind == "I":
                weights.append((stage, count[key]))  # noqa: B023
            count[key] += 1  # noqa: B023

        def weight() -> None:
            if weights:  # noqa: B023
                stage, m = weights.pop(0)  # noqa: B023
                ops.append(("W", stage, m))  # noqa: B023

        def overlap(forward_stage: int, backward_stage: int) -> None:
            add("F", forward_stage)
            add("B", backward_stage)

        for _ in range(2 * (D - rank - 1)):
            add("F", s0)
        for _ in range(rank + 1):
            add("F", s0)
            add("F", s1)
        for _ in range(D - rank - 1):
            add("I", s1)
            weight()
            add("F", s1)
        for i in range(M - 2 * D + rank + 1):
            if i == 0 and rank == D - 1:  # torch does not overlap these two, to shorten the bubble
                add("F", s0)
                add("B", s1)
            else:
                overlap(s0, s1)
            overlap(s1, s0)
        for _ in range(D - rank - 1):
            add("B", s1)
            overlap(s1, s0)
        split = False
        for i in range(rank + 1):
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            add("I" if split else "B", s1)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            add("I" if split else "B", s0)
        for _ in range(D - rank - 1):
            weight()
            add("I" if split else "B", s0)
        for _ in range(rank + 1):
            weight()
        orders.append(ops)
    return orders
