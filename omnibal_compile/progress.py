"""Progress of long work, shown the same way everywhere.

On a terminal: a tqdm bar (steps done / total, elapsed time, the current step's description).
Otherwise (a log file, a pipe, CI): one line per step on stderr, ``[k/total  12.3s] description``.
Disabled: nothing at all.

What the library has to say outside a bar (the example batch it synthesized, the layout candidates
it weighed) goes through :func:`info`: to stderr, never stdout, and silenced by :func:`quiet` (a
context manager) or the environment variable ``OMNIBAL_QUIET=1``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from types import TracebackType
from typing import Any, TextIO, TypeVar

__all__ = ["Progress", "track", "info", "quiet", "QUIET_ENV"]

T = TypeVar("T")

QUIET_ENV = "OMNIBAL_QUIET"
"""Environment variable: set to 1 (or true/yes) to silence :func:`info`."""
_quiet_depth = 0


def is_quiet() -> bool:
    """True inside :func:`quiet` or when ``OMNIBAL_QUIET`` is set to a true value."""
    return _quiet_depth > 0 or os.environ.get(QUIET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def info(text: str, *, stream: TextIO | None = None) -> None:
    """Tell the user ``text`` (to stderr), unless output is silenced (:func:`quiet`, ``OMNIBAL_QUIET``)."""
    if not is_quiet():
        print(text, file=stream if stream is not None else sys.stderr, flush=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence :func:`info` inside the ``with`` block: ``with progress.quiet(): optimize(model)``."""
    global _quiet_depth
    _quiet_depth += 1
    try:
        yield
    finally:
        _quiet_depth -= 1


class Progress:
    """A counter of ``total`` steps; :meth:`step` starts the next one (the one before it is done)."""

    def __init__(self, total: int, *, enabled: bool = True, unit: str = "step", stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.count = 0
        self._bar: Any = None
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit=unit, leave=False, dynamic_ncols=True, file=self.stream)

    def step(self, description: str) -> None:
        """Start the next step, described by ``description``."""
        if not self.enabled:
            return
        self.count += 1
        if self._bar is not None:
            self._bar.n = self.count - 1  # the steps before this one are done
            self._bar.set_description_str(description[:60])
            return
        elapsed = time.perf_counter() - self.started
        print(f"[{self.count}/{self.total} {elapsed:5.1f}s] {description}", file=self.stream, flush=True)

    def note(self, description: str) -> None:
        """Say what the current step is doing, without starting a new one (shown on a terminal only)."""
        if self.enabled and self._bar is not None:
            self._bar.set_description_str(description[:60])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.n = self.total
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def track(items: Iterable[T], description: str, *, enabled: bool = True) -> Iterator[T]:
    """Yield ``items`` while showing ``description`` and how many are done."""
    items = list(items) if not isinstance(items, Sized) else items
    total = len(items)
    with Progress(total, enabled=enabled) as progress:
        for i, item in enumerate(items):
            progress.step(f"{description} ({i + 1}/{total})")
            yield item
