"""``omnibal-compile lengths DATA --model hf:DIR --out lengths.json`` (the model's own units) or ``--tokenizer DIR``
(InternVL's tiling): length statistics of a LLaVA-style dataset."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnibal_compile._utils.files import atomic_write_text, same_file
from omnibal_compile._utils.validate import int_option

if TYPE_CHECKING:
    from omnibal_compile.data.dataset_lengths import DatasetLengths

NAME = "lengths"
HELP = ("measure tiles and tokens per sample of a LLaVA-style dataset (.json/.jsonl: image paths and conversations) "
        "and write OmniBal's length file, in a model's own units (--model) or InternVL's (--tokenizer)")

INTERNVL_OPTIONS = {"min_tiles": 1, "max_tiles": 12, "tile_size": 448, "thumbnail": True, "tokens_per_tile": 256,
                    "image_marker_tokens": 0, "dummy_tile": False, "confine_to_image_root": False}
"""The options of InternVL units (--tokenizer) and their defaults; with --model the processor decides these."""

_SHOW_SKIPPED = 5


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "yes", "true", "1"):
        return True
    if text.lower() in ("off", "no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", metavar="DATA", help="dataset file: a JSON list or JSON Lines (.jsonl) of records with "
                   "'image' (a path or a list of paths; absent for text-only) and 'conversations'")
    p.add_argument("--model", default=None, metavar="hf:DIR",
                   help="measure in this Hugging Face model's units (hf:DIR or hf:ClassName:config.json): each sample "
                        "as its processor makes it (image tokens, chat template), as run --dataset does; plan and run "
                        "take the file as it is with this model")
    p.add_argument("--processor", default=None, metavar="DIR",
                   help="with --model: the processor folder (default: the model's folder)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="InternVL units instead: local Hugging Face tokenizer folder (its chat template applied when "
                        "it has one), images tiled as InternVL does")
    p.add_argument("--out", required=True, metavar="PATH", help="length file to write (.json, .jsonl or .csv)")
    p.add_argument("--image-root", default=None, metavar="DIR",
                   help="folder image paths are relative to (default: the data file's folder)")
    internvl = "; InternVL units (--tokenizer) only"
    p.add_argument("--confine-to-image-root", action="store_true", default=None,
                   help="treat an image path that resolves outside the image root (absolute, '..', a symbolic link) "
                        "as unreadable" + internvl)
    p.add_argument("--min-tiles", type=int_option(min=1), metavar="N", default=None,
                   help="fewest tiles per image, thumbnail not counted (default 1)" + internvl)
    p.add_argument("--max-tiles", type=int_option(min=1), metavar="N", default=None,
                   help="most tiles per image, thumbnail not counted; shared among a record's images (default 12)"
                        + internvl)
    p.add_argument("--tile-size", type=int_option(min=1), metavar="N", default=None,
                   help="tile side in pixels (default 448)" + internvl)
    p.add_argument("--thumbnail", type=_on_off, default=None, metavar="on|off",
                   help="add a whole-image tile when an image has more than one tile (default on)" + internvl)
    p.add_argument("--tokens-per-tile", type=int_option(min=1), metavar="N", default=None,
                   help="LLM tokens each tile becomes (default 256, InternVL's 448 px tiles)" + internvl)
    p.add_argument("--image-marker-tokens", type=int_option(min=0), metavar="N", default=None,
                   help="extra tokens around each image, such as InternVL's <img> and </img> (default 0)" + internvl)
    p.add_argument("--dummy-tile", action="store_true", default=None,
                   help="give text-only samples one dummy tile (vit_num 1, image_flags 0), as InternVL does" + internvl)
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="a record whose image is missing or unreadable: leave it out and report it (default), or stop")
    p.add_argument("--skipped-out", default=None, metavar="PATH",
                   help="also write the left-out records as JSON Lines (record index, image, reason)")
    p.add_argument("--workers", type=int_option(min=1), metavar="N", default=None,
                   help="processes measuring records in parallel (default: the CPUs available, at most 8; --model: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.data.lengths import check_length_file, save_lengths

    started = time.perf_counter()
    _check_sources(args)
    check_length_file(args.out)  # before the work, not after it
    _check_outputs(args)
    result = _model_lengths(args) if args.model else _internvl_lengths(args)
    out = save_lengths(result.stats, args.out)
    if args.skipped_out:
        atomic_write_text(args.skipped_out, "".join(
            json.dumps({"record": s.record, "image": s.image, "reason": s.reason}) + "\n" for s in result.skipped))
    print(format_summary(result, skipped_out=args.skipped_out))
    assert result.stats.header is not None
    print(f"wrote {out} ({len(result.stats):,} samples, {result.stats.header.describe()}) in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


def _check_sources(args: argparse.Namespace) -> None:
    """One of --model and --tokenizer; the options of the other kind of units are not given."""
    from omnibal_compile.errors import InputError

    if (args.model is None) == (args.tokenizer is None):
        raise InputError("give --model hf:DIR (lengths in the model's own units, as plan and run --dataset see them) "
                         "or --tokenizer DIR (InternVL's tiling and tokens per tile), not " +
                         ("both" if args.model else "neither"))
    if args.model is None:
        if args.processor is not None:
            raise InputError("--processor goes with --model (the processor that reads the dataset); with --tokenizer "
                             "the images are tiled as InternVL does")
        return
    given = [f"--{k.replace('_', '-')}" for k in INTERNVL_OPTIONS if getattr(args, k) is not None]
    if args.workers not in (None, 1):
        given.append("--workers")
    if given:
        raise InputError(f"{', '.join(given)} apply to InternVL units (--tokenizer); with --model the model's "
                         f"processor decides the images' tokens and the samples are measured in this process: drop "
                         f"{'it' if len(given) == 1 else 'them'}")


def _internvl_lengths(args: argparse.Namespace) -> DatasetLengths:
    from omnibal_compile.data.dataset_lengths import TilingOptions, dataset_lengths, default_workers

    o: dict[str, Any] = {k: default if getattr(args, k) is None else getattr(args, k)
                         for k, default in INTERNVL_OPTIONS.items()}
    tiling = TilingOptions(min_tiles=o["min_tiles"], max_tiles=o["max_tiles"], tile_size=o["tile_size"],
                           thumbnail=bool(o["thumbnail"]))
    return dataset_lengths(args.data, tokenizer=args.tokenizer, image_root=args.image_root, tiling=tiling,
                           tokens_per_tile=o["tokens_per_tile"], image_marker_tokens=o["image_marker_tokens"],
                           dummy_tile=bool(o["dummy_tile"]), on_error=args.on_error, progress=not args.no_progress,
                           confine_to_root=bool(o["confine_to_image_root"]),
                           workers=default_workers() if args.workers is None else args.workers)


def _model_lengths(args: argparse.Namespace) -> DatasetLengths:
    """The samples as ``run --dataset`` measures them (``ConversationDataset.lengths``), with a header naming the
    model's family and image token, which plan and run check."""
    import dataclasses
    from types import SimpleNamespace

    import numpy as np

    from omnibal_compile._utils.files import file_sha256
    from omnibal_compile.data.dataset_lengths import DatasetLengths, SkippedRecord, _image_paths
    from omnibal_compile.data.lengths import LengthHeader
    from omnibal_compile.models.load import hf_data_facts, load_hf_config
    from omnibal_compile.runtime.batches import conversation_dataset

    config = load_hf_config(args.model)
    facts = hf_data_facts(SimpleNamespace(config=config))  # type: ignore[arg-type]  # what run's data pass reads
    dataset, folder = conversation_dataset(args.data, model=args.model, processor=args.processor,
                                           image_root=args.image_root, skip_bad=args.on_error == "skip", facts=facts)
    stats = dataset.lengths(progress=not args.no_progress)
    header = LengthHeader(units="model", model_type=str(config.model_type), image_token_id=facts.get("image_token_id"),
                          info={"model": args.model, "processor": folder, "dataset": str(args.data),
                                "dataset_sha256": file_sha256(args.data)})
    images = sum(len(_image_paths(*dataset.records[r])) for r in dataset.kept)
    return DatasetLengths(stats=dataclasses.replace(stats, header=header), record_ids=np.asarray(dataset.kept),
                          skipped=tuple(SkippedRecord(record=r, image="", reason=why) for r, why in dataset.skipped),
                          records=len(dataset.records), text_only=int(np.sum(stats.image_flags == 0)), images=images)


def _check_outputs(args: argparse.Namespace) -> None:
    """--out and --skipped-out are neither the dataset nor each other, and --skipped-out's folder exists."""
    from omnibal_compile.errors import InputError

    named = [("--out", args.out)] + ([("--skipped-out", args.skipped_out)] if args.skipped_out else [])
    for i, (flag, path) in enumerate(named):
        if same_file(path, args.data):
            raise InputError(f"{flag} {path} is the dataset DATA itself: writing it would overwrite the dataset; "
                             "give another path")
        for other_flag, other in named[:i]:
            if same_file(path, other):
                raise InputError(f"{flag} {path} is also {other_flag}: one would overwrite the other; "
                                 "give two paths")
    if args.skipped_out and not Path(args.skipped_out).resolve().parent.is_dir():
        raise InputError(f"--skipped-out {args.skipped_out}: folder {Path(args.skipped_out).parent} does not exist; "
                         "create it first")


def format_summary(result: DatasetLengths, *, skipped_out: str | None = None) -> str:
    """Per-kind sample counts and tile/token means and maxima, then the left-out records."""
    import numpy as np

    from omnibal_compile._utils.tables import format_table

    stats = result.stats
    rows = [["samples", "count", "mean tiles", "max tiles", "mean tokens", "max tokens"]]
    kinds = (("with images", stats.image_flags > 0), ("text-only", stats.image_flags == 0),
             ("all", np.ones(len(stats), bool)))
    for label, mask in kinds:
        if not mask.any():
            rows.append([label, "0", "-", "-", "-", "-"])
            continue
        t, k = stats.tiles[mask], stats.tokens[mask]
        rows.append([label, f"{int(mask.sum()):,}", f"{t.mean():.2f}", f"{int(t.max()):,}", f"{k.mean():,.0f}",
                     f"{int(k.max()):,}"])
    lines = [format_table(rows, "lrrrrr")]
    skipped = result.skipped
    if skipped:
        listed = f"listed in {skipped_out}" if skipped_out else "--skipped-out PATH lists them all"
        lines.append(f"left out {len(skipped):,} of {result.records:,} records whose images are missing or unreadable"
                     f"{' (or that cannot be read)' if any(not s.image for s in skipped) else ''}"
                     f"{', the first:' if len(skipped) > _SHOW_SKIPPED else ':'}")
        lines += [f"  record {s.record:,}: {f'{s.image}: ' if s.image else ''}{s.reason}"
                  for s in skipped[:_SHOW_SKIPPED]]
        lines.append(f"After the first of them, row i of the length file is not record i of the dataset ({listed}).")
    return "\n".join(lines)
