"""Mutation testing of the core modules: plant one small bug at a time, see whether the tests notice.

    python bench/mutation.py [--module NAME ...] [--max-mutants N] [--sample] [--seed S]
                             [--timeout-factor F] [--out DIR] [--list]

For every module (``--module`` picks some; ``--list`` prints them with their test files) the script
finds every mutation site in the module's source, applies one mutation at a time to a scratch copy
of the repository (a temporary folder, so the working tree is never touched), runs only the test
files that cover the module (``pytest -x -q -p no:randomly``, fixed hypothesis seed, a timeout per
mutant scaled from the unmutated run), and prints per module: mutants, killed, survived, timed out,
and each survivor's file:line and mutation. Survivors listed in :data:`EQUIVALENT` (mutations that
change no behaviour) are reported with their reason and left out of the score, the percentage of
non-equivalent mutants killed (a timed-out mutant counts as killed: the tests did not pass).

Operators: comparison flips (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``,
``in``/``not in``), arithmetic swaps (``+``/``-``, ``*``/``/``, ``//``/``*``), integer and float
constants (0 <-> 1, else +1), ``and``/``or``, ``True``/``False``, ``max``/``min``, ``not x`` -> ``x``,
a return value replaced by ``None``, a call statement or augmented assignment dropped (``pass``),
and slice bounds (lower + 1, upper - 1). Docstrings, strings, f-strings, the arguments of ``raise``
and lines marked ``# pragma: no mutate`` are not mutated.

``--sample`` runs a random subset of ``--max-mutants`` sites per module (seeded by ``--seed``), so
one module finishes in minutes on a loaded machine; without it the first ``--max-mutants`` sites
(all when 0). The report goes to ``DIR/mutation.json`` and ``DIR/mutation.md``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnibal_compile.tables import format_table  # noqa: E402

_SOLVER_TESTS = ("tests/test_solver.py", "-k", "not vlm and not real and not cost_planners")
"""The torch-free solver tests (the ones on the reference VLM capture and cost a model first: minutes)."""
_RECOMPUTE_RUNTIME = "tests/test_runtime.py::test_build_pipeline_runs_each_blocks_planned_recomputation"
"""The recompute pass applied through ``build_pipeline``, one rank in the test's process."""

MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "problem": ("omnibal_compile/solver/problem.py", _SOLVER_TESTS),
    "dp": ("omnibal_compile/solver/dp.py", _SOLVER_TESTS),
    "ilp": ("omnibal_compile/solver/ilp.py", _SOLVER_TESTS),
    "baselines": ("omnibal_compile/solver/baselines.py", (*_SOLVER_TESTS, "tests/test_partition.py")),
    "explain": ("omnibal_compile/solver/explain.py", _SOLVER_TESTS),
    "solver": ("omnibal_compile/solver/__init__.py", _SOLVER_TESTS),
    "sampler": ("omnibal_compile/data/sampler.py", ("tests/test_data_sampler.py",)),
    "packing": ("omnibal_compile/data/packing.py", ("tests/test_data_balance.py", "tests/test_data_sampler.py")),
    "metrics": ("omnibal_compile/data/metrics.py", ("tests/test_data_balance.py",)),
    "balance": ("omnibal_compile/data/balance.py", ("tests/test_data_balance.py",)),
    "collate": ("omnibal_compile/data/collate.py", ("tests/test_data_collate.py",)),
    "recompute": ("omnibal_compile/passes/recompute.py", (_RECOMPUTE_RUNTIME, "tests/test_recompute.py")),
    "recompute_policy": ("omnibal_compile/passes/recompute_policy.py", ("tests/test_recompute.py",)),
    "codegen": ("omnibal_compile/passes/codegen.py", ("tests/test_codegen.py",)),
    "partition": ("omnibal_compile/passes/partition.py", ("tests/test_partition.py",)),
    "simulate": ("omnibal_compile/sim/simulate.py", ("tests/test_sim.py",)),
    "schedule": ("omnibal_compile/schedule.py", ("tests/test_schedule.py",)),
    "pipeline": ("omnibal_compile/runtime/pipeline.py", ("tests/test_runtime.py",)),
}
"""Module name -> (source file, the pytest arguments that run the tests covering it: files, node ids, ``-k``)."""

EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("omnibal_compile/data/sampler.py", "if world_size < 1 or not 0 <= rank < world_size:", "1  ->  0"):
        "world_size 0 still fails (no rank is >= 0 and < 0)",
    ("omnibal_compile/solver/dp.py", "if work > max_time * (1 + 1e-9) and j > i:", ">  ->  >="):
        "differs only when a range's work equals the bound times (1 + 1e-9) exactly, a float coincidence",
    ("omnibal_compile/solver/dp.py", "sync = [0.0]", "0.0  ->  1.0"):
        "the sync prefix sums are only differenced (sync[j] - sync[i]): a constant offset cancels",
    ("omnibal_compile/solver/dp.py", "states[0][0] = [(0.0, 0.0, 0.0, -1, -1, -1)]", "1  ->  0"):
        "the root state's block, parent and frontier point are never read (backtracking stops at stage 0)",
    ("omnibal_compile/solver/dp.py", "if front and c[0] >= front[-1][0] - tol:", "1  ->  0"):
        "compares with the largest kept sum instead of the least: keeps a superset of the Pareto states, same optimum",
    ("omnibal_compile/solver/problem.py",
     "if any(opts[k] != 0 for k in range(b[slow], b[slow + 1])) and head < 0.02 * problem.stage_budget(slow):",
     "<  ->  <="): "differs only when the headroom is exactly 2% of the budget, a float coincidence (a label, not a plan)",
}
"""(source file, the mutated line stripped, mutation) -> why the mutant changes no behaviour.

Keyed by the line's text, not its number, so notes survive edits elsewhere in the file."""


@dataclass(frozen=True, kw_only=True)
class Mutant:
    """One mutation site."""

    path: str
    """Source file, relative to the repository root."""
    line: int
    """1-based line of the mutated expression or statement."""
    start: tuple[int, int]
    """(line, column) where the replaced text starts (ast offsets: 1-based line, 0-based UTF-8 column)."""
    end: tuple[int, int]
    """(line, column) where it ends."""
    replacement: str
    """The new text of that span."""
    mutation: str
    """What was changed, for a person (``<  ->  <=``)."""
    source_line: str
    """The original line, stripped."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What the tests did with one mutant."""

    mutant: Mutant
    status: str
    """``killed``, ``survived``, ``timeout`` or ``equivalent`` (survived, listed in EQUIVALENT)."""
    seconds: float
    reason: str = ""
    """For ``equivalent``: why; for ``killed``: the first failing test."""


# -- finding mutation sites ------------------------------------------------------------------------
_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
             ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.Div: "/", ast.FloorDiv: "//", ast.And: "and", ast.Or: "or"}


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, f-strings, raise arguments, annotations, ``__all__``."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                drop(body[0])
        if isinstance(node, ast.JoinedStr):
            drop(node)
        elif isinstance(node, ast.Raise):
            drop(node.exc)
        elif isinstance(node, (ast.AnnAssign, ast.arg)):
            drop(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            drop(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            drop(node)  # attribute docstrings
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            drop(node)
    return skip


def _with(node: ast.AST, **changes: object) -> ast.AST:
    new = copy.deepcopy(node)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _node_mutations(node: ast.AST) -> Iterator[tuple[ast.AST, str, str]]:
    """(node whose span is replaced, replacement text, description) for every mutation of ``node``."""
    if isinstance(node, ast.Compare):
        for k, op in enumerate(node.ops):
            if type(op) in _CMP_SWAP:
                ops = list(node.ops)
                ops[k] = _CMP_SWAP[type(op)]()
                yield node, ast.unparse(_with(node, ops=ops)), f"{_SYMBOL[type(op)]}  ->  {_SYMBOL[type(ops[k])]}"
    elif isinstance(node, ast.BinOp) and type(node.op) in _BIN_SWAP:
        new = _BIN_SWAP[type(node.op)]()
        yield node, f"({ast.unparse(_with(node, op=new))})", f"{_SYMBOL[type(node.op)]}  ->  {_SYMBOL[type(new)]}"
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN_SWAP:
        new = _BIN_SWAP[type(node.op)]()
        yield node, ast.unparse(_with(node, op=new)), f"{_SYMBOL[type(node.op)]}=  ->  {_SYMBOL[type(new)]}="
        yield node, "pass", "augmented assignment dropped"
    elif isinstance(node, ast.BoolOp):
        new = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield node, f"({ast.unparse(_with(node, op=new))})", f"{_SYMBOL[type(node.op)]}  ->  {_SYMBOL[type(new)]}"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node, f"({ast.unparse(node.operand)})", "not x  ->  x"
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        v = node.value
        if isinstance(v, bool):
            yield node, str(not v), f"{v}  ->  {not v}"
        else:
            new = {0: 1, 1: 0}.get(v, v + 1) if v in (0, 1) else v + 1
            new = type(v)(new)
            yield node, repr(new), f"{v!r}  ->  {new!r}"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
        other = "min" if node.func.id == "max" else "max"
        yield node.func, other, f"{node.func.id}  ->  {other}"
    elif isinstance(node, ast.Return) and node.value is not None and not (
        isinstance(node.value, ast.Constant) and node.value.value is None
    ):
        yield node, "return None", "return value  ->  None"
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield node, "pass", "call statement dropped"
    elif isinstance(node, ast.Slice):
        if node.lower is not None:
            yield node.lower, f"({ast.unparse(node.lower)} + 1)", "slice lower bound + 1"
        if node.upper is not None:
            yield node.upper, f"({ast.unparse(node.upper)} - 1)", "slice upper bound - 1"


def find_mutants(path: str) -> list[Mutant]:
    """Every mutation site of the file at ``path`` (relative to the repository root), in source order."""
    text = (ROOT / path).read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    skip = _skipped_nodes(tree)
    out: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        for target, replacement, what in _node_mutations(node):
            if not hasattr(target, "end_lineno") or target.end_lineno is None:
                continue
            line = lines[target.lineno - 1]
            if "pragma: no mutate" in line:
                continue
            out.append(Mutant(path=path, line=target.lineno, start=(target.lineno, target.col_offset),
                              end=(target.end_lineno, target.end_col_offset), replacement=replacement,
                              mutation=what, source_line=line.strip()))
    out.sort(key=lambda m: (m.start, m.mutation))
    return [m for m in out if _compiles(apply(text, m))]


def apply(text: str, m: Mutant) -> str:
    """``text`` with the mutant's span replaced (ast columns are UTF-8 byte offsets)."""
    raw = text.encode()
    starts = [0]
    for line in raw.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    a = starts[m.start[0] - 1] + m.start[1]
    b = starts[m.end[0] - 1] + m.end[1]
    return (raw[:a] + m.replacement.encode() + raw[b:]).decode()


def _compiles(text: str) -> bool:
    try:
        compile(text, "<mutant>", "exec")
    except SyntaxError:
        return False
    return True


# -- running the tests -----------------------------------------------------------------------------
def scratch_copy() -> Path:
    """A copy of the repository's package, tests and config in a temporary folder (no bytecode caches)."""
    dest = Path(tempfile.mkdtemp(prefix="omnibal-mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for name in ("omnibal_compile", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run_tests(copy_root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(``passed``, ``failed`` or ``timeout``, seconds, first failing test) of pytest on ``tests`` in ``copy_root``."""
    shutil.rmtree(copy_root / ".hypothesis", ignore_errors=True)  # no examples remembered from another mutant
    env = dict(os.environ, PYTHONPATH=str(copy_root), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "--hypothesis-seed=0", "-W", "ignore"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the whole group: spawned ranks go too
        proc.communicate()
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "passed", seconds, ""
    first = next((ln.split(" - ")[0].removeprefix("FAILED ") for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
    return "failed", seconds, first


def mutate_module(name: str, *, copy_root: Path, max_mutants: int, sample: bool, seed: int, timeout_factor: float,
                  log: bool = True) -> dict:
    """Run every selected mutant of module ``name``; a dict for the report."""
    path, tests = MODULES[name]
    mutants = find_mutants(path)
    total_sites = len(mutants)
    if max_mutants and len(mutants) > max_mutants:
        mutants = sorted(random.Random(seed).sample(mutants, max_mutants), key=lambda m: m.start) if sample else mutants[:max_mutants]
    status, base_s, first = run_tests(copy_root, tests, timeout=3600)
    if status != "passed":
        raise SystemExit(f"{name}: the unmutated tests do not pass ({first or status}); fix them first")
    timeout = timeout_factor * base_s + 30
    if log:
        print(f"{name}: {len(mutants)} of {total_sites} mutants, tests {' '.join(tests)} take {base_s:.0f} s "
              f"unmutated (timeout {timeout:.0f} s)", flush=True)
    original = (ROOT / path).read_text()
    target = copy_root / path
    outcomes: list[Outcome] = []
    try:
        for k, m in enumerate(mutants, 1):
            target.write_text(apply(original, m))
            result, seconds, first = run_tests(copy_root, tests, timeout)
            target.write_text(original)
            if result == "passed":
                note = EQUIVALENT.get((path, m.source_line, m.mutation))
                outcome = Outcome(mutant=m, status="equivalent" if note else "survived", seconds=seconds, reason=note or "")
            else:
                outcome = Outcome(mutant=m, status="killed" if result == "failed" else "timeout", seconds=seconds,
                                  reason=first)
            outcomes.append(outcome)
            if log:
                print(f"  [{k}/{len(mutants)}] {outcome.status:<10} {path}:{m.line}  {m.mutation}  ({seconds:.0f} s)",
                      flush=True)
    finally:
        target.write_text(original)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("killed", "timeout", "survived", "equivalent")}
    live = len(outcomes) - counts["equivalent"]
    return {
        "module": name, "path": path, "tests": list(tests), "sites": total_sites, "mutants": len(outcomes),
        "sampled": bool(sample and max_mutants and total_sites > max_mutants), **counts,
        "score": (counts["killed"] + counts["timeout"]) / live if live else 1.0,
        "baseline_s": base_s, "outcomes": [asdict(o) for o in outcomes],
    }


# -- the report -------------------------------------------------------------------------------------
def summary_table(reports: list[dict]) -> str:
    rows = [["module", "sites", "mutants", "killed", "timed out", "survived", "equivalent", "killed (non-equiv.)"]]
    for r in reports:
        rows.append([r["module"], str(r["sites"]), str(r["mutants"]), str(r["killed"]), str(r["timeout"]),
                     str(r["survived"]), str(r["equivalent"]), f"{100 * r['score']:.0f}%"])
    return format_table(rows, "lrrrrrrr")


def survivors(reports: list[dict]) -> list[str]:
    lines = []
    for r in reports:
        for o in r["outcomes"]:
            if o["status"] in ("survived", "equivalent"):
                m = o["mutant"]
                why = f"  -- equivalent: {o['reason']}" if o["status"] == "equivalent" else ""
                lines.append(f"{m['path']}:{m['line']}  {m['mutation']}  in `{m['source_line']}`{why}")
    return lines


def write_report(reports: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutation.json").write_text(json.dumps({"command": command, "modules": reports}, indent=1))
    text = [f"Command: `{command}`", "", "```", summary_table(reports), "```", ""]
    lines = survivors(reports)
    text += ["Survivors:" if lines else "No survivors.", ""] + [f"- {ln}" for ln in lines]
    (out / "mutation.md").write_text("\n".join(text) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", choices=sorted(MODULES), help="a module to mutate (repeatable; default all)")
    ap.add_argument("--max-mutants", type=int, default=0, metavar="N", help="at most N mutants per module (0: all)")
    ap.add_argument("--sample", action="store_true", help="a random subset of --max-mutants sites, not the first ones")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--timeout-factor", type=float, default=3.0, metavar="F",
                    help="a mutant's tests may take F x the unmutated time + 30 s")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "mutation_out", metavar="DIR")
    ap.add_argument("--list", action="store_true", help="list the modules, their test files and mutation sites, and exit")
    args = ap.parse_args()
    names = args.module or list(MODULES)
    if args.list:
        rows = [["module", "source", "sites", "tests"]]
        rows += [[n, MODULES[n][0], str(len(find_mutants(MODULES[n][0]))), " ".join(MODULES[n][1])] for n in names]
        print(format_table(rows, "llrl"))
        return 0
    command = "python bench/mutation.py " + " ".join(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still restores and removes the copy
    copy_root = scratch_copy()
    reports = []
    try:
        for name in names:
            reports.append(mutate_module(name, copy_root=copy_root, max_mutants=args.max_mutants, sample=args.sample,
                                         seed=args.seed, timeout_factor=args.timeout_factor))
            write_report(reports, args.out, command)
    finally:
        shutil.rmtree(copy_root, ignore_errors=True)
    print()
    print(summary_table(reports))
    lines = survivors(reports)
    if lines:
        print("\nSurvivors (file:line, mutation, the original line):")
        print("\n".join(f"  {ln}" for ln in lines))
    print(f"\nReport: {args.out / 'mutation.md'} and mutation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
