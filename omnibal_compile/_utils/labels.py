"""Label conventions shared by the models, the data collators, the kernels and the runtime's loss weights."""

from __future__ import annotations

__all__ = ["IGNORE_INDEX"]

IGNORE_INDEX = -100
"""Label value the loss ignores (Hugging Face models, the reference VLM, ``torch.nn.functional.cross_entropy``)."""
