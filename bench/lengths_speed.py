"""How fast ``omnibal-compile lengths`` measures a LLaVA-style dataset.

    python bench/lengths_speed.py [--records 100000] [--images 300] [--workdir DIR]
    python bench/lengths_speed.py --build-only --records 2000 --images 20 --workdir DIR   # only the data, kept in DIR

Builds, in a temporary folder: ``images`` small image files of many aspect ratios (PNG and JPEG),
a byte-level BPE tokenizer (8k vocabulary, trained here on the generated text) with a ChatML chat
template, and a ``records``-record dataset (85% one image, 10% two or three images, 5% text-only;
one to three question/answer turns of VQA-like lengths). Then runs the command twice, each as a
fresh process, and prints its wall time and CPU time (Python start, imports and tokenizer loading
included; CPU time summed over the command's worker processes):

1. shared: the records name the image files directly, so each file's header is read once and
   then comes from the cache (a few hundred distinct images);
2. distinct: every record names its own path (a symbolic link to one of the files), so every
   record's header is read from disk, as in a real dataset where images are not shared.

Target (issue 15): 100K samples in under 60 s on this machine. The machine is shared: the load
average is printed, and wall time includes waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
WORDS = ("the a of in on is what how many which color chart bar line value year percent shows highest lowest "
         "between difference total number people image picture describe detail left right top bottom red blue "
         "green man woman dog cat table sign text read answer question title axis label legend average").split()


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) if rng.random() < 0.8 else f"{rng.choice(WORDS)}{rng.randint(0, 999)}"
             for _ in range(n)]
    return " ".join(words).capitalize() + rng.choice(("?", ".", "."))


def _tokenizer(folder: Path, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((_sentence(rng, 40) for _ in range(5000)), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))


def _images(folder: Path, n: int, rng: random.Random) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        w, h = rng.randint(200, 2000), rng.randint(200, 2000)
        name = f"{i:04d}.{'png' if i % 2 else 'jpg'}"
        Image.new("RGB", (w, h), (i % 256, 80, 160)).save(folder / name)
        names.append(name)
    return names


def _conversation(rng: random.Random, images: int) -> list[dict[str, str]]:
    turns = []
    for k in range(rng.choice((1, 1, 1, 2, 3))):
        q = _sentence(rng, rng.randint(5, 30))
        if k == 0 and images:
            q = "<image>\n" * images + q
        a = _sentence(rng, rng.choice((rng.randint(1, 5), rng.randint(20, 120))))
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return turns


def _dataset(path: Path, records: int, names: list[str], rng: random.Random, *, distinct: Path | None) -> None:
    """Write the dataset; with ``distinct``, each image reference is a new symbolic link made in that folder."""
    link = 0
    with open(path, "w") as f:
        for _ in range(records):
            r = rng.random()
            n = 0 if r < 0.05 else 1 if r < 0.90 else rng.choice((2, 3))
            paths = []
            for _ in range(n):
                name = rng.choice(names)
                if distinct is not None:
                    target, name = name, f"link{link:07d}{Path(name).suffix}"
                    os.symlink(Path("..") / "images" / target, distinct / name)
                    name = f"{distinct.name}/{name}"
                    link += 1
                else:
                    name = f"images/{name}"
                paths.append(name)
            rec: dict = {"conversations": _conversation(rng, n)}
            if paths:
                rec["image"] = paths[0] if n == 1 else paths
            f.write(json.dumps(rec) + "\n")


def _run(data: Path, tokenizer: Path, out: Path, workers: int | None) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the command and its worker processes) and what it printed."""
    cmd = [sys.executable, "-m", "omnibal_compile.cli", "lengths", str(data), "--tokenizer", str(tokenizer),
           "--out", str(out), "--no-progress", *(["--workers", str(workers)] if workers else [])]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"the lengths command failed:\n{proc.stdout}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--images", type=int, default=300, help="distinct image files")
    ap.add_argument("--workdir", default=None, help="build the dataset here (default: a temporary folder)")
    ap.add_argument("--workers", type=int, default=None, help="the command's --workers (default: its own default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--build-only",
        action="store_true",
        help="build the images, tokenizer and datasets in --workdir and stop (a sample to try the command on)",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.build_only and not args.workdir:
        ap.error("--build-only keeps what it builds in --workdir DIR; give DIR")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        names = _images(work / "images", args.images, rng)
        _tokenizer(work / "tokenizer", rng)
        _dataset(work / "shared.jsonl", args.records, names, rng, distinct=None)
        links = work / "links"
        links.mkdir(exist_ok=True)
        _dataset(work / "distinct.jsonl", args.records, names, rng, distinct=links)
        print(f"built {args.records:,} records x 2 datasets, {args.images} image files and a tokenizer in "
              f"{time.perf_counter() - t0:.1f} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        if args.build_only:
            print(f"in {work}: shared.jsonl, distinct.jsonl (datasets), images/, links/, tokenizer/")
            return 0
        rows = []
        for label in ("shared", "distinct"):
            load = os.getloadavg()[0]
            seconds, cpu, printed = _run(work / f"{label}.jsonl", work / "tokenizer", work / f"{label}-lengths.json",
                                         args.workers)
            print(f"\n{label} images: {seconds:.1f} s wall, {cpu:.1f} s CPU (all processes) for {args.records:,} "
                  f"records; load average {load:.1f} when it started\n{printed.rstrip()}")
            rows.append((label, seconds, cpu))
        scale = 100_000 / args.records
        print("\nper 100K records (wall time includes waiting for a core on this shared machine; CPU time is the "
              "work done, summed over processes)")
        for label, seconds, cpu in rows:
            verdict = "meets" if seconds * scale < 60 else "misses"
            print(f"  {label:8s} {seconds * scale:6.1f} s wall ({verdict} the 60 s target), {cpu * scale:6.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
