import json
import subprocess
import sys

from omnibal_compile.cli import main


def test_demo_runs_and_reports_parity(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    args = ["demo", "--stages", "3", "--device", "a100-80gb", "--memory", "16MiB", "--save-plan", str(plan_path),
            "--show-code", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Parity OK" in out and "Plan by 'ilp'" in out and "def forward" in out
    table = out[out.index("planner  "):].splitlines()
    assert [r.split()[0] for r in table[2:6]] == ["uniform", "parameters", "omnibal", "ilp"]  # baselines compared
    assert table[5].split()[-1] == "1.00x" and "micro-batch {}" not in out
    plan = json.loads(plan_path.read_text())
    assert set(plan["recompute"]) - {"none"}  # the 16MiB budget forces recomputation somewhere
    assert len(json.loads(plan_path.read_text())["boundaries"]) == 4


def test_demo_errors_are_reported_not_raised(capsys):
    assert main(["demo", "--stages", "999"]) == 2
    assert "exceeds" in capsys.readouterr().err


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "omnibal_compile.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout
