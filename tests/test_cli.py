import json
import math
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from omnibal_compile.cli import main


def test_demo_runs_and_reports_parity(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    args = [
        "demo",
        "--num-stages",
        "3",
        "--device",
        "a100-80gb",
        "--memory-budget",
        "16MiB",
        "--save-plan",
        str(plan_path),
        "--show-code",
        "1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Parity OK" in out and "Plan by 'ilp'" in out and "def forward" in out
    table = out[out.index("planner  "):].splitlines()
    assert [r.split()[0] for r in table[2:6]] == ["uniform", "parameters", "omnibal", "ilp"]  # baselines compared
    assert table[5].split()[-1] == "1.00x" and "micro-batch {}" not in out
    plan = json.loads(plan_path.read_text())
    assert set(plan["recompute"]) - {"none"}  # the 16MiB budget forces recomputation somewhere
    assert len(json.loads(plan_path.read_text())["boundaries"]) == 4
    # stage I/O says what each value is, never an FX node name; losses with 5 significant digits; a next step
    io = out[out.index("What each stage receives"):out.index("Parity")]
    assert "pixel_values (model input)" in io and "loss from <root>:glue" in io and "activations from " in io
    assert not re.search(r"\b(add|linear|mul|eq|unsqueeze|cos|sin)_?\d*\b", io.replace("<root>:glue", "")), io
    assert re.search(r"Parity OK: loss \d\.\d{4},", out)
    assert f"Next: train the plan on 3 local processes: omnibal-compile run --plan {plan_path} --steps 2" in out
    phases = re.search(r"Time taken: (.*); ([\d.]+) s in all", out)
    assert phases and math.isclose(sum(float(x) for x in re.findall(r"([\d.]+) s", phases[1])), float(phases[2]),
                                   abs_tol=0.03)  # the phases add up to the whole


def test_demo_default_budget_fits_two_stages(tmp_path, capsys):
    """The README's `omnibal-compile demo --stages 2`: the default budget scales with the stages (a fixed 16 MiB
    per device did not fit half of the model on one device)."""
    assert main(["demo", "--num-stages", "2", "--save-plan", str(tmp_path / "plan.json")]) == 0, capsys.readouterr().err
    assert "/ 32.0" in capsys.readouterr().out  # 64 MiB / 2 stages, in the plan table's memory column


def test_demo_errors_are_reported_not_raised(capsys):
    assert main(["demo", "--num-stages", "999"]) == 2
    assert "exceeds" in capsys.readouterr().err


def test_console_script_entry_point():
    """The installed ``omnibal-compile`` script (what ``pip install`` puts on PATH) runs the CLI."""
    from importlib import metadata

    try:
        dist = metadata.distribution("omnibal_compile")
    except metadata.PackageNotFoundError:
        pytest.skip("omnibal_compile is not installed (pip install -e .): there is no console script to run")
    (entry,) = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "omnibal-compile"]
    assert entry.value == "omnibal_compile.cli:main"
    script = shutil.which(
        "omnibal-compile", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    )
    assert script is not None, "the omnibal-compile script is not on PATH nor in this interpreter's scripts folder"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout, proc.stderr
    proc = subprocess.run([script, "demo", "--num-stages", "999"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "exceeds" in proc.stderr  # errors reach the shell as exit status 2


def test_every_command_help_ends_with_examples_that_parse(capsys):
    import shlex

    from omnibal_compile.cli import COMMANDS, EXAMPLES, build_parser

    parser = build_parser()
    for name in (path.rsplit(".", 1)[1] for path in COMMANDS):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and EXAMPLES[name], name
        for line in EXAMPLES[name]:
            assert f"  {line}" in text
            argv = shlex.split(line)
            assert argv[:2] == ["omnibal-compile", name]
            parser.parse_args(argv[1:])  # every flag in the example exists


def test_ctrl_c_is_a_sentence_and_exit_status_130(monkeypatch, capsys):
    import omnibal_compile.cli.data as data_command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(data_command, "run", interrupted)
    stats = Path(__file__).resolve().parent.parent / "omnibal_compile" / "data" / "stats" / "ai2d_train_12k.json"
    assert main(["data", str(stats)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "omnibal-compile data: interrupted" and "Traceback" not in err
