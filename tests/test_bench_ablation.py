"""bench/ablation_cpu.py's saved run (bench/runs/ablation_cpu.json): the simulator against measured ranks."""

from __future__ import annotations

import json

import bench_scripts
import pytest

RUN = bench_scripts.BENCH / "runs" / "ablation_cpu.json"


@pytest.fixture(scope="module")
def ablation():
    return bench_scripts.load("ablation_cpu")


def worst_sim_error(ablation, record: dict) -> float:
    return max(abs(sim / measured - 1) for _, measured, sim, *_ in ablation.table_rows(record))


def test_simulator_stays_within_15_percent_of_the_saved_measured_run(ablation):
    """The saved run's measured tokens/s (every layout and step) against the simulator as it is now."""
    record = json.loads(RUN.read_text())
    rows = ablation.table_rows(record)
    assert {k for k, *_ in rows} == {(d, q, s) for d, q in ablation.LAYOUTS for s in ablation.steps_for(q)}
    assert worst_sim_error(ablation, record) <= 0.15


def test_fsdp_call_cost_slows_exactly_the_data_parallel_rows(ablation):
    """Charged at zero, the per-call latency leaves the dp=1 rows as they were and speeds up every dp=2 row."""
    record = json.loads(RUN.read_text())
    with_cost = {k: sim for k, _, sim, *_ in ablation.table_rows(record)}
    for table in record["costs"].values():
        table["dp_link_latency_s"] = 0.0
    without = {k: sim for k, _, sim, *_ in ablation.table_rows(record)}
    for (dp, pp, step), sim in with_cost.items():
        if dp == 1:
            assert without[dp, pp, step] == pytest.approx(sim, rel=1e-12)
        else:
            assert without[dp, pp, step] > sim * 1.01, (dp, pp, step)


def test_resimulate_prints_the_table(ablation, capsys):
    assert ablation.main(["--resimulate", str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "2 x 2    + recompute" in out and "target simulated vs measured tokens/s within 15%" in out
