"""Small reference models used by the demo, the tests and the benches."""

from omnibal_compile.models.tiny_vlm import TinyVLM, TinyVLMConfig, make_example_batch

__all__ = ["TinyVLM", "TinyVLMConfig", "make_example_batch"]
