"""Mutation testing of the core modules: plant one small bug at a time, see whether the tests notice.

    python bench/mutation.py [--module NAME ...] [--max-mutants N] [--sample] [--seed S]
                             [--timeout-factor F] [--out DIR] [--list]

For every module (``--module`` picks some; ``--list`` prints them with their tests) the script finds
every mutation site in the module's source and works in one scratch copy of the repository (a
temporary folder, so the working tree is never touched):

1. **Coverage, once per module.** The module's tests run once unmutated under coverage.py with one
   context per test, which records the tests that execute each line and each test's time. A line run
   at import (outside function bodies: a ``def`` line's defaults, a class body, a module constant)
   counts as covered by every test of the module, also when a test imports the module lazily.
2. **One mutant at a time.** The mutant is written into the copy and only the tests that execute the
   mutated statement run, fastest first, with ``-x`` (``-p no:randomly``, ``--hypothesis-seed=0``, no
   hypothesis database, deadline or shrinking). A mutant on a line no test executes is reported ``not covered``
   without running anything. A long-lived server process imports torch, pytest and the other
   third-party packages once and forks one child per mutant, which imports the package from the
   mutated copy; the time limit per mutant is ``--timeout-factor`` times the covering tests' unmutated
   time plus twice the measured start-up time plus 10 s. A mutant past it counts as killed
   (``timed out``: the tests did not pass).

It prints one line per mutant (progress) and per module: mutants, killed, timed out, survived, not
covered, equivalent, the share of non-equivalent mutants killed, and each survivor's file:line and
mutation. Survivors listed in ``bench/mutation_equivalent.txt`` (mutations that change no behaviour,
each with a one-line reason) are reported as equivalent and left out of the score.

Operators: comparison flips (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``,
``in``/``not in``), arithmetic swaps (``+``/``-``, ``*``/``/``, ``//``/``*``), integer and float
constants (0 <-> 1, else +1), ``and``/``or``, ``True``/``False``, ``max``/``min``, ``not x`` -> ``x``,
a return value replaced by ``None``, a call statement or augmented assignment dropped (``pass``),
and slice bounds (lower + 1, upper - 1). Docstrings, strings, f-strings, the arguments of ``raise``
and lines marked ``# pragma: no mutate`` are not mutated.

Limits: a line executed only in a process the tests start (torchrun or ``torch.multiprocessing``
ranks) is not seen by the coverage run, so such mutants read ``not covered``, except in the modules
of ``SUBPROCESS_COVERAGE`` (the runtime's ``pipeline``): there every Python process a test starts
measures the module too (coverage.py's start-up hook: the ``.pth`` file it installs starts coverage
when ``COVERAGE_PROCESS_START`` names a configuration, set only during the coverage run) with the
starting test's id, read from an environment variable the processes inherit, as its context; a
process that is killed, or exits by ``os._exit``, leaves no data. A test that reads a result cached
by an earlier test (a session fixture) is not selected for the lines that computed it.

``--sample`` runs a random subset of ``--max-mutants`` sites per module (seeded by ``--seed``); without
it the first ``--max-mutants`` sites (all when 0). The report goes to ``DIR/mutation.json`` and
``DIR/mutation.md``.
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
EQUIVALENT_FILE = ROOT / "bench" / "mutation_equivalent.txt"

_SOLVER_TESTS = ("tests/test_solver.py",
                 "--deselect", "tests/test_solver.py::test_ilp_is_never_worse_than_baselines_on_real_costs",
                 "--deselect", "tests/test_solver.py::test_too_small_budget_is_explained_on_a_real_model",
                 "--deselect", "tests/test_solver.py::test_cost_planners_need_costs")
"""The solver tests, less three that plan the reference VLM's measured costs (minutes; ``-k`` would also drop
tests of other files by name)."""
_RECOMPUTE_RUNTIME = "tests/test_runtime.py::test_build_pipeline_runs_each_blocks_planned_recomputation"
"""The recompute pass applied through ``build_pipeline``, one rank in the test's process."""

MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "problem": (
        "omnibal_compile/planning/problem.py",
        (*_SOLVER_TESTS, "tests/test_interleaved.py", "tests/test_problem.py"),
    ),
    # the tie-break's frontiers with slack (dp.py's grid and near-optimal points) are run only by test_ties
    "dp": (
        "omnibal_compile/planning/dp.py",
        (*_SOLVER_TESTS, "tests/test_ties.py"),
    ),
    "ilp": ("omnibal_compile/planning/ilp.py", ("tests/test_ilp.py", *_SOLVER_TESTS, "tests/test_interleaved.py")),
    "interleaved": ("omnibal_compile/planning/interleaved.py", (*_SOLVER_TESTS, "tests/test_interleaved.py")),
    "baselines": (
        "omnibal_compile/planning/baselines.py",
        (*_SOLVER_TESTS, "tests/test_partition.py", "tests/test_baselines.py"),
    ),
    "explain": ("omnibal_compile/planning/explain.py", (*_SOLVER_TESTS, "tests/test_explain.py")),
    "solver": (
        "omnibal_compile/planning/__init__.py",
        (*_SOLVER_TESTS, "tests/test_planners.py", "tests/test_interleaved.py"),
    ),
    "sampler": ("omnibal_compile/data/sampler.py", ("tests/test_data_sampler.py",)),
    "packing": ("omnibal_compile/data/packing.py", ("tests/test_data_balance.py", "tests/test_data_sampler.py")),
    "metrics": ("omnibal_compile/data/metrics.py", ("tests/test_data_balance.py",)),
    "balance": ("omnibal_compile/data/balance.py", ("tests/test_data_balance.py", "tests/test_data_balance_steps.py")),
    "collate": ("omnibal_compile/data/collate.py", ("tests/test_data_collate.py",)),
    "recompute": ("omnibal_compile/compile/recompute.py", (_RECOMPUTE_RUNTIME, "tests/test_recompute.py")),
    "recompute_policy": ("omnibal_compile/compile/recompute_policy.py", ("tests/test_recompute.py",)),
    "codegen": ("omnibal_compile/compile/codegen.py", ("tests/test_codegen.py",)),
    "partition": ("omnibal_compile/planning/build.py", ("tests/test_partition.py",)),
    "simulate": ("omnibal_compile/sim/simulate.py", ("tests/test_sim.py",)),
    "schedule": ("omnibal_compile/ir/schedule.py", ("tests/test_schedule.py",)),
    "pipeline": ("omnibal_compile/runtime/pipeline.py", ("tests/test_runtime.py",)),
}
"""Module name -> (source file, the pytest arguments that run the tests covering it: files, node ids, ``-k``)."""

SUBPROCESS_COVERAGE = frozenset({"pipeline"})
"""Modules whose coverage run also measures the Python processes its tests start (the runtime's ranks)."""

_TEST_ENV = "OMNIBAL_MUTATION_TEST"
"""Environment variable holding the running test's id during a coverage run: processes that a test starts
inherit it, and their coverage records it as the context."""

PRELOAD = ("torch", "numpy", "networkx", "pulp", "hypothesis", "pytest", "coverage")
"""Third-party packages the server imports once, before forking a child per mutant."""


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
    """``killed``, ``timeout``, ``survived``, ``not covered`` (no test executes it) or ``equivalent`` (not
    killed, with a note in the equivalence file)."""
    seconds: float
    reason: str = ""
    """For ``equivalent``: why; for ``killed``: the first failing test."""
    tests: int = 0
    """How many tests were selected (those that execute the mutated statement)."""


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


def find_mutants(path: str, text: str | None = None) -> list[Mutant]:
    """Every mutation site of the file at ``path`` (relative to the repository root; or of ``text``, named
    ``path``), in source order."""
    text = (ROOT / path).read_text() if text is None else text
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


# -- equivalence notes ------------------------------------------------------------------------------
def mutant_key(m: Mutant) -> str:
    """``line:column`` of a mutant, as written in the equivalence file."""
    return f"{m.start[0]}:{m.start[1]}"


def read_equivalent(path: Path = EQUIVALENT_FILE) -> dict[tuple[str, str, str, int], str]:
    """(module, mutation, the mutated line stripped, column) -> why the mutant changes no behaviour.

    One note a line, ``module | line:column | mutation | reason | the original line`` (``#`` starts a
    comment). Matched by the line's text and column, not its number, so notes survive edits elsewhere
    in the file; the number is there for a person."""
    notes: dict[tuple[str, str, str, int], str] = {}
    if not path.exists():
        return notes
    for k, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in raw.split(" | ", 4)]
        if len(parts) != 5 or ":" not in parts[1] or parts[0] not in MODULES:
            raise SystemExit(f"{path}:{k}: expected 'module | line:column | mutation | reason | line', got {raw!r}")
        module, where, mutation, reason, text = parts
        notes[(module, mutation, text, int(where.split(":")[1]))] = reason
    return notes


def equivalent_line(module: str, m: Mutant, reason: str) -> str:
    """The equivalence-file line of mutant ``m`` of ``module`` (what ``read_equivalent`` parses)."""
    return f"{module} | {mutant_key(m)} | {m.mutation} | {reason} | {m.source_line}"


# -- which tests execute which line -----------------------------------------------------------------
def statement_lines(text: str) -> dict[int, int]:
    """Source line -> the first line of the innermost statement containing it (what coverage records)."""
    spans = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.stmt):
            body_start = min((s.lineno for f in ("body", "orelse", "finalbody", "handlers")
                              for s in getattr(node, f, []) or []), default=node.end_lineno + 1)
            head_end = node.end_lineno if body_start > node.end_lineno else body_start - 1
            first = node.lineno
            if getattr(node, "decorator_list", None):  # coverage counts a decorated def from its decorator
                first = min(d.lineno for d in node.decorator_list)
            spans.append((first, max(head_end, node.lineno), first))
    out: dict[int, int] = {}
    for lo, hi, first in sorted(spans, key=lambda s: s[0] - s[1]):  # widest first, innermost overrides
        for line in range(lo, hi + 1):
            out[line] = first
    return out


def import_time_lines(text: str) -> set[int]:
    """Lines that run when the module is imported: everything outside function bodies (module and class
    bodies, decorators, ``def`` lines with their defaults). A test file may import the module inside its
    first test, so coverage would credit that test alone with them."""
    tree = ast.parse(text)
    in_body: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            in_body.update(range(body[0].lineno, node.end_lineno + 1))
    return set(range(1, len(text.splitlines()) + 1)) - in_body


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """What the unmutated tests of one module executed."""

    lines: dict[int, tuple[str, ...]]
    """Executed line -> test ids that executed it (``""`` for import time)."""
    durations: dict[str, float]
    """Test id -> seconds (setup, call and teardown) in the unmutated run."""
    startup_s: float
    """Seconds of the run outside the tests (start-up, collection)."""

    def tests_for(self, m: Mutant, stmt_of: dict[int, int], import_time: set[int] = frozenset()) -> list[str]:
        """The tests that execute mutant ``m``'s statement, fastest first (all the module's tests when the
        statement runs at import time: on ``import_time`` lines or in no test's context); empty when none does."""
        hits: set[str] = set()
        for line in range(m.start[0], m.end[0] + 1):
            hits.update(self.lines.get(stmt_of.get(line, line), ()))
        if hits and any(line in import_time for line in range(m.start[0], m.end[0] + 1)):
            hits.add("")
        if "" in hits:
            hits = set(self.durations)
        return sorted(hits & set(self.durations), key=lambda t: (self.durations[t], t))


class _CollectPlugin:
    """pytest plugin: one coverage context per test, each test's time and the first failure."""

    def __init__(self, cov: object | None) -> None:
        self.cov = cov
        self.durations: dict[str, float] = {}
        self.first_failure = ""

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        if self.cov is not None:
            self.cov.switch_context(nodeid)
            os.environ[_TEST_ENV] = nodeid

    def pytest_runtest_logreport(self, report: object) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed and not self.first_failure:
            self.first_failure = report.nodeid

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        if self.cov is not None:
            self.cov.switch_context("")
            os.environ[_TEST_ENV] = ""


def _pytest_args(tests: list[str]) -> list[str]:
    return [*tests, "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--hypothesis-seed=0", "-W", "ignore",
            "-o", "addopts="]


def _start_subprocess_coverage(path: str, result_path: str) -> Path:
    """Make every Python process the tests start measure ``path`` (coverage.py's start-up hook: the
    ``.pth`` file coverage installs runs ``coverage.process_startup()`` when ``COVERAGE_PROCESS_START``
    names a configuration), with the test that started it as the context; returns the data folder."""
    sub_dir = Path(result_path + ".subprocesses")
    shutil.rmtree(sub_dir, ignore_errors=True)
    sub_dir.mkdir()
    rc = sub_dir / "coveragerc"
    rc.write_text(f"[run]\ndata_file = {sub_dir / 'data'}\nparallel = True\ninclude = {path}\n"
                  f"context = ${{{_TEST_ENV}}}\n")
    os.environ["COVERAGE_PROCESS_START"] = str(rc)
    os.environ[_TEST_ENV] = ""
    return sub_dir


def _subprocess_lines(sub_dir: Path, path: str) -> dict[int, set[str]]:
    """Line of ``path`` -> the tests whose processes executed it, from the data files they left."""
    from coverage import CoverageData

    lines: dict[int, set[str]] = {}
    for f in sorted(sub_dir.glob("data.*")):
        data = CoverageData(basename=str(f))
        data.read()
        for measured in data.measured_files():
            if os.path.exists(measured) and os.path.samefile(measured, path):
                for line, contexts in data.contexts_by_lineno(measured).items():
                    lines.setdefault(line, set()).update(contexts)
    return lines


def _child(request: dict, result_path: str) -> int:
    """In the forked child: run pytest on the request's tests (under coverage for a ``collect`` request)."""
    import pytest
    from hypothesis import Phase, settings

    # no shrinking: a mutant is killed by the first failing example; shrinking it only costs time
    settings.register_profile("mutation", deadline=None, database=None, print_blob=False,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutation")
    cov = None
    if request.get("collect"):
        import coverage

        cov = coverage.Coverage(data_file=None, include=[request["collect"]], config_file=False)
        cov.start()
        if request.get("subprocesses"):
            sub_dir = _start_subprocess_coverage(request["collect"], result_path)
    plugin = _CollectPlugin(cov)
    log = open(result_path + ".log", "w")  # noqa: SIM115 -- stdout and stderr for the rest of this process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    code = int(pytest.main(_pytest_args(request["tests"]), plugins=[plugin]))
    out: dict = {"code": code, "first": plugin.first_failure, "durations": plugin.durations}
    if cov is not None:
        cov.stop()
        data = cov.get_data()
        files = [f for f in data.measured_files() if os.path.samefile(f, request["collect"])]
        lines: dict[int, set[str]] = {}
        for f in files:
            for line, contexts in data.contexts_by_lineno(f).items():
                lines.setdefault(line, set()).update(contexts)
        if request.get("subprocesses"):
            for line, contexts in _subprocess_lines(sub_dir, request["collect"]).items():
                lines.setdefault(line, set()).update(contexts)
            out["subprocess_files"] = len(list(sub_dir.glob("data.*")))
        out["lines"] = {str(k): sorted(v) for k, v in lines.items()}
    Path(result_path).write_text(json.dumps(out))
    return code


def serve() -> None:
    """The server: import the heavy packages once, then fork one child per request read from stdin.

    A request is one JSON line ``{"tests": [...], "timeout": s, "collect": path or null, "subprocesses": bool}``
    (``subprocesses``: the coverage run also measures the processes the tests start); the answer
    one JSON line ``{"status": "passed"|"failed"|"timeout", "seconds": s, "first": test id, ...}``."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]  # the package comes from the copy
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    assert "omnibal_compile" not in sys.modules, "the server must not import the package it mutates"
    tmp = tempfile.mkdtemp(prefix="omnibal-mutation-results-")
    for raw in sys.stdin:
        request = json.loads(raw)
        result_path = os.path.join(tmp, "result.json")
        if os.path.exists(result_path):
            os.remove(result_path)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own process group: a timeout kills spawned ranks too
            try:
                code = _child(request, result_path)
            except BaseException:  # noqa: BLE001 - the child reports and exits, never returns into the loop
                code = 3
            os._exit(code)
        status = None
        while time.monotonic() - start < request["timeout"]:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                status = "done"
                break
            time.sleep(0.02)
        seconds = time.monotonic() - start
        if status is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            answer: dict = {"status": "timeout", "seconds": seconds, "first": ""}
        else:
            result = json.loads(Path(result_path).read_text()) if os.path.exists(result_path) else {"code": 3}
            answer = {**result, "status": "passed" if result["code"] == 0 else "failed", "seconds": seconds}
            answer.setdefault("first", "")
            if result["code"] != 0 and os.path.exists(result_path + ".log"):
                answer["log_tail"] = Path(result_path + ".log").read_text()[-3000:]
        print(json.dumps(answer), flush=True)


class Server:
    """The parent's handle on the server process, started in the scratch copy."""

    def __init__(self, copy_root: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(copy_root), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
        self.proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), "--serve"], cwd=copy_root,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, tests: list[str], timeout: float, collect: str | None = None, subprocesses: bool = False) -> dict:
        request = {"tests": tests, "timeout": timeout, "collect": collect, "subprocesses": subprocesses}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the mutation test server stopped unexpectedly")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


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


def collect_coverage(server: Server, copy_root: Path, name: str) -> Coverage:
    """Run module ``name``'s tests once unmutated under coverage; stop when they do not pass."""
    path, tests = MODULES[name]
    result = server.run(
        list(tests), timeout=7200, collect=str(copy_root / path), subprocesses=name in SUBPROCESS_COVERAGE
    )
    if result["status"] != "passed":
        raise SystemExit(f"{name}: the unmutated tests do not pass ({result.get('first') or result['status']}); "
                         f"fix them first\n{result.get('log_tail', '')}")
    lines = {int(k): tuple(v) for k, v in result.get("lines", {}).items()}
    if not lines:
        raise SystemExit(f"{name}: the tests never imported {path} from the scratch copy")
    durations = result["durations"]
    return Coverage(lines=lines, durations=durations, startup_s=max(0.0, result["seconds"] - sum(durations.values())))


def mutate_module(name: str, *, server: Server, copy_root: Path, max_mutants: int = 0, sample: bool = False,
                  seed: int = 0, timeout_factor: float = 3.0, lines: frozenset[int] = frozenset(),
                  only: frozenset[tuple[int, int, str]] | None = None, log: bool = True) -> dict:
    """Run every selected mutant of module ``name`` (those on ``lines``, or the (line, column, mutation)
    triples in ``only``, when given); a dict for the report."""
    path, tests = MODULES[name]
    original = (ROOT / path).read_text()
    mutants = find_mutants(path)
    total_sites = len(mutants)
    if lines:
        mutants = [m for m in mutants if m.line in lines]
    if only is not None:
        mutants = [m for m in mutants if (m.line, m.start[1], m.mutation) in only]
    if max_mutants and len(mutants) > max_mutants:
        mutants = (
            sorted(random.Random(seed).sample(mutants, max_mutants), key=lambda m: m.start)
            if sample
            else mutants[:max_mutants]
        )
    started = time.monotonic()
    cov = collect_coverage(server, copy_root, name)
    stmt_of = statement_lines(original)
    import_time = import_time_lines(original)
    notes = read_equivalent()
    if log:
        print(f"{name}: {len(mutants)} of {total_sites} mutants; {len(cov.durations)} tests "
              f"({' '.join(tests)}) take {sum(cov.durations.values()):.0f} s under coverage, "
              f"start-up {cov.startup_s:.1f} s", flush=True)
    target = copy_root / path
    outcomes: list[Outcome] = []
    try:
        for k, m in enumerate(mutants, 1):
            selected = cov.tests_for(m, stmt_of, import_time)
            note = notes.get((name, m.mutation, m.source_line, m.start[1]))
            if not selected:
                outcome = Outcome(mutant=m, status="equivalent" if note else "not covered", seconds=0.0,
                                  reason=note or "")
            else:
                timeout = timeout_factor * sum(cov.durations[t] for t in selected) + 2 * cov.startup_s + 10
                target.write_text(apply(original, m))
                try:
                    result = server.run(selected, timeout)
                finally:
                    target.write_text(original)
                if result["status"] == "passed":
                    outcome = Outcome(mutant=m, status="equivalent" if note else "survived", seconds=result["seconds"],
                                      reason=note or "", tests=len(selected))
                else:
                    outcome = Outcome(mutant=m, status="killed" if result["status"] == "failed" else "timeout",
                                      seconds=result["seconds"], reason=result["first"], tests=len(selected))
            outcomes.append(outcome)
            if log:
                elapsed = time.monotonic() - started
                print(f"  [{k}/{len(mutants)}] {outcome.status:<11} {path}:{m.line}:{m.start[1]}  {m.mutation}  "
                      f"({outcome.tests} tests, {outcome.seconds:.1f} s; {elapsed / 60:.1f} min so far)", flush=True)
    finally:
        target.write_text(original)
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    live = len(outcomes) - counts["equivalent"]
    return {
        "module": name, "path": path, "tests": list(tests), "sites": total_sites, "mutants": len(outcomes),
        "sampled": bool(lines) or only is not None or bool(max_mutants and total_sites > max_mutants), **counts,
        "score": (counts["killed"] + counts["timeout"]) / live if live else 1.0,
        "minutes": (time.monotonic() - started) / 60, "outcomes": [asdict(o) for o in outcomes],
    }


STATUSES = ("killed", "timeout", "survived", "not covered", "equivalent")


# -- the report -------------------------------------------------------------------------------------
def summary_table(reports: list[dict]) -> str:
    from omnibal_compile._utils.tables import format_table

    rows = [["module", "sites", "mutants", "killed", "timed out", "survived", "not covered", "equivalent",
             "killed (non-equiv.)", "minutes"]]
    for r in reports:
        rows.append([r["module"] + (" (sample)" if r["sampled"] else ""), str(r["sites"]), str(r["mutants"]),
                     str(r["killed"]), str(r["timeout"]), str(r["survived"]), str(r["not covered"]),
                     str(r["equivalent"]), f"{100 * r['score']:.0f}%", f"{r['minutes']:.0f}"])
    return format_table(rows, "lrrrrrrrrr")


def survivors(reports: list[dict]) -> list[str]:
    """One line per mutant the tests did not kill: location, mutation, the original line, why (equivalent)."""
    lines = []
    for r in reports:
        for o in r["outcomes"]:
            if o["status"] in ("survived", "not covered", "equivalent"):
                m = o["mutant"]
                why = f"  -- equivalent: {o['reason']}" if o["status"] == "equivalent" else f"  -- {o['status']}"
                lines.append(f"{m['path']}:{m['line']}:{m['start'][1]}  {m['mutation']}  in `{m['source_line']}`{why}")
    return lines


def write_report(reports: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutation.json").write_text(json.dumps({"command": command, "modules": reports}, indent=1))
    text = [f"Command: `{command}`", "", "```", summary_table(reports), "```", ""]
    lines = survivors(reports)
    text += ["Not killed:" if lines else "Every mutant killed.", ""] + [f"- {ln}" for ln in lines]
    (out / "mutation.md").write_text("\n".join(text) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--module", action="append", choices=sorted(MODULES), help="a module to mutate (repeatable; default all)"
    )
    ap.add_argument("--max-mutants", type=int, default=0, metavar="N", help="at most N mutants per module (0: all)")
    ap.add_argument("--sample", action="store_true", help="a random subset of --max-mutants sites, not the first ones")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--timeout-factor", type=float, default=3.0, metavar="F",
                    help="a mutant's tests may take F x their unmutated time + 2 x start-up + 10 s")
    ap.add_argument("--lines", default="", metavar="L,L",
                    help="only the mutants on these source lines (to recheck survivors after adding tests)")
    ap.add_argument("--not-killed-in", type=Path, metavar="JSON",
                    help="only the mutants a previous report (mutation.json) did not kill: rerun after adding tests")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "mutation_out", metavar="DIR")
    ap.add_argument("--list", action="store_true", help="list the modules, their tests and mutation sites, and exit")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the forking test server (internal)
    args = ap.parse_args()
    if args.serve:
        serve()
        return 0
    sys.path.insert(0, str(ROOT))
    names = args.module or list(MODULES)
    if args.list:
        from omnibal_compile._utils.tables import format_table

        rows = [["module", "source", "sites", "tests"]]
        rows += [[n, MODULES[n][0], str(len(find_mutants(MODULES[n][0]))), " ".join(MODULES[n][1])] for n in names]
        print(format_table(rows, "llrl"))
        return 0
    read_equivalent()  # a malformed note stops the run before it starts
    command = "python bench/mutation.py " + " ".join(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still restores and removes the copy
    previous: dict[str, frozenset[tuple[int, int, str]]] = {}
    if args.not_killed_in:
        for r in json.loads(args.not_killed_in.read_text())["modules"]:
            previous[r["module"]] = frozenset(
                (o["mutant"]["line"], o["mutant"]["start"][1], o["mutant"]["mutation"])
                for o in r["outcomes"] if o["status"] in ("survived", "not covered", "equivalent"))
        names = [n for n in names if n in previous]
    copy_root = scratch_copy()
    server = Server(copy_root)
    reports = []
    try:
        for name in names:
            reports.append(mutate_module(name, server=server, copy_root=copy_root, max_mutants=args.max_mutants,
                                         sample=args.sample, seed=args.seed, timeout_factor=args.timeout_factor,
                                         lines=frozenset(int(x) for x in args.lines.split(",") if x),
                                         only=previous.get(name) if args.not_killed_in else None))
            write_report(reports, args.out, command)
            print(summary_table(reports[-1:]), flush=True)
    finally:
        server.proc.kill()
        shutil.rmtree(copy_root, ignore_errors=True)
    print()
    print(summary_table(reports))
    lines = survivors(reports)
    if lines:
        print("\nNot killed (file:line:column, mutation, the original line):")
        print("\n".join(f"  {ln}" for ln in lines))
    print(f"\nReport: {args.out / 'mutation.md'} and mutation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
