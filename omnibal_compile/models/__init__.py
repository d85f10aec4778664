"""Small reference models used by the demo, the tests and the benches, and paper-scale models as analytic
block lists (:mod:`.scale`: InternVL 6+20B / 6+34B, LLaVA-1.5) for roofline costs without weights."""

from omnibal_compile.models.analytic import SCALE_MODELS, MicroBatch, VLMSpec, cost_table
from omnibal_compile.models.tiny_vlm import TinyVLM, TinyVLMConfig, make_example_batch

__all__ = ["TinyVLM", "TinyVLMConfig", "make_example_batch", "SCALE_MODELS", "VLMSpec", "MicroBatch", "cost_table"]
