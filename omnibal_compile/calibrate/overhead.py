"""Runtime overhead of the pipeline engine on this machine, for the simulator.

Glossary:
    op overhead    time a forward or backward action costs beyond its compute: the schedule's
                   Python, posting sends and receives, autograd bookkeeping.
    step overhead  fixed time per iteration: optimizer step, barrier, loss bookkeeping.
Measured by running a near-empty model (every width 8) on the real runtime at two micro-batch
counts M1 < M2: with compute ~0, an iteration takes h * g(M) + c, where g(M) is the schedule's
time with one unit of work per action (1F1B/GPipe on S ranks: 2 (M + S - 1)), so
h = (t2 - t1) / (g(M2) - g(M1)) and c = t1 - h g(M1). An action is what the simulator charges
``op_overhead_s`` to: a forward (F), a whole backward (B), and under the split-backward schedules
(interleaved-zb, zbv, dualpipev) each input-gradient (I) and weight-gradient (W) part, so g counts
them all (``schedule_time(..., op_overhead_s=1)`` with no compute: one definition for every schedule).
When the ranks share fewer processors than
there are ranks (CPU ranks on few cores), g comes from the simulator with the same sharing, so h is
the work of an action, not its stretched wall time.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omnibal_compile.errors import InputError

__all__ = ["RuntimeOverhead", "measure_overhead", "fit_overhead", "action_depth"]


@dataclass(frozen=True, kw_only=True)
class RuntimeOverhead:
    """Calibrated runtime overheads (pass them to ``simulate(op_overhead_s=..., step_overhead_s=...)``)."""

    op_s: float
    """Seconds per forward or backward action beyond compute."""
    step_s: float
    """Seconds per iteration beyond the pipeline's actions."""
    ranks: int
    """Pipeline ranks it was measured with."""
    schedule: str = "1f1b"
    """Schedule it was measured (and its actions counted) with."""
    virtual_stages: int = 1
    """Stages per rank of that schedule."""
    processors: int | None = None
    """Processors the ranks were modelled to share (None: one each)."""
    samples: tuple[tuple[int, float], ...]
    """(micro-batches, median step seconds) of the near-empty runs."""


def measure_overhead(
    *, ranks: int = 2, schedule: str = "1f1b", microbatches: tuple[int, int] = (4, 8), steps: int = 10,
    timeout_s: float = 300.0, processors: int | None = None, rounds: int = 1, virtual_stages: int | None = None,
) -> RuntimeOverhead:
    """Run a near-empty TinyVLM on ``ranks`` local processes and fit the two overheads.

    ``processors``: cores the ranks share (pass the same number to ``simulate``); None: one each.
    ``rounds``: runs per micro-batch count, alternating; their steps are pooled.
    ``virtual_stages``: stages per rank (None: what the schedule runs, 2 for zbv and dualpipev, else 1).
    """
    from omnibal_compile.compile.blocks import build_blocks
    from omnibal_compile.compile.capture import capture
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
    from omnibal_compile.planning.build import uniform
    from omnibal_compile.runtime.launch import launch
    from omnibal_compile.runtime.settings import RunConfig

    m1, m2 = microbatches
    v = _stages_per_rank(schedule, virtual_stages)
    if rounds < 1 or steps < 2:
        raise InputError(f"rounds must be >= 1 and steps >= 2 (the first step is dropped), got {rounds} and {steps}")
    if not ranks <= m1 < m2:
        raise InputError(f"microbatches must be two counts ranks <= M1 < M2, got {microbatches} for {ranks} ranks")
    tiny = TinyVLMConfig(
        image_size=8, patch_size=4, vit_hidden=8, vit_layers=ranks, vit_heads=1, vit_mlp=8, llm_hidden=8,
        llm_layers=ranks, llm_heads=2, llm_kv_heads=1, llm_mlp=8, vocab_size=16, image_token_id=15,
    )
    model = TinyVLM(tiny)
    micro = make_example_batch(tiny, batch=1, tiles_per_sample=1, text_tokens=16, seed=0)
    # the passes, not optimize(): no call back
    base = uniform(build_blocks(capture(model, micro), model), ranks * v)
    steps_at: dict[int, list[float]] = {m1: [], m2: []}
    with tempfile.TemporaryDirectory() as tmp:
        # Alternate the two counts over rounds, so drift in the machine's speed hits both alike.
        for _ in range(rounds):
            for m in (m1, m2):
                path = Path(tmp) / f"plan_{m}.json"
                path.write_text(dataclasses.replace(base, num_microbatches=m, schedule=schedule,
                                                    virtual_stages=v).to_json())
                logs = launch(
                    RunConfig(plan=str(path), model_config=dataclasses.asdict(tiny), batch_size=m, tiles_per_sample=1,
                              text_tokens=16, steps=steps, optimizer="sgd", threads=1),
                    timeout_s=timeout_s, quiet=True,
                )
                steps_at[m] += [s.step_time_s for s in logs[1:]]  # the first step warms up
    samples = [(m, statistics.median(t)) for m, t in steps_at.items()]
    return fit_overhead(samples, ranks=ranks, schedule=schedule, processors=processors, virtual_stages=v)


def fit_overhead(
    samples: Sequence[tuple[int, float]], *, ranks: int, schedule: str = "1f1b", processors: int | None = None,
    virtual_stages: int | None = None,
) -> RuntimeOverhead:
    """Fit the two overheads to (micro-batches, step seconds) of near-empty runs (see module docstring)."""
    if len(samples) != 2 or samples[0][0] >= samples[1][0]:
        raise InputError(f"need two samples at micro-batch counts M1 < M2, got {list(samples)}")
    v = _stages_per_rank(schedule, virtual_stages)
    (m1, t1), (m2, t2) = samples
    g1, g2 = (action_depth(schedule, ranks, m, virtual_stages=v, processors=processors) for m in (m1, m2))
    h = max(0.0, (t2 - t1) / (g2 - g1))
    step = max(0.0, t1 - h * g1)
    return RuntimeOverhead(op_s=h, step_s=step, ranks=ranks, processors=processors, samples=tuple(samples),
                           schedule=schedule, virtual_stages=v)


def action_depth(
    schedule: str, ranks: int, microbatches: int, *, virtual_stages: int = 1, processors: int | None = None
) -> float:
    """g(M): the iteration time of ``schedule`` when every action (F, B, I, W) takes one unit and nothing else
    does, with ``processors`` shared as in the simulator (see the module docstring)."""
    from omnibal_compile.sim import schedule_time

    return schedule_time(schedule, ranks, microbatches, forward_s=0.0, backward_s=0.0, op_overhead_s=1.0,
                         virtual_stages=virtual_stages, processors=processors)


def _stages_per_rank(schedule: str, virtual_stages: int | None) -> int:
    """The stages per rank of a measurement: as given, else what the schedule's rule fixes (1 where it fixes none)."""
    from omnibal_compile.ir.schedule import schedule_rule

    return virtual_stages if virtual_stages is not None else schedule_rule(schedule).stages_per_device or 1
