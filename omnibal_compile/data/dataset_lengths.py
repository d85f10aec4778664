"""Length statistics measured on a LLaVA-style dataset: tiles per sample and tokens per sample.

A dataset is a JSON list (or JSON Lines file) of records such as::

    {"image": "coco/0001.jpg", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                                 {"from": "gpt", "value": "A cat."}]}

``image`` is a path or a list of paths (relative to the image root); a record without one is
text-only. The result is OmniBal's length format (:mod:`.lengths`), one row per kept record, in
InternVL units (its header: ``units: internvl``, the tiling and the dataset's sha256). For lengths in
a Hugging Face model's own units (its processor's image tokens), ``omnibal-compile lengths --model``
measures with :meth:`~omnibal_compile.integrations.hf.dataset.ConversationDataset.lengths` instead.

Glossary:
    grid         (columns, rows) of tiles an image is cut into: InternVL's dynamic tiling picks,
                 among every grid with ``min_tiles <= columns * rows <= max_tiles``, the one whose
                 aspect ratio is closest to the image's (a tie goes to the larger grid when the image
                 has more than half that grid's pixels).
    thumbnail    one extra tile, the whole image scaled to one tile, added when the grid has more
                 than one tile.
    multi-image  a record with n images gives each at most ``max(1, max_tiles // n)`` tiles, as
                 InternVL's multi-image training does.
    text tokens  the conversation rendered with the tokenizer's chat template (turns joined by new
                 lines when it has none), ``<image>`` placeholders removed, then tokenized; each image
                 adds ``tiles * tokens_per_tile`` (+ ``image_marker_tokens``) tokens on top.
    header read  Pillow's ``Image.open`` reads only the file header (size, format); no pixel is
                 decoded, so an image whose pixels are damaged behind a sound header is not detected.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from omnibal_compile._utils.files import file_sha256
from omnibal_compile._utils.validate import json_records, open_regular_file, read_text
from omnibal_compile.data.lengths import INTERNVL_TOKENS_PER_TILE, LengthHeader, LengthStats
from omnibal_compile.errors import InputError
from omnibal_compile.progress import Progress

__all__ = ["TilingOptions", "SkippedRecord", "DatasetLengths", "tile_grid", "count_tiles", "read_image_size",
           "read_records", "load_tokenizer", "dataset_lengths", "default_workers", "ON_ERROR"]

ON_ERROR = ("skip", "fail")
"""What to do with a record whose image is missing or unreadable."""

IMAGE_PLACEHOLDER = "<image>"
_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
_CHUNK = 4096  # records per progress step and per tokenizer batch


@dataclass(frozen=True, kw_only=True)
class TilingOptions:
    """InternVL-style dynamic tiling (InternVL-1.5 defaults)."""

    min_tiles: int = 1
    """Fewest tiles of an image's grid (thumbnail not counted)."""
    max_tiles: int = 12
    """Most tiles of an image's grid (thumbnail not counted); divided among a record's images."""
    tile_size: int = 448
    """Tile side in pixels."""
    thumbnail: bool = True
    """Add one whole-image tile when the grid has more than one tile."""

    def __post_init__(self) -> None:
        if self.min_tiles < 1 or self.max_tiles < self.min_tiles:
            raise InputError(f"tiles must satisfy 1 <= min_tiles <= max_tiles, got min_tiles={self.min_tiles}, "
                             f"max_tiles={self.max_tiles}")
        if self.tile_size < 1:
            raise InputError(f"tile_size must be >= 1 pixel, got {self.tile_size}")


@dataclass(frozen=True, kw_only=True)
class SkippedRecord:
    """A record left out because one of its images could not be read."""

    record: int
    """Index of the record in the dataset file."""
    image: str
    """The image path as resolved (image root joined); empty when the reason says what failed (``--model``)."""
    reason: str
    """Why it could not be read, in words."""


@dataclass(frozen=True, kw_only=True, eq=False)
class DatasetLengths:
    """Lengths of a dataset's kept records, and what was left out."""

    stats: LengthStats
    """One row per kept record, in dataset order."""
    record_ids: np.ndarray
    """Dataset record index of each row of ``stats`` (differs from the row index after a skipped record)."""
    skipped: tuple[SkippedRecord, ...]
    """Records left out (``on_error="skip"``), in dataset order."""
    records: int
    """Records in the dataset file."""
    text_only: int
    """Kept records without an image."""
    images: int
    """Images of the kept records."""


@lru_cache(maxsize=64)
def _grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    # Built as InternVL builds its candidates (a set, then a stable sort by tile count), so that
    # grids with equal tile counts are visited in the same order and ties resolve the same way.
    grids = {(c, r) for n in range(min_tiles, max_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
             if min_tiles <= c * r <= max_tiles}
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(width: int, height: int, *, min_tiles: int = 1, max_tiles: int = 12,
              tile_size: int = 448) -> tuple[int, int]:
    """(columns, rows) of InternVL's dynamic tiling for a ``width`` x ``height`` image."""
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), math.inf
    for c, r in _grids(min_tiles, max_tiles):
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * c * r:
            best = (c, r)
    return best


def count_tiles(width: int, height: int, options: TilingOptions = TilingOptions(), *, images_in_record: int = 1) -> int:
    """Tiles one image sends through the vision encoder (grid plus thumbnail).

    A record with ``images_in_record`` images gives each at most ``max(1, max_tiles // images_in_record)``.
    """
    c, r = tile_grid(width, height, min_tiles=options.min_tiles,
                     max_tiles=max(1, options.max_tiles // max(1, images_in_record)), tile_size=options.tile_size)
    n = c * r
    return n + 1 if options.thumbnail and n != 1 else n


def read_image_size(path: str | os.PathLike[str], *, inside: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """(width, height) from the image file's header, without decoding pixels; raises ``OSError`` when unreadable,
    not a regular file (:func:`~omnibal_compile._utils.validate.open_regular_file`) or, with ``inside``, outside
    that folder."""
    try:
        from PIL import Image
    except ImportError:
        raise InputError("reading image sizes needs Pillow: pip install 'omnibal-compile[hf]'") from None

    try:
        with open_regular_file(path, inside=inside) as f, Image.open(f) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:  # training would refuse it too
        raise OSError(str(e)) from None
    if w < 1 or h < 1:
        raise OSError(f"image size {w}x{h} is empty")
    return int(w), int(h)


def _image_error(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return "file not found"
    if type(e).__name__ == "UnidentifiedImageError":
        return "not an image Pillow can read"
    if isinstance(e, IsADirectoryError):
        return "is a folder"
    return str(e) or type(e).__name__


def read_records(path: str | os.PathLike[str]) -> list[tuple[str, Any]]:
    """The records of a ``.json`` (a list) or ``.jsonl`` dataset file, each with a ``where`` label for messages."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"dataset file {p} does not exist")
    return json_records(read_text(p, "dataset file"), str(p), lines=p.suffix.lower() in (".jsonl", ".ndjson"),
                        expected="records with 'conversations' (and 'image')")


def _messages(where: str, rec: Any, placeholder: str) -> list[dict[str, str]]:
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected an object with 'conversations', got {type(rec).__name__}")
    turns = rec.get("conversations", rec.get("messages"))  # as ConversationDataset reads them
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: needs a non-empty 'conversations' list of {{'from': 'human'|'gpt', 'value': ...}} "
                         "(or 'messages' of role/content)")
    out = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict):
            raise InputError(f"{where}: conversations[{k}] is {type(t).__name__}, not an object")
        role = t.get("from", t.get("role"))
        value = t.get("value", t.get("content"))
        if not isinstance(role, str) or not isinstance(value, str):
            raise InputError(f"{where}: conversations[{k}] needs string fields 'from' and 'value', got {sorted(t)}")
        out.append({"role": _ROLES.get(role, role), "content": value.replace(placeholder, "")})
    return out


def _image_paths(where: str, rec: dict[str, Any]) -> list[str]:
    img = rec.get("image", rec.get("images"))
    if img is None or img == "" or img == []:
        return []
    paths = [img] if isinstance(img, str) else img
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise InputError(f"{where}: 'image' must be a path or a list of paths, got {img!r}")
    return paths


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A Hugging Face tokenizer from a local folder (``tokenizer.json`` / ``tokenizer_config.json``); no download."""
    return load_local_pretrained(path, "tokenizer", "AutoTokenizer")


def load_local_pretrained(path: str | os.PathLike[str], what: str, auto_class: str) -> Any:
    """``transformers.<auto_class>.from_pretrained`` of a local folder saved by ``save_pretrained``, never a
    download; a missing folder, a missing transformers or a folder without a ``what`` is an :class:`InputError`."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{what} folder {p} does not exist; give a local folder saved by save_pretrained")
    try:
        import transformers
    except ImportError:
        raise InputError(f"loading a {what} needs transformers: pip install 'omnibal-compile[hf]'") from None
    try:
        return getattr(transformers, auto_class).from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean the folder holds no such thing
        raise InputError(f"{what} folder {p}: cannot load a {what} from it ({type(e).__name__}: {e})") from None


class _TextCounter:
    """Token counts of whole conversations, a batch at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer encodes a batch on all cores; bypass it only if it would truncate or pad.
        usable = backend is not None and backend.truncation is None and backend.padding is None
        self.backend = backend if usable else None

    def texts(self, convs: Sequence[list[dict[str, str]]], wheres: Sequence[str]) -> list[str]:
        if not self.templated:
            return ["\n".join(m["content"] for m in c) for c in convs]
        try:
            return list(self.tokenizer.apply_chat_template(list(convs), tokenize=False))
        except Exception:  # find the record at fault, to name it
            for c, where in zip(convs, wheres):
                try:
                    self.tokenizer.apply_chat_template(c, tokenize=False)
                except Exception as e:
                    raise InputError(f"{where}: the tokenizer's chat template fails on this conversation "
                                     f"({type(e).__name__}: {e})") from None
            raise

    def count(self, convs: Sequence[list[dict[str, str]]], wheres: Sequence[str]) -> list[int]:
        if not convs:
            return []
        texts = self.texts(convs, wheres)
        # A chat template writes the special tokens (BOS, ...) itself; plain text gets the tokenizer's own.
        special = not self.templated
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [len(e) for e in encode(texts, add_special_tokens=special)]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Chunk:
    """What one chunk of consecutive records measured (arrays over the chunk's records)."""

    tiles: np.ndarray
    flags: np.ndarray
    tokens: np.ndarray
    keep: np.ndarray
    skipped: list[SkippedRecord]
    images: int


class _Measurer:
    """Measures chunks of records; one per process (each keeps its own cache of image sizes)."""

    def __init__(self, *, tokenizer: Any, root: str, tiling: TilingOptions, tokens_per_tile: int,
                 image_marker_tokens: int, dummy_tile: bool, on_error: str, placeholder: str,
                 confine_to_root: bool = False) -> None:
        self.counter = _TextCounter(tokenizer)
        self.root, self.tiling, self.on_error, self.placeholder = root, tiling, on_error, placeholder
        self.tokens_per_tile, self.image_marker_tokens = tokens_per_tile, image_marker_tokens
        self.dummy_tile = dummy_tile
        self.inside = root if confine_to_root else None
        self.sizes: dict[str, tuple[int, int] | str] = {}  # resolved path -> (w, h) or why it is unreadable

    def size(self, full: str) -> tuple[int, int] | str:
        size = self.sizes.get(full)
        if size is None:
            try:
                size = read_image_size(full, inside=self.inside)
            except OSError as e:
                size = _image_error(e)
            self.sizes[full] = size
        return size

    def __call__(self, start: int, records: Sequence[tuple[str, Any]]) -> _Chunk:
        n = len(records)
        tiles, flags, tokens = (np.zeros(n, np.int64) for _ in range(3))
        keep = np.ones(n, bool)
        skipped: list[SkippedRecord] = []
        convs, wheres, rows = [], [], []
        images = 0
        for k, (where, rec) in enumerate(records):
            msgs = _messages(where, rec, self.placeholder)
            paths = _image_paths(where, rec)
            t = 0
            for p in paths:
                full = os.path.join(self.root, p)
                size = self.size(full)
                if isinstance(size, str):
                    if self.on_error == "fail":
                        raise InputError(f"{where}: image {full}: {size}; fix the path (or --image-root), or "
                                         "pass --on-error skip to leave such records out")
                    skipped.append(SkippedRecord(record=start + k, image=full, reason=size))
                    keep[k] = False
                    break
                t += count_tiles(*size, self.tiling, images_in_record=len(paths))
            if not keep[k]:
                continue
            images += len(paths)
            tiles[k] = 1 if self.dummy_tile and not paths else t
            flags[k] = t
            tokens[k] = t * self.tokens_per_tile + len(paths) * self.image_marker_tokens
            convs.append(msgs)
            wheres.append(where)
            rows.append(k)
        tokens[rows] += np.asarray(self.counter.count(convs, wheres), np.int64)
        return _Chunk(tiles=tiles, flags=flags, tokens=tokens, keep=keep, skipped=skipped, images=images)


_WORKER: _Measurer | None = None


def _init_worker(measurer: _Measurer) -> None:
    global _WORKER
    # One process per core already: the Rust tokenizer must not start its own threads on top.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = measurer


def _work(start: int, records: Sequence[tuple[str, Any]]) -> _Chunk:
    assert _WORKER is not None
    return _WORKER(start, records)


def default_workers() -> int:
    """Worker processes used by default: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def dataset_lengths(
    data: str | os.PathLike[str],
    *,
    tokenizer: Any,
    image_root: str | os.PathLike[str] | None = None,
    tiling: TilingOptions = TilingOptions(),
    tokens_per_tile: int = INTERNVL_TOKENS_PER_TILE,
    image_marker_tokens: int = 0,
    dummy_tile: bool = False,
    on_error: str = "skip",
    placeholder: str = IMAGE_PLACEHOLDER,
    confine_to_root: bool = False,
    workers: int = 1,
    progress: bool = False,
) -> DatasetLengths:
    """Tiles and tokens of every record of a LLaVA-style ``.json``/``.jsonl`` dataset.

    ``tokenizer``: a local tokenizer folder or a loaded Hugging Face tokenizer. ``image_root``:
    where relative image paths start (default: the data file's folder). ``dummy_tile``: give
    text-only records one dummy tile (``vit_num`` 1, ``image_flags`` 0), as InternVL does.
    ``on_error``: ``"skip"`` leaves out a record whose image is missing or unreadable (listed in
    ``skipped``), ``"fail"`` raises on the first one; an image path that is not a regular file (a FIFO, a
    device) counts as unreadable. ``confine_to_root``: an image path that resolves (symbolic links
    followed) outside the image root is unreadable too. ``workers``: processes measuring chunks of
    records in parallel (1: this process only). ``progress``: show a progress bar (stderr).
    """
    if on_error not in ON_ERROR:
        raise InputError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    if tokens_per_tile < 0 or image_marker_tokens < 0:
        raise InputError("tokens_per_tile and image_marker_tokens must be >= 0")
    if workers < 1:
        raise InputError(f"workers must be >= 1, got {workers}")
    data = Path(data)
    root = str(Path(image_root) if image_root is not None else data.resolve().parent)
    if image_root is not None and not Path(root).is_dir():
        raise InputError(f"image root {root} is not a folder")
    measurer = _Measurer(
        tokenizer=load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer,
        root=root, tiling=tiling, tokens_per_tile=tokens_per_tile, image_marker_tokens=image_marker_tokens,
        dummy_tile=dummy_tile, on_error=on_error, placeholder=placeholder, confine_to_root=confine_to_root)
    records = read_records(data)
    if not records:
        raise InputError(f"{data}: no records; the dataset must hold at least one")

    starts = range(0, len(records), _CHUNK)
    chunks: list[_Chunk] = []
    with ExitStack() as stack:
        if workers > 1 and len(starts) > 1:
            # fork shares the loaded tokenizer with the workers instead of pickling it; the pool
            # starts before the progress bar, whose thread a fork should not copy.
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            pool = ProcessPoolExecutor(min(workers, len(starts)), mp_context=ctx, initializer=_init_worker,
                                       initargs=(measurer,))
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
            # The workers fork on the first submission; a parallelism setting in the environment
            # then keeps the Rust tokenizer from warning that it forked after using its threads.
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                results: Iterable[_Chunk] = pool.map(_work, starts, [records[s:s + _CHUNK] for s in starts])
            finally:
                if saved is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
        else:
            results = (measurer(s, records[s:s + _CHUNK]) for s in starts)
        bar = stack.enter_context(Progress(len(starts), enabled=progress, unit="chunk"))
        it = iter(results)
        for s in starts:
            bar.step(f"records {s + 1:,}-{min(s + _CHUNK, len(records)):,} of {len(records):,}")
            chunks.append(next(it))
    keep = np.concatenate([c.keep for c in chunks])
    skipped = [r for c in chunks for r in c.skipped]
    if not keep.any():
        raise InputError(f"{data}: every record was left out ({len(skipped)} with missing or unreadable images, "
                         f"first {skipped[0].image}: {skipped[0].reason}); is --image-root right?")
    ids = np.flatnonzero(keep)
    flags = np.concatenate([c.flags for c in chunks])[ids]
    header = LengthHeader(units="internvl", tokens_per_tile=tokens_per_tile, info={
        "image_marker_tokens": image_marker_tokens, "min_tiles": tiling.min_tiles, "max_tiles": tiling.max_tiles,
        "tile_size": tiling.tile_size, "thumbnail": tiling.thumbnail, "dummy_tile": dummy_tile,
        **({"tokenizer": str(tokenizer)} if isinstance(tokenizer, (str, os.PathLike)) else {}),
        "dataset": str(data), "dataset_sha256": file_sha256(data)})
    stats = LengthStats(tiles=np.concatenate([c.tiles for c in chunks])[ids],
                        tokens=np.concatenate([c.tokens for c in chunks])[ids], image_flags=flags, source=str(data),
                        header=header)
    return DatasetLengths(stats=stats, record_ids=ids, skipped=tuple(skipped), records=len(records),
                          text_only=int(np.sum(flags == 0)), images=sum(c.images for c in chunks))
