"""bench/ilp_cold.py: the cold ILP against the DP and brute force on drawn problems."""

from __future__ import annotations

import bench_scripts
import pytest


@pytest.fixture(scope="module")
def ilp_cold():
    return bench_scripts.load("ilp_cold")


@pytest.mark.parametrize("extra", [[], ["--interleaved"]])
def test_a_short_run_compares_and_reports(ilp_cold, capsys, extra):
    assert ilp_cold.main(["--draws", "15", *extra]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("15 problems drawn (") and "0 where the cold ILP (auto) differs" in out


def test_a_mismatch_is_printed_and_fails_the_run(ilp_cold, capsys, monkeypatch):
    """A planted wrong ILP (every plan 1% slower) is reported on every draw that has a plan."""
    import dataclasses

    from omnibal_compile.planning import ilp

    real = ilp.solve_ilp
    monkeypatch.setattr(
        "omnibal_compile.planning.solve_ilp",
        lambda P, **kw: dataclasses.replace(real(P, **kw), iteration_time=real(P, **kw).iteration_time * 1.01),
    )
    assert ilp_cold.main(["--draws", "5"]) == 1
    out = capsys.readouterr().out
    assert out.count("MISMATCH") == 5 and "5 where the cold ILP (auto) differs" in out


def test_bad_draw_count_is_refused(ilp_cold):
    with pytest.raises(SystemExit):
        ilp_cold.main(["--draws", "0"])
