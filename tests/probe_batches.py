"""Batch functions for the probe tests' runs (``--batches probe_batches:FN``); the ranks need ``tests/`` on
``PYTHONPATH``."""

from __future__ import annotations

import torch

from omnibal_compile.models import make_example_batch
from tests.conftest import SMALL_VLM


def nan_from_step_3(step: int, *, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Example batches whose images are all NaN from step 3 on (a NaN loss from step 3)."""
    batch = make_example_batch(SMALL_VLM, batch=batch_size, tiles_per_sample=1, text_tokens=12, seed=seed + 1 + step)
    if step >= 3:
        batch["pixel_values"] = torch.full_like(batch["pixel_values"], float("nan"))
    return batch
