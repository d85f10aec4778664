"""One way to name a model on the command line, for ``plan`` and ``run`` alike.

Glossary:
    model spec    ``tiny-vlm`` (or ``tinyvlm``): the reference VLM, its config fields from ``config``;
                  ``hf:ClassName:config.json``: a ``transformers`` class built offline from a config
                  file with random weights; ``hf:DIR`` (or ``hf:ClassName:DIR``): a folder saved by
                  ``save_pretrained`` (config.json and its safetensors, sharded or not), its weights
                  loaded, the class the config's ``architectures`` names; ``module.path:factory``:
                  ``factory(**config)`` returning a model, or ``(model, example_batch)``, from the
                  installed packages or, when none has that name, the current folder (searched after
                  them, never ahead);
                  ``path/to/file.py:factory``: the same from a named file.
    example batch the batch ``plan`` captures the model with: the reference VLM's and Hugging Face
                  models' are built from their configs; a factory may return its own.
    model folder  the folder of an ``hf:`` spec (DIR, or the config file's folder): where the processor
                  and tokenizer files are looked for (:func:`model_folder`).
    data facts    what balanced packs need to know about a Hugging Face VLM (tokens per tile, the
                  image placeholder id, the tile's shape, the vocabulary), read from its config.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from omnibal_compile._utils.validate import read_text
from omnibal_compile.config import TINY_VLM_NAMES
from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.inputs import hf_data_facts, hf_example_batch
from omnibal_compile.models.seeded import seeded_model

__all__ = ["LoadedModel", "load_model", "load_hf_config", "model_folder", "hf_data_facts", "hf_example_batch",
           "import_from_spec"]

TINY_VLM = TINY_VLM_NAMES


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model named by a spec, with its example batch when one is known."""

    model: nn.Module
    """The model, seeded."""
    example_batch: Any
    """A batch to capture it with (a dict of keyword inputs, or what the factory returned); None if unknown."""
    name: str
    """How to call it in messages and file names."""


def import_from_spec(spec: str, what: str) -> Any:
    """``package.module:attr`` or ``path/to/file.py:attr`` -> the attribute (see :func:`_import_module` and
    :func:`_import_file` for where each is looked for)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise InputError(f"{what} {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(Path(target), spec, what) if is_file else _import_module(target, spec, what)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise InputError(
            f"cannot load {what} {spec!r}: module {module.__name__} ({module.__file__}) has no {attr!r}"
        ) from None


def _import_module(name: str, spec: str, what: str) -> ModuleType:
    """The module ``name`` from ``sys.path`` as it is; only when it is found nowhere there, from the
    current folder, which is then searched after the installed packages. A folder first on ``sys.path``
    would let any file in it shadow an installed package (a stray ``pulp.py`` run by the planner's
    ``import pulp``), so the current folder never goes ahead of them."""
    top = name.partition(".")[0]
    cwd = os.getcwd()
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found and importlib.machinery.PathFinder.find_spec(top, [cwd]) is not None and cwd not in sys.path:
        sys.path.append(cwd)  # `omnibal-compile` is a script: its sys.path lacks the directory it runs in
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):  # the spec's own, not an import
            raise InputError(
                f"cannot load {what} {spec!r}: no module {e.name!r} among the installed packages or in the current "
                f"folder {cwd}; name an importable module (package.module:function) or a file "
                "(path/to/file.py:function)"
            ) from None
        raise InputError(f"cannot load {what} {spec!r}: {e}") from None
    except ImportError as e:
        raise InputError(f"cannot load {what} {spec!r}: {e}") from None


def _import_file(path: Path, spec: str, what: str) -> ModuleType:
    """The Python file ``path`` as the module of its stem (once per process); its folder goes on ``sys.path``
    after the installed packages, so that the modules beside it are found and none shadows a package."""
    if not path.is_file():
        raise InputError(f"cannot load {what} {spec!r}: {path} is not a file; give the path of a .py file, "
                         "or an importable module as package.module:function")
    real = path.resolve()
    name = real.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        if where and Path(where).resolve() == real:
            return loaded
        raise InputError(f"cannot load {what} {spec!r}: a module named {name!r} is already imported "
                         f"(from {where or 'built in'}); rename {path}")
    module_spec = importlib.util.spec_from_file_location(name, real)
    if module_spec is None or module_spec.loader is None:
        raise InputError(f"cannot load {what} {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    if str(real.parent) not in sys.path:
        sys.path.append(str(real.parent))
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up there
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, ImportError):
            raise InputError(f"cannot load {what} {spec!r}: {e}") from None
        raise
    return module


def load_model(spec: str, *, config: Mapping[str, Any] | None = None, seed: int = 0, batch: int = 2, tiles: int = 2,
               text: int = 32, meta: bool = False, weights: bool = True) -> LoadedModel:
    """Build the model ``spec`` names (see the module glossary), seeded with ``seed``.

    ``config``: the reference VLM's config fields or the factory's keyword arguments. ``batch``,
    ``tiles``, ``text``: rows, tiles per row and text tokens per row of the built example batch.
    ``meta``: an ``hf:`` model and its example batch on the meta device in bf16 (no weights allocated).
    ``weights=False``: an ``hf:DIR`` model built from its config alone (fp32, random init), its weight files left
    unread (a rank that reads only its own tensors, :mod:`omnibal_compile.runtime.weights`); a seeded spec's model
    with its parameters on meta (a rank makes its own by :func:`~omnibal_compile.models.seeded.seeded_init`).

    The weights of seeded specs (``tiny-vlm``, ``hf:ClassName:config.json``) are the per-name init of
    :mod:`omnibal_compile.models.seeded`: the same values whether a process builds the whole model or one stage.
    A factory's model is what the factory returns (built whole, under the global seed ``seed``).
    """
    config = dict(config or {})
    torch.manual_seed(seed)
    if meta and not spec.startswith("hf:"):
        raise InputError(
            f"--meta builds hf:ClassName:config.json models only; MODEL {spec!r} is built as its factory makes it"
        )
    example: Any  # a dict of keyword inputs, None, or what a factory returned with its model
    if spec in TINY_VLM:
        from omnibal_compile.models import TinyVLM, TinyVLMConfig, make_example_batch

        try:
            cfg = TinyVLMConfig(**config)
        except TypeError as e:
            raise InputError(f"model config does not fit TinyVLMConfig: {e}") from None
        example = make_example_batch(cfg, batch=batch, tiles_per_sample=tiles, text_tokens=text, seed=seed)
        return LoadedModel(model=seeded_model(lambda: TinyVLM(cfg), seed, weights=weights), example_batch=example,
                           name="tiny-vlm")
    if spec.startswith("hf:"):
        class_name, path = _hf_spec(spec)
        if Path(path).is_dir():
            model, class_name = _hf_pretrained(class_name, path, meta=meta, weights=weights)
        elif class_name is None:
            raise InputError(f"MODEL {spec!r}: {path} is not a folder; write hf:DIR for a folder saved by "
                             "save_pretrained, or hf:ClassName:config.json for random weights")
        elif meta:
            model = _hf_model(class_name, path, meta=True)
        else:
            model = seeded_model(lambda: _hf_model(class_name, path), seed, weights=weights)
        example = _hf_example(model, batch=batch, text=text, seed=seed)
        return LoadedModel(model=model, example_batch=_on_meta(example) if meta and example else example,
                           name=class_name)
    if ":" not in spec:
        raise InputError(
            f"MODEL {spec!r} is not tiny-vlm, hf:DIR, hf:ClassName:config.json, module.path:factory or "
            "path/to/file.py:factory"
        )
    made = import_from_spec(spec, "model factory")(**config)
    model, example = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise InputError(
            f"model factory {spec!r} returned {type(made).__name__}; it must return an nn.Module or (model, "
            "example_batch)"
        )
    if example is None and hasattr(getattr(model, "config", None), "to_dict"):
        example = _hf_example(model, batch=batch, text=text, seed=seed)
    return LoadedModel(model=model, example_batch=example, name=spec)


def _hf_spec(spec: str) -> tuple[str | None, str]:
    """``hf:DIR`` -> (None, DIR); ``hf:ClassName:PATH`` -> (ClassName, PATH), PATH a config file or a folder."""
    rest = spec[len("hf:"):]
    head, sep, tail = rest.partition(":")
    if sep and head.isidentifier() and tail:
        return head, tail
    if rest and not sep:
        return None, rest
    raise InputError(f"MODEL {spec!r}: write hf:DIR (a folder saved by save_pretrained) or hf:ClassName:config.json, "
                     "e.g. hf:LlavaForConditionalGeneration:config.json")


def model_folder(spec: str) -> Path | None:
    """The folder of an ``hf:`` spec: DIR of ``hf:DIR`` and ``hf:ClassName:DIR``, the config file's folder of
    ``hf:ClassName:config.json``; None for other specs (or a malformed one)."""
    if not spec.startswith("hf:"):
        return None
    try:
        _, path = _hf_spec(spec)
    except InputError:
        return None
    return Path(path) if Path(path).is_dir() else Path(path).parent


def load_hf_config(spec: str) -> Any:
    """The ``transformers`` config of an ``hf:`` spec (``hf:DIR``, ``hf:ClassName:DIR``, ``hf:ClassName:config.json``),
    read without building the model or its weights."""
    if not spec.startswith("hf:"):
        raise InputError(f"model {spec!r} is not a Hugging Face model: write hf:DIR or hf:ClassName:config.json")
    class_name, path = _hf_spec(spec)
    if class_name is None and not Path(path).is_dir():
        raise InputError(f"MODEL {spec!r}: {path} is not a folder; write hf:DIR for a folder saved by "
                         "save_pretrained, or hf:ClassName:config.json")
    config_path = str(Path(path) / "config.json") if Path(path).is_dir() else path
    read_text(config_path, "config file")  # says whether it is missing, a directory or unreadable
    try:
        if class_name is not None:
            return _hf_class(class_name).config_class.from_json_file(config_path)
        import transformers

        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except ImportError:
        raise InputError("hf: models need transformers: pip install 'omnibal-compile[hf]'") from None
    except (ValueError, OSError, KeyError) as e:
        raise InputError(f"config file {config_path}: cannot read a model config from it ({type(e).__name__}: {e})") \
            from None


def _hf_class(class_name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise InputError("hf: models need transformers: pip install 'omnibal-compile[hf]'") from None
    cls = getattr(transformers, class_name, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise InputError(
            f"transformers has no model class {class_name!r} (e.g. LlavaForConditionalGeneration, LlamaForCausalLM)"
        )
    return cls


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _hf_pretrained(class_name: str | None, folder: str, *, meta: bool = False, weights: bool = True
                   ) -> tuple[nn.Module, str]:
    """The model saved in ``folder`` with its weights (float32), of ``class_name`` or the class its config's
    ``architectures`` names (else the Auto classes' for its ``model_type``); on ``meta``: built from its config
    alone, in bf16; ``weights=False``: built from its config alone, in float32. Returns it and its class name."""
    config_path = Path(folder) / "config.json"
    read_text(str(config_path), "config file")  # says whether it is missing, a directory or unreadable
    if class_name is None:
        try:
            saved = json.loads(config_path.read_text())
            names = saved.get("architectures") or [_auto_class_name(saved.get("model_type"))]
        except (ValueError, AttributeError) as e:
            raise InputError(f"config file {config_path} is not a JSON object: {e}") from None
        if not names or not isinstance(names[0], str):
            raise InputError(f"{config_path} names no class (no 'architectures', and its model_type "
                             f"{saved.get('model_type')!r} is no image-text-to-text or causal LM family): write "
                             f"hf:ClassName:{folder}")
        class_name = names[0]
    cls = _hf_class(class_name)
    if meta:
        return _hf_model(class_name, str(config_path), meta=True), class_name
    if not weights:  # float32 throughout, as from_pretrained(dtype=float32) makes it, whatever the config's dtype
        return _hf_model(class_name, str(config_path)).to(torch.float32).train(), class_name
    if not any((Path(folder) / name).is_file() for name in _WEIGHT_FILES):
        raise InputError(f"model folder {folder} holds no weights ({' or '.join(_WEIGHT_FILES)}): save the model "
                         f"with save_pretrained, or write hf:{class_name}:{config_path} for random weights")
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" once per rank and check: a bar that says nothing new
    try:
        model = cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise InputError(f"model folder {folder}: cannot load {class_name} from it ({type(e).__name__}: {e})") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.train(), class_name  # from_pretrained leaves it in eval mode; a config-built model trains


def _auto_class_name(model_type: Any) -> str | None:
    """The class ``AutoModelForImageTextToText`` (else ``AutoModelForCausalLM``) builds for ``model_type``."""
    try:
        from transformers.models.auto import modeling_auto as auto
    except ImportError:
        raise InputError("hf: models need transformers: pip install 'omnibal-compile[hf]'") from None
    for names in (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if isinstance(model_type, str) and isinstance(names.get(model_type), str):
            return str(names[model_type])
    return None


def _hf_model(class_name: str, config_path: str, *, meta: bool = False) -> nn.Module:
    cls = _hf_class(class_name)
    read_text(config_path, "config file")  # says whether it is missing, a directory or unreadable
    try:
        config = cls.config_class.from_json_file(config_path)
    except (ValueError, OSError) as e:
        raise InputError(f"config file {config_path!r} is not a {class_name} config: {e}") from None
    if meta:  # no weights allocated, in the training precision's dtype (no second capture when costing)
        with torch.device("meta"):
            return cls(config).to(torch.bfloat16)
    return cls(config)  # use_cache is turned off by capture


def _hf_example(model: nn.Module, *, batch: int, text: int, seed: int) -> dict[str, torch.Tensor] | None:
    """The example batch of a Hugging Face model, or None for a family whose layout is unknown (the run then needs
    data=, and plan says what to pass)."""
    try:
        return hf_example_batch(model, batch=batch, text=text, seed=seed)
    except InputError:
        return None


def _on_meta(example: dict[str, Any]) -> dict[str, Any]:
    """An example batch on the meta device, floats in bf16 (as the model ``meta=True`` builds)."""
    return {
        k: v.to(device="meta", dtype=torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in example.items()
    }
