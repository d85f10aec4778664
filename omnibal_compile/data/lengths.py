"""Length statistics of a vision-language dataset: how many tiles and tokens each sample has.

Glossary:
    tiles        ``vit_num``: image crops the sample sends through the vision encoder (a text-only
                 sample may carry one dummy tile).
    tokens       ``token_num``: the sample's full LLM length, image placeholder tokens included.
    image flags  ``image_flags``: how many of the tiles are real images (the rest are dummies);
                 each real tile contributes ``tokens_per_tile`` of the sample's tokens.
    source units the published statistics are in InternVL units: 448 px tiles that become 256 LLM
                 tokens each. :func:`scale_lengths` converts them for a model with fewer tokens per
                 tile (such as the tiny reference VLM).
    header       a file's first record, ``{"units": ...}``, says what its counts are in
                 (:class:`LengthHeader`): ``internvl`` (InternVL's tiling, ``tokens_per_tile`` image
                 tokens per tile) or ``model`` (measured by one model's own processor: taken as is, by
                 that model only). JSON: the list's first object; JSON Lines: the first line; CSV: a
                 first line ``# {...}`` (``#`` then the JSON object) above the column names. A file
                 without one (the published statistics, files written before headers) is in InternVL
                 units, ``source_tokens_per_tile`` tokens per tile.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile._utils.validate import check_int, json_records, read_text
from omnibal_compile.errors import InputError

__all__ = ["LengthStats", "LengthHeader", "UNITS", "load_lengths", "save_lengths", "scale_lengths",
           "bundled_length_files", "INTERNVL_TOKENS_PER_TILE", "MAX_SAMPLE_LENGTH"]

_BUNDLED = Path(__file__).resolve().parent / "stats"

INTERNVL_TOKENS_PER_TILE = 256
"""Image tokens per tile in the published statistics (InternViT 448 px, pixel shuffle 0.5)."""

_FIELDS = ("vit_num", "token_num", "image_flags")

UNITS = ("internvl", "model")
"""What a length file's counts are in (its header's ``units``)."""


@dataclass(frozen=True, kw_only=True)
class LengthHeader:
    """A length file's header record: what its counts are in, and what they were measured on."""

    units: str
    """``internvl`` (InternVL's tiling, ``tokens_per_tile`` tokens per tile) or ``model`` (one model's own units)."""
    tokens_per_tile: int | None = None
    """internvl: image tokens each tile was counted as."""
    model_type: str | None = None
    """model: the Hugging Face ``model_type`` whose processor measured the samples."""
    image_token_id: int | None = None
    """model: that model's image placeholder id (None: a text-only model)."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The rest of the header, as written (processor, model, dataset, dataset_sha256, tiling, ...): not checked."""

    def __post_init__(self) -> None:
        if self.units not in UNITS:
            raise InputError(f"length header: units must be one of {list(UNITS)}, got {self.units!r}")
        if self.units == "internvl":
            tpt = check_int(self.tokens_per_tile, "length header: tokens_per_tile", min=1)
            object.__setattr__(self, "tokens_per_tile", tpt)
        elif not isinstance(self.model_type, str) or not self.model_type:
            raise InputError(f"length header: units 'model' needs a model_type string, got {self.model_type!r}")
        if self.image_token_id is not None:
            object.__setattr__(self, "image_token_id", check_int(self.image_token_id, "length header: image_token_id",
                                                                 min=0))

    @property
    def key(self) -> tuple[Any, ...]:
        """What the counts mean (two files with equal keys can be concatenated)."""
        return (self.units, self.tokens_per_tile, self.model_type, self.image_token_id)

    def describe(self) -> str:
        if self.units == "internvl":
            return f"InternVL units ({self.tokens_per_tile} tokens per tile)"
        return f"the units of a {self.model_type} model (image token {self.image_token_id})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"units": self.units}
        for name in ("tokens_per_tile", "model_type", "image_token_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return {**out, **{k: v for k, v in self.info.items() if k not in out}}

    @classmethod
    def from_json(cls, value: Any, where: str) -> LengthHeader:
        if not isinstance(value, dict):
            raise InputError(f"{where}: the header must be a JSON object, got {type(value).__name__}")
        known = {k: value.get(k) for k in ("units", "tokens_per_tile", "model_type", "image_token_id")}
        try:
            return cls(**known, info={k: v for k, v in value.items() if k not in known})  # type: ignore[arg-type]
        except InputError as e:
            raise InputError(f"{where}: {e}") from None


def _is_header(rec: Any) -> bool:
    return isinstance(rec, dict) and "units" in rec and "vit_num" not in rec

MAX_SAMPLE_LENGTH = 2**24
"""Most tiles or tokens one sample may have (16.8M): far beyond any real sample, and small enough
that sums and squares over a dataset stay exact in int64. Larger values are corrupt statistics."""


@dataclass(frozen=True, kw_only=True, eq=False)
class LengthStats:
    """Per-sample lengths of a dataset, as int64 arrays of equal length (index = sample id)."""

    tiles: np.ndarray
    """Tiles per sample (``vit_num``)."""
    tokens: np.ndarray
    """LLM tokens per sample, image tokens included (``token_num``)."""
    image_flags: np.ndarray
    """Real (non-dummy) tiles per sample; equals ``tiles`` when the source has no such field."""
    source: str = "arrays"
    """Where the statistics came from (file names), for messages."""
    header: LengthHeader | None = None
    """What the counts are in (the file's header record); None: no header, InternVL units (module glossary)."""

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("tiles", "tokens", "image_flags"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1:
                raise InputError(f"{self.source}: {name} must be one-dimensional, got shape {a.shape}")
            if (
                a.size
                and not np.issubdtype(a.dtype, np.integer)
                and (not np.issubdtype(a.dtype, np.floating) or not np.all(np.isfinite(a)) or np.any(a != np.round(a)))
            ):
                bad = _first_bad(a, lambda x: not float(x).is_integer())
                raise InputError(f"{self.source}: {name}[{bad}] = {a[bad]!r} is not an integer")
            if a.size and (a.min() < 0 or a.max() > MAX_SAMPLE_LENGTH):
                bad = int(np.argmax((a < 0) | (a > MAX_SAMPLE_LENGTH)))
                what = "is negative" if a[bad] < 0 else f"is over {MAX_SAMPLE_LENGTH:,}, the most one sample may have"
                raise InputError(f"{self.source}: {name}[{bad}] = {a[bad].item()!r} {what}; check the statistics")
            a = a.astype(np.int64)
            a.setflags(write=False)
            arrays[name] = a
        n = {k: v.size for k, v in arrays.items()}
        if len(set(n.values())) != 1:
            raise InputError(f"{self.source}: tiles, tokens and image_flags differ in length: {n}")
        if arrays["tokens"].size == 0:
            raise InputError(f"{self.source}: no samples; give at least one")
        if arrays["tokens"].min() < 1:
            bad = int(np.argmax(arrays["tokens"] < 1))
            raise InputError(f"{self.source}: tokens[{bad}] = 0: every sample has at least one token (token_num counts "
                             "its image tokens too); drop empty samples from the statistics")
        over = arrays["image_flags"] > arrays["tiles"]
        if over.any():
            bad = int(np.argmax(over))
            raise InputError(
                f"{self.source}: record {bad}: image_flags {arrays['image_flags'][bad]} > vit_num "
                f"{arrays['tiles'][bad]}"
            )
        for k, v in arrays.items():
            object.__setattr__(self, k, v)

    def __len__(self) -> int:
        return int(self.tokens.size)

    @functools.cached_property
    def digest(self) -> str:
        """A fingerprint of the lengths (equal digests: the same samples in the same order)."""
        h = hashlib.sha256()
        for a in (self.tiles, self.tokens, self.image_flags):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
            h.update(b"|")
        return h.hexdigest()[:16]

    @classmethod
    def from_arrays(cls, tiles: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    image_flags: Sequence[int] | np.ndarray | None = None, *, source: str = "arrays") -> LengthStats:
        """Two (or three) arrays from Python; ``image_flags`` defaults to ``tiles``."""
        t = np.asarray(tiles)
        return cls(
            tiles=t,
            tokens=np.asarray(tokens),
            image_flags=t if image_flags is None else np.asarray(image_flags),
            source=source,
        )

    @classmethod
    def concat(cls, parts: Sequence[LengthStats]) -> LengthStats:
        """Several datasets as one; sample ids follow the order of ``parts``."""
        if not parts:
            raise InputError("no length statistics to concatenate")
        keys = {None if p.header is None else p.header.key for p in parts}
        if len(keys) > 1:
            said = "; ".join(f"{p.source}: {'no header (InternVL units)' if p.header is None else p.header.describe()}"
                             for p in parts)
            raise InputError(f"the length files are in different units ({said}): measure them the same way "
                             "(omnibal-compile lengths with the same --model, or the same --tokenizer options)")
        return cls(
            tiles=np.concatenate([p.tiles for p in parts]),
            tokens=np.concatenate([p.tokens for p in parts]),
            image_flags=np.concatenate([p.image_flags for p in parts]),
            source=" + ".join(p.source for p in parts),
            header=parts[0].header,
        )

    def resample(self, n: int, *, seed: int = 0) -> LengthStats:
        """``n`` samples drawn with replacement (scale tests on a bigger set from the same distribution)."""
        idx = np.random.default_rng(seed).integers(0, len(self), size=n)
        return LengthStats(tiles=self.tiles[idx], tokens=self.tokens[idx], image_flags=self.image_flags[idx],
                           source=f"{n} draws from {self.source}", header=self.header)

    def subset(self, idx: np.ndarray) -> LengthStats:
        return LengthStats(tiles=self.tiles[idx], tokens=self.tokens[idx], image_flags=self.image_flags[idx],
                           source=self.source, header=self.header)


def _first_bad(a: np.ndarray, pred: Any) -> int:
    for i, x in enumerate(a.tolist()):
        if pred(x):
            return i
    return 0


def _check_value(value: Any, where: str, field: str, *, text: bool = False, low: int = 0) -> int:
    """One count of a record, at least ``low``; ``text``: the value comes from a CSV cell (a string)."""
    if text and isinstance(value, str):
        try:
            value = float(value.strip()) if value.strip() else value
        except ValueError:
            pass  # refused below, with the cell's text
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value < 0:
        raise InputError(f"{where}: field '{field}' = {value!r} is negative")
    return check_int(value, f"{where}: field '{field}'", min=low, max=MAX_SAMPLE_LENGTH,
                     hint="a count of tiles or tokens (a larger one is corrupt statistics)")


def _records_to_stats(records: Iterable[tuple[str, Any]], source: str, *, text: bool = False,
                      header: LengthHeader | None = None) -> LengthStats:
    """``text``: records are CSV rows (string cells; a row shorter or longer than the header is an error)."""
    tiles: list[int] = []
    tokens: list[int] = []
    flags: list[int] = []
    for where, rec in records:
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected an object with fields {list(_FIELDS)}, got {type(rec).__name__}")
        if _is_header(rec):
            raise InputError(f"{where}: a header record ('units') belongs first in the file, before every record")
        if text:  # csv.DictReader: None for a column the row lacks, key None for values past the header
            if None in rec:
                raise InputError(f"{where}: {len(rec[None])} value(s) beyond the header's columns; "
                                 "each row needs one value per header column")
            short = [k for k, v in rec.items() if v is None]
            if short:
                raise InputError(f"{where}: no value in column '{short[0]}' (the row is shorter than the header); "
                                 "each row needs one value per header column")
        for f in ("vit_num", "token_num"):
            if f not in rec or rec[f] is None or rec[f] == "":
                raise InputError(f"{where}: missing field '{f}' (each record needs vit_num and token_num)")
        v = _check_value(rec["vit_num"], where, "vit_num", text=text)
        t = _check_value(rec["token_num"], where, "token_num", text=text, low=1)  # image tokens count too
        # The OmniBal README spells it image_flag, the published files image_flags.
        key = "image_flags" if "image_flags" in rec else "image_flag" if "image_flag" in rec else None
        if key is not None and rec[key] is None:
            raise InputError(
                f"{where}: field '{key}' is null; give a count, or leave the field out (then it is vit_num)"
            )
        fl = v if key is None else _check_value(rec[key], where, key, text=text)
        if fl > v:
            raise InputError(f"{where}: field '{key}' = {fl} exceeds vit_num = {v}")
        tiles.append(v)
        tokens.append(t)
        flags.append(fl)
    if not tokens:
        raise InputError(f"{source}: empty file; it must hold at least one record")
    return LengthStats(tiles=np.array(tiles, np.int64), tokens=np.array(tokens, np.int64),
                       image_flags=np.array(flags, np.int64), source=source, header=header)


def _load_file(path: Path) -> LengthStats:
    name = str(path)
    suffix = path.suffix.lower()
    text = read_text(path, "length statistics file")
    if not text.strip():
        raise InputError(f"{name}: empty file; it must hold at least one record")
    if suffix == ".csv":
        lines = text.splitlines()
        header = None
        if lines and lines[0].startswith("#"):  # the header record: '# {"units": ...}'
            try:
                value = json.loads(lines[0][1:])
            except ValueError as e:
                raise InputError(f"{name} line 1: a '#' line holds the header, a JSON object ({e})") from None
            header = LengthHeader.from_json(value, f"{name} line 1")
            lines = lines[1:]
        reader = csv.DictReader(lines)
        missing = [k for k in ("vit_num", "token_num") if k not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{name}: CSV header {reader.fieldnames} lacks column(s) {missing}")
        # The column names are line 1 (2 under a header record), so record i sits on line i + 2 (i + 3).
        first = 2 + (header is not None)
        rows = ((f"{name} record {i} (line {i + first})", r) for i, r in enumerate(reader))
        return _records_to_stats(rows, name, text=True, header=header)
    records = json_records(
        text,
        name,
        lines=suffix in (".jsonl", ".ndjson"),
        expected='records like {"vit_num": 5, "token_num": 1420, "image_flags": 5} (or use .csv for CSV)',
    )
    if records and _is_header(records[0][1]):
        where, value = records[0]
        header = LengthHeader.from_json(value, f"{where} (the header)")
        # record i of the samples, as without a header (the line numbers stay the file's)
        rest = [(re.sub(r"record \d+", f"record {i}", w, count=1), r) for i, (w, r) in enumerate(records[1:])]
        return _records_to_stats(rest, name, header=header)
    return _records_to_stats(records, name)


def load_lengths(lengths: Any) -> LengthStats:
    """Length statistics from a :class:`LengthStats`, one or more files, or a ``(tiles, tokens)`` pair.

    Files: OmniBal JSON (a list of ``{"vit_num", "token_num", "image_flags"}``), JSON Lines
    (``.jsonl``) or CSV (``.csv``) with the same fields; several files are concatenated in order.
    """
    if isinstance(lengths, LengthStats):
        return lengths
    if isinstance(lengths, (str, os.PathLike)):
        return _load_file(Path(lengths))
    if isinstance(lengths, tuple) and len(lengths) in (2, 3) and all(
        isinstance(a, (np.ndarray, list)) for a in lengths
    ):
        return LengthStats.from_arrays(*lengths)
    if isinstance(lengths, (list, tuple)) and lengths and all(isinstance(p, (str, os.PathLike)) for p in lengths):
        return LengthStats.concat([_load_file(Path(p)) for p in lengths])
    raise InputError(
        f"cannot read length statistics from {type(lengths).__name__}; give a LengthStats, a file path "
        "(.json, .jsonl, .csv), a list of paths, or a (tiles, tokens) pair of arrays"
    )


def check_length_file(path: str | os.PathLike[str]) -> str:
    """The format (suffix) :func:`save_lengths` would write ``path`` in; raises if it cannot write there."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".jsonl", ".ndjson", ".csv"):
        raise InputError(f"{p}: cannot tell the format from the suffix {suffix!r}; use .json, .jsonl or .csv")
    if not p.parent.is_dir():
        raise InputError(f"{p}: folder {p.parent} does not exist; create it first")
    return suffix


def save_lengths(stats: LengthStats, path: str | os.PathLike[str]) -> Path:
    """Write ``stats`` in the format :func:`load_lengths` reads, chosen by suffix: ``.json`` (OmniBal's
    list of records), ``.jsonl`` or ``.csv``, its header (``stats.header``) first when it has one (module
    glossary). Returns the path written."""
    p = Path(path)
    suffix = check_length_file(p)
    rows = zip(stats.tiles.tolist(), stats.tokens.tolist(), stats.image_flags.tolist())
    head = None if stats.header is None else json.dumps(stats.header.to_json())
    if suffix == ".csv":
        text = ("" if head is None else f"# {head}\n") + ",".join(_FIELDS) + "\n" + "".join(
            f"{v},{t},{f}\n" for v, t, f in rows)
    else:
        lines = ([] if head is None else [head]) + [json.dumps(dict(zip(_FIELDS, r))) for r in rows]
        text = "\n".join(lines) + "\n" if suffix != ".json" else "[\n" + ",\n".join(lines) + "\n]\n"
    atomic_write_text(p, text)  # a full disk or a kill leaves the old file as it was
    return p


def scale_lengths(stats: LengthStats, *, tokens_per_tile: int, source_tokens_per_tile: int = INTERNVL_TOKENS_PER_TILE,
                  text_scale: float | None = None, min_text_tokens: int = 2) -> LengthStats:
    """Convert statistics measured for one model's tile size to another's.

    Each sample's tokens split into image tokens (``image_flags * source_tokens_per_tile``) and text
    tokens (the rest). Image tokens become ``image_flags * tokens_per_tile``; text tokens are
    multiplied by ``text_scale`` (default ``tokens_per_tile / source_tokens_per_tile``, which keeps
    the image/text ratio of every sample, so balancing decisions carry over), rounded up and kept
    at least ``min_text_tokens`` (a sample needs two tokens for a next-token loss). Tiles are
    unchanged.
    """
    if tokens_per_tile < 1 or source_tokens_per_tile < 1:
        raise InputError("tokens_per_tile and source_tokens_per_tile must be >= 1")
    scale = tokens_per_tile / source_tokens_per_tile if text_scale is None else float(text_scale)
    if scale <= 0:
        raise InputError(f"text_scale must be positive, got {scale}")
    text = stats.tokens - stats.image_flags * source_tokens_per_tile
    if text.min() < 0:
        bad = int(np.argmax(text < 0))
        raise InputError(
            f"{stats.source}: record {bad} has {stats.tokens[bad]} tokens, fewer than its {stats.image_flags[bad]} "
            f"image tiles x {source_tokens_per_tile}; is source_tokens_per_tile right? (a file measured in a model's "
            "own units: measure it again with omnibal-compile lengths DATA --model hf:DIR, whose header says so)"
        )
    new_text = np.maximum(np.ceil(text * scale).astype(np.int64), min_text_tokens)
    return LengthStats(
        tiles=stats.tiles,
        tokens=new_text + stats.image_flags * tokens_per_tile,
        image_flags=stats.image_flags,
        source=f"{stats.source} (scaled to {tokens_per_tile} tokens/tile)",
    )


def bundled_length_files() -> list[Path]:
    """The real length statistics shipped with the package (ai2d 12k + chartqa 18k; see ``data/stats/README.md``)."""
    files = sorted(_BUNDLED.glob("*.json"))
    if not files:
        raise InputError(f"the bundled length statistics are missing from {_BUNDLED}; reinstall omnibal-compile")
    return files
