"""Compiler passes over the captured graph: capture, blocks, kernel fusion, codegen, recompute."""
