"""The one check of every number, name and file a user gives, at the boundary where it enters.

Each check returns the value in its canonical type or raises the project's own error (an
:class:`~omnibal_compile.errors.InputError` unless the caller names another) with the input's name,
the value it got and what to change. Optimize keywords, command-line options, length files,
``plan.json`` and the data options all go through these, so a NaN, a 12.5 where a count belongs,
a string where a number belongs or a directory given as a file say so in the same words.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from omnibal_compile.errors import InputError, OmnibalError

__all__ = [
    "check_int", "check_number", "check_seed", "check_choice", "check_int_list", "read_text", "json_records",
    "int_option", "number_option", "open_regular_file", "MAX_SEED",
]

MAX_SEED = 2**63 - 1
"""Largest seed every consumer takes (numpy's SeedSequence and torch.manual_seed both do)."""

ErrorType = type[OmnibalError]


def _fail(name: str, want: str, value: Any, hint: str, error: ErrorType) -> OmnibalError:
    shown = f"{value!r}" if not isinstance(value, float) else f"{value:g}"
    return error(f"{name} must be {want}, got {shown}{'; ' + hint if hint else ''}")


def _bounds(lo: float | None, hi: float | None, *, above: float | None = None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:,g}" if isinstance(above, float) else f"> {above:,}")
    if lo is not None:
        parts.append(f">= {lo:,g}" if isinstance(lo, float) else f">= {lo:,}")
    if hi is not None:
        parts.append(f"<= {hi:,g}" if isinstance(hi, float) else f"<= {hi:,}")
    return " and ".join(parts)


def check_int(value: Any, name: str, *, min: int | None = None, max: int | None = None, hint: str = "",
              error: ErrorType = InputError) -> int:
    """``value`` as an int: an integer (numpy's too) or an integral float such as ``12.0``.

    Refused: bools, strings, NaN, infinities, fractions (``12.5`` is not silently 12) and values
    outside ``[min, max]``.
    """
    want = "an integer" + (f" {_bounds(min, max)}" if min is not None or max is not None else "")
    if isinstance(value, bool):
        raise _fail(name, want, value, hint, error)
    if isinstance(value, numbers.Integral):
        v = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
        v = int(float(value))
    else:
        raise _fail(name, want, value, hint, error)
    if (min is not None and v < min) or (max is not None and v > max):
        raise _fail(name, want, value, hint, error)
    return v


def check_number(value: Any, name: str, *, min: float | None = None, max: float | None = None,
                 above: float | None = None, finite: bool = True, hint: str = "",
                 error: ErrorType = InputError) -> float:
    """``value`` as a float: a real number, not NaN, finite unless ``finite=False``, within the bounds
    (``above``: strictly greater than)."""
    bounds = _bounds(min, max, above=above)
    want = ("a finite number" if finite else "a number") + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, want, value, hint, error)
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        raise _fail(name, want, value, hint, error)
    if (min is not None and v < min) or (max is not None and v > max) or (above is not None and v <= above):
        raise _fail(name, want, value, hint, error)
    return v


def check_seed(value: Any, name: str = "seed", *, error: ErrorType = InputError) -> int:
    """A seed: an integer in ``[0, MAX_SEED]`` (numpy refuses negative seeds, torch larger ones)."""
    return check_int(value, name, min=0, max=MAX_SEED, error=error)


def check_choice(value: Any, name: str, options: Iterable[str], *, error: ErrorType = InputError) -> str:
    """``value`` if it is one of ``options``."""
    opts = list(options)
    if not isinstance(value, str) or value not in opts:
        raise error(f"{name} must be one of {opts}, got {value!r}")
    return value


def check_int_list(value: Any, name: str, *, min: int | None = None, error: ErrorType = InputError) -> tuple[int, ...]:
    """A sequence of integers (each checked as :func:`check_int`) as a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise error(f"{name} must be a list of integers, got {value!r}"[:300])
    return tuple(check_int(x, f"{name}[{i}]", min=min, error=error) for i, x in enumerate(value))


def read_text(path: str | os.PathLike[str], what: str, *, hint: str = "") -> str:
    """The text of the file ``path`` (``what`` names it: "plan file", "length statistics file", ...).

    Says whether it does not exist, is a directory, cannot be read or is not UTF-8 text.
    """
    p = Path(path)
    tail = f"; {hint}" if hint else ""
    if p.is_dir():
        raise InputError(f"{what} {str(p)!r} is a directory; give the path of a file inside it{tail}")
    if not p.exists():
        raise InputError(f"{what} {str(p)!r} does not exist{tail}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.start}); is it the right file?") from None
    except OSError as e:
        raise InputError(f"{what} {str(p)!r} cannot be read: {e.strerror or e}") from None


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular(path: str, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path} is a folder")
    if not stat.S_ISREG(mode):
        what = next((kind for test, kind in _KINDS if test(mode)), "a special file")
        raise OSError(f"{what}, not a regular file; only regular files are read")


def open_regular_file(path: str | os.PathLike[str], *, inside: str | os.PathLike[str] | None = None) -> IO[bytes]:
    """``path`` opened for binary reading if it is a regular file (symbolic links followed), else ``OSError``
    saying what it is.

    A path named by a data file may point anywhere: a FIFO blocks the open forever, a device or a
    ``/proc`` file reads without end or has side effects. So the file is checked before it is opened,
    and again on the open descriptor (it may have been swapped in between); an empty file is refused
    too (``/proc`` files say they are). ``inside``: refuse a path that resolves outside this folder.
    """
    real = os.path.realpath(path)  # the file itself: the checks and the open are all on this path
    if inside is not None:
        root = os.path.realpath(inside)
        if os.path.commonpath([real, root]) != root:
            raise PermissionError(f"resolves to {real}, outside {root}")
    _check_regular(str(path), os.stat(real).st_mode)  # FileNotFoundError when missing
    # O_NONBLOCK: a FIFO swapped in after the check makes the open return instead of wait for a writer
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        _check_regular(str(path), st.st_mode)
        if st.st_size == 0:
            raise OSError("empty file (0 bytes)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_records(text: str, name: str, *, lines: bool, expected: str) -> list[tuple[str, Any]]:
    """The records of a JSON list (``lines=False``) or of JSON Lines, each with a label for messages
    (``"NAME record I (line L)"``); ``expected`` describes a record for the error when the JSON is not a list."""
    if lines:
        out: list[tuple[str, Any]] = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{name} line {line_no}: not valid JSON ({e.msg})") from None
            out.append((f"{name} record {len(out)} (line {line_no})", rec))
        return out
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{name}: not valid JSON at line {e.lineno} ({e.msg}); use a .jsonl suffix for JSON Lines"
        ) from None
    if not isinstance(data, list):
        raise InputError(f"{name}: expected a JSON list of {expected}, got {type(data).__name__}")
    return [(f"{name} record {i}", rec) for i, rec in enumerate(data)]


def int_option(*, min: int | None = None, max: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer option, checked as :func:`check_int` (argparse names the flag)."""
    return _option(int, "an integer", lambda v: check_int(v, "the value", min=min, max=max))


def number_option(*, min: float | None = None, above: float | None = None) -> Callable[[str], float]:
    """An argparse ``type=`` for a finite number, checked as :func:`check_number` (NaN and inf are refused)."""
    return _option(float, "a number", lambda v: check_number(v, "the value", min=min, above=above))


def _option(convert: Callable[[str], Any], noun: str, check: Callable[[Any], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        try:
            return check(value)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse
