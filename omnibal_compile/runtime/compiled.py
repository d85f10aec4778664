"""``run --compile``: each stage module's forward under ``torch.compile`` (inductor), checked before launch.

Glossary:
    region      what one ``torch.compile`` call covers. Here: one stage module's ``forward`` (after
                recompute is applied), not each transformer block as torchtitan compiles them.
                Codegen inlines a stage's blocks into one flat FX graph, so there is no block module
                to compile on its own; the stage forward is the smallest region that holds them
                all, and Dynamo traces the recompute regions (``CheckpointedRegion``, i.e.
                ``torch.utils.checkpoint``, full or selective) inside it as it does inside a
                torchtitan block. Like torchtitan, the module's hooks stay outside the region:
                only ``forward`` is compiled, so FSDP2/replicate's all-gathers and gradient
                reductions and the pipeline's send/receive run eagerly around it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnibal_compile.errors import InputError

__all__ = ["check_compile", "compile_stage"]

_FLAG = "--compile (RunConfig.compile)"


def check_compile(device: str) -> None:
    """An InputError naming ``--compile`` when ``torch.compile``'s inductor backend cannot run on ``device``.

    Cheap: no compilation. On CPU inductor writes C++ and needs a compiler; on CUDA it writes Triton.
    """
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise InputError(f"{_FLAG}: torch.compile does not support this Python or platform; run without --compile")
    if device == "cuda":
        from omnibal_compile.kernels.ops import triton_available

        if not triton_available():
            raise InputError(f"{_FLAG} on cuda needs triton (inductor writes Triton kernels): pip install triton, "
                             "or run without --compile")
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:  # inductor's own search: InvalidCxxCompiler, or an OSError from running it
        raise InputError(f"{_FLAG} on cpu needs a C++ compiler for inductor (none usable: {e}); install g++ or set "
                         "CXX, or run without --compile") from None


def compile_stage(module: nn.Module) -> nn.Module:
    """``module`` (changed in place) with its ``forward`` compiled by inductor; see the glossary.

    The instance attribute shadows the class's ``forward``: parameter names, hooks and
    ``state_dict`` are the module's own (an ``OptimizedModule`` wrapper would prefix every name
    with ``_orig_mod.``). Compilation happens on the first call.
    """
    compiled: Any = torch.compile(module.forward, backend="inductor")
    module.forward = compiled
    return module
