"""Runtime overhead of the pipeline engine on this machine, for the simulator.

Glossary:
    op overhead    time a forward or backward action costs beyond its compute: the schedule's
                   Python, posting sends and receives, autograd bookkeeping.
    step overhead  fixed time per iteration: optimizer step, barrier, loss bookkeeping.
Measured by running a near-empty model (every width 8) on the real runtime at two micro-batch
counts M1 < M2: with compute ~0, a 1F1B/GPipe iteration takes (M + S - 1) * 2h + c, so
2h = (t2 - t1) / (M2 - M1) and c = t1 - (M1 + S - 1) * 2h.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omnibal_compile.errors import InputError

__all__ = ["RuntimeOverhead", "measure_overhead"]


@dataclass(frozen=True, kw_only=True)
class RuntimeOverhead:
    """Calibrated runtime overheads (pass them to ``simulate(op_overhead_s=..., step_overhead_s=...)``)."""

    op_s: float
    """Seconds per forward or backward action beyond compute."""
    step_s: float
    """Seconds per iteration beyond the pipeline's actions."""
    ranks: int
    """Pipeline ranks it was measured with."""
    samples: tuple[tuple[int, float], ...]
    """(micro-batches, median step seconds) of the near-empty runs."""


def measure_overhead(
    *, ranks: int = 2, schedule: str = "1f1b", microbatches: tuple[int, int] = (4, 8), steps: int = 10,
    timeout_s: float = 300.0,
) -> RuntimeOverhead:
    """Run a near-empty TinyVLM on ``ranks`` local processes and fit the two overheads."""
    import omnibal_compile as oc
    from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch
    from omnibal_compile.runtime.launch import RunConfig, launch

    m1, m2 = microbatches
    if not ranks <= m1 < m2:
        raise InputError(f"microbatches must be two counts ranks <= M1 < M2, got {microbatches} for {ranks} ranks")
    tiny = TinyVLMConfig(
        image_size=8, patch_size=4, vit_hidden=8, vit_layers=ranks, vit_heads=1, vit_mlp=8, llm_hidden=8,
        llm_layers=ranks, llm_heads=2, llm_kv_heads=1, llm_mlp=8, vocab_size=16, image_token_id=15,
    )
    model = TinyVLM(tiny)
    micro = make_example_batch(tiny, batch=1, tiles_per_sample=1, text_tokens=16, seed=0)
    base = oc.optimize(model, micro, num_stages=ranks, planner="uniform").plan
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in (m1, m2):
            path = Path(tmp) / f"plan_{m}.json"
            path.write_text(dataclasses.replace(base, num_microbatches=m, schedule=schedule).to_json())
            logs = launch(
                RunConfig(plan=str(path), model_config=dataclasses.asdict(tiny), batch_size=m, tiles_per_sample=1,
                          text_tokens=16, steps=steps, optimizer="sgd", threads=1),
                timeout_s=timeout_s, quiet=True,
            )
            samples.append((m, statistics.median(s.step_time_s for s in logs[1:])))
    (_, t1), (_, t2) = samples
    two_h = max(0.0, (t2 - t1) / (m2 - m1))
    step = max(0.0, t1 - (m1 + ranks - 1) * two_h)
    return RuntimeOverhead(op_s=two_h / 2, step_s=step, ranks=ranks, samples=tuple(samples))
