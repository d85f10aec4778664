"""omnibal_compile.config: one default per setting, the same flag in every command, config files, refusals."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

from omnibal_compile.cli import build_parser
from omnibal_compile.cli._settings import settings_from_args, show_default
from omnibal_compile.config import SECTIONS, Config, ScheduleConfig, flag_name, load_config_file
from omnibal_compile.errors import InputError
from omnibal_compile.runtime.settings import RunConfig

COMMANDS = ("plan", "run", "demo")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: action.choices[name] for name in COMMANDS}


def _field_defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    for sec in SECTIONS:
        for f in dataclasses.fields(sec):
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def _help_defaults(parser: argparse.ArgumentParser) -> dict[str, str]:
    """flag -> the default its ``--help`` text states (each option's entry re-joined over its lines)."""
    entries: dict[str, str] = {}
    flag = None
    for line in parser.format_help().splitlines():
        m = re.match(r"^  (-[-a-z0-9]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = line[m.end():]
        elif flag is not None and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    found = {}
    for flag, text in entries.items():
        d = re.search(r"\(default: ([^)]*)\)$", " ".join(text.split()))
        if d:
            found[flag] = d.group(1)
    return found


def test_every_flag_default_is_the_field_default() -> None:
    """plan, run and demo: each generated flag parses to nothing, so the setting is the field's default."""
    defaults = _field_defaults()
    for name, sub in _subparsers().items():
        argv = {"plan": ["plan"], "run": ["run", "--plan", "p.json"], "demo": ["demo"]}[name]
        args = build_parser().parse_args(argv)
        config = settings_from_args(args, RunConfig if name == "run" else Config)
        flags = [a for a in sub._actions if a.dest in defaults]
        assert len(flags) > 8, name
        for action in flags:
            assert action.option_strings[0] == flag_name(action.dest)  # one rule for the name
            want = "p.json" if action.dest == "plan" else defaults[action.dest]
            got = getattr(config, action.dest)
            if action.dest == "device" and name == "run":
                assert got == "cpu" and want is None  # a run without a device trains on cpu, as documented
                continue
            assert got == want, (name, action.dest, got, want)


def test_shared_settings_have_one_flag_and_one_default_in_every_help() -> None:
    helps = {name: _help_defaults(sub) for name, sub in _subparsers().items()}
    defaults = _field_defaults()
    shared = set(helps["plan"]) & set(helps["run"])
    assert {
        "--seed",
        "--tiles-per-sample",
        "--text-tokens",
        "--num-microbatches",
        "--dp",
        "--model",
        "--lengths",
    } <= shared
    for flag in shared | (set(helps["plan"]) & set(helps["demo"])):
        stated = {name: h[flag] for name, h in helps.items() if flag in h}
        assert len(set(stated.values())) == 1, (flag, stated)
        assert next(iter(stated.values())) == show_default(defaults[flag[2:].replace("-", "_")]), flag


def test_the_drifting_defaults_are_one() -> None:
    config, run = Config(), RunConfig(plan="p.json")
    assert config.tiles_per_sample == run.tiles_per_sample == 2
    assert config.samples_per_pack == run.samples_per_pack == 4.0
    assert config.model == run.model == "tinyvlm"
    assert config.num_microbatches is None and config.num_stages is None


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_files_round_trip_and_flags_override_them(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"run{suffix}"
    if suffix == ".toml":
        path.write_text('lr = 0.5\nsteps = 3\nlengths = ["a.json"]\n\n[schedule]\nnum_microbatches = 4\n')
    else:
        path.write_text(json.dumps({"lr": 0.5, "steps": 3, "lengths": ["a.json"], "schedule": {"num_microbatches": 4}}))
    assert load_config_file(path) == {"lr": 0.5, "steps": 3, "lengths": ("a.json",), "num_microbatches": 4}
    args = build_parser().parse_args(["run", "--plan", "p.json", "--config", str(path), "--steps", "7"])
    config = settings_from_args(args)
    assert (config.lr, config.steps, config.lengths, config.num_microbatches) == (0.5, 7, ("a.json",), 4)
    assert RunConfig.from_json(config.to_json()) == config
    plan_args = build_parser().parse_args(["plan", "tinyvlm", "--config", str(path), "--num-microbatches", "8"])
    planned = settings_from_args(plan_args)  # run-only keys are left out, shared ones kept
    assert isinstance(planned, Config) and planned.num_microbatches == 8 and planned.lengths == ("a.json",)


def test_unknown_keys_and_overrides_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("num_stage = 4\n")
    with pytest.raises(InputError, match=r"'num_stage'.*did you mean 'num_stages' \(--num-stages\)"):
        load_config_file(path)
    nested = tmp_path / "bad.json"
    nested.write_text(json.dumps({"schedule": {"microbatches": 4}}))
    with pytest.raises(InputError, match=r"'microbatches'.*'num_microbatches'"):
        load_config_file(nested)
    with pytest.raises(InputError, match=r"'memory_budgt'.*'memory_budget'"):
        Config().replace(memory_budgt="1GiB")
    import omnibal_compile as oc

    with pytest.raises(InputError, match=r"'num_stage'.*'num_stages'"):
        oc.optimize(None, None, num_stage=2)  # refused before the model is looked at
    with pytest.raises(InputError, match=r"lr must be a finite number > 0.*lr \(--lr\)"):
        Config(lr=float("nan"))
    with pytest.raises(InputError, match=r"setting dp_shard \(--dp-shard\)"):
        Config(dp_shard="zero")


def test_field_names_are_unique_across_sections() -> None:
    names = [n for sec in SECTIONS for n in sec.names()]
    assert len(names) == len(set(names)) and set(names) == set(Config.names())
    assert Config(num_microbatches=4).section(ScheduleConfig) == ScheduleConfig(num_microbatches=4)


def test_optimize_takes_at_most_four_named_parameters() -> None:
    import omnibal_compile as oc

    params = inspect.signature(oc.optimize).parameters.values()
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 4 and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def test_optimize_prints_nothing_and_quiet_silences_its_notes(capsys, monkeypatch) -> None:
    import omnibal_compile as oc
    from omnibal_compile import progress
    from omnibal_compile.models import TinyVLM, TinyVLMConfig

    model = TinyVLM(TinyVLMConfig())
    result = oc.optimize(model, num_stages=2)
    captured = capsys.readouterr()
    assert captured.out == "" and result.example.summary() in captured.err  # synthesized: told on stderr
    with progress.quiet():
        oc.optimize(model, num_stages=2)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(progress.QUIET_ENV, "1")
    oc.optimize(model, config=Config(num_stages=2))
    assert capsys.readouterr() == ("", "")
