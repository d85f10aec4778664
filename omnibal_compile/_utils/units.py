"""Byte sizes written by people: ``"80GiB"``, ``"40GB"``, ``"512MiB"``, ``"1.5 TiB"``, ``"123"``.

Glossary:
    binary units   KiB, MiB, GiB, TiB: powers of 1024 (so are the bare letters K, M, G, T).
    decimal units  kB/KB, MB, GB, TB: powers of 1000, as disk and GPU vendors write them.
"""

from __future__ import annotations

import re

from omnibal_compile._utils.validate import check_number
from omnibal_compile.errors import InputError

__all__ = ["parse_size", "format_size"]

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, name: str = "size") -> int:
    """Bytes in ``text``; an int or float is taken as bytes already. ``name`` is the input's name for
    errors (``"memory_budget"``, ``"--memory"``). Raises InputError with an example."""
    if isinstance(text, str):
        m = _SIZE.match(text)
        if not m:
            raise InputError(
                f"cannot read {name} {text!r}: write a number and a unit, e.g. '80GiB', '40GB' or '512MiB'"
            )
        number, unit = m.groups()
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise InputError(
                f"unknown unit {unit!r} in {name} {text!r}: use B, KiB, MiB, GiB, TiB (powers of 1024) "
                "or kB, MB, GB, TB (powers of 1000)"
            )
        return int(round(float(number) * factor))
    # NaN, infinities, bools and negative numbers are refused by the shared number check.
    return int(check_number(text, name, min=0, hint="give bytes as a number or a string like '80GiB'"))


def format_size(nbytes: float) -> str:
    """``1.50 GiB``-style text for a byte count (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
