"""Hugging Face folders from checkpoints: ``run --export-hf DIR`` and ``omnibal-compile export CKPT OUT``.

Glossary:
    export          a folder ``from_pretrained`` loads: ``config.json``, the weights as safetensors
                    (``save_pretrained``'s, sharded when large), ``generation_config.json`` when the
                    model has one, the processor and tokenizer files copied from the processor
                    folder, and ``omnibal-export.json`` (what it was made from: checkpoint, step,
                    model spec).
    made from       a complete step folder (:func:`~omnibal_compile.runtime.checkpoint.find_checkpoint`):
                    the unsplit model is built from the run's model spec (saved in the checkpoint's
                    ``meta.json``, or given), the checkpoint's full (consolidated) tensors are loaded
                    into it under their original names
                    (:func:`~omnibal_compile.runtime.checkpoint.load_into_model`), and it is saved.
    LoRA export     a checkpoint of a ``--lora`` run (its ``meta.json`` names the spec): the base model
                    is wrapped by peft (``get_peft_model``), the checkpoint loaded into it, and the
                    adapter alone written by ``PeftModel.save_pretrained`` (``adapter_config.json``,
                    ``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base, OUT)`` loads
                    onto the base model (the run's ``hf:DIR``).
    processor folder  ``--processor`` of the run when it set one, else the model folder of an
                    ``hf:`` spec (:func:`~omnibal_compile.models.load.model_folder`): DIR of ``hf:DIR``,
                    the config file's folder of ``hf:ClassName:config.json``. Only the files of
                    :data:`PROCESSOR_FILES` are copied (never weights or configs of the model).
    ours            a folder whose ``omnibal-export.json`` says ``"written_by": "omnibal_compile"``. An
                    export replaces only an export of ours; any other existing path is refused.
    atomic-ish      written into ``.OUT.partial`` beside OUT, then the old export (if any) is renamed
                    away, the new one renamed to OUT and the old one removed: OUT is at every moment
                    absent, the previous export or the new one, never a half-written folder.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile.config import lora_spec
from omnibal_compile.errors import InputError

__all__ = ["EXPORT_MARKER", "PROCESSOR_FILES", "check_export_target", "export_hf", "is_export"]

EXPORT_MARKER = "omnibal-export.json"
"""The file that marks an export as ours (and says what it was made from)."""
PROCESSOR_FILES = (
    "tokenizer*", "*processor_config.json", "chat_template*", "special_tokens_map.json", "added_tokens.json",
    "vocab*", "merges.txt", "spiece.model", "sentencepiece*.model", "*.tiktoken", "generation_config.json",
)
"""Names (glob patterns) of the files copied from the processor folder into an export: tokenizer, processor,
image processor, chat template; the generation config when ``save_pretrained`` wrote none."""
_WRITER = "omnibal_compile"


def is_export(folder: str | Path) -> bool:
    """Whether ``folder`` is an export this program wrote (its omnibal-export.json says so)."""
    try:
        meta = json.loads((Path(folder) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("written_by") == _WRITER


def check_export_target(out: str | Path, flag: str = "export folder") -> None:
    """``out`` may be written: it does not exist, or it is an earlier export of ours (replaced)."""
    path = Path(out)
    if path.exists() and not (path.is_dir() and is_export(path)):
        what = "is a file" if not path.is_dir() else f"exists and is not an export of ours (no {EXPORT_MARKER})"
        raise InputError(f"{flag} {path} {what}; it is left as it is: give a new folder, or one written by an "
                         "earlier export")


def _processor_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in PROCESSOR_FILES))


def export_hf(checkpoint: str | Path, out: str | Path, *, model: str | None = None,
              processor: str | Path | None = None) -> Path:
    """Write the model of ``checkpoint`` (a step folder, or a root: its newest complete step) as the Hugging Face
    folder ``out``; returns ``out``.

    ``model``: the model spec to build (default: the one the run saved; its ``model_config`` and seed are the
    saved ones). ``processor``: the folder to copy processor and tokenizer files from (default: the run's
    ``--processor``, else the spec's model folder; none copied when there is none). Leaves the global RNG state
    as it was (a rank exporting in the middle of a run trains on as it would without).
    """
    from omnibal_compile.models.load import load_model, model_folder
    from omnibal_compile.runtime.checkpoint import find_checkpoint, load_into_model

    folder, meta = find_checkpoint(checkpoint)
    data: dict[str, Any] = meta.get("data", {})
    spec = model or data.get("model")
    if not isinstance(spec, str) or not spec:
        raise InputError(f"checkpoint {folder} records no model spec; give the model (--model SPEC)")
    out = Path(out)
    check_export_target(out)
    saved_config, saved_seed = data.get("model_config"), data.get("seed")
    config = saved_config if isinstance(saved_config, dict) else {}
    seed = saved_seed if isinstance(saved_seed, int) else 0
    lora = lora_spec(meta.get("lora"))
    with torch.random.fork_rng(devices=[]):  # load_model seeds the global RNG
        net = load_model(spec, config=config, seed=seed).model
    save_pretrained = getattr(net, "save_pretrained", None)
    if not callable(save_pretrained):
        raise InputError(f"model {spec!r} ({type(net).__name__}) has no save_pretrained: only Hugging Face models "
                         "export to a Hugging Face folder; load the checkpoint with load_into_model instead")
    if lora is not None:  # the adapter alone: adapter_config.json and adapter_model.safetensors
        from omnibal_compile.models.lora import peft_model

        wrapped = peft_model(net, lora, seed=seed)
        step = load_into_model(wrapped.base_model.model, folder)  # the run's parameter names
        save_pretrained = wrapped.save_pretrained
    else:
        step = load_into_model(net, folder)
    source = processor if processor is not None else data.get("processor") or model_folder(spec)
    partial, old = out.parent / f".{out.name}.partial", out.parent / f".{out.name}.old"
    out.parent.mkdir(parents=True, exist_ok=True)
    for leftover in (partial, old):  # of an export that was killed
        if leftover.is_dir():
            shutil.rmtree(leftover)
    try:
        save_pretrained(str(partial))
        for f in _processor_files(Path(source)) if source else []:
            if not (partial / f.name).exists():  # save_pretrained's own (generation config) are the model's
                shutil.copy2(f, partial / f.name)
        record = {"written_by": _WRITER, "checkpoint": str(folder.resolve()), "step": step, "model": spec,
                  "processor": str(source) if source else None, "lora": None if lora is None else str(lora)}
        atomic_write_text(partial / EXPORT_MARKER, json.dumps(record, indent=2) + "\n")
        if out.exists():
            out.rename(old)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
