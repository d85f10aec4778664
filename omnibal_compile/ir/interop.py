"""Export a plan's split in the formats of other pipeline-parallel frameworks (torch-free).

Glossary:
    torchtitan format  a list per stage of the fully qualified module names the stage keeps, as
                       torchtitan's ``module_names_per_model_chunk`` / ``pipeline_module_split``
                       take it: ``[["llm.embed_tokens", "llm.layers.0"], ["llm.layers.1", "llm.norm", "lm_head"]]``.
                       Glue blocks (code that runs outside any submodule: masks, rotary tables, the
                       loss) have no module name and are left out; the framework's forward runs
                       them on whichever stage owns the surrounding modules. A module called twice
                       (``name#2`` blocks) is listed once, on its first stage.
    Megatron layout    the string grammar of Megatron-LM's ``--pipeline-model-parallel-layout``:
                       stages separated by ``|``; ``E`` the language model's embedding, ``t`` one
                       decoder layer, ``L`` the output layer and loss (written where the last module
                       block, the head, sits; the final norm travels with it in Megatron); a run of one
                       symbol is written ``t*N``. Example: ``Et*3|t*4|t*3L``. Megatron's grammar has no symbol for a
                       vision encoder or projector (its multimodal models place the encoder by other
                       options), so those blocks, and glue, are left out of the string; a stage that
                       holds only such blocks is an empty segment between two ``|``. Megatron places
                       virtual stages in a loop (segment i on pipeline rank i mod P): a plan for a V
                       schedule (``zbv``, ``dualpipev``: stages s and 2D - 1 - s on one device) has no layout.
    decoder stack      the layer stack of the last ``layer`` block in the chain (the LLM's layers).
"""

from __future__ import annotations

import re

from omnibal_compile.errors import InputError
from omnibal_compile.ir.plan import Plan
from omnibal_compile.ir.schedule import schedule_rule

__all__ = ["torchtitan_module_names", "megatron_layout"]

_REPEAT = re.compile(r"#\d+$")


def _module_name(block: str) -> str | None:
    """The module path of a block, or None for glue."""
    if block.endswith(":glue") or ":glue#" in block or block.startswith("<root>"):
        return None
    return _REPEAT.sub("", block)


def torchtitan_module_names(plan: Plan) -> list[list[str]]:
    """Module names each stage keeps, in order (torchtitan's ``module_names_per_model_chunk``)."""
    seen: set[str] = set()
    out: list[list[str]] = []
    for st in plan.stages:
        names = []
        for block in st.blocks:
            name = _module_name(block)
            if name is not None and name not in seen:
                seen.add(name)
                names.append(name)
        out.append(names)
    return out


def _stack_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def megatron_layout(plan: Plan) -> str:
    """The plan as a Megatron-LM ``--pipeline-model-parallel-layout`` string (see the module glossary)."""
    if not plan.block_kinds:
        raise InputError(
            "megatron_layout needs the plan's block_kinds (plans from optimize() and the planners have them)"
        )
    if schedule_rule(plan.schedule).placement != "loop":
        raise InputError(
            f"schedule {plan.schedule!r} puts stages s and 2D-1-s on one device (a V), which Megatron-LM's "
            "layout cannot express (it places virtual stages in a loop); plan with 1f1b or interleaved for Megatron"
        )
    layers = [i for i, k in enumerate(plan.block_kinds) if k == "layer"]
    if not layers:
        raise InputError("the plan has no layer blocks, so it has no decoder layers to lay out")
    stack = _stack_of(plan.block_names[layers[-1]])
    owner = _stack_of(stack)  # e.g. "llm" for "llm.layers"
    decoder = [i for i in layers if _stack_of(plan.block_names[i]) == stack]
    first, last = decoder[0], decoder[-1]
    after = [
        i
        for i in range(last + 1, plan.num_blocks)
        if plan.block_kinds[i] == "module" and _module_name(plan.block_names[i])
    ]
    head = after[-1] if after else None
    symbols: list[str] = []
    for i, (name, kind) in enumerate(zip(plan.block_names, plan.block_kinds)):
        module = _module_name(name)
        if i in decoder:
            symbols.append("t")
        elif module is None or kind != "module":
            symbols.append("")
        elif i < first and "embed" in module.lower() and (not owner or module.startswith(owner + ".")):
            symbols.append("E")
        elif i == head:
            symbols.append("L")
        else:
            symbols.append("")
    segments = []
    for st in plan.stages:
        compact = [symbols[i] for i in range(st.start, st.stop) if symbols[i]]
        text, j = "", 0
        while j < len(compact):
            k = j
            while k < len(compact) and compact[k] == compact[j]:
                k += 1
            text += compact[j] + (f"*{k - j}" if k - j > 1 else "")
            j = k
        segments.append(text)
    return "|".join(segments)
