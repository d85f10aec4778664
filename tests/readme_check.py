"""Run every example of README.md and of docs/**/*.md as a new user would, and say which pass.

    python tests/readme_check.py                 # every example of README.md and docs/**/*.md
    python tests/readme_check.py docs/guides/data.md   # the examples of these files only
    python tests/readme_check.py --list          # each block: its file, line, language and how it is checked
    python tests/readme_check.py README.md --only 131 163  # the blocks holding these lines (one file)
    python tests/readme_check.py --setup-commands  # the README's set-up commands, one a line (for .ci/readme_clone)
    python tests/readme_check.py --jobs 2        # two pages at a time (each page's report printed when it ends)

How each fenced block is checked, by its language tag:

    python      run as a fresh interpreter (``python block.py``); a block whose first line is
                ``# save as NAME`` is written to NAME instead, for a later block to run
    bash, sh    run with ``bash -e -o pipefail`` (a failing command fails the block)
    json        parsed as JSON
    text, none  not run: command output, listings, tables

A block right after ``<!-- not run: REASON -->`` is not run, and the listing gives the reason.
README.md's first block is its set-up commands (install, demo; install, tests): the checker does
not run it; ``.ci/readme_clone`` runs those commands in a fresh clone before the checker. (In the
other files the first block is an ordinary one.)

Each file's blocks run in a scratch folder of their own, a fresh copy of the repository's files (so
paths such as ``omnibal_compile/data/stats/*.json`` resolve), in the file's order, so a file one
block writes is there for the next block of the same page; pages do not depend on each other. The
package itself is imported from where it is installed.
Exit status: 0 when every block that runs passes, 1 otherwise, 2 for a file that cannot be parsed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGS = {"python": "python", "bash": "bash", "sh": "bash"}
TEXT_LANGS = {"", "text", "console", "output"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
SAVE_AS = re.compile(r"#\s*save as\s+([\w./-]*\w)")
TAIL_LINES = 25


@dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block of the README."""

    line: int
    """The line of its opening fence (1-based)."""
    end: int
    """The line of its closing fence."""
    lang: str
    """Its language tag, lower case; "" for none."""
    code: str
    """Its text, without the fences."""
    not_run: str | None = None
    """The reason given in a ``<!-- not run: ... -->`` line before it."""
    setup: bool = False
    """Whether it is the README's set-up block (its first)."""

    @property
    def save_as(self) -> str | None:
        """The file a ``# save as NAME`` python block is written to."""
        first = self.code.split("\n", 1)[0]
        m = SAVE_AS.match(first) if self.lang == "python" else None
        return m.group(1) if m else None

    def how(self) -> str:
        """How the checker treats this block, in words."""
        if self.setup:
            return "set-up commands: not run here (.ci/readme_clone runs them in a fresh clone first)"
        if self.not_run:
            return f"not run: {self.not_run}"
        if self.save_as:
            return f"saved as {self.save_as} (a later block runs it)"
        if self.lang in RUN_LANGS:
            return f"run ({RUN_LANGS[self.lang]})"
        if self.lang == "json":
            return "parsed as JSON"
        return "text (output or listing): not run"


def parse_blocks(text: str, *, setup: bool = True) -> list[Block]:
    """Every fenced block of a markdown text, in order; with ``setup``, the first is the set-up block."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise ValueError(f"line {start + 1}: the block opened here is never closed")
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = NOT_RUN.search(lines[prev]) if prev >= 0 else None
        blocks.append(Block(line=start + 1, end=j + 1, lang=m.group(3).lower(),
                            code="\n".join(lines[start + 1:j]) + "\n",
                            not_run=marker.group(1) if marker else None, setup=setup and not blocks))
        i = j + 1
    for b in blocks:
        if b.lang not in RUN_LANGS and b.lang not in TEXT_LANGS and b.lang != "json":
            raise ValueError(f"line {b.line}: block language {b.lang!r} is not one this checker knows "
                             f"({', '.join(sorted(set(RUN_LANGS) | {'json', 'text'}))})")
    return blocks


def setup_commands(blocks: list[Block]) -> list[str]:
    """The set-up block's commands, one per line (continuation lines joined)."""
    code = blocks[0].code.replace("\\\n", " ")
    return [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def scratch_copy(dest: Path) -> None:
    """Copy the repository's files (tracked, and untracked but not ignored) into ``dest``."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def run_block(block: Block, work: Path, scripts: Path, timeout: float) -> tuple[bool, str]:
    """Run one block in ``work``; (passed, output tail)."""
    if block.lang == "json":
        try:
            json.loads(block.code)
            return True, ""
        except json.JSONDecodeError as e:
            return False, f"not valid JSON: {e}"
    if block.save_as:
        target = work / block.save_as
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        return True, ""
    if RUN_LANGS[block.lang] == "python":
        script = scripts / f"readme_line_{block.line}.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, out + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode == 0, proc.stdout + ("" if proc.returncode == 0 else f"\n(exit status {proc.returncode})")


def tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join("    " + ln for ln in text.rstrip().splitlines()[-n:])


def default_files() -> list[Path]:
    """README.md, then every page of docs/ (sorted by path)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def check_file(path: Path, blocks: list[Block], args: argparse.Namespace,
               say: Callable[[str], None] = lambda text: print(text, flush=True)) -> tuple[int, list[int], int]:
    """Run one file's blocks in its own scratch folder: (blocks run, lines of failures, blocks not run); its report
    goes to ``say``, a line (or a failure's output) at a time."""
    runnable = [b for b in blocks if not b.setup and not b.not_run and (b.lang in RUN_LANGS or b.lang == "json")]
    failed: list[int] = []
    ran = 0
    with tempfile.TemporaryDirectory(prefix="readme-check-") as tmp:
        work = args.workdir or Path(tmp) / "work"
        scripts = Path(tmp) / "blocks"
        scripts.mkdir()
        if args.workdir is None:
            work.mkdir()
            scratch_copy(work)
        say(f"examples of {_name(path)}, run in {work}")
        for b in runnable:
            if args.only and not b.save_as and not any(b.line <= n <= b.end for n in args.only):
                continue
            t0 = time.perf_counter()
            ok, out = run_block(b, work, scripts, args.timeout)
            ran += 1
            say(f"line {b.line:>5}  {b.lang:<6} {'pass' if ok else 'FAIL'}  {time.perf_counter() - t0:6.1f} s"
                f"  {b.how()}")
            if not ok:
                failed.append(b.line)
            if out.strip() and (not ok or args.verbose):
                say(tail(out, TAIL_LINES if not args.verbose else 10**6))
    return ran, failed, len(blocks) - len(runnable)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run every example of README.md and docs/**/*.md and report each block's result."
    )
    ap.add_argument("files", nargs="*", type=Path,
                    help="markdown files to check (default: README.md and docs/**/*.md); a folder means its *.md files")
    ap.add_argument("--list", action="store_true", help="list the blocks and how each is checked; run nothing")
    ap.add_argument("--setup-commands", action="store_true",
                    help="print the set-up block's commands of README.md (or of the one file given), one a line")
    ap.add_argument("--only", type=int, nargs="+", metavar="LINE",
                    help="run only the blocks holding these lines of the one file given "
                         "(files of '# save as' blocks are still saved)")
    ap.add_argument("--workdir", type=Path,
                    help="run in this folder (default: a scratch copy of the repository per file)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one block may take (default 600)")
    ap.add_argument("--verbose", action="store_true", help="print every block's output, not only failures'")
    ap.add_argument("--jobs", type=int, default=1,
                    help="pages checked at a time (default 1); pages do not depend on each other, and with more than "
                         "one each page's report is printed whole when the page ends")
    args = ap.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and args.workdir is not None):
        print("readme_check: --jobs must be >= 1, and 1 with --workdir (pages would share the folder)", file=sys.stderr)
        return 2
    files: list[Path] = []
    for f in args.files or ([ROOT / "README.md"] if args.setup_commands else default_files()):
        files.extend(sorted(f.rglob("*.md")) if f.is_dir() else [f])
    if (args.only or args.setup_commands) and len(files) != 1:
        print("readme_check: --only and --setup-commands take one file", file=sys.stderr)
        return 2
    parsed: list[tuple[Path, list[Block]]] = []
    for f in files:
        try:
            # the set-up block is README.md's first (and that of the one file given to --setup-commands)
            blocks = parse_blocks(f.read_text(), setup=f.name == "README.md" or args.setup_commands)
        except (OSError, ValueError) as e:
            print(f"readme_check: {_name(f)}: {e}", file=sys.stderr)
            return 2
        if not blocks and (args.setup_commands or args.only):
            print(f"readme_check: {_name(f)} has no fenced block", file=sys.stderr)
            return 2
        parsed.append((f, blocks))
    if args.setup_commands:
        print("\n".join(setup_commands(parsed[0][1])))
        return 0
    if args.list:
        for f, blocks in parsed:
            for b in blocks:
                print(f"{_name(f)}:{b.line:<5}  {b.lang or '(none)':<7} {b.how()}")
        return 0
    if args.only:
        unknown = [n for n in args.only if not any(b.line <= n <= b.end for b in parsed[0][1])]
        if unknown:
            print(f"readme_check: no block holds line(s) {unknown}; see --list", file=sys.stderr)
            return 2
    t_all = time.perf_counter()
    ran = skipped = total = 0
    failed: list[str] = []
    pages = [(f, blocks) for f, blocks in parsed if blocks]
    if args.jobs == 1:
        results = [check_file(f, blocks, args) for f, blocks in pages]
    else:
        def check_whole(f: Path, blocks: list[Block]) -> tuple[int, list[int], int]:
            lines: list[str] = []  # one page's report together, not interleaved with another's
            try:
                return check_file(f, blocks, args, say=lines.append)
            finally:
                print("\n".join(lines), flush=True)

        # the pages with the most blocks to run start first, so that a long one does not start last
        order = sorted(range(len(pages)), key=lambda i: -sum(b.lang in RUN_LANGS and not b.not_run and not b.setup
                                                             for b in pages[i][1]))
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # each block runs in a process of its own
            futures = {i: pool.submit(check_whole, *pages[i]) for i in order}
            results = [futures[i].result() for i in range(len(pages))]
    for (f, blocks), (n, bad, not_run) in zip(pages, results):
        ran, skipped, total = ran + n, skipped + not_run, total + len(blocks)
        failed += [f"{_name(f)}:{line}" for line in bad]
    print(f"{ran} blocks checked in {time.perf_counter() - t_all:.0f} s, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + f"; {skipped} of the {total} blocks in {len(parsed)} file(s) are not run"
          " (set-up, output, or marked; --list says which)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
