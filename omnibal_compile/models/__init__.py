"""Small reference models used by the demo, the tests and the benches (paper-scale models as analytic
block lists live in :mod:`omnibal_compile.costs.analytic`)."""

from omnibal_compile.models.tiny_vlm import TinyVLM, TinyVLMConfig, make_example_batch

__all__ = ["TinyVLM", "TinyVLMConfig", "make_example_batch"]
