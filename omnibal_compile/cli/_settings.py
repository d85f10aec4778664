"""Command-line flags generated from the config fields (:mod:`omnibal_compile.config`).

One rule: field ``name`` is flag ``--name`` with dashes; its default, type, choices and help are the
field's. Booleans are ``--x/--no-x``. ``--config FILE`` (TOML or JSON) gives settings; flags given on
the command line override the file. A subcommand names the sections (or config class) it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from typing import Any, TypeVar

from omnibal_compile._utils.validate import int_option, number_option
from omnibal_compile.config import Config, Section, field_help, flag_name, load_config_file

__all__ = ["add_settings", "settings_from_args", "show_default", "command_fields"]

C = TypeVar("C", bound=Section)

_FIELDS_ATTR = "_settings_fields"


def show_default(value: Any) -> str:
    """How a default is written in ``--help``: ``none``, ``true``/``false``, ``[]``, numbers and names as they are."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(show_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def command_fields(cls: type[Section], sections: Iterable[type[Section]] | None = None,
                   exclude: Iterable[str] = ()) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` a command takes: those of ``sections`` (default: all), minus ``exclude``."""
    skip = set(exclude)
    wanted = None if sections is None else {n for sec in sections for n in sec.names()}
    return [f for f in dataclasses.fields(cls) if f.name not in skip and (wanted is None or f.name in wanted)]


def add_settings(p: argparse.ArgumentParser, cls: type[Section], *, sections: Iterable[type[Section]] | None = None,
                 exclude: Iterable[str] = (), required: Iterable[str] = ()) -> None:
    """Add one flag per field of ``cls`` in ``sections`` (minus ``exclude``) and ``--config FILE`` to ``p``."""
    must = set(required)
    fields = command_fields(cls, sections, exclude)
    group = p.add_argument_group("settings (omnibal_compile.config; also keys of a --config file)")
    group.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        dest="config_file",
        help="TOML (.toml) or JSON file of settings, flat or in section tables; flags given here override it",
    )
    for f in fields:
        kind = f.type if isinstance(f.type, str) else str(f.type)
        meta = f.metadata
        default = _default(f)
        doc = field_help(cls, f.name)
        text = (doc if f.name in must else f"{doc} (default: {show_default(default)})").replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if f.name in must:
            kw["required"] = True
        if kind.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
            kw.pop("metavar", None)
        elif meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        elif kind.startswith("int"):
            kw["type"] = int_option(min=meta.get("min"), max=meta.get("max"))
        elif kind.startswith("float"):
            kw["type"] = number_option(min=meta.get("min"), above=meta.get("above"))
        elif kind.startswith("tuple[int"):
            kw["type"], kw["nargs"] = int_option(min=meta.get("min")), "+"
        elif kind.startswith("tuple[str"):
            kw["nargs"] = "+"
        elif kind.startswith("Mapping"):
            kw["type"] = _json_object
        group.add_argument(flag_name(f.name), **kw)
    p.set_defaults(**{_FIELDS_ATTR: (cls, tuple(f.name for f in fields))})


def settings_from_args(args: argparse.Namespace, cls: type[C] | None = None, **given: Any) -> C:
    """The settings of a parsed command line: the field defaults, then ``--config FILE``, then the flags
    given, then ``given`` (what the command itself fixes)."""
    declared, names = getattr(args, _FIELDS_ATTR)
    target = cls or declared
    values: dict[str, Any] = {}
    path = getattr(args, "config_file", None)
    if path:  # keys are checked against every setting; those this command does not take are left out
        values.update({k: v for k, v in load_config_file(path, Config).items() if k in target.names()})
    for name in names:
        if hasattr(args, name):
            value = getattr(args, name)
            values[name] = tuple(value) if isinstance(value, list) else value
    values.update(given)
    return target(**values)
