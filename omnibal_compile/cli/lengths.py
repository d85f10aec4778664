"""``omnibal-compile lengths DATA --tokenizer DIR --out lengths.json``: length statistics of a LLaVA-style dataset."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omnibal_compile._utils.files import atomic_write_text, same_file
from omnibal_compile._utils.validate import int_option

if TYPE_CHECKING:
    from omnibal_compile.data.dataset_lengths import DatasetLengths

NAME = "lengths"
HELP = ("measure tiles and tokens per sample of a LLaVA-style dataset (.json/.jsonl: image paths and conversations) "
        "and write OmniBal's length file")

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
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="local Hugging Face tokenizer folder; its chat template is applied when it has one")
    p.add_argument("--out", required=True, metavar="PATH", help="length file to write (.json, .jsonl or .csv)")
    p.add_argument("--image-root", default=None, metavar="DIR",
                   help="folder image paths are relative to (default: the data file's folder)")
    p.add_argument("--confine-to-image-root", action="store_true",
                   help="treat an image path that resolves outside the image root (absolute, '..', a symbolic link) "
                        "as unreadable")
    p.add_argument("--min-tiles", type=int_option(min=1), metavar="N", default=1,
                   help="fewest tiles per image, thumbnail not counted (default 1)")
    p.add_argument("--max-tiles", type=int_option(min=1), metavar="N", default=12,
                   help="most tiles per image, thumbnail not counted; shared among a record's images (default 12)")
    p.add_argument(
        "--tile-size", type=int_option(min=1), metavar="N", default=448, help="tile side in pixels (default 448)"
    )
    p.add_argument("--thumbnail", type=_on_off, default=True, metavar="on|off",
                   help="add a whole-image tile when an image has more than one tile (default on)")
    p.add_argument("--tokens-per-tile", type=int_option(min=1), metavar="N", default=256,
                   help="LLM tokens each tile becomes (default 256, InternVL's 448 px tiles)")
    p.add_argument("--image-marker-tokens", type=int_option(min=0), metavar="N", default=0,
                   help="extra tokens around each image, such as InternVL's <img> and </img> (default 0)")
    p.add_argument("--dummy-tile", action="store_true",
                   help="give text-only samples one dummy tile (vit_num 1, image_flags 0), as InternVL does")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="a record whose image is missing or unreadable: leave it out and report it (default), or stop")
    p.add_argument("--skipped-out", default=None, metavar="PATH",
                   help="also write the left-out records as JSON Lines (record index, image, reason)")
    p.add_argument("--workers", type=int_option(min=1), metavar="N", default=None,
                   help="processes measuring records in parallel (default: the CPUs available, at most 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.data.dataset_lengths import TilingOptions, dataset_lengths, default_workers
    from omnibal_compile.data.lengths import check_length_file, save_lengths

    started = time.perf_counter()
    check_length_file(args.out)  # before the work, not after it
    _check_outputs(args)
    tiling = TilingOptions(min_tiles=args.min_tiles, max_tiles=args.max_tiles, tile_size=args.tile_size,
                           thumbnail=args.thumbnail)
    result = dataset_lengths(args.data, tokenizer=args.tokenizer, image_root=args.image_root, tiling=tiling,
                             tokens_per_tile=args.tokens_per_tile, image_marker_tokens=args.image_marker_tokens,
                             dummy_tile=args.dummy_tile, on_error=args.on_error, progress=not args.no_progress,
                             confine_to_root=args.confine_to_image_root,
                             workers=default_workers() if args.workers is None else args.workers)
    out = save_lengths(result.stats, args.out)
    if args.skipped_out:
        atomic_write_text(args.skipped_out, "".join(
            json.dumps({"record": s.record, "image": s.image, "reason": s.reason}) + "\n" for s in result.skipped))
    print(format_summary(result, skipped_out=args.skipped_out))
    print(f"wrote {out} ({len(result.stats):,} samples) in {time.perf_counter() - started:.1f} s")
    return 0


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
                     f"{', the first:' if len(skipped) > _SHOW_SKIPPED else ':'}")
        lines += [f"  record {s.record:,}: {s.image}: {s.reason}" for s in skipped[:_SHOW_SKIPPED]]
        lines.append(f"After the first of them, row i of the length file is not record i of the dataset ({listed}).")
    return "\n".join(lines)
