"""Compiler passes: plain functions over typed data, run in order by :func:`omnibal_compile.optimize`."""
