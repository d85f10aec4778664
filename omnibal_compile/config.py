"""Every setting of a planning or training run, written once: one frozen dataclass per concern.

Each field has its one default and its one description (the attribute docstring under it, which is
also the ``--help`` text of its flag). A field named ``num_stages`` is the keyword
``optimize(num_stages=...)``, the flag ``--num-stages`` of every command that takes its section, the
key ``num_stages`` of a ``--config`` file and of ``run.json``. Names are unique across sections, so a
flat ``num_stages=4`` finds its section.

Each section checks its own fields in ``__post_init__`` (through :mod:`omnibal_compile._utils.validate`),
naming the field and its flag. :class:`Config` composes every section (its fields are theirs);
:class:`omnibal_compile.runtime.settings.RunConfig` composes the sections a training run reads.

Torch-free on purpose: ``omnibal-compile --help`` builds its flags from here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from omnibal_compile._utils.units import parse_size
from omnibal_compile._utils.validate import MAX_SEED, check_choice, check_int, check_int_list, check_number, read_text
from omnibal_compile.errors import InputError
from omnibal_compile.ir.costs import DP_SHARDS, RECOMPUTE_OPTIONS
from omnibal_compile.ir.schedule import SCHEDULE_KINDS, Schedule

if TYPE_CHECKING:
    from omnibal_compile.costs.devices import DeviceSpec

__all__ = [
    "Section", "ModelConfig", "DataConfig", "LayoutConfig", "ParallelConfig", "ScheduleConfig", "MemoryConfig",
    "PlannerConfig", "OptimizerConfig", "CheckpointConfig", "RuntimeConfig", "OutputConfig", "Config", "SECTIONS",
    "flag_name", "field_help", "find_field", "load_config_file", "DEFAULT_SAMPLES_PER_PACK", "TINY_VLM_NAMES",
    "LR_SCHEDULES", "PRECISIONS", "precision_for", "DEFAULT_STEPS", "LoraSpec", "lora_spec",
]

S = TypeVar("S", bound="Section")

DEFAULT_STEPS = 5
"""Training steps of a run given neither ``steps`` nor ``epochs``."""
DEFAULT_SAMPLES_PER_PACK = 4.0
"""Target mean samples per balanced pack, wherever packs are made (DataOptions, the HF sampler, ``run``)."""
TINY_VLM_NAMES = ("tinyvlm", "tiny-vlm")
"""Names of the built-in reference VLM (``tinyvlm`` is the canonical one)."""
PRECISIONS = ("bf16", "fp16", "fp32")
"""Compute dtypes of ``--precision`` (``omnibal_compile.runtime.precision`` runs them)."""


def precision_for(precision: str | None, device: Any) -> str:
    """The precision a run trains in, and a plan costs: the ``precision`` setting when given; None (auto): ``bf16``
    on a GPU (``cuda``, ``cuda:N``, or a roofline target such as ``h200``), ``fp32`` on ``cpu`` and with no device
    (a run then trains on cpu). The one rule: ``RunConfig`` and ``optimize()`` both resolve through it."""
    if precision is not None:
        return precision
    if device is None:
        return "fp32"
    name = str(getattr(device, "name", device)).strip().lower()  # a DeviceSpec: its name
    return "fp32" if name == "cpu" else "bf16"
LR_SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules after warm-up (``omnibal_compile.runtime.recipe.lr_at`` computes them)."""


def freeze_patterns(patterns: Any) -> tuple[str, ...]:
    """The patterns of a ``freeze`` setting: each entry split on commas (``"a,b"`` is ``a`` and ``b``), each
    compiled once to check it (an InputError names a malformed one)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    if not isinstance(patterns, (tuple, list)) or not all(isinstance(p, str) for p in patterns):
        raise InputError(f"freeze (--freeze) must be a list of regular expressions, got {patterns!r}"[:300])
    out: list[str] = []
    for entry in patterns:
        for p in (x.strip() for x in entry.split(",")):
            if not p:
                continue
            try:
                re.compile(p)
            except re.error as e:
                raise InputError(f"freeze pattern {p!r} (--freeze) is not a regular expression: {e}") from None
            out.append(p)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """A LoRA adapter (``--lora r=16,alpha=32,targets=q_proj,v_proj``): low-rank updates ``B @ A`` beside the named
    linear layers, the base weights frozen (peft's ``LoraConfig``)."""

    KEYS: ClassVar[tuple[str, ...]] = ("r", "alpha", "dropout", "targets")

    r: int = 8
    """Rank of each adapter (rows of A, columns of B)."""
    alpha: float = 16.0
    """Scale numerator: the update is ``alpha / r x B @ A x input``."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training (0: none)."""
    targets: tuple[str, ...] = ()
    """Names of the linear modules to adapt, matched as peft matches ``target_modules`` (the last parts of a module
    path: q_proj matches every ``...self_attn.q_proj``)."""

    def __post_init__(self) -> None:
        write = "write e.g. --lora r=16,alpha=32,targets=q_proj,v_proj"
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise InputError(f"lora (--lora): r must be a whole number > 0, got {self.r!r}; {write}")
        for name in ("alpha", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
                raise InputError(f"lora (--lora): {name} must be a number, got {value!r}; {write}")
            object.__setattr__(self, name, float(value))
        if self.alpha <= 0:
            raise InputError(f"lora (--lora): alpha must be > 0, got {self.alpha:g}; {write}")
        if not 0 <= self.dropout < 1:
            raise InputError(f"lora (--lora): dropout must be in [0, 1), got {self.dropout:g}; {write}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not all(isinstance(t, str) and t.strip() for t in targets):
            raise InputError(f"lora (--lora): targets must be module names, got {self.targets!r}; {write}")
        object.__setattr__(self, "targets", tuple(t.strip() for t in targets))
        if not self.targets:
            raise InputError(f"lora (--lora) names no targets (the linear modules to adapt); {write}")

    def __str__(self) -> str:
        """The ``--lora`` text of this spec (``lora_spec`` reads it back)."""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"


def lora_spec(value: Any) -> LoraSpec | None:
    """A ``lora`` setting as a :class:`LoraSpec`: None (off), a LoraSpec, a mapping of its fields (run.json), or the
    flag's text ``r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj`` (the names after ``targets=`` run to the end or
    the next ``key=``). An InputError names --lora and what to write."""
    write = "write e.g. --lora r=16,alpha=32,targets=q_proj,v_proj"
    if value is None or isinstance(value, LoraSpec):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(LoraSpec.KEYS))
        if unknown:
            raise InputError(f"lora (--lora): unknown key {unknown[0]!r}; the keys are {', '.join(LoraSpec.KEYS)}")
        data = dict(value)
        if isinstance(data.get("targets"), list):
            data["targets"] = tuple(data["targets"])
        return LoraSpec(**data)
    if not isinstance(value, str):
        raise InputError(f"lora (--lora) must be text such as r=16,alpha=32,targets=q_proj,v_proj, got {value!r}")
    if not value.strip() or value.strip().lower() in ("none", "off"):
        return None
    fields: dict[str, Any] = {}
    key: str | None = None
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        if "=" in part:
            key, _, text = (x.strip() for x in part.partition("="))
            if key not in LoraSpec.KEYS:
                close = difflib.get_close_matches(key, LoraSpec.KEYS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise InputError(f"lora (--lora): unknown key {key!r}{hint}; the keys are "
                                 f"{', '.join(LoraSpec.KEYS)}: {write}")
            if key in fields:
                raise InputError(f"lora (--lora): {key} is given twice in {value!r}; {write}")
            fields[key] = [text] if key == "targets" else text
        elif key == "targets":
            fields["targets"].append(part)
        else:
            raise InputError(f"lora (--lora): {part!r} is not key=value; {write}")
    try:
        if "r" in fields:
            fields["r"] = int(fields["r"])
        for name in ("alpha", "dropout"):
            if name in fields:
                fields[name] = float(fields[name])
    except ValueError as e:
        raise InputError(f"lora (--lora): {e} in {value!r}; {write}") from None
    fields["targets"] = tuple(t for t in fields.get("targets", ()) if t)
    return LoraSpec(**fields)


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, choices: tuple[Any, ...] = (),
            min: float | None = None, max: float | None = None, above: float | None = None,
            metavar: str | None = None, check: bool = True) -> Any:
    """A config field: its default and the rules its value is checked against (the help is its docstring).

    ``check=False``: the rules are the flag's only; the section's ``_check`` applies another class's
    (the schedule fields are :class:`~omnibal_compile.ir.schedule.Schedule`'s)."""
    meta = {"choices": choices, "min": min, "max": max, "above": above, "metavar": metavar, "check": check}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    """The command-line flag of field ``name``: ``num_stages`` -> ``--num-stages``."""
    return "--" + name.replace("_", "-")


def _label(name: str) -> str:
    return f"{name} ({flag_name(name)})"


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right under a field) of ``cls``, joined to one line."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): flags without help
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def field_help(cls: type, name: str) -> str:
    """The description of field ``name`` of section ``cls`` (or of a class composing it)."""
    for klass in cls.__mro__:
        if name in _docstrings(klass):
            return _docstrings(klass)[name]
    return ""


@dataclass(frozen=True, kw_only=True)
class Section:
    """A group of settings; ``__post_init__`` checks every field against its ``setting(...)`` rules."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            self._check_field(f, getattr(self, f.name))
        for klass in type(self).__mro__:  # each section's own cross-field rules, once
            check = klass.__dict__.get("_check")
            if check is not None:
                check(self)

    def _check_field(self, f: dataclasses.Field[Any], value: Any) -> None:
        if value is None or not f.metadata or not f.metadata.get("check", True):
            return
        try:
            self._check_value(f, value)
        except InputError as e:
            raise InputError(f"{e}; setting {_label(f.name)}") from None

    def _check_value(self, f: dataclasses.Field[Any], value: Any) -> None:
        meta, name = f.metadata, f.name
        kind = f.type if isinstance(f.type, str) else str(f.type)
        if meta.get("choices"):
            check_choice(value, name, meta["choices"])
        elif kind.startswith("bool"):
            if not isinstance(value, bool):
                raise InputError(f"{name} must be true or false, got {value!r}")
        elif kind.startswith("int"):
            check_int(value, name, min=meta.get("min"), max=meta.get("max"))
        elif kind.startswith("float"):
            check_number(value, name, min=meta.get("min"), max=meta.get("max"), above=meta.get("above"))
        elif kind.startswith("tuple[int"):
            object.__setattr__(self, f.name, check_int_list(value, name, min=meta.get("min")))
        elif kind.startswith("tuple[str"):
            if (
                isinstance(value, str)
                or not isinstance(value, (tuple, list))
                or not all(isinstance(x, str) for x in value)
            ):
                raise InputError(f"{name} must be a list of strings, got {value!r}"[:300])
            object.__setattr__(self, f.name, tuple(value))
        elif kind in ("str", "str | None") and not isinstance(value, str):
            raise InputError(f"{name} must be a string, got {value!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def section(self, cls: type[S]) -> S:
        """This config's fields of section ``cls``, as a ``cls``."""
        return cls(**{n: getattr(self, n) for n in cls.names()})

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (field names; an unknown one is an InputError naming the closest field)."""
        for name in changes:
            find_field(name, type(self))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (tuples as lists)."""
        return {f.name: json.loads(json.dumps(getattr(self, f.name), default=str)) for f in dataclasses.fields(self)}


# -- the sections ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelConfig(Section):
    """Which model, seeded how, computed where."""

    model: str = setting("tinyvlm", metavar="MODEL")
    """tinyvlm (the built-in reference VLM; tiny-vlm also accepted), hf:DIR (a save_pretrained folder, its weights
    loaded), hf:ClassName:config.json (random weights), or package.module:factory returning a model or (model,
    example_batch)."""
    model_config: Mapping[str, Any] = setting(factory=dict, metavar="JSON")
    """TinyVLMConfig fields, or keyword arguments of the factory (JSON on the command line)."""
    seed: int = setting(0, min=0, max=MAX_SEED)
    """Seed of the weights (the same on every rank) and of the built-in batches."""
    kernels: str | None = setting(None, choices=("triton", "eager"))
    """Rewrite norms, SwiGLU, rotary and the LM-head loss into fused ops (omnibal_compile.kernels) before cutting:
    triton (Triton where it runs: CUDA, or TRITON_INTERPRET=1) or eager; plan: the ops costed; run: the ops the stages
    run; None: no rewrite."""
    device: str | DeviceSpec | None = setting(None)
    """cpu or cuda (profile the costs here; train here, gloo or NCCL), or a roofline target such as a100-80gb (costing
    only); None: optimize() does not cost, plan and run use cpu."""
    freeze: tuple[str, ...] = setting(factory=tuple, metavar="REGEX", check=False)
    """Parameters to freeze (no gradient, no optimizer state): regular expressions searched in each parameter name,
    comma-separated or several, e.g. vision_tower, or vision_tower,language_model to train the projector only."""
    lora: LoraSpec | str | None = setting(None, metavar="SPEC", check=False)
    """Train LoRA adapters instead of the weights (needs peft): r=16,alpha=32,dropout=0.0,targets=q_proj,v_proj; the
    base weights are frozen (before freeze applies); None: off."""
    precision: str | None = setting(None, choices=PRECISIONS)
    """Parameter and compute dtype: bf16, fp16 (with a dynamic loss scale) or fp32; run: 16-bit parameters in compute
    over fp32 master weights, gradients and optimizer states (TF32 matmuls on CUDA in every precision); plan: the
    precision costed (parameter bytes, and activations measured in its dtype), recorded in the plan; None (auto):
    bf16 on cuda and GPU targets, fp32 on cpu."""

    def _check(self) -> None:
        object.__setattr__(self, "freeze", freeze_patterns(self.freeze))
        object.__setattr__(self, "lora", lora_spec(self.lora))
        if not isinstance(self.model_config, Mapping):
            raise InputError(f"{_label('model_config')} must be a mapping (a JSON object), got {self.model_config!r}")
        if self.device is not None and not isinstance(self.device, str) and not hasattr(self.device, "peak_flops"):
            raise InputError(f"{_label('device')} must be a device name or a DeviceSpec, got {self.device!r}")


OVERSIZED_POLICIES: tuple[str, ...] = ("error", "truncate", "own-pack")
"""What the balancer does with a sample larger than the pack shape (``DataConfig.oversized``)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig(Section):
    """What a step trains on: built-in batches, a batch function, or packs balanced from length statistics."""

    lengths: tuple[str, ...] = setting(factory=tuple, metavar="FILE")
    """Dataset length-statistics files (OmniBal JSON, JSONL, CSV): train on balanced packs of these lengths (run),
    simulate micro-batches that differ (plan)."""
    batches: str | None = setting(None, metavar="MODULE:FN")
    """package.module:fn with fn(step, *, batch_size, seed) -> batch; None: built-in random batches."""
    dataset: str | None = setting(None, metavar="FILE")
    """A conversation dataset (LLaVA/ShareGPT .json or .jsonl) to train on: its samples, read by the model's
    processor, in balanced packs."""
    image_root: str | None = setting(None, metavar="DIR")
    """With dataset: the folder its image paths are relative to; None: the dataset file's folder."""
    data_workers: int = setting(0, min=0)
    """DataLoader worker processes that make the next steps' batches while a step trains (0: made in the rank)."""
    skip_bad_records: bool = setting(False)
    """With dataset: leave out the records that cannot be read (each named on stderr) instead of stopping."""
    processor: str | None = setting(None, metavar="DIR")
    """With dataset: the Hugging Face processor (or tokenizer) folder; None: the folder of the model's config."""
    batching: str = setting("balanced", choices=("balanced", "random"))
    """With lengths: balanced (one balanced pack per row) or random (one random sample per row, padded)."""
    samples_per_pack: float = setting(DEFAULT_SAMPLES_PER_PACK, min=1)
    """With lengths: target mean samples per pack."""
    oversized: str = setting("error", choices=OVERSIZED_POLICIES)
    """A sample larger than the pack shape: error (refused, named), truncate (cut to the shape) or own-pack (a pack
    of its own shape)."""
    batch_size: int = setting(8, min=1)
    """Rows per training step over all dp ranks and micro-batches; with lengths, packs per step."""
    tiles_per_sample: int = setting(2, min=0)
    """Built-in and example batches: image tiles per sample."""
    text_tokens: int = setting(32, min=2)
    """Built-in and example batches: text tokens per sample."""
    eval_data: str | None = setting(None, metavar="FILE")
    """A held-out set in the training data's format (a dataset file with dataset, a lengths file with lengths): its
    loss, forward only, every eval_every steps and at the end."""
    eval_every: int = setting(0, min=0)
    """With eval_data: evaluate every this many steps (0: only after the last step)."""


@dataclass(frozen=True, kw_only=True)
class LayoutConfig(Section):
    """How many pipeline stages, on how many devices, with micro-batches of what size."""

    num_stages: int | None = setting(None, min=1)
    """Pipeline stages, chunks included; None: chosen by the layout search over devices."""
    devices: int | None = setting(None, min=1)
    """Devices to lay the job out on (pipeline depth and chunks, data parallelism, micro-batches, searched where not
    pinned); None: the job's (WORLD_SIZE, the visible GPUs, else 1)."""
    global_batch: int | None = setting(None, min=1)
    """Layout search: micro-batches of the example's shape per optimizer step; None: two per device."""
    microbatch_size: int = setting(2, min=1)
    """Samples per micro-batch of the example batch the model is captured and costed with."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(Section):
    """Data-parallel replicas of the pipeline and how they hold weights, gradients and optimizer states."""

    dp: int | None = setting(None, min=1)
    """Data-parallel replicas of the pipeline; None: the plan's when one is given, else 1."""
    dp_shard: str | None = setting(None, choices=DP_SHARDS)
    """With dp > 1: fsdp (FSDP2 fully_shard, sharded state) or ddp (replicated); None: the plan's, else fsdp."""
    reshard_after_forward: bool | None = setting(None)
    """FSDP: free the gathered weights after each forward (ZeRO-3) instead of keeping them to backward; None: the
    plan's, else true (false under a schedule that splits the backward, which needs them kept)."""
    tp: int = setting(1, min=1)
    """run: tensor-parallel ranks per pipeline stage (Megatron column/row pairs of each block sharded with DTensor,
    the rest replicated; world = dp x pp x tp); 1: none."""
    sequence_parallel: bool = setting(False)
    """run, with tp > 1: the token-wise ops between the tensor-parallel pairs (residual adds, norms) run on each
    rank's 1 / tp of the sequence (row outputs reduce-scattered, column inputs all-gathered: the same bytes as the
    all-reduces, their activations divided by tp)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(Section):
    """The pipeline schedule."""

    schedule: str | None = setting(None, choices=SCHEDULE_KINDS, check=False)
    """Pipeline schedule (gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev; the last three split the
    backward, are simulated and run (dp 1, no recomputation) but not planned yet); None: the plan's when one is
    given, else 1f1b."""
    num_microbatches: int | None = setting(None, min=1, check=False)
    """Micro-batches per iteration; None: the plan's when one is given, else one per stage."""
    virtual_stages: int | None = setting(None, min=1, check=False)
    """Stage chunks per device (interleaved, interleaved-zb; 2 for zbv and dualpipev); None: the plan's when one is
    given, else 1."""

    def _check(
        self,
    ) -> None:  # the schedule's own rules (a PlanError naming the field); its fit to the stages comes later
        chunks = 1 if self.virtual_stages is None else self.virtual_stages
        open_kind = "interleaved" if isinstance(chunks, int) and chunks > 1 else "1f1b"  # a plan's may be interleaved
        Schedule(kind=open_kind if self.schedule is None else self.schedule,
                 num_microbatches=1 if self.num_microbatches is None else self.num_microbatches,
                 virtual_stages=1 if self.virtual_stages is None else self.virtual_stages)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(Section):
    """The memory each device may use and what is recomputed to fit it."""

    memory_budget: str | float | tuple[str | float, ...] | None = setting(None, metavar="SIZE")
    """Memory budget per device, e.g. 40GiB (one value, or one per device in Python); needs costs;
    None: unconstrained."""
    recompute: str = setting("auto", choices=("auto", *RECOMPUTE_OPTIONS))
    """Activation recomputation: auto (the planner chooses per block), none, selective or full."""

    def _check(self) -> None:
        budget = self.memory_budget
        try:
            if isinstance(budget, (list, tuple)):
                object.__setattr__(self, "memory_budget", tuple(budget))
                for i, b in enumerate(budget):
                    parse_size(b, f"memory_budget[{i}]")
            elif budget is not None:
                parse_size(budget, "memory_budget")
        except InputError as e:
            raise InputError(f"{e}; setting {_label('memory_budget')}") from None


@dataclass(frozen=True, kw_only=True)
class PlannerConfig(Section):
    """How the model is captured, costed and planned."""

    planner: str | Callable[..., Any] | None = setting(None)
    """Planner (omnibal_compile.planning.PLANNERS): ilp, dp, uniform, parameters, flops, omnibal; None: ilp when costs
    are known, else parameters."""
    solver: str = setting("auto", choices=("auto", "highs", "cbc"))
    """ILP backend: auto (HiGHS if installed, else CBC), highs or cbc."""
    solver_time_limit: float | None = setting(60.0, above=0)
    """Seconds the ILP solver may take; None: no limit."""
    costs: str | None = setting(None, metavar="FILE")
    """A CostTable JSON to use instead of costing the blocks (not together with device in optimize())."""
    cost_cache: str | None = setting(None, metavar="FILE")
    """JSON file caching profiled block costs."""
    refresh_costs: bool = setting(False)
    """Profile again instead of reading cached costs."""
    meta: bool = setting(False)
    """hf: models: build the model and example batch on the meta device in bf16 (no weights; cost with a roofline
    device such as a100-80gb)."""
    capture_method: str = setting("export", choices=("export", "fx"))
    """export (torch.export, non-strict) or fx (symbolic_trace)."""
    block_prefixes: tuple[str, ...] | None = setting(None, metavar="PREFIX")
    """Module paths that each form one block, overriding the default grouping."""

    def _check(self) -> None:
        if self.planner is not None and not isinstance(self.planner, str) and not callable(self.planner):
            raise InputError(f"{_label('planner')} must be a planner name or a callable (BlockGraph, S) -> Plan, "
                             f"got {self.planner!r}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    """The training loop's optimizer and loss."""

    steps: int | None = setting(None, min=1)
    """Training steps (a resumed run counts the steps done before); None: those of epochs, else 5."""
    epochs: int | None = setting(None, min=1)
    """With lengths or dataset, instead of steps: train every sample this many times (the last step's missing packs
    are empty rows)."""
    optimizer: str = setting("adamw", choices=("adamw", "sgd"))
    """adamw or sgd."""
    lr: float = setting(1e-3, above=0)
    """Learning rate (the peak, after warm-up)."""
    lr_schedule: str = setting("constant", choices=LR_SCHEDULES)
    """Learning rate after warm-up: constant, or linear / cosine decay to min_lr over the rest of steps."""
    warmup_steps: int = setting(0, min=0)
    """Linear learning-rate warm-up: step k < warmup_steps uses lr x (k + 1) / warmup_steps (0: none)."""
    min_lr: float = setting(0.0, min=0)
    """Floor of the linear and cosine decay (at most lr)."""
    weight_decay: float = setting(0.0, min=0)
    """Weight decay (AdamW's decoupled one; sgd's adds it to the gradient); biases, norm weights (1-D parameters)
    and embeddings get none."""
    max_grad_norm: float | None = setting(None, min=0)
    """Clip the gradients to this global norm over every stage, rank and shard; None or 0: no clipping (the norm is
    logged either way)."""
    weighting: str = setting("tokens", choices=("tokens", "rows"))
    """How micro-batch losses combine: tokens (mean over labelled tokens) or rows."""

    def _check(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise InputError(f"give {_label('steps')} or {_label('epochs')}, not both: epochs counts the steps itself")
        if self.min_lr > self.lr:
            raise InputError(f"{_label('min_lr')} is {self.min_lr:g}, above lr ({flag_name('lr')}) {self.lr:g}: "
                             "the decay ends at min_lr, so give min_lr <= lr")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    """Where checkpoints go and which one a run continues from."""

    save: str | None = setting(None, metavar="DIR")
    """Checkpoint root: step-<K> folders are written here after the last step (and every save_every); locked
    for the run."""
    save_every: int = setting(0, min=0)
    """Also save every this many steps (0: only at the end)."""
    resume: str | None = setting(None, metavar="DIR")
    """Checkpoint root (its newest complete step folder) or step folder to continue from; steps counts all steps."""
    export_hf: str | None = setting(None, metavar="DIR")
    """With save: after each save, rank 0 writes the saved step's model here as a Hugging Face folder (replacing the
    previous export), from_pretrained loadable."""


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig(Section):
    """How the training ranks are started and what they record."""

    plan: str | None = setting(None, metavar="FILE")
    """Plan JSON (Plan.to_json, or `omnibal-compile demo --save-plan`): run trains with it, optimize() uses it instead
    of planning."""
    nproc: int | None = setting(None, min=1)
    """Processes; None: dp x the plan's pipeline ranks."""
    threads: int = setting(1, min=1)
    """torch threads per rank."""
    log: str | None = setting(None, metavar="PATH")
    """JSON-lines file for per-step loss and time, and eval_data's evaluations ("record": "eval"), appended to (a
    resumed run continues it; written by the rank holding the last stage)."""
    memory_steps: tuple[int, ...] = setting(factory=tuple, min=0, metavar="STEP")
    """Steps in which every rank measures its peak live tensor bytes; empty: no accounting (it costs Python work on
    every op)."""
    timeout: float | None = setting(None, above=0, metavar="SECONDS")
    """End every rank after this many seconds in all; None: no limit."""
    collective_timeout: float = setting(600.0, above=0, metavar="SECONDS")
    """Seconds a rank waits in one collective (start-up included) before it fails, so a frozen rank ends the run."""
    apply_recompute: bool = setting(True)
    """run: apply the plan's recompute options (false: keep every activation)."""
    compile: bool = setting(False)
    """run: compile each stage module with torch.compile (inductor; on CPU it needs a C++ compiler); false: eager."""
    peak_flops: float | None = setting(None, above=0, metavar="FLOP/S")
    """Peak FLOP/s of one device, for the logged MFU; None: the datasheet bf16 figure of an A100, H100 or H200, and no
    MFU on other devices."""
    tensorboard: str | None = setting(None, metavar="DIR")
    """Also write the per-step figures as TensorBoard scalars to this folder (needs the tensorboard package)."""


@dataclass(frozen=True, kw_only=True)
class OutputConfig(Section):
    """What the plan command writes."""

    out: str = setting("omnibal-plan", metavar="DIR")
    """Output folder of the plan command."""
    pictures: bool = setting(True)
    """Draw the pictures (needs matplotlib); false: JSON and text only."""


SECTIONS: tuple[type[Section], ...] = (
    ModelConfig, DataConfig, LayoutConfig, ParallelConfig, ScheduleConfig, MemoryConfig, PlannerConfig,
    OptimizerConfig, CheckpointConfig, RuntimeConfig, OutputConfig,
)


def _section_of() -> dict[str, type[Section]]:
    owner: dict[str, type[Section]] = {}
    for sec in SECTIONS:
        for name in sec.names():
            if name in owner:
                raise AssertionError(f"field {name} is in both {owner[name].__name__} and {sec.__name__}")
            owner[name] = sec
    return owner


SECTION_OF: dict[str, type[Section]] = _section_of()
"""Field name -> the section that holds it (names are unique across sections)."""


@dataclass(frozen=True, kw_only=True)
class Config(OutputConfig, RuntimeConfig, CheckpointConfig, OptimizerConfig, PlannerConfig, MemoryConfig,
             ScheduleConfig, ParallelConfig, LayoutConfig, DataConfig, ModelConfig):
    """Every section together: ``Config(num_stages=4, memory_budget="20GiB")``; ``config.section(ScheduleConfig)``."""

    sections: ClassVar[tuple[type[Section], ...]] = SECTIONS

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        return cls(**load_config_file(path, cls))


def find_field(name: str, within: type[Section] = Config) -> type[Section]:
    """The section holding field ``name`` (among ``within``'s fields), or an InputError naming the closest one."""
    names = within.names()
    if name in names:
        return SECTION_OF.get(name, within)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r} ({flag_name(close[0])})?" if close else ""
    raise InputError(f"unknown setting {name!r}{hint} (the settings are the fields of omnibal_compile.config."
                     f"{within.__name__})")


def iter_fields(cls: type[Section]) -> Iterator[dataclasses.Field[Any]]:
    yield from dataclasses.fields(cls)


def _toml_loads() -> Callable[[str], Any]:
    """``tomllib.loads`` (Python 3.11+), or ``tomli``'s on 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads
    try:
        import tomli  # a dependency on Python 3.10
    except ModuleNotFoundError:
        raise InputError("reading a .toml config file on Python 3.10 needs tomli (pip install tomli), "
                         "or give the settings as a .json file") from None
    return tomli.loads


def load_config_file(path: str | Path, within: type[Section] = Config) -> dict[str, Any]:
    """The settings of a TOML (``.toml``) or JSON file: flat ``name = value`` keys, or tables named after the
    sections (``[schedule]`` for ScheduleConfig). An unknown key is an InputError naming the closest field."""
    p = Path(path)
    text = read_text(p, "config file (--config)", hint="give a .toml or .json file of settings")
    toml = p.suffix.lower() == ".toml"
    loads: Callable[[str], Any] = _toml_loads() if toml else json.loads
    try:
        data = loads(text)
    except ValueError as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise InputError(f"config file {str(p)!r} is not valid {'TOML' if toml else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"config file {str(p)!r} must hold a table (an object) of settings, got {type(data).__name__}")
    tables = {sec.__name__.removesuffix("Config").lower(): sec for sec in SECTIONS}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        # a section table (a field value is never a table), or one flat setting
        items = value.items() if key in tables and isinstance(value, dict) else [(key, value)]
        for name, v in items:
            try:
                find_field(name, within)
            except InputError as e:
                raise InputError(f"config file {str(p)!r}: {e}") from None
            flat[name] = tuple(v) if isinstance(v, list) else v
    return flat
