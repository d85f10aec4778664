"""Starting a rank without the whole model: the model built on ``meta``, then only its own stages' tensors made real.

Glossary:
    skeleton       the model built with every parameter on the meta device (nothing allocated, no init computed)
                   and its buffers real: rotary tables and position ids come from the model's own constructor,
                   so non-persistent buffers, which no weight file holds, are right. LoRA adapters (small,
                   seeded) are made real too. Then every tensor is moved to meta, so that capture sees one
                   device; the real ones are kept aside by name (``RankWeights.values``).
    weight files   the safetensors of an ``hf:DIR`` folder saved by ``save_pretrained``: ``model.safetensors``,
                   or the shards ``model.safetensors.index.json`` names. A rank opens only the files holding its
                   tensors and reads only those tensors (``safe_open``); ``WeightFiles.read_names`` logs them.
    materialise    replace the meta parameters and buffers of a rank's stages by real ones on its device, by
                   their names in the original model: from the kept real tensors, else from the weight files. A
                   tensor under several names (a tied embedding and head) becomes one tensor, read once.
    seeded specs   ``tiny-vlm`` and ``hf:ClassName:config.json`` have no weights on disk: their weights are the
                   per-name init of :mod:`omnibal_compile.models.seeded` (each parameter's random init seeded by the
                   run's seed and its name), so a rank makes its own stages' parameters, and only those, with the
                   values the unsplit model (``build_model``) has.
    factories      ``module:factory`` specs are built whole on every rank, as the factory builds them (its own
                   values, which a meta build would lose: :func:`meta_start` returns None); only their examples are
                   made on meta.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnibal_compile import progress
from omnibal_compile.errors import InputError
from omnibal_compile.models.seeded import materialise_seeded, params_on_meta
from omnibal_compile.runtime.settings import RunConfig

__all__ = ["WeightFiles", "RankWeights", "MetaStart", "meta_model", "meta_start", "on_meta", "materialise",
           "retarget_meta", "compile_on_meta", "cut_on_meta"]


@contextlib.contextmanager
def _adapters_stay_real() -> Iterator[None]:
    """Modules are not moved to meta inside: peft moves new adapters to their base layer's device, on a skeleton
    meta, which would lose their seeded start (they are moved to meta with the rest, their values kept)."""
    move = nn.Module.to

    def stay(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        return module if device is not None and device.type == "meta" else move(module, *args, **kwargs)

    nn.Module.to = stay  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.to = move  # type: ignore[method-assign]


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (non-persistent buffers too) under each of its names."""
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _replace(modules: Iterable[nn.Module], new: dict[int, torch.Tensor]) -> None:
    """Point every parameter and buffer slot of ``modules`` whose tensor's id is in ``new`` at its replacement."""
    for module in modules:
        for sub in module.modules():
            for slots in (sub._parameters, sub._buffers):
                for key, t in slots.items():
                    if t is not None and id(t) in new:
                        slots[key] = new[id(t)]  # type: ignore[assignment]  # a Parameter where one was


def _to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move every real parameter and buffer of ``model`` to meta in place (shared ones stay shared); returns the
    real ones by every name they have."""
    real = {n: t for n, t in _named_tensors(model) if not t.is_meta}
    new: dict[int, torch.Tensor] = {}
    for t in real.values():
        if id(t) not in new:
            m = t.detach().to("meta")
            new[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
    _replace([model], new)
    return {n: t.detach() for n, t in real.items()}


@dataclass(frozen=True, kw_only=True)
class WeightFiles:
    """The safetensors of a ``save_pretrained`` folder, read tensor by tensor (module glossary)."""

    folder: Path
    """The folder."""
    keys: dict[str, tuple[str, str]]
    """The model's tensor name -> (the file in ``folder`` holding it, its key there)."""
    read_names: list[str] = field(default_factory=list)
    """The model's names read so far, in order (what a rank took from disk)."""

    @classmethod
    def open(cls, folder: str | Path, model: nn.Module) -> WeightFiles | None:
        """The weight files of ``folder`` saved from ``model``'s class (its keys renamed as ``from_pretrained``
        renames them); None when it holds no ``model.safetensors`` (nor its index) or a key needs more than a
        rename (a conversion that merges or splits tensors: ``from_pretrained`` then loads the whole model)."""
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        files: dict[str, str]  # key -> file
        if index.is_file():
            try:
                files = {str(k): str(v) for k, v in json.loads(index.read_text())["weight_map"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise InputError(f"{index} is not a safetensors index (no 'weight_map': {e})") from None
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            return None
        renamed = _model_names(list(files), model)
        if renamed is None:
            return None
        keys = {renamed[k]: (file, k) for k, file in files.items()}
        for name, _ in _named_tensors(model):  # a LoRA target's weight: saved as ...q_proj.weight
            base = name.replace(".base_layer.", ".")
            if name not in keys and base in keys:
                keys[name] = keys[base]
        return cls(folder=folder, keys=keys)

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors of the model's ``names`` on CPU as saved, opening each file once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.keys[n][0], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(self.folder / file), framework="pt") as f:
                for n in wanted:
                    out[n] = f.get_tensor(self.keys[n][1])
                    self.read_names.append(n)
        return out


def _model_names(keys: Sequence[str], model: nn.Module) -> dict[str, str] | None:
    """Saved key -> the model's name for it, as ``from_pretrained`` renames (transformers 5 saves some families,
    Llava's among them, under their older names); None when some key needs a conversion beyond a rename."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversions saves the model's own names
        return {k: k for k in keys}
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a PreTrainedModel (hf: spec)
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, str] = {}
    for k in keys:
        name, converted = rename_source_key(k, renames, converters,  # type: ignore[arg-type]
                                            base_model_prefix=prefix, meta_state_dict=state)
        if converted is not None:
            return None
        out[k] = name
    return out


@dataclass(frozen=True, kw_only=True)
class RankWeights:
    """Where a rank's real tensors come from (module glossary: materialise)."""

    values: dict[str, torch.Tensor] = field(repr=False)
    """Real tensors the skeleton made (buffers, LoRA adapters), by every original name."""
    files: WeightFiles | None
    """The weight files (None: every tensor is in ``values`` or seeded)."""
    seed: int | None = None
    """A seeded spec's seed: parameters in neither ``values`` nor ``files`` are made by the per-name init
    (:func:`~omnibal_compile.models.seeded.seeded_init`); None: every one is in ``values`` or ``files``."""


@dataclass(frozen=True, kw_only=True)
class MetaStart:
    """A model on meta and where its real tensors come from."""

    model: nn.Module = field(repr=False)
    """The model (LoRA and freeze applied as ``build_model`` applies them), every tensor on meta."""
    weights: RankWeights = field(repr=False)
    """Its real tensors."""


def _skeleton(config: RunConfig) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of ``config`` as :func:`~omnibal_compile.runtime.batches.build_model` builds it (LoRA, freeze), on
    meta, and the real tensors its construction made (module glossary)."""
    from omnibal_compile.models.freeze import freeze_parameters
    from omnibal_compile.models.load import load_model

    with params_on_meta():
        model = load_model(config.model, config=config.model_config, seed=config.seed, batch=config.batch_size,
                           tiles=config.tiles_per_sample, text=config.text_tokens, weights=False).model
    model.train()  # as _hf_pretrained leaves a loaded model
    if config.lora is not None:
        from omnibal_compile.models.lora import apply_lora

        with _adapters_stay_real():
            model = apply_lora(model, config.lora, seed=config.seed)
    freeze_parameters(model, config.freeze)
    return model, _to_meta(model)


def _is_weights_folder(spec: str) -> Path | None:
    """The folder of an ``hf:DIR`` (or ``hf:ClassName:DIR``) spec; None for other specs."""
    from omnibal_compile.models.load import _hf_spec

    if not spec.startswith("hf:"):
        return None
    _, path = _hf_spec(spec)
    return Path(path) if Path(path).is_dir() else None


def meta_model(config: RunConfig) -> nn.Module | None:
    """The model of ``config`` on meta, for checks that need its structure only (the launcher's); None for a
    factory spec, which is built as the factory builds it."""
    from omnibal_compile.models.load import TINY_VLM

    if config.model not in TINY_VLM and not config.model.startswith("hf:"):
        return None
    return _skeleton(config)[0]


def _is_seeded(spec: str) -> bool:
    """Whether ``spec`` is a seeded spec (module glossary): ``tiny-vlm`` or ``hf:ClassName:config.json``."""
    from omnibal_compile.models.load import TINY_VLM, _hf_spec

    if spec in TINY_VLM:
        return True
    return spec.startswith("hf:") and not Path(_hf_spec(spec)[1]).is_dir()


def meta_start(config: RunConfig) -> MetaStart | None:
    """``config``'s model on meta and where its real tensors come from (its weight files, or the per-name init of a
    seeded spec), for a rank that makes only its own stages real; None for a factory (module glossary) or a folder
    whose files lack some of the model's tensors under their names (then it is loaded whole, by
    ``from_pretrained``, which may rename them)."""
    if _is_seeded(config.model):
        model, values = _skeleton(config)
        return MetaStart(model=model, weights=RankWeights(values=values, files=None, seed=config.seed))
    folder = _is_weights_folder(config.model)
    if folder is None:
        return None
    model, values = _skeleton(config)
    files = WeightFiles.open(folder, model)
    if files is None:
        return None  # load_model names missing weights; a conversion beyond renames is from_pretrained's to make
    groups: dict[int, list[str]] = {}
    for name, t in _named_tensors(model):
        groups.setdefault(id(t), []).append(name)
    persistent = set(model.state_dict(keep_vars=True))
    for names in groups.values():
        if not any(n in values or n in files.keys for n in names) and any(n in persistent for n in names):
            progress.info(f"note: {folder}: its weight files hold no tensor {names[0]!r}; every rank loads the whole "
                          "model (from_pretrained maps the names)")
            return None
    return MetaStart(model=model, weights=RankWeights(values=values, files=files))


def on_meta(batch: Any) -> Any:
    """``batch`` with every tensor on meta (same shapes and dtypes): the example a meta model is captured with."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch)


def materialise(model: nn.Module, stages: Sequence[nn.Module], weights: RankWeights, device: torch.device, *,
                param_dtype: torch.dtype | None = None) -> int:
    """Make every meta parameter and buffer of ``stages`` (cut from ``model``) real on ``device``, in place in the
    stages and in ``model`` (module glossary); returns the bytes made. A file tensor of another shape than the
    model's is an InputError naming it; floating ones take the model's dtype (``from_pretrained(dtype=float32)``
    does the same), or ``param_dtype`` for floating parameters (a 16-bit run's fp32 masters of a model captured
    with 16-bit parameters)."""
    names: dict[int, list[str]] = {}
    for name, t in _named_tensors(model):
        names.setdefault(id(t), []).append(name)
    wanted: dict[int, torch.Tensor] = {}
    for stage in stages:
        for _, t in _named_tensors(stage):
            if t.is_meta:
                wanted.setdefault(id(t), t)
    missing = [k for k in wanted if k not in names]
    if missing:
        raise InputError(f"internal error: {len(missing)} stage tensors are not tensors of the model they were cut "
                         "from")
    on_disk: dict[int, str] = {}
    seeded: list[nn.Parameter] = []
    for k, t in wanted.items():
        if not any(n in weights.values for n in names[k]):
            found = next((n for n in names[k] if weights.files is not None and n in weights.files.keys), None)
            if found is not None:
                on_disk[k] = found
            elif weights.seed is not None and isinstance(t, nn.Parameter):
                seeded.append(t)
            else:
                raise InputError(f"{names[k][0]} is neither in the model's weight files nor made by its constructor")
    read = weights.files.read(list(on_disk.values())) if weights.files is not None and on_disk else {}
    # seeded: made on CPU (the same values on every device), in the masters' dtype when one is given
    init = materialise_seeded(model, seeded, weights.seed, dtype=param_dtype) if seeded and weights.seed is not None \
        else {}
    new: dict[int, torch.Tensor] = {}
    made = 0
    for k, old in wanted.items():
        src = init[k] if k in init else read[on_disk[k]] if k in on_disk else next(
            weights.values[n] for n in names[k] if n in weights.values)
        if tuple(src.shape) != tuple(old.shape):
            where = f"{weights.files.folder}: " if k in on_disk and weights.files is not None else ""
            raise InputError(f"{where}tensor {names[k][0]} has shape {list(src.shape)}, the model's is "
                             f"{list(old.shape)}: the weights are of another config")
        dtype = old.dtype if src.is_floating_point() else src.dtype
        if param_dtype is not None and isinstance(old, nn.Parameter) and old.is_floating_point():
            dtype = param_dtype
        real = src.detach().to(device=device, dtype=dtype)
        new[k] = nn.Parameter(real, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else real
        made += real.numel() * real.element_size()
    _replace([*stages, model], {**new, **{id(init[k]): new[k] for k in init}})  # the model holds the seeded ones
    return made


def retarget_meta(gm: torch.fx.GraphModule, device: torch.device, *, source: str = "meta") -> int:
    """Point every ``source`` device a graph captured there bakes into its ops (``arange(device=...)``, ``.to(...)``,
    metadata asserts) at ``device``, in place; returns how many nodes changed. ``source="cpu"``: stages captured on
    cpu that run on a GPU (their causal masks and position ids are made where the graph says)."""
    meta = torch.device(source)

    def swap(x: Any) -> Any:
        return device if isinstance(x, torch.device) and x.type == meta.type else x

    changed = 0
    for node in gm.graph.nodes:
        args, kwargs = torch.fx.node.map_aggregate(node.args, swap), torch.fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _meta_blocker(result: Any) -> str | None:
    """Why stages cut on meta cannot start a rank, or None: a stage reads tensor values into shapes (its examples
    need values), or holds a meta tensor that is no tensor of the model (a constant of the graph, whose value
    capture on meta lost)."""
    from omnibal_compile.costs.meta import value_reads

    reads = value_reads(result.captured.graph_module.graph)
    if reads:
        return f"its graph reads tensor values into shapes ({reads[0].name})"
    known = {id(t) for _, t in _named_tensors(result.model)}
    for s, stage in enumerate(result.stages):
        for node in stage.graph.nodes:
            if node.op == "get_attr":
                t = _attr(stage, str(node.target))
                if isinstance(t, torch.Tensor) and t.is_meta and id(t) not in known:
                    return f"stage {s} holds the graph constant {node.target!r}"
    return None


def _attr(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def cut_on_meta(model: nn.Module, batch: Any, plan: Any, *, kernels: str | None = None) -> tuple[Any, str | None]:
    """``model`` (on meta) captured and cut under ``plan`` on a meta copy of ``batch``: (its ``OptimizeResult``,
    None), or (None, why not) when its capture on meta fails (e.g. a value read on meta inputs: the whole model's
    capture then says what is wrong, if anything). A plan that does not fit the model is a PlanError here."""
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.errors import OmnibalError, PlanError

    try:
        return compile_for_microbatches(model, on_meta(batch), plan, kernels=kernels), None
    except PlanError:
        raise
    except (OmnibalError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return None, f"its capture on meta fails ({type(e).__name__}: {first})"


def compile_on_meta(config: RunConfig, start: MetaStart, batch: Any, plan: Any) -> Any | None:
    """``start.model`` cut under ``plan`` (:func:`cut_on_meta`), or None (with a note) when a rank cannot start from
    it: its capture on meta fails, or :func:`_meta_blocker` says why; the caller then builds the whole model."""
    result, why = cut_on_meta(start.model, batch, plan, kernels=config.kernels)
    if result is not None:
        why = _meta_blocker(result)
        if why is None:
            return result
    if os.environ.get("RANK", "0") == "0":
        progress.info(f"note: {config.model}: every rank builds the whole model, as {why}")
    return None
