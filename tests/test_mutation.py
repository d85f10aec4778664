"""bench/mutation.py: mutation sites, statement lines, test selection from coverage, equivalence notes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "mutation.py"
_spec = importlib.util.spec_from_file_location("bench_mutation", _PATH)
mutation = importlib.util.module_from_spec(_spec)
sys.modules["bench_mutation"] = mutation
_spec.loader.exec_module(mutation)

SOURCE = '''"""Docstring: never mutated."""
LIMIT = 3


def f(a, b=0):
    if a < b and not a:
        raise ValueError("a < b")
    total = (a +
             b * 2)
    return total
'''


def test_sites_cover_each_operator_and_skip_docstrings_and_raise_messages():
    ms = mutation.find_mutants("toy.py", SOURCE)
    got = {(m.line, m.mutation) for m in ms}
    assert got == {
        (2, "3  ->  4"), (5, "0  ->  1"), (6, "<  ->  <="), (6, "and  ->  or"), (6, "not x  ->  x"),
        (8, "+  ->  -"), (9, "*  ->  /"), (9, "2  ->  3"), (10, "return value  ->  None"),
    }
    plus = next(m for m in ms if m.mutation == "+  ->  -")
    assert (plus.start, plus.end) == ((8, 13), (9, 18))
    mutated = mutation.apply(SOURCE, plus)
    ns: dict = {}
    exec(compile(mutated, "toy", "exec"), ns)
    assert ns["f"](5, 2) == 1  # the planted bug: 5 - 2 * 2


def test_statement_lines_map_a_continuation_line_to_its_statement():
    stmt = mutation.statement_lines(SOURCE)
    assert stmt[9] == 8  # `b * 2)` belongs to `total = (a +`
    assert stmt[6] == 6 and stmt[7] == 7 and stmt[10] == 10  # an if's header, a body line, a return
    assert stmt[5] == 5


def test_import_time_lines_are_outside_function_bodies():
    lines = mutation.import_time_lines(SOURCE)
    assert {1, 2, 5} <= lines and not lines & {6, 7, 8, 9, 10}  # docstring, constant, def line; the body


def test_an_import_time_line_selects_every_test_even_when_its_import_ran_in_one_test():
    ms = {(m.line, m.mutation): m for m in mutation.find_mutants("toy.py", SOURCE)}
    cov = mutation.Coverage(lines={2: ("t_fast",), 6: ("t_fast",)}, durations={"t_slow": 2.0, "t_fast": 0.1},
                            startup_s=1.0)
    stmt, imported = mutation.statement_lines(SOURCE), mutation.import_time_lines(SOURCE)
    assert cov.tests_for(ms[(2, "3  ->  4")], stmt, imported) == ["t_fast", "t_slow"]
    assert cov.tests_for(ms[(6, "<  ->  <=")], stmt, imported) == ["t_fast"]


def _coverage() -> mutation.Coverage:
    return mutation.Coverage(
        lines={2: ("",), 5: ("",), 6: ("t_slow", "t_fast"), 8: ("t_fast",)},
        durations={"t_slow": 2.0, "t_fast": 0.1, "t_other": 0.5},
        startup_s=1.0,
    )


def test_tests_for_selects_covering_tests_fastest_first():
    ms = {(m.line, m.mutation): m for m in mutation.find_mutants("toy.py", SOURCE)}
    stmt = mutation.statement_lines(SOURCE)
    cov = _coverage()
    assert cov.tests_for(ms[(6, "<  ->  <=")], stmt) == ["t_fast", "t_slow"]
    assert cov.tests_for(ms[(8, "+  ->  -")], stmt) == ["t_fast"]  # spans lines 8-9, recorded on 8
    assert cov.tests_for(ms[(9, "*  ->  /")], stmt) == ["t_fast"]  # on line 9, part of the statement on 8
    assert cov.tests_for(ms[(2, "3  ->  4")], stmt) == ["t_fast", "t_other", "t_slow"]  # import time: all tests
    assert cov.tests_for(ms[(10, "return value  ->  None")], stmt) == []  # no test executes it: not covered


def test_equivalence_notes_round_trip_and_bad_lines_are_named(tmp_path):
    m = next(m for m in mutation.find_mutants("toy.py", SOURCE) if m.mutation == "<  ->  <=")
    f = tmp_path / "eq.txt"
    f.write_text("# comment\n\n" + mutation.equivalent_line("dp", m, "a reason") + "\n")
    assert mutation.read_equivalent(f) == {("dp", "<  ->  <=", m.source_line, m.start[1]): "a reason"}
    f.write_text("dp | 6 | no columns\n")
    with pytest.raises(SystemExit, match="eq.txt:1"):
        mutation.read_equivalent(f)


def test_the_projects_equivalence_file_parses():
    notes = mutation.read_equivalent()
    assert all(module in mutation.MODULES for module, *_ in notes)


def test_subprocess_coverage_records_lines_run_in_a_started_process_under_the_starting_test(tmp_path, monkeypatch):
    import subprocess

    toy = tmp_path / "toy.py"
    toy.write_text("def f(a):\n    if a:\n        return 1\n    return 2\n\n\nf(1)\n")
    for name in ("COVERAGE_PROCESS_START", mutation._TEST_ENV):
        monkeypatch.setenv(name, "")  # restored after the test
    sub_dir = mutation._start_subprocess_coverage(str(toy), str(tmp_path / "result.json"))
    monkeypatch.setenv(mutation._TEST_ENV, "tests/t.py::t_sub")  # what the plugin sets when a test starts
    subprocess.run([sys.executable, str(toy)], check=True)
    lines = mutation._subprocess_lines(sub_dir, str(toy))
    assert lines == {1: {"tests/t.py::t_sub"}, 2: {"tests/t.py::t_sub"}, 3: {"tests/t.py::t_sub"},
                     7: {"tests/t.py::t_sub"}}  # line 4 never runs: f(1) returns on line 3
